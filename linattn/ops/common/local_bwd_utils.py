"""The one dot helper the backward kernels share, and its precision policy.

The backward follows the forward's policy (``common/__init__.py``): a dot whose operands are both inputs (Q Kᵀ)
runs in the input dtype; a dot that touches an fp32 intermediate (the state, A_inv, V_new, dS, any gate-scaled
operand) runs on fp32 operands at ``dot_precision(dtype)``: ``"tf32"`` for bf16, ``"tf32x3"`` for fp16 and fp32
inputs. Each kernel's launch width is its launcher's: 8 warps for dq/dk and the WY backward (4 spill kilobytes per
thread on sm_90), 4 for dv_local and the reverse walk (8 measured slower there).
``dot_prec="input"`` instead rounds those operands to the 16-bit input dtype (full tensor-core rate, ~8× coarser
operands): benchmarks/gpu_check_bwd.py measures its error beside the default's.
Every dot accumulates in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import dot_precision

DOT_PRECISIONS = ("ieee", "tf32", "input")

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
