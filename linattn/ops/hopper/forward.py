"""The Hopper forward end to end: a pre-pass (gc, β head-major and each chunk's A_inv), then the fused chunk kernel
(``chunk_fwd.py``). What ``triton_chunk``'s "auto" path runs on sm_90 where :func:`hopper_launch` says the kernel's
programs fill the card, and what ``FORWARD_PATH = "hopper"`` forces wherever the inputs suit it.

The pre-pass is the split forward's (``fused_prepass(write_wy=False)``: 0.275 ms at B=8 T=4096 H=16 in run 20,
plus two small head-major copies). A TileLang pre-pass (gc, K Kᵀ on wgmma, A_inv by an fp32 forward substitution,
gc and β written head-major) measured 0.76 ms there (run 20) and was removed.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..common.fused_prepass import fused_prepass
from .chunk_fwd import chunk_fwd_hopper_hm, head_major

# The fused kernel's launch when the caller names none (the public op's "hopper" path): run 20 (H200, B=8 T=4096
# H=16, the kernel alone, ms) measured one warpgroup at BV=64 0.70 (tf32 A_inv X) / 0.66 (bf16 A_inv, async first
# dots), two warpgroups 0.60 / 0.55, and two warpgroups at BV=128 with bf16 A_inv 0.385: the fastest, taken here.
# BV is capped at V (K = V = 64)
LAUNCH = dict(BV=128, threads=256, num_stages=2, async_dots=True)
A_INV_DTYPE = torch.bfloat16
# The "auto" path takes the Hopper forward only where its (sequence, value head, V tile) programs fill the card:
# one program walks all the chunks of its sequence (no sequence parallelism yet), so with fewer programs than SMs
# the card idles. Run 20: B=8 T=4096 H=16 (128 programs at BV=128 on 132 SMs) 0.653 ms with the pre-pass against
# the split's 1.005; B=1 (16 programs) 0.451 (BV=64, 32 programs: 0.330) against 0.261, and B=1 T=32768 2.42 against
# 1.68. BV=128 where its programs fill FILL_FRACTION of the SMs, else BV=64 where those do, else None
FILL_FRACTION = 0.9


def hopper_launch(num_sequences: int, HV: int, V: int, sms: int) -> Optional[dict]:
    """The fused kernel's launch for ``num_sequences`` sequences of ``HV`` value heads of width ``V`` on ``sms``
    SMs, or None where no V tile gives enough programs to fill the card (:data:`FILL_FRACTION`)."""
    for BV in (LAUNCH["BV"], 64):
        if V % BV == 0 and num_sequences * HV * (V // BV) >= FILL_FRACTION * sms:
            return dict(LAUNCH, BV=BV)
    return None


def forward_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float, initial_state: Optional[torch.Tensor], a_inv_dtype: Optional[torch.dtype] = None,
                   **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """o ``[B, T, HV, V]`` and the final state ``[B, HV, K, V]`` fp32 from bf16 q, k ``[B, T, H, K]``, v
    ``[B, T, HV, V]``, fp32 log decays g and β ``[B, T, HV]``. ``a_inv_dtype``: the pre-pass writes A_inv in it
    (fp32 or bf16; None: :data:`A_INV_DTYPE`); ``launch``: the fused kernel's (``chunk_fwd_hopper_hm``; none:
    :data:`LAUNCH`, BV capped at V)."""
    if not launch:
        launch = dict(LAUNCH, BV=min(LAUNCH["BV"], v.shape[-1]))
    gc, a_inv = fused_prepass(g, k, v, beta, write_wy=False, store_dtype=a_inv_dtype or A_INV_DTYPE)
    return chunk_fwd_hopper_hm(q, k, v, head_major(gc), head_major(beta), a_inv, scale, initial_state, **launch)
