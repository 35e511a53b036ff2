"""GPU timing and check of intra-card sequence parallelism for the fused forward (issue 4, step 2).

    python benchmarks/bench_seq_parallel.py [--quick] [--out DIR]

For each of the issue's seven shapes (bf16, K = V = 128; ``--quick``: the first three and the last) with the fused
pre-pass run once: the sequential part of the forward unsegmented (``fused_fwd``), as the planner splits it
(``fused_fwd_seq_parallel``, the default path), and forced to 2, 4, 8, 16 segments per sequence; its phases A, B, C
alone at 4 segments (what calibrates ``seq_parallel``'s AFFINE_COST, SCAN_COST and OCCUPANCY); the whole forward
(``chunk_gated_delta_rule_fwd_triton``). Every segmented o and final state is compared with the unsegmented ones
(relative L2, same inputs). Then accuracy: fp32 inputs, segmented vs unsegmented (exact up to fp32 rounding is the
claim), and bf16/fp32 segmented vs the float64 reference. Prints the tables last; writes bench_seq_parallel.json
under --out. ``triton.testing.do_bench`` medians, eager calls.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

from linattn.ops.common import CHUNK
from linattn.ops.common import seq_parallel as sp
from linattn.ops.common.fused_fwd import fused_fwd, fused_fwd_config, launch_walk, num_sms
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.gated_delta.triton_chunk import chunk_gated_delta_rule_fwd_triton, fwd_prepass

torch.backends.cuda.matmul.allow_tf32 = False
DEVICE = "cuda"
# (B, T, H, HV): issue 4's shapes, K = V = 128; FlashQLA fwd ms from the issue's table (2026-11-29)
SHAPES = [(1, 4096, 16, 16), (8, 4096, 16, 16), (1, 32768, 16, 16), (1, 131072, 16, 16), (4, 8192, 16, 32),
          (2, 16384, 32, 32), (1, 32768, 2, 8)]
FLASHQLA = {(1, 4096, 16, 16): 0.334, (8, 4096, 16, 16): 0.336, (1, 32768, 16, 16): 0.461,
            (1, 131072, 16, 16): 1.294, (4, 8192, 16, 32): 0.632, (2, 16384, 32, 32): 0.783, (1, 32768, 2, 8): 0.290}
FORCED = (2, 4, 8, 16)
ACC_SHAPE = (1, 2048, 2, 4, 128, 128)     # B, T, H, HV, K, V of the accuracy check


def make(B, T, H, HV, K, V, dt, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)
    # gates /64: the state remembers across segments, so a wrong stitch would show in o
    return dict(q=r(B, T, H, K).to(dt), k=F.normalize(r(B, T, H, K), dim=-1).to(dt), v=r(B, T, HV, V).to(dt),
                g=F.logsigmoid(r(B, T, HV)) / 64, beta=torch.rand(B, T, HV, device=DEVICE, generator=gen).to(dt))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def time_shape(B, T, H, HV, K=128, V=128):
    x = make(B, T, H, HV, K, V, torch.bfloat16)
    scale = K ** -0.5
    gc, w, u, p = fwd_prepass(x["q"], x["k"], x["v"], x["g"], x["beta"])
    base = (x["q"], x["k"], w, u, gc, scale, None, torch.bfloat16)
    NT = triton.cdiv(T, CHUNK)
    _, BV, nw = fused_fwd_config(K, V, B * HV, num_sms(x["q"].device))
    L_plan = sp.plan_segments([NT] * B, HV, K, V, BV, num_sms(x["q"].device))
    o0, ht0 = fused_fwd(*base, p=p)
    row = dict(shape=(B, T, H, HV), BV=BV, L_plan=L_plan, nseg_plan=triton.cdiv(NT, L_plan) if L_plan else 1,
               unsegmented=triton.testing.do_bench(lambda: fused_fwd(*base, p=p)),
               planned=triton.testing.do_bench(lambda: sp.fused_fwd_seq_parallel(*base, p=p)),
               forward=triton.testing.do_bench(lambda: chunk_gated_delta_rule_fwd_triton(
                   x["q"], x["k"], x["v"], x["g"], x["beta"], scale, None, None, None)))
    diffs = []
    for nseg in FORCED:
        L = triton.cdiv(NT, nseg)
        f = lambda L=L: sp.fused_fwd_seq_parallel(*base, segment_chunks=L, p=p)
        o, ht = f()
        diffs.append((rel(o, o0), rel(ht, ht0)))
        row[f"seg{nseg}"] = triton.testing.do_bench(f)
    worst = lambda vals: max(vals, key=lambda v: (v != v, v))      # a NaN is the worst
    row["o_vs_unsegmented"], row["ht_vs_unsegmented"] = worst([d[0] for d in diffs]), worst([d[1] for d in diffs])

    # the three phases alone at 4 segments per sequence (calibration of the planner's constants)
    nseg = 4
    L = triton.cdiv(NT, nseg)
    L = triton.cdiv(NT, triton.cdiv(NT, L))
    NS = B * nseg
    mn = torch.empty(NS, HV, K, K + V, dtype=torch.float32, device=DEVICE)
    walk = dict(cu_seqlens=None, num_warps=nw, dot_prec=None, state_prec=None, chunk_size=CHUNK, num_segments=NS,
                segments=None, nseg=nseg, seg_len=L, segmented=True)
    phase_a = lambda: launch_walk(x["q"], x["k"], w, u, gc, None, None, mn, scale, BV=BV, affine=True, **walk)
    phase_a()
    h_in = sp.affine_scan(mn, None, V, B, None, nseg, BV=BV)
    o = torch.empty_like(o0)
    ht = torch.empty_like(ht0)
    row["phaseA"] = triton.testing.do_bench(phase_a)
    row["phaseB"] = triton.testing.do_bench(lambda: sp.affine_scan(mn, None, V, B, None, nseg, BV=BV))
    row["phaseC"] = triton.testing.do_bench(lambda: launch_walk(x["q"], x["k"], w, u, gc, o, h_in, ht, scale,
                                                                BV=BV, **walk))
    # per-chunk figures: unsegmented walk ms per chunk; phase A per chunk relative to phase C; phase B per segment
    row["walk_us_per_chunk"] = row["unsegmented"] * 1e3 / NT
    row["affine_cost"] = row["phaseA"] / row["phaseC"] * (triton.cdiv(V, BV) / triton.cdiv(K + V, BV))
    row["scan_us_per_segment"] = row["phaseB"] * 1e3 / nseg
    return row


def accuracy():
    rows = []
    for dt in (torch.float32, torch.bfloat16):
        B, T, H, HV, K, V = ACC_SHAPE
        x = make(B, T, H, HV, K, V, dt, seed=1)
        h0 = torch.randn(B, HV, K, V, device=DEVICE) * 0.1
        scale = K ** -0.5
        gc, w, u, p = fwd_prepass(x["q"], x["k"], x["v"], x["g"], x["beta"])
        o0, ht0 = fused_fwd(x["q"], x["k"], w, u, gc, scale, h0, torch.float32, p=p)
        ro, rht = gated_delta_rule_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, h0)
        for nseg in (1, 4, 16):
            o, ht = sp.fused_fwd_seq_parallel(x["q"], x["k"], w, u, gc, scale, h0, torch.float32,
                                              segment_chunks=triton.cdiv(T // CHUNK, nseg), p=p)
            rows.append(dict(dtype=str(dt)[6:], nseg=nseg, o_vs_unsegmented=rel(o, o0), ht_vs_unsegmented=rel(ht, ht0),
                             o_vs_ref=rel(o, ro), o_out_dtype_vs_ref=rel(o.to(dt), ro), ht_vs_ref=rel(ht, rht)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          "SMs", num_sms(torch.device(DEVICE)), flush=True)
    acc = accuracy()
    rows = []
    for shape in (SHAPES[:3] + SHAPES[-1:]) if a.quick else SHAPES:
        rows.append(time_shape(*shape))
        torch.cuda.empty_cache()
        print("done", shape, flush=True)
    with open(os.path.join(a.out, "bench_seq_parallel.json"), "w") as f:
        json.dump(dict(accuracy=acc, speed=rows,
                       model=dict(OCCUPANCY=sp.OCCUPANCY, AFFINE_COST=sp.AFFINE_COST, SCAN_COST=sp.SCAN_COST,
                                  MIN_SEGMENT_CHUNKS=sp.MIN_SEGMENT_CHUNKS)), f, indent=1)

    print(f"\n## Accuracy (B, T, H, HV, K, V = {ACC_SHAPE}, weak gates, h0; o written in fp32): relative L2")
    print("| dtype | segments | o vs unsegmented | ht vs unsegmented | o vs float64 | o in input dtype vs float64 "
          "| ht vs float64 |\n|---|---|---|---|---|---|---|")
    for r in acc:
        print(f"| {r['dtype']} | {r['nseg']} | {r['o_vs_unsegmented']:.2e} | {r['ht_vs_unsegmented']:.2e} | "
              f"{r['o_vs_ref']:.3e} | {r['o_out_dtype_vs_ref']:.3e} | {r['ht_vs_ref']:.3e} |")
    print(f"\n## Planner calibration (model: OCCUPANCY={sp.OCCUPANCY} AFFINE_COST={sp.AFFINE_COST} "
          f"SCAN_COST={sp.SCAN_COST} chunk-times)")
    print("| B, T, H, HV | BV | walk µs/chunk | phase A ms | B ms | C ms (4 segments) | measured AFFINE_COST "
          "| phase B µs/segment |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {', '.join(map(str, r['shape']))} | {r['BV']} | {r['walk_us_per_chunk']:.2f} | {r['phaseA']:.3f} | "
              f"{r['phaseB']:.3f} | {r['phaseC']:.3f} | {r['affine_cost']:.2f} | {r['scan_us_per_segment']:.1f} |")
    print("\n## Sequential part of the forward (after the pre-pass), bf16 K=V=128, do_bench median ms")
    print("| B, T, H, HV | unsegmented | planner (segments) | " + " | ".join(f"{n} seg" for n in FORCED)
          + " | whole fwd (default) | FlashQLA fwd (anchor) | o vs unseg (worst) | ht vs unseg |")
    print("|" + "---|" * (8 + len(FORCED)))
    for r in rows:
        forced = " | ".join(f"{r[f'seg{n}']:.3f}" for n in FORCED)
        print(f"| {', '.join(map(str, r['shape']))} | {r['unsegmented']:.3f} | {r['planned']:.3f} ({r['nseg_plan']}) | "
              f"{forced} | {r['forward']:.3f} | {FLASHQLA[tuple(r['shape'])]} | {r['o_vs_unsegmented']:.1e} | "
              f"{r['ht_vs_unsegmented']:.1e} |")


if __name__ == "__main__":
    main()
