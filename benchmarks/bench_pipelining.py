"""GPU check and timing of the sequential kernels' loop pipelining (NUM_STAGES) and V tile (BV), and of the
backward stage by stage.

    python benchmarks/bench_pipelining.py [--quick] [--parts 1,2,3,4] [--out DIR]

The three kernels that walk chunks one after another — the fused forward's walk (``fused_fwd``), the forward state
pass the backward recomputes with (``state_pass_fwd``) and the backward's reverse walk (``state_pass_bwd``) — ran
as ``while`` loops, which Triton never software-pipelines. NUM_STAGES ≥ 1 compiles them as ``tl.range`` loops (at
2, the next chunk's tiles arrive by cp.async while this one computes). Per shape (bf16, K = V = 128):

1. each kernel alone at NUM_STAGES 0 (the while loop) … 3 and BV 16 / 32 / 64: median ms (do_bench) and the
   largest relative difference of its outputs from NUM_STAGES = 0 at the same BV (same inputs: a pipelined loop
   computes the same thing, so anything above ~1e-6 is a bug);
2. the forward pre-pass and the backward stage by stage (recompute, dv_local, reverse walk, dq/dk, WY) at 4 warps
   (today) and 8 warps (``fused_prepass.PREPASS_WARPS``, ``local_bwd_utils.BWD_WARPS``: ptxas spills 13 / 7.7 /
   5.7 KB per thread in dq/dk, WY and the reverse walk at 4 warps, 1.9 / 1.0 / 1.0 KB at 8; the pre-pass 284 → 0
   bytes; compile_all.py), to show where the time goes;
3. the public op, forward and forward + backward, at the defaults and the variants of ``OP_CONFIGS`` (the
   reverse walk at 8 warps; run 10's loops and widths), with the output against the float64 reference (B=2 T=300
   H=4 anchor) for each;
4. fp32 inputs at the fp32 precisions of ``common`` (WIDE_CONFIGS), and with ``--dtypes fp32,fp16`` fp16 inputs on
   both forward paths: output, final state and every gradient against float64 at the anchor, first-call (compile)
   time, forward and forward + backward at the first two shapes.

Run 16 ran table 4 over ``FP32_DOT_PRECISION`` "ieee" / "tf32x3" × walk / split against its written prediction
(tf32x3 split ≈ 3–4 ms forward at B=8, fwd+bwd 15–25, errors ≤ 5e-6; switch if every error ≤ 1e-5 and ≥ 3× faster):
tf32x3 15× faster at B=8 (forward 86.2 → 5.62 ms on the split, fwd+bwd 367 → 23.6), every error ≤ 5.0e-7, the
split ahead of the walk in fp32 at B=1 and B=8 — both switched; fp16's walk stayed ahead at both sizes.

Run 17 timed ``FP32_PRODUCT_PRECISION`` "ieee" (default) against "tf32x3" on the split (the written prediction
and rule below): tf32x3 slower, forward 5.49 → 6.71 ms at B=8, fwd+bwd 22.87 → 23.85, errors the same — "ieee"
stays. That run's table 4 was the prediction's: the solve's block
merges and the WY backward's inverse products, the last fp32 products on the FMA units. sm_90 ptxas (compile_all.py
--dtype fp32 --B 8 [--set common.FP32_PRODUCT_PRECISION=tf32x3]): WY backward FFMA 2156 → 138, HGMMA 160 → 256,
spills 3.4 → 4.1 KB, SASS 9520 → 8640 instructions; kkt_solve FFMA 522 → 10 but shuffles 28 → 268 and SASS 5776 →
7384 (the 16×16 dots' layout conversions). Prediction: the WY backward's −0.6 ms of run 12's bf16 measurement
(2.11 → 1.50) again, the solve ±0.05, so fwd+bwd ≈ 23.3 → 22.7 ms at B=8 (−3%), forward unchanged within 2%;
errors ≤ 6e-7. Rule: "tf32x3" if fwd+bwd gains ≥ 2% at B=8 and every error stays ≤ 1e-6.

Run 11 (docs/performance.md) measured tables 1–3 and set the defaults from them. Prediction written before that
run (sm_90 compile, benchmarks/compile_sequential.py: the while loops issue no
cp.async; at NUM_STAGES = 2 every kernel does): the walk ≈ 8 µs per chunk at B=1 T=4096 H=16 BV=16 is load
latency, so NUM_STAGES = 2 takes it toward 4–5 µs (walk 0.54 → ~0.3 ms), and the state passes likewise. Prints
the tables last; writes bench_pipelining.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
from gpu_check_fwd import make, rel  # noqa: E402  (this folder is on sys.path)

from linattn import chunk_gated_delta_rule
from linattn.ops import common
from linattn.ops.common import CHUNK
from linattn.ops.common import fused_fwd as FF
from linattn.ops.common import fused_prepass as FP
from linattn.ops.common import state_pass as SP
from linattn.ops.common import state_pass_bwd as SPB
from linattn.ops.common.local_bwd_dqk import local_bwd_dqk
from linattn.ops.common.local_bwd_dv import local_bwd_dv
from linattn.ops.common.local_bwd_utils import BWD_WARPS
from linattn.ops.common.local_bwd_wy import local_bwd_wy
from linattn.ops.gated_delta import triton_chunk
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.gated_delta.triton_bwd import recompute_forward
from linattn.ops.gated_delta.triton_chunk import fwd_prepass

torch.backends.cuda.matmul.allow_tf32 = False
SHAPES = [(1, 4096, 16, 16), (8, 4096, 16, 16), (1, 32768, 16, 16), (1, 32768, 2, 8)]
STAGES = (0, 1, 2, 3)
BVS = (16, 32, 64)
D = 128


def max_rel(outs, refs) -> float:
    return max(rel(a, b) for a, b in zip(outs, refs))


def kernels_alone(B, T, H, HV):
    """Rows of table 1 for one shape."""
    x, _, _ = make(B, T, H, HV, D, D, None, torch.bfloat16)
    x["initial_state"] = None
    scale = D ** -0.5
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    gc, w, u, p = fwd_prepass(*args, None, None)
    do = torch.randn_like(x["v"])
    dv_local = torch.randn(B, T, HV, D, device=x["q"].device)
    dht = torch.zeros(B, HV, D, D, device=x["q"].device)
    calls = {
        "walk": lambda bv, s: FF.fused_fwd(x["q"], x["k"], w, u, gc, scale, None, torch.bfloat16, BV=bv, p=p,
                                           num_stages=s),
        "state_pass_fwd": lambda bv, s: SP.state_pass_fwd(x["k"], w, u, gc, None, num_stages=s,
                                                          block_v=bv),
        "state_pass_bwd": lambda bv, s: SPB.state_pass_bwd(x["q"], x["k"], w, gc, do, dv_local, dht, scale,
                                                           num_stages=s, block_v=bv),
    }
    rows = []
    for name, call in calls.items():
        for bv in BVS:
            ref = [t for t in call(bv, 0) if t is not None]
            for s in STAGES:
                row = dict(kernel=name, shape=(B, T, H, HV), BV=bv, stages=s)
                try:
                    out = [t for t in call(bv, s) if t is not None]
                    row["diff"] = max_rel(out, ref)
                    row["ms"] = triton.testing.do_bench(lambda call=call, bv=bv, s=s: call(bv, s))
                except Exception as e:  # a variant that does not compile or launch is a row, not the end
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def backward_stages(B, T, H, HV):
    """Table 2: the backward's stages at the defaults (the op's own calls, timed one by one)."""
    x, _, _ = make(B, T, H, HV, D, D, None, torch.bfloat16)
    scale = D ** -0.5
    q, k, v, beta = x["q"], x["k"], x["v"], x["beta"]
    recompute = lambda: recompute_forward(k, v, x["g"], beta, None, None, None, None, triton.cdiv(T, CHUNK))
    gc, A_inv, w, v_new, h = recompute()
    do = torch.randn_like(v)
    dht = torch.zeros(B, HV, D, D, device=x["q"].device)
    dv_local = local_bwd_dv(q, k, gc, do, scale, None, None)
    dh, dv_new2, _ = SPB.state_pass_bwd(q, k, w, gc, do, dv_local, dht, scale)
    dqk = lambda: local_bwd_dqk(q, k, beta, gc, A_inv, h, v_new, do, dh, dv_new2, scale, None, None)
    dq, dk, dbeta_p, dg_p, dA_inv_p = dqk()
    t = {"forward pre-pass (fused_prepass, P)": lambda: fwd_prepass(q, k, v, x["g"], beta),
         "recompute (cumsum, kkt solve, WY, state pass)": recompute,
         "dv_local": lambda: local_bwd_dv(q, k, gc, do, scale, None, None),
         "state_pass_bwd": lambda: SPB.state_pass_bwd(q, k, w, gc, do, dv_local, dht, scale),
         "dq/dk (local_bwd_dqk)": dqk,
         "WY (local_bwd_wy)": lambda: local_bwd_wy(k, v, beta, gc, A_inv, dv_new2, dA_inv_p, dbeta_p, dg_p, dk,
                                                    None, None)}
    rows = []
    saved = settings()
    for warps in (4, 8):
        set_bwd_warps(warps)
        rows += [dict(shape=(B, T, H, HV), stage=n, warps=warps, ms=triton.testing.do_bench(f)) for n, f in t.items()]
    restore(saved)
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def set_bwd_warps(n: int):
    """The backward kernels' and the forward pre-pass's launch width (the pre-pass spills at 4 warps too)."""
    for key in BWD_WARPS:
        BWD_WARPS[key] = n
    FP.PREPASS_WARPS = n


def settings() -> dict:
    """The op's module settings this script varies (restored with :func:`restore`)."""
    return dict(stages=(FF.WALK_STAGES, SP.STATE_PASS_STAGES, SPB.BWD_STAGES), warps=dict(BWD_WARPS),
                prepass=FP.PREPASS_WARPS)


