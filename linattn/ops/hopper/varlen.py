"""Packed sequences (``cu_seqlens``) on the Hopper forward, by padding: every sequence copied into its own row of an
``[N, Tp, ...]`` batch, zeros after its end, the equal-length forward (``forward.forward_hopper``) run on that
batch, and o's valid rows gathered back into the packed layout.

Exact, not approximate: a zero row (k = 0, v = 0, q = 0, β = 0 and log decay g = 0) neither decays the state
(e⁰ = 1) nor writes to it (β k vᵀ = 0), and it comes after every valid row of its sequence, so the valid rows'
outputs and each sequence's final state are those of the walk over its own rows alone; a chunk that ends inside
the padding decays its state by its valid rows' gates only (the gates' cumulative sum stops growing there).

What it costs: the padded rows' work, N·Tp − ΣT rows (:data:`MAX_PADDED_FRACTION` caps it), and the copies around
the kernels: q, k, v, g and β into the batch (a zero fill and an index copy each) and o out of it (one gather),
≈ 2.3× the inputs' bytes moved once more. The kernels themselves are the equal-length ones, unchanged.
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
# faster than the split where both fill the card (issue 4's row 2: 0.295 ms against ≈ 1.0), so padding a third of
# the rows would still be ahead by the kernels alone; a fifth leaves room for the copies. Not measured
MAX_PADDED_FRACTION = 0.2


def padded_rows(offsets: list[int]) -> int:
    """Tp: the longest sequence of the packed offsets ``[N + 1]`` rounded up to a whole chunk (64 rows, at least
    one chunk)."""
    longest = max((e - b for b, e in zip(offsets[:-1], offsets[1:])), default=0)
    return max(1, -(-longest // BT)) * BT


def worth_padding(offsets: list[int]) -> bool:
    """Whether padding these sequences to :func:`padded_rows` wastes at most :data:`MAX_PADDED_FRACTION` of the
    batch's rows."""
    N, total = len(offsets) - 1, offsets[-1] - offsets[0]
    return N >= 1 and N * padded_rows(offsets) * (1 - MAX_PADDED_FRACTION) <= total


def row_index(cu_seqlens: torch.Tensor, total: int, Tp: int) -> torch.Tensor:
    """For each packed row t (of ``total``), its row in the flattened ``[N·Tp]`` batch: n·Tp + (t − cu[n]) for the
    sequence n that holds it. Built on the device from ``cu_seqlens`` (no per-row host work), int64."""
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(total, device=cu.device)
    n = torch.searchsorted(cu[1:].contiguous(), t, right=True)   # the sequence of row t (empty ones skipped)
    return t + n * Tp - cu[n]


def pad(x: torch.Tensor, index: torch.Tensor, N: int, Tp: int) -> torch.Tensor:
    """Packed ``[1, total, ...]`` → ``[N, Tp, ...]``, each sequence's rows first in its row of the batch, zeros after."""
    out = x.new_zeros(N * Tp, *x.shape[2:])
    out.index_copy_(0, index, x[0])
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
    index = row_index(cu_seqlens, total, Tp)
    o, final_state = forward_hopper(*(pad(x, index, N, Tp) for x in (q, k, v, g, beta)), scale, initial_state,
                                    **launch)
    return o.reshape(N * Tp, *o.shape[2:]).index_select(0, index).unsqueeze(0), final_state
