"""GPU check of the sequence-parallel Triton backward (common/seq_parallel_bwd.py, split_fwd.segmented_state_pass):
time and accuracy of the segmented walks against the unsegmented ones.

Part 1, accuracy (B=1 T=4096 H=HV=16, K=V=128, bf16, anchors' gates logsigmoid(randn)/16): every gradient of the
backward planned (the reverse planner splits this row) and unsegmented against the torch backend in float64 on the
same rounded inputs, and planned against unsegmented.
Part 2, per row (bf16, K=V=128; B=1 T=4096 H=16 and the three long rows of issue 45): the planned segment lengths
of both walks; do_bench medians (ms) of the whole backward unsegmented (segment_chunks = the chunk count) and
planned; the relative L2 difference of every gradient planned vs unsegmented; then the two walks alone — the
reverse walk (state_pass_bwd vs its segmented form) and the recompute's state pass (state_pass_fwd vs
segmented_state_pass) — unsegmented and at forced segment lengths, the figures that calibrate the planners' costs
(seq_parallel_bwd.REVERSE_MAP_COST, split_fwd.AFFINE_COST).

JSON goes to --out after each part; the table is printed last. One device call, about 3-5 minutes (compiles
included):

    PYTHONPATH=$PWD python benchmarks/gpu_check_bwd_segments.py --out $OUT/bwd_segments.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from linattn.ops.common import CHUNK, num_sms  # noqa: E402
from linattn.ops.common.local_bwd_dv import local_bwd_dv  # noqa: E402
from linattn.ops.common.seq_parallel_bwd import plan_reverse_segments, state_pass_bwd_seq_parallel  # noqa: E402
from linattn.ops.common.split_fwd import segmented_state_pass, state_pass_plan, store_dtype  # noqa: E402
from linattn.ops.common.state_pass import state_pass_fwd  # noqa: E402
from linattn.ops.common.state_pass_bwd import state_pass_bwd  # noqa: E402
from linattn.ops.common.wy import wy_fwd  # noqa: E402
from linattn.ops.gated_delta.torch_chunk import chunk_gated_delta_rule_bwd_torch  # noqa: E402
from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton, recompute_forward  # noqa: E402
from linattn.ops.utils import flat_offsets  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
ROWS = [  # (name, B, T, H, HV, K = V); the first is short, but the reverse planner splits it (L = 8)
    ("B1_T4096_H16", 1, 4096, 16, 16, 128),
    ("B1_T32768_H16", 1, 32768, 16, 16, 128),
    ("B1_T131072_H16", 1, 131072, 16, 16, 128),
    ("B1_T32768_H2_HV8", 1, 32768, 2, 8, 128),
]
ACC_ROW = ("B1_T4096_H16", 1, 4096, 16, 16, 128)
SWEEP = (16, 32, 64, 128, 256)      # forced segment lengths of the walk timings (those shorter than the sequence)
# --smoke: the code paths on tiny shapes (CPU interpreter: fp32, whose dots it runs right; one timed call each)
SMOKE_ROWS = [("smoke_T640_HV2", 1, 640, 1, 2, 32)]
SMOKE_ACC_ROW = ("smoke_T256_HV2", 1, 256, 1, 2, 32)
SMOKE_SWEEP = (2, 4)


def bench(fn) -> float:
    """do_bench's median (ms) on the GPU; one timed call elsewhere (smoke runs)."""
    if DEVICE == "cuda":
        from triton.testing import do_bench
        return do_bench(fn)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def rel(x, ref):
    if x is None or ref is None:
        return None
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def make(B, T, H, HV, D, seed=0):
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)
    q = F.normalize(r(B, T, H, D), dim=-1).to(dt)
    k = F.normalize(r(B, T, H, D), dim=-1).to(dt)
    v = r(B, T, HV, D).to(dt)
    g = F.logsigmoid(r(B, T, HV)) / 16
    beta = torch.rand(B, T, HV, device=DEVICE, generator=gen).to(dt)
    h0 = r(B, HV, D, D) * 0.1
    do = r(B, T, HV, D).to(dt)
    dht = r(B, HV, D, D)
    return (q, k, v, g, beta, D ** -0.5, h0), do, dht


def bwd(inp, do, dht, segment_chunks=None):
    return chunk_gated_delta_rule_bwd_triton(*inp, None, None, do, dht, segment_chunks=segment_chunks)