def restore(saved: dict):
    FF.WALK_STAGES, SP.STATE_PASS_STAGES, SPB.BWD_STAGES = saved["stages"]
    BWD_WARPS.update(saved["warps"])
    FP.PREPASS_WARPS = saved["prepass"]


def run10_settings():
    """Loops and widths as run 10 measured them (the state passes' V tile rule is today's either way)."""
    FF.WALK_STAGES = SP.STATE_PASS_STAGES = SPB.BWD_STAGES = 0
    set_bwd_warps(4)


# table 3's configurations: name, change from the defaults
OP_CONFIGS = (("defaults", lambda: None),
              ("reverse walk at 8 warps", lambda: BWD_WARPS.update(state_pass=8)),
              ("run-10 loops and widths (stages 0, 4 warps)", run10_settings))


def whole_op(shapes):
    """Table 3: the public op at the defaults and the variants of OP_CONFIGS."""
    rows = []
    xa, _, _ = make(2, 300, 4, 4, D, D, None, torch.bfloat16)
    a_args = [xa[n] for n in ("q", "k", "v", "g", "beta")]
    ro, _ = gated_delta_rule_reference(*a_args, D ** -0.5, None, None)
    saved = settings()
    for name, change in OP_CONFIGS:
        restore(saved)
        change()
        o, _ = chunk_gated_delta_rule(*a_args, scale=D ** -0.5)
        anchor = rel(o, ro)
        for (B, T, H, HV) in shapes:
            x, _, _ = make(B, T, H, HV, D, D, None, torch.bfloat16)
            ins = [x[k].requires_grad_(True) for k in ("q", "k", "v", "g", "beta")]
            f = lambda ins=ins: chunk_gated_delta_rule(*ins, scale=D ** -0.5, output_final_state=True)
            with torch.no_grad():
                fwd = triton.testing.do_bench(f)
            do = torch.randn_like(x["v"])
            fb = triton.testing.do_bench(lambda f=f, ins=ins, do=do: torch.autograd.grad(f()[0], ins, do))
            row = dict(config=name, shape=(B, T, H, HV), fwd_ms=fwd, fwdbwd_ms=fb, anchor_o=anchor)
            rows.append(row)
            print(json.dumps(row), flush=True)
    restore(saved)
    return rows


