"""The split forward: the state pass walks the chunks, the output is computed in parallel afterwards.

    h, V_new, S_T = state_pass_fwd(k, W, U, gc, S_0)     sequential: per chunk W S and Kᵀ V_new (state_pass.py)
    o             = output_fwd(q, k, V_new, h, gc)        parallel over (V tile, chunk, value head) (output.py)

after the pre-pass (gc, W, U; fused_prepass.py). The walk (fused_fwd.py) does both in one program per (sequence,
value head, V slice); this path keeps only the two dots that feed the next chunk on the sequential chain and pays
for it with h (K·V fp32 per chunk and value head) and V_new written once and read once (docs/architecture.md).

When the state pass's programs cannot fill the SMs, long sequences are cut into segments exactly as for the walk
(``seq_parallel.py``: phase A the affine map of every segment, phase B the scan that gives each segment its true
entering state) and phase C is the state pass run over the segments as if each were a sequence of its own: the
segments are chunk-aligned, so the pseudo-sequences' chunks are the real ones in the same global order, h comes
out in the layout the output kernel reads, and only the final states need picking (the last segment's of each
sequence). The split is planned by ``seq_parallel.plan_segments`` with phase A costed against a state-pass chunk
(:data:`AFFINE_COST`) instead of a walk chunk.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..utils import cdiv, flat_offsets
from . import CHUNK, dot_precision, num_sms
from .fused_fwd import fused_fwd_config, launch_walk
from .output import output_fwd
from .seq_parallel import affine_scan, plan_segments, segment_layout, segment_tables
from .state_pass import state_pass_fwd
from .wy import wy_fwd

# phase A's chunk (two dots over the K + V columns of [M | N]) against a chunk of the state pass (the same two
# dots over V columns), per column slice: 2.0 splits only when far fewer programs than SMs walk very long sequences
# (e.g. HV = 1); planned segments at 1.0 measured slower than none.
AFFINE_COST = 2.0

# From this many (sequence, value head) pairs the pre-pass writes each chunk's inverse A_inv and the state pass
# forms V_new = A_inv (β ⊙ V − βΓ ⊙ (K S)) from it (state_pass.py, FROM_A_INV); below, the pre-pass writes W and U.
# The A_inv form writes a sixth of the bytes (at K = V = 128) and skips two dots per chunk in the pre-pass, but puts
# a third dot on the state pass's sequential chain: that pays once the pairs fill the SMs, not where a few pairs
# walk long sequences.
WY_IN_STATE_PASS_MIN_PAIRS = 64


def store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the split forward stores h and V_new in for inputs of ``dtype``: bf16 for bf16 inputs, else fp32.
    Both are only read by the output kernel (the state pass carries its state in fp32 registers), so bf16 storage
    rounds what o reads once, not compounding over chunks, and leaves the final state unchanged; it halves the
    bytes of the two largest intermediates."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def wu_store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the split path's pre-pass writes W and U in: fp32 for every input dtype. W enters the state
    recurrence (V_new = U − W S), so a bf16 W would carry its rounding across chunks (the final state's error
    doubles) for a mixed speed-up."""
    return torch.float32


def wy_in_state_pass(num_sequences: int, HV: int, dtype: torch.dtype) -> bool:
    """Whether the split path's pre-pass writes A_inv for the state pass instead of W and U, for ``num_sequences``
    sequences of ``HV`` value heads: from :data:`WY_IN_STATE_PASS_MIN_PAIRS` pairs on (every input dtype)."""
    return num_sequences * HV >= WY_IN_STATE_PASS_MIN_PAIRS


def output_precision(dtype: torch.dtype) -> str:
    """The split forward's output-kernel precision for inputs of ``dtype``: "bf16x3" for bf16 (``dot.py``: Q stays
    bf16, so Q S is two bf16 MMAs and P V_new three, ≈ 2^-16 per product; as accurate as "tf32x3" and the output
    kernel twice as fast, where "tf32" puts o's error at the bf16 goal's edge), ``dot_precision`` otherwise."""
    return "bf16x3" if dtype == torch.bfloat16 else dot_precision(dtype)


