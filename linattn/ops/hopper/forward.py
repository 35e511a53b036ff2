"""The experimental Hopper forward end to end: a pre-pass (gc, β head-major and each chunk's A_inv), then the fused
chunk kernel (``chunk_fwd.py``). What ``triton_chunk.FORWARD_PATH = "hopper"`` runs where the inputs suit it.

Two pre-passes, neither yet run on a GPU with the fused kernel: "triton" (``fused_prepass(write_wy=False)``, the
split forward's, measured at 0.277 ms at B=8 T=4096 H=16 in run 18, plus two small head-major copies) and "tilelang"
(``prepass.py``: gc, A_inv by an fp32 forward substitution, gc and β written head-major). :data:`PREPASS` picks;
benchmarks/hopper_fwd_check.py times both.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..common.fused_prepass import fused_prepass
from .chunk_fwd import chunk_fwd_hopper_hm, head_major

PREPASSES = ("triton", "tilelang")
PREPASS = "triton"
# The fused kernel's launch when the caller names none (the public op's "hopper" path): run 20 (H200, B=8 T=4096
# H=16, the kernel alone, ms) measured one warpgroup at BV=64 0.70 (tf32 A_inv X) / 0.66 (bf16 A_inv, async first
# dots), two warpgroups 0.60 / 0.55, and two warpgroups at BV=128 with bf16 A_inv 0.385: the fastest, taken here.
# BV is capped at V (K = V = 64)
LAUNCH = dict(BV=128, threads=256, num_stages=2, async_dots=True)
A_INV_DTYPE = torch.bfloat16


def forward_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float, initial_state: Optional[torch.Tensor], prepass: Optional[str] = None,
                   a_inv_dtype: Optional[torch.dtype] = None, **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """o ``[B, T, HV, V]`` and the final state ``[B, HV, K, V]`` fp32 from bf16 q, k ``[B, T, H, K]``, v
    ``[B, T, HV, V]``, fp32 log decays g and β ``[B, T, HV]``. ``prepass``: one of :data:`PREPASSES` (None:
    :data:`PREPASS`); ``a_inv_dtype``: the Triton pre-pass writes A_inv in it (fp32 or bf16, None:
    :data:`A_INV_DTYPE`; the TileLang pre-pass writes fp32); ``launch``: the fused kernel's (``chunk_fwd_hopper_hm``;
    none: :data:`LAUNCH`)."""
    which = prepass or PREPASS
    if not launch:
        launch = dict(LAUNCH, BV=min(LAUNCH["BV"], v.shape[-1]))
    if which == "tilelang":
        from .prepass import prepass_hopper
        gc_hm, beta_hm, a_inv = prepass_hopper(k, g, beta)
    elif which == "triton":
        gc, a_inv = fused_prepass(g, k, v, beta, write_wy=False, store_dtype=a_inv_dtype or A_INV_DTYPE)
        gc_hm, beta_hm = head_major(gc), head_major(beta)
    else:
        raise ValueError(f"prepass must be one of {PREPASSES}, got {which!r}")
    return chunk_fwd_hopper_hm(q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state, **launch)
