"""The next GPU session's checks in one device call: each step a child process with its own time limit (a hang or a
crash costs that step, not the call), its output's tail printed as it ends, and a table of the steps last. The
steps and their order are docs/performance.md's "Where things stand" list (after run 32):

    mkdir -p /tmp/site && tar -C /tmp/site -xJf .anchors/anchors-site.tar.xz
    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python benchmarks/pending_flags_check.py [--only WORD ...] [--list]
        [--budget S]

Run 32 timed the steps. On a fresh machine, the first bench_anchors row ran past 300 s (FlashQLA's forward and
backward compiles, fla's autotune and linattn's first Triton backward). Once those were cached on the machine, a
row at a compiled head configuration took 35–40 s, and one at a new configuration took 110–250 s. The flag steps
took 10–90 s each. ``--budget`` (560 s: a device call's 600 less the start) caps the whole run: each step gets what
is left of it, and the steps it cannot start are listed as skipped (run them with ``--only`` in the next call,
within 30 s of the last one's end so that the machine and its caches are still there). Carry ``.anchors`` (the
bench_anchors steps run its bench_anchors.py; they need fla in the site, the others run with it moved aside).
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

# (name, command, time limit in s): docs/performance.md's "Where things stand" list after run 31
STEPS = [
    # session 26's kept scratch (hopper/prepared.py REUSE_SCRATCH, off): the GPU tests of the prepared calls with and
    # without it (bitwise the plain forward, its kept tensors poisoned first), then host time at the host-bound rows
    # 1 and 7 (predicted −15 to −25 µs per call; GPU time unchanged)
    # and session 26's routes (gated_delta/prepared_route.py ROUTES, off): the op's repeated calls straight to their
    # prepared call (predicted −25 to −40 µs per call at rows 1 and 7)
    ("prepared calls, kept scratch and routes, GPU tests", [PY, "-m", "pytest", "-q",
                                                            "tests/ops/test_hopper_prepared.py",
                                                            "tests/ops/test_prepared_route.py", "-k", "gpu"], 300),
    ("routes, timed", [PY, "benchmarks/op_time_check.py", "--routes-ab", "--repeat", "2", "--graph", "1,4096,16,16",
                       "1,32768,2,8"], 180),
    # session 26: inputs that start off a 16-byte boundary take the Triton paths (hopper.chunk_fwd.misaligned)
    ("inputs off a 16-byte boundary, GPU test", [PY, "-m", "pytest", "-q", "tests/ops/test_hopper_fwd.py", "-k",
                                                 "boundary"], 120),
    ("kept scratch, timed", [PY, "benchmarks/op_time_check.py", "--kept-scratch-ab", "--repeat", "2", "--graph",
                             "1,4096,16,16", "1,32768,2,8"], 180),
    # the Python and allocations around the launches on the H200's host (every kernel a no-op), forward_hopper's
    # and the op's (plain, prepared, routed, routed with kept scratch): what rows 1 and 7 have left besides launches
    ("host floor on the GPU's host", [PY, "benchmarks/host_hopper.py", "--calls", "1000", "--rounds", "3"], 120),
    # the segmented rows at gates drawn as a Mamba-style initialisation draws them (op_time_check --mixed-gates: some
    # heads take the maps), against the anchors' gates where every head warms up; and wide segments there
    ("mixed gates at rows 3 and 7", [PY, "benchmarks/op_time_check.py", "--mixed-gates", "--graph", "1,32768,16,16",
                                     "1,32768,2,8"], 150),
    ("wide segments, mixed gates", [PY, "benchmarks/op_time_check.py", "--wide-segments-ab", "--mixed-gates",
                                    "--graph", "2,16384,32,32"], 120),
    # issue 4's other head sizes through the op on today's defaults (last timed in run 28, before session 23's
    # switches): K = V = 64 at rows 2 and 3's sizes, and K = 128, V = 256
    ("other head sizes", [PY, "benchmarks/op_time_check.py", "--graph", "8,4096,16,16,64", "1,32768,16,16,64",
                          "8,4096,16,16,128,256"], 150),
    # what bounds the walk after session 23's switches: DRAM throughput against the chain's stalls
    ("walk and pre-pass under ncu", ["ncu", "--kernel-name", "regex:gdn_", "--launch-skip", "2", "--launch-count", "2",
                                     "--section", "SpeedOfLight", "--section", "WarpStateStats", "--section",
                                     "MemoryWorkloadAnalysis", PY, "benchmarks/ncu_forward.py", "--path", "auto"],
     240),
    # issue 4's table beside fla, FlashQLA and SDPA: one process per row (a cut costs one row), the host-bound rows
    # first, then the row run 32 did not reach
] + [(f"row {n} beside fla", [PY, ".anchors/bench_anchors.py", "--impl", "linattn:chunk_gated_delta_rule",
                              "--no-decode", "--skip-correct", "--shapes", shape], 420)
     for n, shape in [(1, "1,4096,16,16"), (7, "1,32768,2,8"), (5, "4,8192,16,32"), (3, "1,32768,16,16"),
                      (2, "8,4096,16,16"), (4, "1,131072,16,16"), (6, "2,16384,32,32")]] + [
    # session 25's WIDE_SEGMENTS (off: 1.50× at slow gates in run 32): its accuracy at drawn and slow gates
    ("wide segments, GPU test", [PY, "-m", "pytest", "-q", "tests/ops/test_hopper_fwd.py", "-k", "wide"], 200),
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
            print(f"{name} ({limit} s): {' '.join('python' if c == PY else c for c in cmd)}")
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
