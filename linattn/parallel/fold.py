"""Folding affine state maps ``h ← M h + N``: the stitching of context parallelism, sequential and as a tree.

Per (sequence, value head) a shard of the gated delta rule maps the state entering it to the state leaving it
affinely, ``h_out = M h_in + N`` (M ``K × K`` acts on the key side of the ``K × V`` state, see
:mod:`linattn.parallel.scan`). The state after shards ``0 .. n − 1``, starting from zero, is the fold of their maps.
Composition is associative, ``(M_b, N_b) ∘ (M_a, N_a) = (M_b M_a, M_b N_a + N_b)``, so the fold is a tree of
depth ⌈log₂ n⌉: each level composes neighbouring pairs in one batched matmul. The backward folds the transposed
maps of the later shards in reverse order (``dh_in = Mᵀ dh_out + D``), with the same function.
"""
from __future__ import annotations

import torch


def fold_affine_ref(M: torch.Tensor, N: torch.Tensor) -> torch.Tensor:
    """The state after applying maps ``0 .. n − 1`` in order to a zero state, one map at a time.

    Args:
        M: ``[n, ..., K, K]``.
        N: ``[n, ..., K, V]``.
    Returns:
        ``[..., K, V]`` (zeros for n = 0).
    """
    h = torch.zeros_like(N[0]) if N.shape[0] else N.new_zeros(N.shape[1:])
    for j in range(N.shape[0]):
        h = M[j] @ h + N[j]
    return h


def fold_affine(M: torch.Tensor, N: torch.Tensor) -> torch.Tensor:
    """:func:`fold_affine_ref` as a tree: ⌈log₂ n⌉ levels of batched pair compositions (n − 1 in all).
    Same arguments and result."""
    if N.shape[0] == 0:
        return N.new_zeros(N.shape[1:])
    while N.shape[0] > 1:
        n = N.shape[0]
        even = n - n % 2
        Ma, Mb, Na, Nb = M[0:even:2], M[1:even:2], N[0:even:2], N[1:even:2]
        M_pair, N_pair = Mb @ Ma, Mb @ Na + Nb
        if n % 2:
            M_pair, N_pair = torch.cat([M_pair, M[-1:]]), torch.cat([N_pair, N[-1:]])
        M, N = M_pair, N_pair
    return N[0]


def state_entering(M: torch.Tensor, N: torch.Tensor, rank: int) -> torch.Tensor:
    """The state entering shard ``rank``: the fold of the maps of shards ``0 .. rank − 1`` (``M, N`` stacked over
    all ranks, ``[R, ..., K, K]`` and ``[R, ..., K, V]``)."""
    return fold_affine(M[:rank], N[:rank])


def grad_leaving(M: torch.Tensor, D: torch.Tensor, rank: int) -> torch.Tensor:
    """The gradient of the loss with respect to the state leaving shard ``rank``.

    Shard j's entering state h_j reaches the loss directly (through its outputs: ``D_j = ∂L/∂h_j`` with the
    leaving state's gradient held at zero) and through its leaving state ``M_j h_j + N_j``. So
    ``dh_out_r = D_{r+1} + M_{r+1}ᵀ dh_out_{r+1}``: the fold of the maps ``(M_jᵀ, D_j)`` for ``j = R − 1 .. r + 1``.
    """
    later = slice(rank + 1, None)
    return fold_affine(M[later].flip(0).transpose(-1, -2), D[later].flip(0))
