"""Issue 4's forward table in one process: linattn's public op ("auto"), FlashQLA, fla and SDPA on every row.

bench_anchors.py times the forward and then the forward + backward of every implementation at every row; the
backwards' compiles and autotunes (fla's, FlashQLA's, ours) and SDPA's backward at T = 131072 took three device calls
of ≈ 560 s for the seven rows (runs 32–37), so the table was always a mix of runs. This script times the forward
alone, with bench_anchors' own pieces imported from ``.anchors/bench_anchors.py`` (not copied): its inputs
(``make_inputs``, bf16, seed 2, requires_grad), its implementations as it loads them (``load_impls``: fla with
``FLA_FLASH_QLA=0``, FlashQLA, and linattn through ``--impl linattn:chunk_gated_delta_rule``) and its timer
(``bench``: do_bench, 25 warm-ups, 100 ms, median), under ``torch.no_grad()`` as it does. SDPA is timed as it times
it (flash SDPA, causal, [B, HV, T, K] bf16). So every figure is what bench_anchors' ``fwd_ms`` column would print, and
all seven rows come from one process on one card:

    mkdir -p /tmp/site && tar -C /tmp/site -xJf .anchors/anchors-site.tar.xz
    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python benchmarks/anchors_forward_table.py [--rows 4 6 ...]

Each record is printed as JSON as it is measured (a call cut at its limit keeps the rows it reached) and the whole
run goes to ``$OUT/forward_table.json``; the table last gives each row's goal (FlashQLA's same-run figure / 1.25, and
below SDPA at row 1) and linattn against it and against issue 4's roofline floor. ``first_call_s`` is each
implementation's first call at the row's shape (compiles included: issue 4 asks for < 2 s on a new T).

``--warm`` first runs every implementation's first call at every row in spawned worker processes side by side
(``anchors_warm.py``), filling TileLang's and Triton's disk caches, so that the timed process loads its kernels
instead of compiling them one after another; it prints the phase's seconds (each task's seconds, charged and peak
MB into ``$OUT/warm.json``, the workers' output into ``$OUT/warm_logs/``). Its first calls are then no compile
figure: they are recorded as ``first_call_after_warm_s``, and the table's notes say so.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / ".anchors"))
import anchors_warm  # noqa: E402
from bench_anchors import bench, load_impls, make_inputs  # noqa: E402  (the anchors' own pieces)

from linattn.ops.hopper.precompile import usable_cores  # noqa: E402

# issue 4's rows in its order: (B, T, Hqk, Hv) and its roofline floor in ms (K = V = 128)
ROWS = {
    1: ((1, 4096, 16, 16), 0.016),
    2: ((8, 4096, 16, 16), 0.126),
    3: ((1, 32768, 16, 16), 0.126),
    4: ((1, 131072, 16, 16), 0.503),
    5: ((4, 8192, 16, 32), 0.218),
    6: ((2, 16384, 32, 32), 0.252),
    7: ((1, 32768, 2, 8), 0.054),
}
LINATTN = "linattn:chunk_gated_delta_rule"
GOAL_SPEEDUP = 1.25
K = 128


def sdpa(q, k, v):
    """Causal flash SDPA, as bench_anchors times it (a tuple, like the other implementations' outputs)."""
    return (F.scaled_dot_product_attention(q, k, v, is_causal=True),)


def time_training(fn, xs) -> dict:
    """bench_anchors' fwd+bwd figures of one implementation: ``fwdbwd_ms`` (forward + ``torch.autograd.grad``
    over every input, do_bench median) and ``peak_extra_MB`` (peak allocation of one fwd+bwd over the inputs')."""
    o = fn(*xs)[0]
    do = torch.randn_like(o)
    record = dict(fwdbwd_ms=bench(lambda: torch.autograd.grad(fn(*xs)[0], xs, do)))
    del o
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(fn(*xs)[0], xs, do)
    record["peak_extra_MB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return record


def time_row(impls, B, T, H, HV, train: bool = False, first_call_key: str = "first_call_s"):
    """One record per implementation at one row: ``fwd_ms`` (and the first call's seconds, under
    ``first_call_key``), or with ``train`` the :func:`time_training` figures, or ``error``."""
    records = []
    for name, fn in list(impls.items()) + [("sdpa_flash", None)]:
        record = dict(impl=name, B=B, T=T, H=H, HV=HV, K=K)
        try:
            if fn is None:
                q = torch.randn(B, HV, T, K, device="cuda", dtype=torch.bfloat16, requires_grad=train)
                k, v = torch.randn_like(q, requires_grad=train), torch.randn_like(q, requires_grad=train)
                if train:
                    record.update(time_training(sdpa, [q, k, v]))
                else:
                    with torch.no_grad():
                        record["fwd_ms"] = bench(lambda q=q, k=k, v=v: sdpa(q, k, v))
            else:
                xs = make_inputs(B, T, H, HV, K, K, torch.bfloat16, seed=2, requires_grad=True)
                start = time.time()
                fn(*xs, K ** -0.5)
                torch.cuda.synchronize()
                record[first_call_key] = time.time() - start
                if train:
                    record.update(time_training(lambda *x, fn=fn: fn(*x, K ** -0.5), xs))
                else:
                    with torch.no_grad():
                        record["fwd_ms"] = bench(lambda fn=fn, xs=xs: fn(*xs, K ** -0.5))
        except Exception as error:  # one implementation's failure is a record, not the end of the table
            record["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        print(json.dumps(record), flush=True)
        records.append(record)
        torch.cuda.empty_cache()
    return records


def cell(ms):
    return "n/a" if ms is None else f"{ms:.3f}"


def table(records, rows, key: str = "fwd_ms"):
    """Issue 4's table as markdown: each implementation's ms (``key``), the goal, linattn / FlashQLA and / floor
    (the floor is the forward's)."""
    by = {(r["impl"], r["B"], r["T"], r["H"], r["HV"]): r.get(key) for r in records}
    lines = ["| row | B, T, Hqk, Hv | linattn | FlashQLA | fla | SDPA | goal | linattn / FlashQLA | floor | / floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        shape, floor = ROWS[row]
        ours, qla, fla, sdpa = (by.get((name, *shape)) for name in (LINATTN, "flashqla", "fla", "sdpa_flash"))
        goal = qla / GOAL_SPEEDUP if qla else None
        if goal is None or ours is None:
            verdict = "n/a"
        else:
            met = ours <= goal and (row != 1 or (sdpa is not None and ours < sdpa))
            verdict = f"{ours / qla:.2f}×: " + ("met" if met else f"missed by {ours / goal - 1:.0%}")
        goal_text = "n/a" if goal is None else f"≤ {goal:.3f}" + (" and < SDPA" if row == 1 else "")
        lines.append(f"| {row} | {', '.join(map(str, shape))} | {cell(ours)} | {cell(qla)} | {cell(fla)} | "
                     f"{cell(sdpa)} | {goal_text} | {verdict} | {floor} | "
                     f"{'n/a' if ours is None else f'{ours / floor:.1f}×'} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS), choices=list(ROWS),
                    help="issue 4's rows to time, in this order (all seven by default)")
    ap.add_argument("--impl", action="append", default=[],
                    help="more implementations as MODULE:FUNCTION (bench_anchors' --impl), beside linattn's op")
    ap.add_argument("--train", action="store_true",
                    help="forward + backward (ms) and its peak extra memory (MB) instead of the forward, as "
                         "bench_anchors measures them (issue 45's table)")
    ap.add_argument("--skip", action="append", default=[], help="an implementation to leave out (e.g. fla)")
    ap.add_argument("--warm", action="store_true",
                    help="first call every implementation at every row in parallel worker processes (compiles "
                         "into the disk caches), then time; first calls are then recorded as after warm")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if args.warm:
        anchors_warm.cache_autotune_results()       # before fla's import in load_impls creates its autotuners
    impls = {n: f for n, f in load_impls([LINATTN, *args.impl]).items() if n not in args.skip}
    print("impls:", list(impls), flush=True)
    first_call_key = "first_call_s"
    if args.warm:
        tasks = anchors_warm.warm_tasks(impls, {row: ROWS[row][0] for row in args.rows}, args.train,
                                        [LINATTN, *args.impl])
        log_dir = os.path.join(os.environ["OUT"], "warm_logs") if "OUT" in os.environ else None
        seconds, results = anchors_warm.warm(tasks, torch.cuda.mem_get_info()[0], usable_cores(), log_dir=log_dir)
        print(f"warm phase: {seconds:.1f} s", flush=True)
        (Path(os.environ.get("OUT", ".")) / "warm.json").write_text(anchors_warm.to_json(seconds, results))
        first_call_key = "first_call_after_warm_s"
    records = []
    out = Path(os.environ.get("OUT", ".")) / ("train_table.json" if args.train else "forward_table.json")
    for row in args.rows:
        records += time_row(impls, *ROWS[row][0], train=args.train, first_call_key=first_call_key)
        out.write_text(json.dumps(records, indent=1))
    print()
    print(table(records, args.rows, "fwdbwd_ms" if args.train else "fwd_ms"))
    label = ("after the warm phase (caches filled: no compile figure)" if args.warm else
             "compiles included, unless an earlier process on this machine cached them")
    print(f"\nfirst call s, {label}")
    for r in records:
        if first_call_key in r:
            print(f"{r['B']},{r['T']},{r['H']},{r['HV']}  {r['impl']:<32} {r[first_call_key]:9.2f}")
    if args.train:
        print("\npeak extra MB during fwd+bwd (goal: linattn's ≤ FlashQLA's)")
        for r in records:
            print(f"{r['B']},{r['T']},{r['H']},{r['HV']}  {r['impl']:<32} {r.get('peak_extra_MB', float('nan')):9.0f}")


if __name__ == "__main__":
    main()
