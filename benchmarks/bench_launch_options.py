"""GPU timing of every kernel of the chunked op under register caps and loop-pipelining depths
(``common.launch_options_override`` over ``common.LAUNCH_OPTIONS``: ``maxnreg``, ``num_stages``).

    python benchmarks/bench_launch_options.py [--quick] [--out DIR]

Why (sm_90 ptxas, benchmarks/compile_all.py, bf16 K = V = 128): every kernel compiles to ~255 registers per
thread, so an SM holds 8 warps of any of them (two programs at 4 warps, one at 8) — 1/8 of its 64 warp slots —
and the parallel kernels are latency-bound (the pre-pass takes tens of µs per program, for ~6000 instructions).
A cap of 168 registers fits three programs of 4 warps per SM, 128 fits four, at the price of spills
(pre-pass 284 → 1756 / 4528 bytes per thread; kkt_solve 0 → 680 / 2208; wy 0 → 928 / 1400; dv 0 → 1072 / 1808).
local_bwd_dqk pipelines its inner loops 3 deep by default (176 KB of shared memory at 4 warps, 192 at 8: one
program per SM); num_stages = 1 takes it to 64 / 80 KB.

Per shape (bf16, B=1 and B=8 at T=4096 H=16): each kernel alone (do_bench median ms; the sequential kernels only
where their grid exceeds one wave) at Triton's defaults and at the option sets of :data:`VARIANTS` (num_stages only
for kernels with tile loops), with the largest relative difference of its outputs from the defaults (the
options change the schedule, not the math: ~0 expected). Prints the table last; writes bench_launch_options.json.
"""
from __future__ import annotations

import json

import torch
import triton
from bench_cli import bench_args, write_json  # noqa: E402  (this folder is on sys.path)
from gpu_check_fwd import make, rel  # noqa: E402  (this folder is on sys.path)

from linattn.ops import common
from linattn.ops.common.fused_fwd import fused_fwd
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.common.kkt_solve import kkt_solve
from linattn.ops.common.local_bwd_dqk import local_bwd_dqk
from linattn.ops.common.local_bwd_dv import local_bwd_dv
from linattn.ops.common.local_bwd_wy import local_bwd_wy
from linattn.ops.common.output import output_fwd
from linattn.ops.common.state_pass import state_pass_fwd
from linattn.ops.common.state_pass_bwd import state_pass_bwd
from linattn.ops.common.wy import wy_fwd
from linattn.ops.gated_delta.triton_chunk import fwd_prepass

torch.backends.cuda.matmul.allow_tf32 = False
SHAPES = [(1, 4096, 16, 16), (8, 4096, 16, 16)]
D = 128
VARIANTS = {"maxnreg 168": dict(maxnreg=168), "maxnreg 128": dict(maxnreg=128), "num_stages 1": dict(num_stages=1),
            "num_stages 1, maxnreg 168": dict(num_stages=1, maxnreg=168)}
# num_stages only changes kernels with plain for loops over tiles; the sequential kernels pipeline their chunk loop
# with their own NUM_STAGES and, at B=1, run one program per SM whatever their registers (nothing to gain there)
LOOPED = {"local_bwd_dqk", "local_bwd_dv", "local_bwd_wy", "output_fwd", "wy", "kkt_solve", "fused_prepass"}
SEQUENTIAL = {"fused_fwd", "state_pass_fwd", "state_pass_bwd"}


def stage_inputs(B, T, H, HV):
    """Every stage's real inputs at one shape (bf16, K = V = D): the forward pre-pass and state pass, the inverse,
    and the backward's own stages up to WY (its dq/dk partials). Also used by bench_bwd_precision.py."""
    x, _, _ = make(B, T, H, HV, D, D, None, torch.bfloat16)
    s = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    q, k, v, g, beta = s["q"], s["k"], s["v"], s["g"], s["beta"]
    s["scale"] = scale = D ** -0.5
    s["gc"], s["w"], s["u"], s["p"] = gc, w, u, _ = fwd_prepass(q, k, v, g, beta)
    s["A_inv"] = A_inv = kkt_solve(k, beta, gc, HV)
    s["h"], s["v_new"], _ = h, v_new, _ = state_pass_fwd(k, w, u, gc, None)
    s["do"] = do = torch.randn_like(v)
    s["dht"] = dht = torch.zeros(B, HV, D, D, device=q.device)
    s["dv_local"] = dv_local = local_bwd_dv(q, k, gc, do, scale, None, None)
    s["dh"], s["dv_new"], _ = dh, dv_new, _ = state_pass_bwd(q, k, w, gc, do, dv_local, dht, scale)
    _, s["dk"], s["dbeta_p"], s["dg_p"], s["dA_inv_p"] = local_bwd_dqk(q, k, beta, gc, A_inv, h, v_new, do, dh,
                                                                       dv_new, scale, None, None)
    return s


