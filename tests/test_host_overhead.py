"""benchmarks/host_overhead.py on the CPU, where every launch is a no-op: it runs to its table, the Hopper backward's
rows (its prepared call and the plain backward) and stages included (run in a process of its own: the script
replaces kernels module-wide)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "host_overhead.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script times the real kernels")
def test_host_overhead_runs_on_the_cpu_to_its_table():
    run = subprocess.run([sys.executable, str(SCRIPT), "--calls", "3"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    for kind in ("prepared", "plain"):
        assert any(line.startswith(f"| Hopper bwd B=1 T=4096 H=16 ({kind}) | public call |") for line in rows), \
            run.stdout
    for stage in ("solve (pre-pass)", "states recompute", "reverse warm-ups"):
        assert any(f"| {stage} |" in line for line in rows), stage
    assert any(line.startswith("| decode B=1 Tq=1 (slot check) | public call |") for line in rows)
