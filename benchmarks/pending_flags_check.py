"""Every switch built but not yet measured on the GPU, checked in one device call: each step a child process with its
own time limit (a hang or a crash costs that step, not the call), its output's tail printed as it ends, and a table
of the steps last. The steps and their order are docs/performance.md's "Where things stand" list:

    mkdir -p /tmp/site && tar -C /tmp/site -xJf .anchors/anchors-site.tar.xz && rm -rf /tmp/site/fla
    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python benchmarks/pending_flags_check.py [--only WORD ...] [--list]
        [--budget S]

≈ 6–8 minutes in all on an H200 with TileLang's disk cache cold. ``--budget`` (560 s: a device call's 600 less
the start) caps the whole run: each step gets what is left of it, and the steps it cannot start are listed as
skipped (run them with ``--only`` in the next call). The pre-pass A/B compares today's pre-pass file with
a copy of itself (written to ab_old/prepass.py) with the switch set on one side.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TESTS = "tests/ops/test_hopper_fwd.py"

# (name, command, time limit in s). The capture whose kernels never ran eagerly must come first, in a process of its
# own: a later one would find those kernels already loaded
STEPS = [
    ("capture, kernels cold", [PY, "-m", "pytest", "-q", "-x", TESTS, "-k", "never_ran_eagerly"], 240),
    ("GPU tests of the switches", [PY, "-m", "pytest", "-q", TESTS, "tests/ops/test_launch.py", "-k",
                                   "captured or two_launch or two_programs_per_sm_on_the_gpu or launches"], 300),
    ("two launches at row 1", [PY, "benchmarks/op_time_check.py", "--plan-in-walk-ab", "--repeat", "2", "--graph",
                               "1,4096,16,16"], 240),
    ("two launches, host per layer", [PY, "benchmarks/op_time_check.py", "--plan-in-walk-ab", "--host-parts",
                                      "1,4096,16,16"], 120),
    ("capture plan at row 1", [PY, "benchmarks/op_time_check.py", "--when-captured-ab", "--graph", "1,4096,16,16"],
     180),
    ("two programs per SM", [PY, "benchmarks/op_time_check.py", "--two-per-sm-ab", "--repeat", "2", "8,4096,16,16",
                             "4,8192,16,32"], 300),
    ("pre-pass step 4 blocked", [PY, "benchmarks/prepass_ab.py", "ab_old/prepass.py", "--set", "STEP4_BLOCKED=1"],
     240),
    ("K = V = 64 and V = 256", [PY, "benchmarks/op_time_check.py", "8,4096,16,16,64", "1,32768,16,16,64",
                                "8,4096,16,16,128,256"], 240),
]


def text(x) -> str:
    """A timed-out child's captured output (bytes or str, by Python version)."""
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="run the steps whose names contain one of these words")
    ap.add_argument("--list", action="store_true", help="print the steps and stop")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for the whole run")
    args = ap.parse_args()
    steps = [s for s in STEPS if not args.only or any(w in s[0] for w in args.only)]
    if args.list:
        for name, cmd, limit in steps:
            print(f"{name} ({limit} s): {' '.join(cmd[1:])}")
        return
    (ROOT / "ab_old").mkdir(exist_ok=True)
    shutil.copy(ROOT / "linattn/ops/hopper/prepass.py", ROOT / "ab_old/prepass.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT),
                                                                      str(ROOT / "benchmarks")])))
    rows = []
    start = time.time()
    for name, cmd, limit in steps:
        t0 = time.time()
        left = args.budget - (t0 - start)
        if left < 30:
            rows.append((name, "skipped: budget", 0.0))
            continue
        limit = min(limit, left)
        try:
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
            status, out = ("ok" if done.returncode == 0 else f"rc {done.returncode}"), done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            status, out = f"timeout ({limit:.0f} s)", text(e.stdout) + text(e.stderr)
        lines = [ln for ln in out.splitlines() if "TileLang" not in ln and "Warning" not in ln]
        print(f"=== {name}: {status}, {time.time() - t0:.0f} s\n" + "\n".join(lines[-25:]), flush=True)
        rows.append((name, status, time.time() - t0))
    print("\n| step | result | s |\n|---|---|---|")
    for name, status, seconds in rows:
        print(f"| {name} | {status} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
