"""Packed sequences (``cu_seqlens``) on the Hopper forward, by padding: every sequence copied into its own row of an
``[N, Tp, ...]`` batch, zeros after its end, the equal-length forward (``forward.forward_hopper``) run on that
batch, and o's valid rows gathered back into the packed layout.

Exact, not approximate: a zero row (k = 0, v = 0, q = 0, β = 0 and log decay g = 0) neither decays the state
(e⁰ = 1) nor writes to it (β k vᵀ = 0), and it comes after every valid row of its sequence, so the valid rows'
outputs and each sequence's final state are those of the walk over its own rows alone; a chunk that ends inside
the padding decays its state by its valid rows' gates only (the gates' cumulative sum stops growing there).

What it costs: the padded rows' work, N·Tp − ΣT rows (:data:`MAX_PADDED_FRACTION` caps it), and the copies around
the kernels: q, k, v, g and β into the batch and o out of it (``common.varlen.pad_rows`` / ``unpad_rows``: one
Triton launch each, straight from cu_seqlens): the inputs' and o's bytes read and written once more, ≈ 1.1 GB and so
≈ 0.3 ms at 3.5 TB/s for 8 sequences of ≈ 4096 tokens at 16 heads of 128 (B=8 T=4096 H=16's forward: 0.30 ms).
Sequences of one length need none of it: the packed rows are then the batch's, as views.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..common.varlen import pad_rows, unpad_rows
from .chunk_fwd import BT

# Whether "auto" (and "hopper") take packed sequences to the Hopper forward by padding (else the Triton paths).
# Run 29 (H200, op_time_check.py --packed --varlen-ab, B uneven sequences of T less 0-255 rows each): the split /
# padded 1.106 / 0.662 ms at 8 x 4096 H=16, 2.189 / 1.071 at 4 x 8192 16/32 heads, 2.514 / 1.390 at 2 x 16384 H=32;
# its GPU test within the bf16 bound
VARLEN_BY_PADDING = True
# "auto" pads only where the padded rows are at most this fraction of the batch's (N·Tp ≤ ΣT / (1 − it)): beyond
# it the Triton split, which walks the packed rows as they are, is predicted to win. The padded forward measured
# 0.60× / 0.49× / 0.55× the split's time at ≈ 3% padding (run 29), so a fifth more rows to walk (≈ 1.2× its time
# at most) keeps it ahead; the crossover itself not measured
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


def worth_padding(offsets: list[int], Tp: Optional[int] = None) -> bool:
    """Whether padding these sequences to ``Tp`` rows (None: :func:`padded_rows`, which a caller that has it passes
    instead of having it computed again) wastes at most :data:`MAX_PADDED_FRACTION` of the batch's rows."""
    N, total = len(offsets) - 1, offsets[-1] - offsets[0]
    return N >= 1 and N * (Tp or padded_rows(offsets)) * (1 - MAX_PADDED_FRACTION) <= total


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
    if N * Tp == total:                 # one length (equal_lengths: Tp is it): already an [N, Tp] batch, as views
        o, final_state = forward_hopper(*(x.reshape(N, Tp, *x.shape[2:]) for x in (q, k, v, g, beta)), scale,
                                        initial_state, **launch)
        return o.reshape(1, total, *o.shape[2:]), final_state
    o, final_state = forward_hopper(*(pad_rows(x, cu_seqlens, Tp) for x in (q, k, v, g, beta)), scale,
                                    initial_state, **launch)
    return unpad_rows(o, cu_seqlens, total), final_state
