"""The next GPU session's checks in one device call: each step a child process with its own time limit (a hang or a
crash costs that step, not the call), its output's tail printed as it ends, and a table of the steps last. The
steps and their order are docs/performance.md's "Where things stand" list (after run 36). Each step's whole output
goes to ``$OUT/steps/NN-name.log`` as it runs (bench_anchors' anchors.json into a folder of the same name), so a
call killed at its limit still brings back what its steps printed:

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

# (name, command, time limit in s): docs/performance.md's "Where things stand" list after run 36
ROWS = "1,32768,16,16", "1,32768,2,8", "1,131072,16,16"      # issue 4's segmented rows 3, 7 and 4
# one ncu run over the pre-pass and the plan kernel at row 3 (the second call's launches), its per-SASS-instruction
# counters (shared wavefronts, stall samples) exported as CSV beside the logs (run 35 found step 2's reloads this way)
PROFILE = ("ncu --kernel-name regex:'segment_plan|gdn_prepass' --launch-skip 2 --launch-count 2 --set full "
           "--import-source no -f -o /tmp/prof {py} benchmarks/ncu_forward.py --path auto --B 1 --T 32768 && "
           "ncu --import /tmp/prof.ncu-rep --page details --print-details all && "
           "ncu --import /tmp/prof.ncu-rep --page source --print-source sass --csv > $OUT/profile_sass.csv")
STEPS = [
    # session 34's STATE_ONLY_WARMUPS (on since run 42: −5.5% / −2.3% / −1.0% at row 4's mixed / anchors' / slow
    # gates): a warm-up's chunk without o's dots. Its GPU test (bitwise the plain walk through both segmented forwards
    # at mixed and slow gates), then the A/B where warm-ups are long (mixed gates: rows 4, 3 and 1) and where they are
    # short (the anchors' gates); kept to re-check a change to the walk's chunk step
    ("state-only warm-ups, GPU test", [PY, "-m", "pytest", "-q", "tests/ops/test_hopper_state_only_warmups.py"], 300),
    ("state-only warm-ups, A/B", ["bash", "-c", " && ".join(
        f"{PY} benchmarks/op_time_check.py --brief --graph --state-only-warmups-ab {gates} {ROWS[2]} {ROWS[0]} "
        "1,4096,16,16" for gates in ("--mixed-gates", "", "--slow-gates"))], 240),
    # SPLIT_HEADS (off; run 39: anchors' gates 0.673 → 0.575 eager, mixed 0.717 → 0.948, slow 0.668 → 0.723). Its
    # GPU test (its route loads without divisions since b4c8a2d), its launch order (SPLIT_HEADS_NARROW_FIRST) off/on
    # with SPLIT_HEADS on at the three gate settings; then what an exiting program costs (ncu on both walks of the
    # second call at slow gates, each alone: the wide one walks nothing there), and the traces of the op's calls
    # (every kernel's start, duration and stream). Done in runs 40–41 (H100): it stays off (docs/performance.md); kept
    # to re-check a change to the split walks
    ("split heads, GPU test", [PY, "-m", "pytest", "-q", "tests/ops/test_hopper_fwd.py", "-k", "split_heads"], 200),
    ("split heads order, row 6", ["bash", "-c", " && ".join(
        f"{PY} benchmarks/op_time_check.py --brief --graph --split-heads-on --narrow-first-ab {gates} 2,16384,32,32"
        for gates in ("", "--mixed-gates", "--slow-gates"))], 200),
    ("split heads exits under ncu", ["ncu", "--kernel-name", "regex:gdn_chunk_fwd", "--launch-skip", "2",
                                     "--launch-count", "2", "--section", "SpeedOfLight", "--section",
                                     "WarpStateStats", "--section", "SourceCounters", "--section", "LaunchStats",
                                     "--print-details", "all", PY, "benchmarks/ncu_forward.py", "--path", "auto",
                                     "--B", "2", "--T", "16384", "--H", "32", "--slow-gates", "--split-heads"], 200),
    ("split heads traces", ["bash", "-c", f"{PY} benchmarks/gate_sensitivity.py --phases --trace --split-heads "
                                          f"2,16384,32,32"], 150),
    ("split heads, row 6 beside FlashQLA", [PY, "-c", "import runpy, sys; from linattn.ops.hopper import forward; "
                                            "forward.SPLIT_HEADS = True; sys.argv = ['bench_anchors.py', '--impl', "
                                            "'linattn:chunk_gated_delta_rule', '--no-decode', '--skip-correct', "
                                            "'--shapes', '2,16384,32,32']; "
                                            "runpy.run_path('.anchors/bench_anchors.py', run_name='__main__')"], 420),
    # session 29's pre-pass switches, on since run 36 (prepass_ab.py and op_time_check.py: −7 to −18% of the
    # pre-pass): the pre-pass's and the Hopper forward's GPU tests on the new defaults (run 36 reached 37 of 50 in
    # 200 s, the 38th a stale count mended since); and session 30's prepared plan and scan launches (BoundLaunch,
    # the plan's flags kept as scratch): the prepared calls bitwise the plain forward
    ("prepared calls, GPU tests", [PY, "-m", "pytest", "-q", "tests/ops/test_hopper_prepared.py",
                                   "tests/ops/test_launch.py", "-k", "gpu or real_kernel or split_forward"], 200),
    ("pre-pass GPU tests", [PY, "-m", "pytest", "-q", "-m", "not interpreter", "tests/ops/test_hopper_prepass.py",
                            "tests/ops/test_hopper_fwd.py", "-k", "not wide"], 320),
    # session 30's phase B switches (off until measured): the map as one tile with the next one prefetched, then
    # also at tf32; their GPU accuracy test, then the A/B at mixed and slow gates (rows 3 and 7: the scan is 46 and
    # 113 µs there at mixed gates, 6.5 µs per step; predicted 2–3.5 µs per step, row 7 −55 to −80 µs)
    ("scan switches, GPU test", [PY, "-m", "pytest", "-q", "tests/ops/test_hopper_scan.py"], 200),
    ("scan whole map, mixed gates", [PY, "benchmarks/op_time_check.py", "--brief", "--graph", "--mixed-gates",
                                     "--scan-whole-map-ab", *ROWS[:2]], 150),
    ("scan whole map at tf32, mixed gates", [PY, "benchmarks/op_time_check.py", "--brief", "--graph",
                                             "--mixed-gates", "--scan-whole-map-ab", "--scan-tf32-ab", *ROWS[:2]],
     150),
    ("scan whole map at tf32, slow gates", [PY, "benchmarks/op_time_check.py", "--brief", "--graph", "--slow-gates",
                                            "--scan-whole-map-ab", "--scan-tf32-ab", *ROWS], 200),
    ("pre-pass and plan profile", ["bash", "-c", PROFILE.format(py=PY)], 240),
    # the scan at mixed gates: 6.5 µs per dependent step (run 34: 113 µs of row 7's 359 there), where M_s's load does
    # not depend on the state
    ("scan under ncu", ["ncu", "--kernel-name", "regex:affine_scan", "--launch-skip", "1", "--launch-count", "1",
                        "--section", "SpeedOfLight", "--section", "WarpStateStats", "--section", "SourceCounters",
                        "--section", "MemoryWorkloadAnalysis", "--print-details", "all", PY,
                        "benchmarks/ncu_forward.py", "--path", "auto", "--B", "1", "--T", "32768", "--mixed-gates"],
     200),
    # the wave-fill rule's GPU test and A/B (run 34: row 3 −18%, row 7 −10% at mixed gates), to re-check after a
    # change to the plan kernel
    ("wave fill, GPU test", [PY, "-m", "pytest", "-q", "tests/ops/test_hopper_segmented.py", "-k", "wave_fill"],
     300),
    ("wave fill, mixed gates", [PY, "benchmarks/op_time_check.py", "--brief", "--map-wave-fill-ab", "--mixed-gates",
                                "--graph", *ROWS[:2]], 150),
    # issue 4's table: rows 6 and 7 first (last measured in runs 32 and 34), then rows 2, 3 and 1 in one process
    # (one head configuration: FlashQLA's and fla's compiles once; each row's records reach the step's log as they
    # are printed, so a cut costs the rows not yet reached), then rows 4 and 5 again (run 36)
] + [(f"{rows} beside fla", [PY, ".anchors/bench_anchors.py", "--impl", "linattn:chunk_gated_delta_rule",
                              "--no-decode", "--skip-correct", "--shapes", shape], 420)
     for rows, shape in [("row 6", "2,16384,32,32"), ("row 7", "1,32768,2,8"),
                         ("rows 2, 3 and 1", "8,4096,16,16;1,32768,16,16;1,4096,16,16"), ("row 4", "1,131072,16,16"),
                         ("row 5", "4,8192,16,32")]] + [
    # issue 4's whole table, forward only, in one process (benchmarks/anchors_forward_table.py: bench_anchors' own
    # inputs, implementations and timer, without the backwards that made the steps above take three calls)
    ("issue 4 table, forward", [PY, "benchmarks/anchors_forward_table.py"], 540),
    # session 25's WIDE_SEGMENTS (off: 1.50x at slow gates in run 32) at mixed gates, and its accuracy test
    ("wide segments, mixed gates", [PY, "benchmarks/op_time_check.py", "--brief", "--wide-segments-ab",
                                    "--mixed-gates", "--graph", "2,16384,32,32"], 120),
    ("wide segments, GPU test", [PY, "-m", "pytest", "-q", "tests/ops/test_hopper_fwd.py", "-k", "wide"], 200),
    # issue 4's other head sizes through the op on today's defaults (last timed in run 28, before session 23's
    # switches): K = V = 64 at rows 2 and 3's sizes, and K = 128, V = 256
    ("other head sizes", [PY, "benchmarks/op_time_check.py", "--brief", "--graph", "8,4096,16,16,64",
                          "1,32768,16,16,64", "8,4096,16,16,128,256"], 150),
    # what bounds the walk after session 23's switches: DRAM throughput against the chain's stalls
    ("walk and pre-pass under ncu", ["ncu", "--kernel-name", "regex:gdn_", "--launch-skip", "2", "--launch-count", "2",
                                     "--section", "SpeedOfLight", "--section", "WarpStateStats", "--section",
                                     "MemoryWorkloadAnalysis", PY, "benchmarks/ncu_forward.py", "--path", "auto"],
     240),
]


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
    logs = Path(os.environ.get("OUT", "/tmp")) / "steps"
    logs.mkdir(parents=True, exist_ok=True)
    env["PYTHONUNBUFFERED"] = "1"
    rows = []
    start = time.time()
    for name, cmd, limit in steps:
        t0 = time.time()
        left = args.budget - (t0 - start)
        if left < 30:
            rows.append((name, "skipped: budget", 0.0))
            continue
        limit = min(limit, left)
        # the step's whole output goes to its log as it runs (run 33 lost a call's output to a pipe's buffer when the
        # call was killed); bench_anchors writes its anchors.json beside the log, not over the last row's
        log = logs / f"{len(rows) + 1:02d}-{''.join(c if c.isalnum() else '-' for c in name)}.log"
        if ".anchors/bench_anchors.py" in cmd:
            cmd = [*cmd, "--out", str(log.with_suffix(""))]
            log.with_suffix("").mkdir(exist_ok=True)
        with open(log, "w") as sink:
            try:
                done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=limit)
                status = "ok" if done.returncode == 0 else f"rc {done.returncode}"
            except subprocess.TimeoutExpired:
                status = f"timeout ({limit:.0f} s)"
        out = log.read_text(errors="replace")
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
