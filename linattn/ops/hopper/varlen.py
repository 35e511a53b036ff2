"""Packed sequences (``cu_seqlens``) on the Hopper forward, by padding: every sequence copied into its own row of an
``[N, Tp, ...]`` batch, zeros after its end, the equal-length forward (``forward.forward_hopper``) run on that
batch, and o's valid rows gathered back into the packed layout.

Exact, not approximate: a zero row (k = 0, v = 0, q = 0, β = 0 and log decay g = 0) neither decays the state
(e⁰ = 1) nor writes to it (β k vᵀ = 0), and it comes after every valid row of its sequence, so the valid rows'
outputs and each sequence's final state are those of the walk over its own rows alone; a chunk that ends inside
the padding decays its state by its valid rows' gates only (the gates' cumulative sum stops growing there).

What it costs: the padded rows' work, N·Tp − ΣT rows (:data:`MAX_PADDED_FRACTION` caps it), and the copies around
the kernels: q, k, v, g and β into the batch (an index copy of the valid rows and zeros written to the padded
ones only) and o out of it (one gather): the inputs' and o's bytes read and written once more, ≈ 1.1 GB and so
≈ 0.3 ms at 3.5 TB/s for 8 sequences of ≈ 4096 tokens at 16 heads of 128 (B=8 T=4096 H=16's forward: 0.30 ms).
Sequences of one length need none of it: the packed rows are then the batch's, as views.
"""
from __future__ import annotations

from typing import Optional

import torch

from .chunk_fwd import BT

# Whether "auto" (and "hopper") take packed sequences to the Hopper forward by padding (else the Triton paths).
# Built in session 22 and tested on the CPU around the kernel's twin; not run on the GPU: off until measured
# (benchmarks/op_time_check.py --varlen-ab)
VARLEN_BY_PADDING = False
# "auto" pads only where the padded rows are at most this fraction of the batch's (N·Tp ≤ ΣT / (1 − it)): beyond
# it the Triton split, which walks the packed rows as they are, is predicted to win. The Hopper forward is ≈ 3×
# faster than the split where both fill the card (issue 4's row 2: 0.295 ms against ≈ 1.0); with the copies
# (≈ 0.3 ms there) ≈ 0.6 against 1.0, and a fifth more rows to walk keeps it ahead. Not measured
MAX_PADDED_FRACTION = 0.2


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


def worth_padding(offsets: list[int]) -> bool:
    """Whether padding these sequences to :func:`padded_rows` wastes at most :data:`MAX_PADDED_FRACTION` of the
    batch's rows."""
    N, total = len(offsets) - 1, offsets[-1] - offsets[0]
    return N >= 1 and N * padded_rows(offsets) * (1 - MAX_PADDED_FRACTION) <= total


def spread_rows(counts_cu: torch.Tensor, total: int, Tp: int, first: torch.Tensor) -> torch.Tensor:
    """Rows of the flattened ``[N·Tp]`` batch for ``total`` rows handed out in order to the batch's N rows: row n
    takes ``counts_cu[n + 1] − counts_cu[n]`` of them (``counts_cu`` ``[N + 1]``, int64, from 0), from column
    ``first[n]`` on: n·Tp + first[n] + (t − counts_cu[n]) for the t-th. Built on the device (a searchsorted, no
    per-row host work), int64."""
    t = torch.arange(total, device=counts_cu.device)
    n = torch.searchsorted(counts_cu[1:].contiguous(), t, right=True)   # whose row t is (empty ones skipped)
    return t + n * Tp + first[n] - counts_cu[n]


def row_index(cu_seqlens: torch.Tensor, total: int, Tp: int) -> torch.Tensor:
    """For each packed row t (of ``total``), its row in the flattened ``[N·Tp]`` batch: n·Tp + (t − cu[n]) for the
    sequence n that holds it (:func:`spread_rows` from column 0), int64."""
    cu = cu_seqlens.to(torch.int64)
    return spread_rows(cu, total, Tp, torch.zeros_like(cu))


def padding_index(cu_seqlens: torch.Tensor, padded: int, Tp: int) -> torch.Tensor:
    """The ``padded`` (= N·Tp − total, known on the host) rows of the flattened batch past the sequences' ends:
    for sequence n, columns len_n … Tp − 1 (:func:`spread_rows` from column len_n), int64."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    pads_cu = torch.cat([cu.new_zeros(1), torch.cumsum(Tp - lengths, 0)])
    return spread_rows(pads_cu, padded, Tp, lengths)


def pad(x: torch.Tensor, index: torch.Tensor, fill: torch.Tensor, N: int, Tp: int) -> torch.Tensor:
    """Packed ``[1, total, ...]`` → ``[N, Tp, ...]``: each sequence's rows first in its row of the batch (to the
    rows ``index`` names), zeros after (to the rows ``fill`` names): every row written once."""
    out = x.new_empty(N * Tp, *x.shape[2:])
    out.index_copy_(0, index, x[0])
    out.index_fill_(0, fill, 0)
    return out.view(N, Tp, *x.shape[2:])


def forward_hopper_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          scale: float, initial_state: Optional[torch.Tensor], cu_seqlens: torch.Tensor,
                          offsets: list[int], **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward.forward_hopper`` for packed sequences: q, k ``[1, total, H, K]``, v ``[1, total, HV, V]``, g and β
    ``[1, total, HV]``, ``cu_seqlens`` ``[N + 1]`` on the device and the same ``offsets`` on the host (checked by
    the op), initial_state ``[N, HV, K, V]`` or None; ``launch``: ``forward_hopper``'s keywords for N sequences of
    :func:`padded_rows` rows (``forward.plan``). Returns o ``[1, total, HV, V]`` and the final states ``[N, HV, K,
    V]`` fp32."""
    from .forward import forward_hopper
    if q.shape[0] != 1 or len(offsets) < 2 or offsets[-1] != q.shape[1]:
        raise ValueError(f"packed sequences need B = 1 and offsets ending at T = {q.shape[1]}, got B = {q.shape[0]} "
                         f"and offsets {offsets[:3]}...{offsets[-1:]}")
    N, Tp, total = len(offsets) - 1, padded_rows(offsets), q.shape[1]
    if equal_lengths(offsets):          # already an [N, Tp] batch: views, no copies
        o, final_state = forward_hopper(*(x.reshape(N, Tp, *x.shape[2:]) for x in (q, k, v, g, beta)), scale,
                                        initial_state, **launch)
        return o.reshape(1, total, *o.shape[2:]), final_state
    index, fill = row_index(cu_seqlens, total, Tp), padding_index(cu_seqlens, N * Tp - total, Tp)
    o, final_state = forward_hopper(*(pad(x, index, fill, N, Tp) for x in (q, k, v, g, beta)), scale,
                                    initial_state, **launch)
    return o.reshape(N * Tp, *o.shape[2:]).index_select(0, index).unsqueeze(0), final_state