def state_pass_plan(chunks: list[int], HV: int, K: int, V: int, sms: int, segment_chunks: Optional[int] = None
                    ) -> tuple[Optional[int], int, int]:
    """(L, BV, num_warps) of the state pass over sequences of ``chunks`` chunks: L the segment length in chunks
    (``segment_chunks`` when given, ≥ 1; else ``seq_parallel.plan_segments`` with phase A costed at
    :data:`AFFINE_COST`), None for no split (also when L covers the longest sequence); BV and num_warps phase A's
    (``fused_fwd_config``). The split forward and the backward's recompute both plan here."""
    if segment_chunks is not None and segment_chunks < 1:
        raise ValueError(f"segment_chunks must be >= 1, got {segment_chunks}")
    _, BV, num_warps = fused_fwd_config(K, V, len(chunks) * HV, sms)
    L = segment_chunks or plan_segments(chunks, HV, K, V, BV, sms, affine_cost=AFFINE_COST)
    return (None if L is None or L >= max(chunks, default=0) else L), BV, num_warps


def segmented_state_pass(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gc: torch.Tensor,
                         initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], flat: list[int],
                         L: int, BV: int, num_warps: int, store: torch.dtype, chunk_size: int = CHUNK
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``state_pass_fwd`` with the sequences cut into segments of L chunks: phases A and B (``seq_parallel.py``:
    the segments' affine maps, then the scan giving each its true entering state), phase C the state pass over the
    segments as pseudo-sequences (module docstring).

    Args: k ``[B, T, H, K]``; w ``[B, T, HV, K]`` and u ``[B, T, HV, V]`` fp32 (the WY form: phase A walks W and
        U); gc ``[B, T, HV]`` fp32; initial_state ``[N, HV, K, V]`` or None; cu_seqlens ``[N + 1]`` or None; flat:
        the host token offsets of the N sequences (cu_seqlens', or ``b·T``); L, BV, num_warps: from
        :func:`state_pass_plan`; store: the dtype of h and v_new.
    Returns: h ``[B, NT, HV, K, V]``, v_new ``[B, T, HV, V]`` (both ``store``) and the final state
        ``[N, HV, K, V]`` fp32, as ``state_pass_fwd`` returns them.
    """
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    N = len(flat) - 1
    layout = segment_layout(flat, L, chunk_size, k.device)
    if cu_seqlens is None:
        # the walk indexes equal sequences by position: give it the flat layout's tables instead
        k1, w1, u1, gc1 = (t.reshape(1, B * T, *t.shape[2:]) for t in (k, w, u, gc))
    else:
        k1, w1, u1, gc1 = k, w, u, gc
    cu_flat = cu_seqlens if cu_seqlens is not None else layout.cu_seqlens
    segments = segment_tables(flat, L, chunk_size, k.device)[0]
    mn = torch.empty(layout.num_segments, HV, K, K + V, dtype=torch.float32, device=k.device)
    # phase A reads no queries (k stands in for q's shape and dtype)
    launch_walk(k1, k1, w1, u1, gc1, None, None, mn, 1.0, cu_flat, BV=BV, num_warps=num_warps, dot_prec=None,
                state_prec=None, chunk_size=chunk_size, num_segments=layout.num_segments, segments=segments, nseg=1,
                seg_len=L, segmented=True, affine=True)
    h_in = affine_scan(mn, initial_state, V, N, layout.segment_first, 1, BV=BV)
    del mn
    # phase C: the state pass over the segments as pseudo-sequences (chunk-aligned: same chunks, same order)
    NT_total = sum(-(-(e - b) // chunk_size) for b, e in zip(flat[:-1], flat[1:]))
    h, v_new, seg_final = state_pass_fwd(k1, w1, u1, gc1, h_in, layout.seg_cu_seqlens, layout.seg_chunk_offsets,
                                         NT_total, store_dtype=store)
    final_state = seg_final[(layout.segment_first[1:] - 1).long()]
    if cu_seqlens is None:
        h = h.view(B, cdiv(T, chunk_size), HV, K, V)
        v_new = v_new.view(B, T, HV, V)
    return h, v_new, final_state


def split_fwd(q: torch.Tensor, k: torch.Tensor, wy: list, gc: torch.Tensor, scale: float,
              initial_state: Optional[torch.Tensor], out_dtype: torch.dtype, cu_seqlens: Optional[torch.Tensor],
              offsets: Optional[list[int]], chunk_indices: Optional[torch.Tensor],
              chunk_offsets: Optional[torch.Tensor], out_prec: Optional[str] = None,
              segment_chunks: Optional[int] = None, chunk_size: int = CHUNK,
              store: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """o ``[B, T, HV, V]`` in ``out_dtype`` and the final state ``[N, HV, K, V]`` fp32.

    Args: q, k ``[B, T, H, K]``; wy: the chunks' WY form from the pre-pass, either the list [w ``[B, T, HV, K]``,
        u ``[B, T, HV, V]``] or [A_inv ``[B, T, HV, 64]`` fp32, beta ``[B, T, HV]``, v ``[B, T, HV, V]``] (the state
        pass then forms W S and U per chunk: state_pass.py, FROM_A_INV; segments, which phase A walks with W and
        U, get them from ``wy_fwd`` first). This function empties the list once the state pass has read it: when
        the caller keeps no other reference (the op does not), W and U (or A_inv) are free before the output
        kernel runs (at B=8 T=4096 H=16 K=V=128, W and U are 537 MB of the forward's 1.07 GB peak of
        intermediates); gc ``[B, T, HV]`` fp32 (the pre-pass);
        initial_state ``[N, HV, K, V]`` or None; cu_seqlens / offsets (device and host) with chunk_indices /
        chunk_offsets from ``varlen.chunk_tables``, or all None; out_prec: the output kernel's precision for its
        fp32 dots (``output_fwd``'s dot_prec); segment_chunks: force segments of this many chunks (≥ 1, tests and
        benchmarks), None: planned; store: the dtype of h and V_new (None: :func:`store_dtype` of the inputs).
    """
    if len(wy) not in (2, 3):
        raise ValueError(f"split_fwd takes [w, u] or [a_inv, beta, v], got a list of {len(wy)}")
    from_a_inv = len(wy) == 3
    w, u, a_inv, beta = (None, wy[2], wy[0], wy[1]) if from_a_inv else (*wy, None, None)
    wy.clear()
    B, T, H, K = q.shape
    HV, V = u.shape[2], u.shape[3]
    if cu_seqlens is not None and offsets is None:
        offsets = cu_seqlens.tolist()
    flat = offsets if cu_seqlens is not None else flat_offsets(B, T)
    chunks = [-(-(e - b) // chunk_size) for b, e in zip(flat[:-1], flat[1:])]
    L, BV, num_warps = state_pass_plan(chunks, HV, K, V, num_sms(q.device), segment_chunks)
    store = store or store_dtype(q.dtype)
    if L is None:
        h, v_new, final_state = state_pass_fwd(k, w, u, gc, initial_state, cu_seqlens, chunk_offsets,
                                               sum(chunks) if cu_seqlens is not None else None, store_dtype=store,
                                               a_inv=a_inv, beta=beta)
    else:
        if from_a_inv:
            # phase A walks the segments with W and U (seq_parallel.py): form them (rare: few, very long sequences)
            w, u = wy_fwd(k, u, beta, gc, a_inv, cu_seqlens, chunk_indices)
            a_inv = None
        h, v_new, final_state = segmented_state_pass(k, w, u, gc, initial_state, cu_seqlens, flat, L, BV, num_warps,
                                                     store, chunk_size)
    del w, u, a_inv  # their last reader
    o = output_fwd(q, k, v_new, h, gc, scale, out_dtype, cu_seqlens, chunk_indices, dot_prec=out_prec)
    return o, final_state
