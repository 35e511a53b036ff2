"""Composing affine state maps ``h ← M h + N``: the stitching of context parallelism.

Per (sequence, value head) a shard of the gated delta rule maps the state entering it to the state leaving it
affinely, ``h_out = M h_in + N`` (M ``K × K`` acts on the key side of the ``K × V`` state, see
:mod:`linattn.parallel.scan`). A map travels packed as one tensor ``[..., K, K + V]`` = ``[M | N]``. Composition
is associative, ``(M_b, N_b) ∘ (M_a, N_a) = (M_b M_a, M_b N_a + N_b)``, so the maps of all earlier shards fold in
⌈log₂ R⌉ rounds (:func:`linattn.parallel.collectives.scan_maps`), not R − 1.
"""
from __future__ import annotations

import torch


def compose(later: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
    """The packed map of ``earlier`` then ``later`` (both ``[..., K, K + V]``)."""
    K = later.shape[-2]
    M_b, N_b = later[..., :K], later[..., K:]
    return torch.cat([M_b @ earlier[..., :K], M_b @ earlier[..., K:] + N_b], dim=-1)


def identity_map(like: torch.Tensor) -> torch.Tensor:
    """``[I | 0]`` shaped like the packed map ``like``."""
    K = like.shape[-2]
    out = torch.zeros_like(like)
    out[..., :K] = torch.eye(K, dtype=like.dtype, device=like.device)
    return out


def transpose_map(maps: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``[Mᵀ | grad]``: the map the backward folds, ``dh_in = Mᵀ dh_out + D``."""
    K = maps.shape[-2]
    return torch.cat([maps[..., :K].transpose(-1, -2), grad], dim=-1)


def fold_affine_ref(maps: torch.Tensor) -> torch.Tensor:
    """The state after applying the packed maps ``maps[0 .. n − 1]`` (``[n, ..., K, K + V]``) in order to a zero
    state, one at a time: ``[..., K, V]``. The obviously right twin of the scan over ranks."""
    K = maps.shape[-2]
    h = maps.new_zeros(*maps.shape[1:-1], maps.shape[-1] - K)
    for m in maps:
        h = m[..., :K] @ h + m[..., K:]
    return h
