"""Compile kernels for an H200 (sm_90) from a test: in a child process without TRITON_INTERPRET (the interpreter
replaces the kernels), through the benchmarks' compile helpers (benchmarks/sm90.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compile_for_h200(imports: str, expression: str):
    """Run ``imports`` then print ``expression`` in a child Python with benchmarks/ on sys.path; return the
    printed value (a literal: tuples of ints, lists and dicts of them). A failed compile fails the test with the
    child's stderr."""
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    script = f"import sys; sys.path.insert(0, 'benchmarks'); {imports}; print({expression})"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return eval(done.stdout.strip().splitlines()[-1])
