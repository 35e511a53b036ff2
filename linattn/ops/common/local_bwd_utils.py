"""The one dot helper the backward kernels share, and its precision policy.

The backward follows the forward's policy (``common/__init__.py``): a dot whose operands are both inputs (Q Kᵀ)
runs in the input dtype; a dot that touches an fp32 intermediate (the state, A_inv, V_new, dS, any gate-scaled
operand) runs on fp32 operands at ``dot_precision(dtype)``: ``"ieee"`` for fp32, ``"tf32"`` for bf16, ``"tf32x3"``
for fp16 inputs.
``dot_prec="input"`` instead rounds those operands to the 16-bit input dtype (full tensor-core rate, ~8× coarser
operands); benchmarks/gpu_check_bwd.py measures both so the faster one can be chosen where it stays accurate.
Every dot accumulates in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import dot_precision

DOT_PRECISIONS = ("ieee", "tf32", "input")

# num_warps of each backward kernel's launch, read at call time. At 4 warps ptxas spills 13 KB (dq/dk), 7.7 KB (WY)
# and 5.7 KB (reverse walk, BV=64) per thread on sm_90 for bf16 K = V = 128; at 8 warps 1.9 / 1.0 / 1.0 KB
# (benchmarks/compile_all.py, docs/performance.md run 10). Timed on the H200 (run 11, bench_pipelining.py, 4 → 8
# warps): dq/dk 3.82 → 1.69 ms and WY 3.66 → 1.96 ms at B=8 T=4096 H=16 (B=1: 0.49 → 0.23, 0.44 → 0.26); dv_local
# 0.231 → 0.285 (slower); the reverse walk at BV=64 1.21 → 1.17 (B=8), 0.62 → 0.57 (B=1, but BV=16 at 4 warps is
# 0.42 and 8 warps was not timed there), so it stays at 4.
BWD_WARPS = {"dv": 4, "state_pass": 4, "dqk": 8, "wy": 8}


def bwd_dot_precision(dtype: torch.dtype, dot_prec: Optional[str] = None) -> str:
    """The ``DOT_PREC`` constexpr for inputs of ``dtype``: ``dot_prec`` if given, else the forward's policy."""
    if dot_prec is None:
        return dot_precision(dtype)
    if dot_prec not in DOT_PRECISIONS:
        raise ValueError(f"dot_prec must be one of {DOT_PRECISIONS} or None, got {dot_prec!r}")
    return "ieee" if dtype == torch.float32 else dot_prec


@triton.jit
def mdot(a, b, DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """a @ b accumulated in fp32; operands in DT (the input dtype) if DOT_PREC is "input" or both already are
    (a bf16 input against a bf16-stored intermediate: the products are exact either way, and one 16-bit MMA is the
    cheapest), else fp32 operands at input_precision DOT_PREC. (The interpreter multiplies bf16 tl.dot operands as
    raw bits, so bf16 inputs are tested on the GPU, as everywhere in the backward.)"""
    if DOT_PREC == "input":
        return tl.dot(a.to(DT), b.to(DT))
    elif DT != tl.float32 and a.dtype == DT and b.dtype == DT:
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PREC)
