"""RMSNorm and the gated RMSNorm that closes a Gated DeltaNet mixer.

Both normalise in fp32 and return the input's dtype. The gated form is Qwen3-Next's and fla's ("norm before
gate"): ``y = w ⊙ x / rms(x) ⊙ silu(z)``, with one weight of the head's width shared by all heads.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """``weight ⊙ x · rsqrt(mean(x²) + eps)`` over the last dim, computed in fp32, returned in x's dtype."""
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (no mean subtraction, no bias).

    Args:
        hidden_size (int): width of the normalised dimension.
        eps (float): added to the mean square.
        elementwise_affine (bool): learn a per-channel weight (initialised to ones).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, elementwise_affine: bool = True):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm({self.hidden_size}) got an input whose last dim is {x.shape[-1]}")
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """``weight ⊙ rmsnorm(x) ⊙ silu(z)`` (normalise first, then gate), over the last dimension.

    Args:
        hidden_size (int): width of the normalised dimension (a GDN layer uses the value head dim).
        eps (float): added to the mean square.
    Shapes: x and z ``[..., hidden_size]``; the output has x's shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if x.shape != z.shape:
            raise ValueError(f"GatedRMSNorm needs x and its gate z of one shape, got {tuple(x.shape)} and "
                             f"{tuple(z.shape)}")
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"GatedRMSNorm({self.hidden_size}) got an input whose last dim is {x.shape[-1]}")
        y = rms_norm(x, self.weight, self.eps)
        zf = z.float() if z.dtype != torch.float64 else z
        return (y.to(zf.dtype) * F.silu(zf)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
