"""One (DOT_PREC, STATE_PREC) of the sequential forward kernel per process: bf16 accuracy at the anchor case and
walk timings, printed as one JSON line. A process per variant, so a variant that faults on the GPU cannot hide the
others (bench_fwd.py's precision table runs them all in one process).

    for p in tf32x3,tf32 bf16x3,tf32 bf16x3,bf16x3 tf32,tf32; do python benchmarks/walk_precision_probe.py $p; done
"""
from __future__ import annotations

import json
import sys

import torch
import triton
from gpu_check_fwd import make, rel  # noqa: E402  (this folder is on sys.path when run as a script)

from linattn.ops.common.fused_fwd import fused_fwd
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.gated_delta.reference import gated_delta_rule_reference


def main() -> None:
    dp, sp = sys.argv[1].split(",")
    out = dict(dot_prec=dp, state_prec=sp)
    x, _, _ = make(2, 300, 4, 4, 128, 128, None, torch.bfloat16)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    ro, rht = gated_delta_rule_reference(*args, 128 ** -0.5, x["initial_state"])
    gc, w, u = fused_prepass(x["g"], x["k"], x["v"], x["beta"])
    o, ht = fused_fwd(x["q"], x["k"], w, u, gc, 128 ** -0.5, x["initial_state"], torch.bfloat16, dot_prec=dp,
                      state_prec=sp)
    torch.cuda.synchronize()
    out.update(o_err=rel(o, ro), ht_err=rel(ht, rht), o_floor=rel(ro.to(torch.bfloat16), ro))
    print(json.dumps(out), flush=True)
    for B in (1, 8):
        x, _, _ = make(B, 4096, 16, 16, 128, 128, None, torch.bfloat16)
        gc, w, u = fused_prepass(x["g"], x["k"], x["v"], x["beta"])
        for bv in (16, 32, 64):
            out[f"B{B}_walk_bv{bv}"] = triton.testing.do_bench(
                lambda bv=bv, x=x, w=w, u=u, gc=gc: fused_fwd(x["q"], x["k"], w, u, gc, 128 ** -0.5, None,
                                                              torch.bfloat16, BV=bv, dot_prec=dp, state_prec=sp))
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