def accuracy_part(row) -> dict:
    name, B, T, H, HV, D = row
    inp, do, dht = make(B, T, H, HV, D)
    ref = chunk_gated_delta_rule_bwd_torch(*(x.double() for x in inp[:5]), inp[5], inp[6].double(), None,
                                           do.double(), dht.double())
    # the smoke row is too short for the planner: force the segments it would cut a long row into
    planned, unseg = bwd(inp, do, dht, 2 if DEVICE == "cpu" else None), bwd(inp, do, dht, T // CHUNK)
    return dict(row=name, reverse_L=plan_reverse_segments([T // CHUNK] * B, HV, D, D, num_sms(do.device)),
                planned_vs_f64={n: rel(a, r) for n, a, r in zip(GRADS, planned, ref)},
                unsegmented_vs_f64={n: rel(a, r) for n, a, r in zip(GRADS, unseg, ref)},
                planned_vs_unsegmented={n: rel(a, b) for n, a, b in zip(GRADS, planned, unseg)})


def walk_timings(inp, do, dht, nt: int, sweep) -> dict:
    """ms of the reverse walk and of the recompute's state pass, unsegmented ("none") and at forced lengths."""
    q, k, v, g, beta, scale, h0 = inp
    B, T, H, K = q.shape
    HV = v.shape[2]
    offsets = flat_offsets(B, T)
    gc, A_inv, w, _, _ = recompute_forward(k, v, g, beta, h0, None, None, None, nt)
    dv_local = local_bwd_dv(q, k, gc, do, scale, None, None, None)
    walk = (q, k, w, gc, do, dv_local, dht, scale, None, None, nt)
    out = {"reverse": {"none": bench(partial(state_pass_bwd, *walk))}, "recompute_state_pass": {}}
    for L in (x for x in sweep if x < nt):
        out["reverse"][L] = bench(partial(state_pass_bwd_seq_parallel, *walk, offsets, segment_chunks=L))
    del dv_local
    _, u = wy_fwd(k, v, beta, gc, A_inv, None, None)
    _, BV, warps = state_pass_plan([nt] * B, HV, K, v.shape[3], num_sms(q.device))
    store = store_dtype(k.dtype)
    out["recompute_state_pass"]["none"] = bench(partial(state_pass_fwd, k, w, u, gc, h0, store_dtype=store))
    for L in (x for x in sweep if x < nt):
        out["recompute_state_pass"][L] = bench(partial(segmented_state_pass, k, w, u, gc, h0, None, offsets, L,
                                                          BV, warps, store))
    return out


def row_part(row, sweep) -> dict:
    name, B, T, H, HV, D = row
    inp, do, dht = make(B, T, H, HV, D)
    nt = T // CHUNK
    sms = num_sms(do.device)
    rec = dict(row=name, reverse_L=plan_reverse_segments([nt] * B, HV, D, D, sms),
               recompute_L=state_pass_plan([nt] * B, HV, D, D, sms)[0])
    planned, unseg = bwd(inp, do, dht, 2 if DEVICE == "cpu" else None), bwd(inp, do, dht, nt)
    rec["planned_vs_unsegmented"] = {n: rel(a, b) for n, a, b in zip(GRADS, planned, unseg)}
    del planned, unseg
    rec["bwd_ms_unsegmented"] = bench(partial(bwd, inp, do, dht, nt))
    rec["bwd_ms_planned"] = bench(partial(bwd, inp, do, dht))
    rec["walk_ms"] = walk_timings(inp, do, dht, nt, sweep)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="JSON file, rewritten after each part")
    ap.add_argument("--rows", default=",".join(r[0] for r in ROWS), help="comma-separated subset of the rows")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the code paths; runs on the CPU)")
    a = ap.parse_args()
    rows, acc_row, sweep = (SMOKE_ROWS, SMOKE_ACC_ROW, SMOKE_SWEEP) if a.smoke else (
        [r for r in ROWS if r[0] in a.rows.split(",")], ACC_ROW, SWEEP)
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    print(device, flush=True)
    result = dict(device=device, accuracy=None, rows=[])

    def save():
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    try:
        result["accuracy"] = accuracy_part(acc_row)
    except Exception as e:          # one failing part must not hide the others
        result["accuracy"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    print(json.dumps(result["accuracy"]), flush=True)
    save()
    for row in rows:
        try:
            rec = row_part(row, sweep)
        except Exception as e:
            rec = dict(row=row[0], error=f"{type(e).__name__}: {str(e)[:300]}")
        result["rows"].append(rec)
        print(json.dumps(rec), flush=True)
        save()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print_table(result, sweep)


def print_table(result, sweep):
    acc = result["accuracy"]
    if "error" not in acc:
        print(f"\naccuracy {acc['row']} (reverse L = {acc['reverse_L']}): relative L2 per gradient")
        print(f"{'':28}" + "".join(f"{n:>9}" for n in GRADS))
        for key in ("planned_vs_f64", "unsegmented_vs_f64", "planned_vs_unsegmented"):
            print(f"{key:28}" + "".join(f"{acc[key][n] or 0:9.1e}" for n in GRADS))
    print(f"\n{'row':20}{'L rev':>6}{'L rec':>6}{'bwd unseg':>10}{'planned':>9}{'speedup':>8}  worst grad diff")
    for rec in result["rows"]:
        if "error" in rec:
            print(f"{rec['row']:20} {rec['error']}")
            continue
        worst = max(v for v in rec["planned_vs_unsegmented"].values() if v is not None)
        print(f"{rec['row']:20}{rec['reverse_L'] or '-':>6}{rec['recompute_L'] or '-':>6}"
              f"{rec['bwd_ms_unsegmented']:10.3f}{rec['bwd_ms_planned']:9.3f}"
              f"{rec['bwd_ms_unsegmented'] / rec['bwd_ms_planned']:8.2f}  {worst:.1e}")
    print(f"\n{'walk ms by forced L':36}" + "".join(f"{str(x):>9}" for x in ("none", *sweep)))
    for rec in result["rows"]:
        for walk in ("reverse", "recompute_state_pass"):
            if "error" in rec:
                continue
            t = rec["walk_ms"][walk]
            print(f"{rec['row'] + ' ' + walk:36}" + "".join(f"{t[x]:9.3f}" if x in t else f"{'-':>9}"
                                                            for x in ("none", *sweep)))


if __name__ == "__main__":
    main()
