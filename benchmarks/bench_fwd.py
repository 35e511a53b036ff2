"""GPU check and timing of the fused Triton forward (issue 4) against the unfused five-stage forward.

    python benchmarks/bench_fwd.py [--quick | --precisions] [--out DIR]

Part 1, accuracy (bf16 and fp16, which the CPU interpreter cannot check for bf16): relative L2 of o and of the
final state against the float64 token-by-token reference at the accuracy anchor (B=2 T=300 H=4 K=V=128), for the
unfused path and the fused path at each (DOT_PREC, STATE_PREC) of the sequential kernel in PRECISIONS (output dots
Q S, P V_new / state dots W S, Kᵀ V_new; "bf16x3" is the split-bf16 dot of linattn/ops/common/dot.py), plus
tf32x3 everywhere. Then, on every timed shape, the fused o and state against the unfused ones (same inputs).
Part 2, speed (bf16, eager, ``triton.testing.do_bench`` medians): the issue's seven shapes plus K=V=64 and
K=128/V=256: unfused forward, fused forward (and its two kernels alone); achieved TFLOP/s, GB/s and the ratio to
the roofline floor (../shared/anchors/roofline.py's formula, copied below because ../shared does not travel to the
device). Then the first-call time on a new T, and a small sweep of the sequential kernel's (BV, num_warps).
Part 3, dot precisions (bf16): on PRECISION_SHAPES, for each of PRECISIONS, the sequential kernel alone (unsplit
walk) and the whole forward (pre-pass + the seq-parallel walk the public op runs). ``--precisions`` runs only
the anchor accuracy (bf16) and part 3 (≈ 1–2 min, most of it compiling the four variants).
Prints the tables last; writes bench_fwd.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

# inputs and the error measure are gpu_check_fwd's (this file runs as `python benchmarks/bench_fwd.py`, so its
# folder is on sys.path)
from gpu_check_fwd import make, rel  # noqa: E402

from linattn.ops.common import CHUNK
from linattn.ops.common.fused_fwd import fused_fwd
from linattn.ops.common.seq_parallel import fused_fwd_seq_parallel
from linattn.ops.common.varlen import chunk_tables
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.gated_delta.triton_chunk import (
    chunk_gated_delta_rule_fwd_stages,
    chunk_gated_delta_rule_fwd_triton,
    fwd_prepass,
)

torch.backends.cuda.matmul.allow_tf32 = False
DEVICE = "cuda"
PEAK, BW = 790e12, 4.3e12          # measured H200 ceilings (../shared/anchors/roofline.py)

# (B, T, H, HV, K, V): the seven shapes (K = V = 128), then the two extra head sizes it asks to time
SHAPES = [(1, 4096, 16, 16, 128, 128), (8, 4096, 16, 16, 128, 128), (1, 32768, 16, 16, 128, 128),
          (1, 131072, 16, 16, 128, 128), (4, 8192, 16, 32, 128, 128), (2, 16384, 32, 32, 128, 128),
          (1, 32768, 2, 8, 128, 128), (8, 4096, 16, 16, 64, 64), (8, 4096, 16, 16, 128, 256)]
# the table (2026-11-29, same card model): fla fwd ms, FlashQLA fwd ms, linattn goal ms
ANCHOR = {(1, 4096, 16, 16): (0.532, 0.334, 0.15), (8, 4096, 16, 16): (0.935, 0.336, 0.27),
          (1, 32768, 16, 16): (1.258, 0.461, 0.37), (1, 131072, 16, 16): (4.904, 1.294, 1.03),
          (4, 8192, 16, 32): (1.642, 0.632, 0.50), (2, 16384, 32, 32): (1.716, 0.783, 0.63),
          (1, 32768, 2, 8): (1.095, 0.290, 0.23)}
# (DOT_PREC, STATE_PREC) of the sequential kernel compared for bf16: today's default first (fused_dot_precisions)
# ("bf16x3", …) pairs are left out: the walk refuses them on CUDA (they fault on the H200, docs/performance.md run 8;
# benchmarks/bf16x3_walk_ab.py bisects that)
PRECISIONS = [("tf32x3", "tf32"), ("tf32", "tf32")]
PRECISION_SHAPES = [(1, 4096, 16, 16, 128, 128), (8, 4096, 16, 16, 128, 128), (1, 32768, 16, 16, 128, 128),
                    (4, 8192, 16, 32, 128, 128)]


def floor_ms(B, T, H, HV, K, V, C=CHUNK):
    """Roofline floor: FLOPs 8·C·d + 6·d² per (token, value head) with d = √(K·V)-ish (exact for K = V), bytes of
    q, k, v, o in bf16 and g, β in fp32. Returns (floor, flops, bytes)."""
    d = (K * V) ** 0.5
    flops = B * T * HV * (8 * C * d + 6 * d * d)
    bytes_ = B * T * (H * 2 * K * 2 + HV * (2 * V * 2 + 8))
    return max(flops / PEAK, bytes_ / BW) * 1e3, flops, bytes_


def prepass_as_default(x, cu=None, ci=None, dot_prec=None):
    """gc, W, U and P as the default path computes them (``triton_chunk.fwd_prepass``)."""
    return fwd_prepass(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, ci, dot_prec=dot_prec)


def fused(x, cu, offsets, scale, prec_seq=None, prec_pre=None, prec_state=None):
    """The fused path with optional dot-precision overrides (what chunk_gated_delta_rule_fwd_triton runs)."""
    ci = chunk_tables(offsets, CHUNK, DEVICE)[0] if cu is not None else None
    gc, w, u, p = prepass_as_default(x, cu, ci, dot_prec=prec_pre)
    return fused_fwd_seq_parallel(x["q"], x["k"], w, u, gc, scale, x["initial_state"], x["v"].dtype, cu, offsets, p=p,
                                  dot_prec=prec_seq, state_prec=prec_state)


def accuracy(quick, dtypes=(torch.bfloat16, torch.float16)):
    rows = []
    cases = [("anchor B=2 T=300 H=4 K=V=128", (2, 300, 4, 4, 128, 128), None),
             ("varlen 1,64,235 H=2 HV=4 K=60 V=100", (1, 300, 2, 4, 60, 100), (1, 64, 235))]
    # (name, (prec_seq, prec_pre, prec_state)): the sequential kernel's output / state dots; the pre-pass default
    variants = [("unfused (tf32)", None)] + [(f"fused o {o} / state {st}", (o, None, st))
                                             for o, st in PRECISIONS + [("tf32x3", "tf32x3")]]
    for name, (B, T, H, HV, K, V), lengths in cases[:1] if quick else cases:
        for dt in dtypes:
            x, cu, offsets = make(B, T, H, HV, K, V, lengths, dt)
            scale = K ** -0.5
            args = [x[n] for n in ("q", "k", "v", "g", "beta")]
            ro, rht = gated_delta_rule_reference(*args, scale, x["initial_state"], offsets)
            floor = rel(ro.to(dt), ro)
            for vname, prec in variants:
                if prec is None:
                    st = chunk_gated_delta_rule_fwd_stages(*args, scale, x["initial_state"], cu, offsets)
                    o, ht = st.o, st.final_state
                else:
                    o, ht = fused(x, cu, offsets, scale, *prec)
                rows.append(dict(case=name, dtype=str(dt)[6:], variant=vname, o=rel(o, ro), o_floor=floor,
                                 ht=rel(ht, rht)))
    return rows


def time_shape(B, T, H, HV, K, V):
    """One row of the speed table (and the config sweep on the first two shapes)."""
    x, _, _ = make(B, T, H, HV, K, V, None, torch.bfloat16)
    scale = K ** -0.5
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    old = lambda: chunk_gated_delta_rule_fwd_stages(*args, scale, None, None, None)
    new = lambda: chunk_gated_delta_rule_fwd_triton(*args, scale, None, None, None)
    x["initial_state"] = None
    # same inputs, both paths: the fused output against the unfused one
    st = old()
    o, ht = new()
    diff_o, diff_h = rel(o, st.o), rel(ht, st.final_state)
    del st
    gc, w, u, p = prepass_as_default(x)
    seq = lambda bv=None, nw=None: fused_fwd(x["q"], x["k"], w, u, gc, scale, None, torch.bfloat16, BV=bv,
                                             num_warps=nw, p=p)
    t = {n: triton.testing.do_bench(f) for n, f in (
        ("unfused", old), ("fused", new), ("prepass", lambda: prepass_as_default(x)),
        ("sequential", seq))}
    fl, flops, bytes_ = floor_ms(B, T, H, HV, K, V)
    row = dict(shape=(B, T, H, HV, K, V), o_vs_unfused=diff_o, ht_vs_unfused=diff_h, floor_ms=fl,
               tflops=flops / t["fused"] / 1e9, gbs=bytes_ / t["fused"] / 1e6, **t)
    cfg = []
    if (B, T, H, HV) in ((1, 4096, 16, 16), (8, 4096, 16, 16)) and K == V == 128:
        for bv, nw in ((32, 4), (32, 2), (64, 4), (16, 4)):
            cfg.append(dict(shape=(B, T, H, HV), BV=bv, num_warps=nw,
                            ms=triton.testing.do_bench(lambda bv=bv, nw=nw: seq(bv, nw))))
    return row, cfg


def precision_speed(B, T, H, HV, K, V):
    """Part 3 on one shape: per (DOT_PREC, STATE_PREC), the unsplit sequential kernel and the whole forward."""
    x, _, _ = make(B, T, H, HV, K, V, None, torch.bfloat16)
    x["initial_state"] = None
    scale = K ** -0.5
    gc, w, u, p = prepass_as_default(x)
    rows = []
    for dp, sp in PRECISIONS:
        walk = lambda dp=dp, sp=sp: fused_fwd(x["q"], x["k"], w, u, gc, scale, None, torch.bfloat16, dot_prec=dp,
                                              state_prec=sp, p=p)
        fwd = lambda dp=dp, sp=sp: fused(x, None, None, scale, dp, None, sp)
        rec = dict(shape=(B, T, H, HV, K, V), dot_prec=dp, state_prec=sp,
                   walk=triton.testing.do_bench(walk), fwd=triton.testing.do_bench(fwd))
        if T == 4096:  # the spills changed with the precision: the walk at each BV (fused_fwd_config picks one)
            for bv in (16, 32, 64):
                rec[f"walk_bv{bv}"] = triton.testing.do_bench(
                    lambda dp=dp, sp=sp, bv=bv: fused_fwd(x["q"], x["k"], w, u, gc, scale, None, torch.bfloat16,
                                                          BV=bv, dot_prec=dp, state_prec=sp, p=p))
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    return rows


def speed(quick):
    rows, cfg_rows = [], []
    for shape in SHAPES[:2] if quick else SHAPES:
        row, cfg = time_shape(*shape)
        rows.append(row)
        cfg_rows += cfg
        torch.cuda.empty_cache()
    # first call on a new T with the same heads: no specialisation on T, so only the launch cost
    x, _, _ = make(1, 5000, 16, 16, 128, 128, None, torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    chunk_gated_delta_rule_fwd_triton(*[x[n] for n in ("q", "k", "v", "g", "beta")], 128 ** -0.5, None, None, None)
    torch.cuda.synchronize()
    return rows, cfg_rows, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--precisions", action="store_true", help="only the anchor accuracy (bf16) and part 3")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    acc = accuracy(True, (torch.bfloat16,)) if a.precisions else accuracy(a.quick)
    prec = []
    for shape in PRECISION_SHAPES:
        prec += precision_speed(*shape)
        torch.cuda.empty_cache()
    sp, cfg, first = ([], [], None) if a.precisions else speed(a.quick)
    with open(os.path.join(a.out, "bench_fwd.json"), "w") as f:
        json.dump(dict(accuracy=acc, precisions=prec, speed=sp, configs=cfg, first_call_new_T_s=first), f, indent=1)

    print("\n## Accuracy: relative L2 vs float64 reference")
    print("| case | dtype | variant | o | o rounding floor | final state |\n|---|---|---|---|---|---|")
    for r in acc:
        print(f"| {r['case']} | {r['dtype']} | {r['variant']} | {r['o']:.4e} | {r['o_floor']:.3e} | {r['ht']:.3e} |")
    print("\n## Sequential kernel dot precisions, bf16, do_bench median ms (walk: unsplit sequential kernel; "
          "forward: pre-pass + seq-parallel walk)")
    print("| B, T, H, HV, K, V | DOT_PREC | STATE_PREC | walk | walk / default | forward | forward / default |")
    print("|" + "---|" * 7)
    base = {r["shape"]: r for r in prec if (r["dot_prec"], r["state_prec"]) == PRECISIONS[0]}
    for r in prec:
        b = base[r["shape"]]
        print(f"| {', '.join(map(str, r['shape']))} | {r['dot_prec']} | {r['state_prec']} | {r['walk']:.3f} | "
              f"{r['walk'] / b['walk']:.2f} | {r['fwd']:.3f} | {r['fwd'] / b['fwd']:.2f} |")
    if a.precisions:
        return
    print("\n## Sequential kernel (BV, num_warps) sweep, ms")
    print("| B, T, H, HV | BV | warps | ms |\n|---|---|---|---|")
    for r in cfg:
        print(f"| {r['shape']} | {r['BV']} | {r['num_warps']} | {r['ms']:.3f} |")
    print(f"\nfirst call on a new T (T=5000, same heads): {first:.3f} s")
    print("\n## Forward speed, bf16, do_bench median ms")
    print("| B, T, H, HV, K, V | unfused | fused | prepass | sequential | floor | fused TFLOP/s | fused GB/s | ×floor "
          "| FlashQLA (anchor) | goal | o vs unfused | ht vs unfused |")
    print("|" + "---|" * 13)
    for r in sp:
        an = ANCHOR.get(tuple(r["shape"][:4]), ("–", "–", "–"))
        print(f"| {', '.join(map(str, r['shape']))} | {r['unfused']:.3f} | {r['fused']:.3f} | {r['prepass']:.3f} | "
              f"{r['sequential']:.3f} | {r['floor_ms']:.3f} | "
              f"{r['tflops']:.0f} | "
              f"{r['gbs']:.0f} | {r['fused'] / r['floor_ms']:.1f} | {an[1]} | {an[2]} | {r['o_vs_unfused']:.1e} | "
              f"{r['ht_vs_unfused']:.1e} |")


if __name__ == "__main__":
    main()