def kernels(B, T, H, HV):
    """{LAUNCH_OPTIONS key: a call of that kernel alone on real inputs} for one shape."""
    s = stage_inputs(B, T, H, HV)
    q, k, v, g, beta, gc, w, u, p = (s[n] for n in ("q", "k", "v", "g", "beta", "gc", "w", "u", "p"))
    scale, A_inv, h, v_new, do, dht = (s[n] for n in ("scale", "A_inv", "h", "v_new", "do", "dht"))
    dv_local, dh, dv_new = s["dv_local"], s["dh"], s["dv_new"]
    return {
        "fused_prepass": lambda: fused_prepass(g, k, v, beta, q=q),
        "fused_fwd": lambda: fused_fwd(q, k, w, u, gc, scale, None, torch.bfloat16, p=p),
        "kkt_solve": lambda: kkt_solve(k, beta, gc, HV),
        "wy": lambda: wy_fwd(k, v, beta, gc, A_inv),
        "state_pass_fwd": lambda: state_pass_fwd(k, w, u, gc, None),
        "output_fwd": lambda: output_fwd(q, k, v_new, h, gc, scale, torch.bfloat16),
        "local_bwd_dv": lambda: local_bwd_dv(q, k, gc, do, scale, None, None),
        "state_pass_bwd": lambda: state_pass_bwd(q, k, w, gc, do, dv_local, dht, scale),
        "local_bwd_dqk": lambda: local_bwd_dqk(q, k, beta, gc, A_inv, h, v_new, do, dh, dv_new, scale, None, None),
        "local_bwd_wy": lambda: local_bwd_wy(k, v, beta, gc, A_inv, dv_new, s["dA_inv_p"], s["dbeta_p"], s["dg_p"],
                                             s["dk"].clone(), None, None),
    }


def tensors(out):
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


def sweep(shape):
    """Each kernel at Triton's own launch options ("defaults") and at each variant; the op's chosen options
    (common.LAUNCH_OPTIONS) apply again after."""
    rows = []
    for name, call in kernels(*shape).items():
        if name in SEQUENTIAL and shape[0] * shape[3] * 2 <= 132:  # one wave: one program per SM at any width
            continue
        with common.launch_options_override({}):
            ref = tensors(call())
            row = dict(kernel=name, shape=shape, default_ms=triton.testing.do_bench(call))
        for label, opts in VARIANTS.items():
            if "num_stages" in opts and name not in LOOPED:
                row[label] = dict(error="n/a (no tile loops)")
                continue
            try:
                with common.launch_options_override({name: opts}):
                    out = tensors(call())
                    row[label] = dict(ms=triton.testing.do_bench(call),
                                      diff=max(rel(a, b) for a, b in zip(out, ref)))
            except Exception as e:  # a variant that does not compile or launch is a cell, not the end
                row[label] = dict(error=f"{type(e).__name__}: {str(e)[:80]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    a = bench_args("B=8 only")
    rows = [r for s in (SHAPES[1:] if a.quick else SHAPES) for r in sweep(s)]
    write_json(a.out, "bench_launch_options.json", rows)
    print("\n| kernel | B, T, H, HV | defaults ms | " + " | ".join(f"{v} ms (diff)" for v in VARIANTS) + " |")
    print("|---|---|---|" + "---|" * len(VARIANTS))
    for r in rows:
        cells = [(f"{c['ms']:.3f} ({c['diff']:.0e})" if "ms" in c else c["error"][:30]) for c in
                 (r[v] for v in VARIANTS)]
        print(f"| {r['kernel']} | {', '.join(map(str, r['shape']))} | {r['default_ms']:.3f} | " + " | ".join(cells)
              + " |")


if __name__ == "__main__":
    main()
