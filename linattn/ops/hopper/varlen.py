"""Packed sequences (``cu_seqlens``) on the Hopper forward and backward, by padding: every sequence copied into its
own row of an ``[N, Tp, ...]`` batch, zeros after its end, the equal-length forward (``forward.py``) or backward
(``backward.py``) run on that batch, and o (or dq, dk, dv, dg, dβ) gathered back into the packed layout.

Exact, not approximate: a zero row (k = 0, v = 0, q = 0, β = 0 and log decay g = 0) neither decays the state
(e⁰ = 1) nor writes to it (β k vᵀ = 0), and it comes after every valid row of its sequence, so the valid rows'
outputs and each sequence's final state are those of the walk over its own rows alone; a chunk that ends inside
the padding decays its state by its valid rows' gates only (the gates' cumulative sum stops growing there).

The backward, for the same reason: the padded batch's loss, as a function of the valid rows' inputs with the
padding held at zero, is the packed loss itself, so its gradients with respect to the valid rows are the packed
gradients. Step by step, reverse: the padded rows' dO is zero, so a zero row passes dS back unchanged (its adjoint
map is dS ↦ e⁰ (I − 0) dS, and it adds scale·q dOᵀ = 0), and dht reaches each sequence's last valid row as it is;
each sequence starts at row 0 of its batch row, so its chunks are its own, the recompute's states are its own,
and dh0 is its own (an empty sequence's is dht). In a chunk that ends in the padding the gradient of the chunk-end
decay e^{G_C} lands on the padded last row's dG, and every valid row's dg sums the dG of all rows after it in its
chunk (dg = revcumsum(dG)): the sum is the one the sequence alone gives at its last valid row. The padded rows'
gradients (dg among them) are not gathered.

What it costs: the padded rows' work, N·Tp − ΣT rows (``plan.HopperPlanConfig.max_padded_fraction`` caps it), and
the copies around the kernels (``common.varlen.pad_rows`` / ``unpad_rows``: one Triton launch each, straight from
cu_seqlens), which read and write their tensors' bytes once more: q, k, v, g and β into the batch and o out of it
forward; q, k, v, g, β and dO in and dq, dk, dv, dg, dβ out backward. Sequences of one length need none of it: the
packed rows are then the batch's, as views.
"""
from __future__ import annotations

import torch

from ..common.varlen import pad_rows, unpad_rows
from ..utils import check_cu_seqlens_tensor, check_offsets
from .chunk_fwd import BT


def equal_lengths(offsets: list[int]) -> bool:
    """Whether the packed offsets ``[N + 1]`` hold N ≥ 1 sequences of one length, at least one row each: then they
    are an ``[N, T/N]`` batch as they stand."""
    N, total = len(offsets) - 1, offsets[-1] - offsets[0]
    return N >= 1 and total > 0 and total % N == 0 and offsets == list(range(offsets[0], offsets[-1] + 1, total // N))


def padded_rows(offsets: list[int]) -> int:
    """Tp: the sequences' one length where they share one (:func:`equal_lengths`), else the longest rounded up to a
    whole chunk (64 rows, at least one chunk)."""
    if equal_lengths(offsets):
        return (offsets[-1] - offsets[0]) // (len(offsets) - 1)
    longest = max((e - b for b, e in zip(offsets[:-1], offsets[1:])), default=0)
    return max(1, -(-longest // BT)) * BT


def worth_padding(offsets: list[int], Tp: int, max_padded_fraction: float) -> bool:
    """Whether padding these sequences to ``Tp`` rows wastes at most ``max_padded_fraction`` of the batch's rows
    (``plan.HopperPlanConfig``)."""
    N, total = len(offsets) - 1, offsets[-1] - offsets[0]
    return N >= 1 and N * Tp * (1 - max_padded_fraction) <= total


def check_packed(cu_seqlens: torch.Tensor, offsets: list[int], B: int, T: int, device: torch.device) -> int:
    """N, the number of packed sequences, after checking that ``cu_seqlens`` ``[N + 1]`` (int32 or int64, on
    ``device``) and ``offsets``, its values on the host, describe B = 1 row of T packed tokens: ValueError or
    TypeError otherwise (:func:`to_padded` would read or write past the rows)."""
    check_cu_seqlens_tensor(cu_seqlens)
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if B != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need B = 1, the sequences packed along T, got B = {B}")
    if len(offsets) != cu_seqlens.numel():
        raise ValueError(f"offsets must be cu_seqlens' {cu_seqlens.numel()} values on the host, got {len(offsets)}")
    check_offsets(offsets, T)
    return len(offsets) - 1


def to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor, N: int, Tp: int) -> torch.Tensor:
    """Packed rows ``[1, total, ...]`` as an ``[N, Tp, ...]`` batch: a view where the sequences share one length
    (N·Tp = total), else a copy with zeros after each sequence's end (``common.varlen.pad_rows``)."""
    if N * Tp == x.shape[1]:
        return x.reshape(N, Tp, *x.shape[2:])
    return pad_rows(x, cu_seqlens, Tp)


def from_padded(y: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[N, Tp, ...]`` rows of :func:`to_padded`'s batch (o, or a gradient) back as packed rows ``[1, total, ...]``:
    a view where the sequences share one length, else the valid rows' copy (``common.varlen.unpad_rows``)."""
    if y.shape[0] * y.shape[1] == total:
        return y.reshape(1, total, *y.shape[2:])
    return unpad_rows(y, cu_seqlens, total)
