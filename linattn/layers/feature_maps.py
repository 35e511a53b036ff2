"""Feature maps φ for linear attention (``o_t = Σ_s φ(q_t)·φ(k_s) v_s``, optionally normalised).

All map ``[..., d] → [..., F]`` per head and are applied to q and k alike:

* ``identity``: φ(x) = x (F = d).
* ``elu+1``: φ(x) = elu(x) + 1 > 0 (F = d), Katharopoulos et al.; positive, so the normalised form is safe.
* ``rff``: random Fourier features φ(x) = √(2/F)·cos(xΩ + b) with fixed Ω ~ N(0, σ⁻²), b ~ U[0, 2π)
  (buffers: saved with the model, never trained), approximating a Gaussian kernel.
* ``learnable``: φ(x) = x Wᵀ, a trained d → F projection.
* ``block_orthogonal``: φ(x) = x R with R block-diagonal, ``num_blocks`` (4) square blocks, each initialised to
  the Q of a Gaussian matrix's QR decomposition (sign-fixed), then trained.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURE_MAPS = ("identity", "elu+1", "rff", "learnable", "block_orthogonal")


class IdentityMap(nn.Module):
    """φ(x) = x: ``[..., dim] → [..., dim]``."""

    positive = False

    def __init__(self, dim: int):
        super().__init__()
        self.out_dim = dim

    def forward(self, x):
        return x


class EluPlusOne(nn.Module):
    """φ(x) = elu(x) + 1 > 0: ``[..., dim] → [..., dim]``."""

    positive = True

    def __init__(self, dim: int):
        super().__init__()
        self.out_dim = dim

    def forward(self, x):
        return F.elu(x) + 1


class RandomFourierFeatures(nn.Module):
    """φ(x) = √(2/F)·cos(xΩ + b), Ω ``[dim, F]`` ~ N(0, σ⁻²) and b ``[F]`` fixed buffers:
    ``[..., dim] → [..., num_features]``."""

    positive = False

    def __init__(self, dim: int, num_features: int, sigma: float = 1.0):
        super().__init__()
        self.out_dim = num_features
        self.register_buffer("omega", torch.randn(dim, num_features) / sigma)
        self.register_buffer("bias", torch.rand(num_features) * 2 * math.pi)

    def forward(self, x):
        return math.sqrt(2.0 / self.out_dim) * torch.cos(x @ self.omega.to(x.dtype) + self.bias.to(x.dtype))


class LearnableProjection(nn.Module):
    """φ(x) = x Wᵀ with a trained W ``[num_features, dim]``: ``[..., dim] → [..., num_features]``."""

    positive = False

    def __init__(self, dim: int, num_features: int):
        super().__init__()
        self.out_dim = num_features
        self.weight = nn.Parameter(torch.randn(num_features, dim) / math.sqrt(dim))

    def forward(self, x):
        return x @ self.weight.to(x.dtype).T


class BlockOrthogonalProjection(nn.Module):
    """φ(x) = x R, R block-diagonal with ``num_blocks`` trained blocks ``[dim / num_blocks]²`` initialised
    orthogonal: ``[..., dim] → [..., dim]``."""

    positive = False

    def __init__(self, dim: int, num_blocks: int = 4):
        super().__init__()
        if dim % num_blocks != 0:
            raise ValueError(f"block_orthogonal needs the head dim ({dim}) divisible by num_blocks={num_blocks}")
        self.out_dim, self.num_blocks = dim, num_blocks
        b = dim // num_blocks
        qs = []
        for _ in range(num_blocks):
            q, r = torch.linalg.qr(torch.randn(b, b))
            qs.append(q * torch.sign(torch.diagonal(r))[None])   # sign fix: a uniformly random orthogonal block
        self.weight = nn.Parameter(torch.stack(qs))               # [num_blocks, b, b]

    def forward(self, x):
        xb = x.unflatten(-1, (self.num_blocks, -1))               # [..., nb, b]
        return torch.einsum("...ni,nij->...nj", xb, self.weight.to(x.dtype)).flatten(-2)


def make_feature_map(name: str, dim: int, num_features: Optional[int] = None, sigma: float = 1.0,
                     num_blocks: int = 4) -> nn.Module:
    """Build the feature map ``name`` (one of ``FEATURE_MAPS``) for heads of dim ``dim``."""
    if name == "identity":
        return IdentityMap(dim)
    if name == "elu+1":
        return EluPlusOne(dim)
    if name == "rff":
        return RandomFourierFeatures(dim, num_features or dim, sigma)
    if name == "learnable":
        return LearnableProjection(dim, num_features or dim)
    if name == "block_orthogonal":
        return BlockOrthogonalProjection(dim, num_blocks)
    raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {name!r}")