# Table 4's grid: (dtype, FP32_DOT_PRECISION, FP32_PRODUCT_PRECISION, forward path). The precisions only change
# fp32 inputs' dots (fp16's are tf32x3 whatever they say), so fp16 runs once per path. Run 16 measured ieee against
# tf32x3 dots on both paths (docs/performance.md; the grid is in git history): tf32x3 on the split is the default.
# Next: the solve's merges and the WY backward's inverse products at tf32x3 too (FP32_PRODUCT_PRECISION).
WIDE_CONFIGS = {
    "fp32": [(torch.float32, "tf32x3", prod, "split") for prod in ("ieee", "tf32x3")],
    "fp16": [(torch.float16, "n/a", "n/a", path) for path in ("walk", "split")],
}


def wide_dtypes(shapes, dtypes=("fp32",)):
    """Table 4: fp32 (and fp16) inputs at each configuration of WIDE_CONFIGS: o, final state and every gradient
    against float64 at the anchor (B=2 T=300 H=4), first call, forward and forward + backward."""
    rows = []
    names = ("q", "k", "v", "g", "beta")
    saved = common.FP32_DOT_PRECISION, common.FP32_PRODUCT_PRECISION, triton_chunk.FORWARD_PATH
    try:
        for dtype_name in dtypes:
            xa, _, _ = make(2, 300, 4, 4, D, D, None, WIDE_CONFIGS[dtype_name][0][0])
            ref_in = [xa[n].double().requires_grad_(True) for n in names]
            ro, rS = chunk_gated_delta_rule(*ref_in, scale=D ** -0.5, output_final_state=True, backend="torch")
            dO = torch.randn_like(ro)
            ref_grads = torch.autograd.grad((ro * dO).sum(), ref_in)
            for dtype, prec, prod, path in WIDE_CONFIGS[dtype_name]:
                if dtype == torch.float32:
                    common.FP32_DOT_PRECISION, common.FP32_PRODUCT_PRECISION = prec, prod
                triton_chunk.FORWARD_PATH = path
                ins = [xa[n].clone().requires_grad_(True) for n in names]
                t0 = time.time()
                o, S = chunk_gated_delta_rule(*ins, scale=D ** -0.5, output_final_state=True)
                grads = torch.autograd.grad((o * dO.to(o.dtype)).sum(), ins)
                torch.cuda.synchronize()
                row = dict(dtype=dtype_name, prec=prec, products=prod, path=path, first_call_s=time.time() - t0,
                           o=rel(o, ro), state=rel(S, rS),
                           **{f"d{n}": rel(gr, rg) for n, gr, rg in zip(names, grads, ref_grads)})
                for (B, T, H, HV) in shapes[:2]:
                    x, _, _ = make(B, T, H, HV, D, D, None, dtype)
                    xs = [x[n].requires_grad_(True) for n in names]
                    f = lambda xs=xs: chunk_gated_delta_rule(*xs, scale=D ** -0.5, output_final_state=True)
                    with torch.no_grad():
                        row[f"fwd_ms {B},{T},{H},{HV}"] = triton.testing.do_bench(f)
                    do = torch.randn_like(x["v"])
                    row[f"fwdbwd_ms {B},{T},{H},{HV}"] = triton.testing.do_bench(
                        lambda f=f, xs=xs, do=do: torch.autograd.grad(f()[0], xs, do))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        common.FP32_DOT_PRECISION, common.FP32_PRODUCT_PRECISION, triton_chunk.FORWARD_PATH = saved
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first two shapes only")
    ap.add_argument("--parts", default="1,2,3,4", help="which tables to run (1 kernels alone, 2 backward stages, "
                                                          "3 whole op, 4 fp32 precisions)")
    ap.add_argument("--dtypes", default="fp32", help="table 4's input dtypes: fp32 and/or fp16 (comma-separated)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    shapes = SHAPES[:2] if a.quick else SHAPES
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    parts = {int(x) for x in a.parts.split(",")}
    alone = [r for s in shapes for r in kernels_alone(*s)] if 1 in parts else []
    bwd = [r for s in shapes for r in backward_stages(*s)] if 2 in parts else []
    op = whole_op(shapes) if 3 in parts else []
    fp32 = wide_dtypes(shapes, a.dtypes.split(",")) if 4 in parts else []
    with open(os.path.join(a.out, "bench_pipelining.json"), "w") as f:
        json.dump(dict(alone=alone, backward=bwd, op=op, fp32=fp32), f, indent=1)

    print("\n| kernel | B, T, H, HV | BV | " + " | ".join(f"stages {s} ms (diff)" for s in STAGES) + " |")
    print("|---|---|---|" + "---|" * len(STAGES))
    for name in ("walk", "state_pass_fwd", "state_pass_bwd") if alone else ():
        for shape in shapes:
            for bv in BVS:
                cells = []
                for s in STAGES:
                    r = next(r for r in alone if (r["kernel"], r["shape"], r["BV"], r["stages"]) ==
                             (name, shape, bv, s))
                    cells.append(r["error"][:30] if "error" in r else f"{r['ms']:.3f} ({r['diff']:.0e})")
                print(f"| {name} | {', '.join(map(str, shape))} | {bv} | " + " | ".join(cells) + " |")
    print("\n| B, T, H, HV | backward stage | ms at 4 warps | ms at 8 warps |\n|---|---|---|---|")
    for r in bwd:
        if r["warps"] == 4:
            r8 = next(x for x in bwd if (x["shape"], x["stage"], x["warps"]) == (r["shape"], r["stage"], 8))
            print(f"| {', '.join(map(str, r['shape']))} | {r['stage']} | {r['ms']:.3f} | {r8['ms']:.3f} |")
    print("\n| config | B, T, H, HV | fwd ms | fwd+bwd ms | anchor o rel L2 |\n|---|---|---|---|---|")
    for r in op:
        print(f"| {r['config']} | {', '.join(map(str, r['shape']))} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | "
              f"{r['anchor_o']:.3e} |")
    if fp32:
        print("\nfp32 / fp16 inputs: relative L2 vs float64 at the anchor (B=2 T=300 H=4); ms at B, T, H, HV")
        times = [k for k in fp32[0] if k.endswith("ms") or "_ms " in k]
        errs = ("o", "state", "dq", "dk", "dv", "dg", "dbeta")
        print("| dtype | FP32_DOT_PRECISION | FP32_PRODUCT_PRECISION | path | first call s | " + " | ".join(errs)
              + " | " + " | ".join(times) + " |")
        print("|---|---|---|---|---|" + "---|" * (len(errs) + len(times)))
        for r in fp32:
            print(f"| {r['dtype']} | {r['prec']} | {r['products']} | {r['path']} | {r['first_call_s']:.1f} | "
                  + " | ".join(f"{r[e]:.2e}" for e in errs) + " | " + " | ".join(f"{r[t]:.3f}" for t in times)
                  + " |")


if __name__ == "__main__":
    main()
