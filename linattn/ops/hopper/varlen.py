"""Packed sequences (``cu_seqlens``) on the Hopper forward, by padding: every sequence copied into its own row of an
``[N, Tp, ...]`` batch, zeros after its end, the equal-length forward (``forward.py``) run on that
batch, and o's valid rows gathered back into the packed layout.

Exact, not approximate: a zero row (k = 0, v = 0, q = 0, β = 0 and log decay g = 0) neither decays the state
(e⁰ = 1) nor writes to it (β k vᵀ = 0), and it comes after every valid row of its sequence, so the valid rows'
outputs and each sequence's final state are those of the walk over its own rows alone; a chunk that ends inside
the padding decays its state by its valid rows' gates only (the gates' cumulative sum stops growing there).

What it costs: the padded rows' work, N·Tp − ΣT rows (``plan.HopperPlanConfig.max_padded_fraction`` caps it), and
the copies around the kernels: q, k, v, g and β into the batch and o out of it (``common.varlen.pad_rows`` /
``unpad_rows``: one Triton launch each, straight from cu_seqlens), which read and write the inputs' and o's bytes
once more. Sequences of one length need none of it: the packed rows are then the batch's, as views.
"""
from __future__ import annotations

import torch

from ..common.varlen import pad_rows, unpad_rows
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


def to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor, N: int, Tp: int) -> torch.Tensor:
    """Packed rows ``[1, total, ...]`` as an ``[N, Tp, ...]`` batch: a view where the sequences share one length
    (N·Tp = total), else a copy with zeros after each sequence's end (``common.varlen.pad_rows``)."""
    if N * Tp == x.shape[1]:
        return x.reshape(N, Tp, *x.shape[2:])
    return pad_rows(x, cu_seqlens, Tp)


def from_padded(o: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """o ``[N, Tp, HV, V]`` of :func:`to_padded`'s batch back as packed rows ``[1, total, HV, V]``."""
    if o.shape[0] * o.shape[1] == total:
        return o.reshape(1, total, *o.shape[2:])
    return unpad_rows(o, cu_seqlens, total)
