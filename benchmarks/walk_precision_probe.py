"""One (DOT_PREC, STATE_PREC) of the sequential forward kernel per process: bf16 accuracy at the anchor case and
walk timings, printed as one JSON line. A process per variant, so a variant that faults on the GPU cannot hide the
others (bench_fwd.py's precision table runs them all in one process).

    for p in tf32x3,tf32 bf16x3,tf32 bf16x3,bf16x3 tf32,tf32; do python benchmarks/walk_precision_probe.py $p; done
    python benchmarks/walk_precision_probe.py tf32x3,tf32 --p

``--p``: P = Q Kᵀ ⊙ D ⊙ causal computed once by the pre-pass (``fused_prepass(..., q=q)``) and read by the walk
(``fused_fwd(..., p=p)``, LOAD_P). The anchor accuracy then runs with p (plus p's error against its float64 twin,
and o against the same walk without p), and per shape it times the pre-pass without and with p, the walk without
and with p at BV = 16 / 32 / 64 (same process, so the pairs share clocks), and the whole default forward
(``chunk_gated_delta_rule_fwd_triton``, default precisions and BV, planner on) with ``PRECOMPUTE_QK`` off and on.
Keys with ``_p`` are the p variants. About 12 kernel compilations: ≈ 1 min on a fresh H200.
"""
from __future__ import annotations

import json
import sys

import torch
import triton
from gpu_check_fwd import make, rel  # noqa: E402  (this folder is on sys.path when run as a script)

from linattn.ops.common.fused_fwd import fused_fwd
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.gated_delta import torch_chunk as tc
from linattn.ops.gated_delta import triton_chunk
from linattn.ops.gated_delta.reference import gated_delta_rule_reference

SCALE = 128 ** -0.5


def p_twin(x: dict) -> torch.Tensor:
    """Float64 P of every chunk in the pre-pass's layout [B, T, HV, 64] (``torch_chunk.qk_decay_ref``)."""
    T, H, HV = x["q"].shape[1], x["q"].shape[2], x["v"].shape[2]
    qc, kc = (tc.to_chunks(x[n].double().repeat_interleave(HV // H, 2)) for n in ("q", "k"))
    gc = tc.chunk_local_cumsum_ref(tc.to_chunks(x["g"].double()))
    return tc.from_chunks(tc.qk_decay_ref(qc, kc, gc), T)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--p"]
    use_p = "--p" in sys.argv[1:]
    dp, sp = args[0].split(",")
    out = dict(dot_prec=dp, state_prec=sp, p=use_p)
    walk = lambda x, w, u, gc, h0, p=None, **kw: fused_fwd(x["q"], x["k"], w, u, gc, SCALE, h0, torch.bfloat16,
                                                           dot_prec=dp, state_prec=sp, p=p, **kw)

    x, _, _ = make(2, 300, 4, 4, 128, 128, None, torch.bfloat16)
    ro, rht = gated_delta_rule_reference(*[x[n] for n in ("q", "k", "v", "g", "beta")], SCALE, x["initial_state"])
    gc, w, u, *p = fused_prepass(x["g"], x["k"], x["v"], x["beta"], q=x["q"] if use_p else None)
    p = p[0] if use_p else None
    o, ht = walk(x, w, u, gc, x["initial_state"], p)
    torch.cuda.synchronize()
    out.update(o_err=rel(o, ro), ht_err=rel(ht, rht), o_floor=rel(ro.to(torch.bfloat16), ro))
    if use_p:
        out.update(p_err=rel(p, p_twin(x)), o_vs_no_p=rel(o, walk(x, w, u, gc, x["initial_state"])[0]))
    print(json.dumps(out), flush=True)

    for B in (1, 8):
        x, _, _ = make(B, 4096, 16, 16, 128, 128, None, torch.bfloat16)
        gc, w, u = fused_prepass(x["g"], x["k"], x["v"], x["beta"])
        if use_p:
            p = fused_prepass(x["g"], x["k"], x["v"], x["beta"], q=x["q"])[3]
            out[f"B{B}_prepass"] = triton.testing.do_bench(lambda x=x: fused_prepass(x["g"], x["k"], x["v"],
                                                                                      x["beta"]))
            out[f"B{B}_prepass_p"] = triton.testing.do_bench(lambda x=x: fused_prepass(x["g"], x["k"], x["v"],
                                                                                        x["beta"], q=x["q"]))
        for bv in (16, 32, 64):
            out[f"B{B}_walk_bv{bv}"] = triton.testing.do_bench(
                lambda bv=bv, x=x, w=w, u=u, gc=gc: walk(x, w, u, gc, None, BV=bv))
            if use_p:
                out[f"B{B}_walk_p_bv{bv}"] = triton.testing.do_bench(
                    lambda bv=bv, x=x, w=w, u=u, gc=gc, p=p: walk(x, w, u, gc, None, p, BV=bv))
        if use_p:
            fwd = lambda x=x: triton_chunk.chunk_gated_delta_rule_fwd_triton(
                *[x[n] for n in ("q", "k", "v", "g", "beta")], SCALE, None, None, None)
            for flag in (False, True):
                triton_chunk.PRECOMPUTE_QK = flag
                out[f"B{B}_fwd_default{'_p' if flag else ''}"] = triton.testing.do_bench(fwd)
            triton_chunk.PRECOMPUTE_QK = False
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
