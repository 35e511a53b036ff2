"""Every switch built but not yet measured on the GPU, checked in one device call: each step a child process with its
own time limit (a hang or a crash costs that step, not the call), its output's tail printed as it ends, and a table
of the steps last. The steps and their order are docs/performance.md's "Where things stand" list (after run 29):

    mkdir -p /tmp/site && tar -C /tmp/site -xJf .anchors/anchors-site.tar.xz && rm -rf /tmp/site/fla
    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python benchmarks/pending_flags_check.py [--only WORD ...] [--list]
        [--budget S]

≈ 38 minutes in all at every step's cap on an H200 with TileLang's disk cache cold (FlashQLA compiles for ≈ 1
min, fla autotunes for ≈ 40 s per row: the last step needs fla in the site, so leave out the ``rm -rf
/tmp/site/fla`` for it): in priority order, the first four steps (≈ 22 minutes at their caps) first.
``--budget`` (560 s: a device call's 600 less the start) caps the whole run: each step gets what is left of it, and
the steps it cannot start are listed as skipped (run them with ``--only`` in the next call). Carry ``.anchors``
(the last step runs its bench_anchors.py).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# (name, command, time limit in s): docs/performance.md's "Where things stand" list after run 29
STEPS = [
    ("uniform warpgroup index, GPU tests", [PY, "-m", "pytest", "-q", "tests/ops/test_hopper_uniform_warpgroup.py",
                                            "-k", "gpu"], 240),
    ("deferred decay and P's fold, GPU tests", [PY, "-m", "pytest", "-q", "tests/ops/test_hopper_deferred_decay.py",
                                                "-k", "gpu"], 450),
    # all three against none: first the head configurations the tests above compiled (H = 16), then the others
    ("all three, timed, rows 2 3 5", [PY, "benchmarks/op_time_check.py", "--uniform-warpgroup-ab",
                                      "--deferred-decay-ab", "--fold-p-decay-ab", "--repeat", "2", "8,4096,16,16",
                                      "1,32768,16,16", "4,8192,16,32"], 300),
    ("all three, timed, rows 6 1 7", [PY, "benchmarks/op_time_check.py", "--uniform-warpgroup-ab",
                                      "--deferred-decay-ab", "--fold-p-decay-ab", "--repeat", "2", "2,16384,32,32",
                                      "1,4096,16,16", "1,32768,2,8"], 300),
    ("uniform warpgroup index alone, timed", [PY, "benchmarks/op_time_check.py", "--uniform-warpgroup-ab",
                                              "--repeat", "2", "8,4096,16,16", "1,32768,16,16"], 200),
    ("deferred decay alone, timed", [PY, "benchmarks/op_time_check.py", "--deferred-decay-ab", "--repeat", "2",
                                     "8,4096,16,16", "1,32768,16,16"], 200),
    ("deferred decay with P's fold, timed", [PY, "benchmarks/op_time_check.py", "--deferred-decay-ab",
                                             "--fold-p-decay-ab", "--repeat", "2", "8,4096,16,16", "1,32768,16,16"],
     200),
    ("rows 2 and 5 beside fla", [PY, ".anchors/bench_anchors.py", "--impl", "linattn:chunk_gated_delta_rule",
                                 "--no-decode", "--skip-correct", "--shapes", "8,4096,16,16;4,8192,16,32"], 400),
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
        # TileLang's own log lines ("[TileLang:...] ... compile kernel") and warnings out; not every line that names
        # TileLang: run 28 lost op_time_check --host-parts' row with its "TileLang launches" key that way
        lines = [ln for ln in out.splitlines() if "[TileLang:" not in ln and "Warning" not in ln]
        print(f"=== {name}: {status}, {time.time() - t0:.0f} s\n" + "\n".join(lines[-25:]), flush=True)
        rows.append((name, status, time.time() - t0))
    print("\n| step | result | s |\n|---|---|---|")
    for name, status, seconds in rows:
        print(f"| {name} | {status} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
