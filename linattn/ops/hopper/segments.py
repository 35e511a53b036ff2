"""The Hopper backward's reverse walk in segments (issue 45): equal-length sequences cut into S chunk-aligned segments
of L chunks, all walked at once, stitched exactly.

The unsegmented walk runs one program per (sequence, value head, V slice): at B = 1 and 16 value heads that is 32
programs of T/64 chunks each on 132 SMs. The reverse chain is linear (docs/backward.md §5): walking segment s from
the gradient of the state leaving it, dS_out(s), gives exactly the unsegmented walk's outputs over its chunks, and
the gradient entering it. ``common/seq_parallel_bwd.segment_grads`` gives every dS_out(s) (Triton phases A', the
maps [M_sᵀ | D_s], and B', the reverse scan from dht) from the Triton reverse walk's inputs: W (``common/wy.py``)
and dv_local = scale·Pᵀ dO (``common/local_bwd_dv.py``), formed only when segmenting.

With T a multiple of 64·L a segment is a view: q ``[B, T, H, K]`` → ``[B·S, T/S, H, K]`` (likewise k, v, do and
T = A_inv) and h ``[B, NT, HV, K, V]`` → ``[B·S, NT/S, HV, K, V]``, segment s of sequence b at b·S + s, the order of
``segment_layout``'s segments; the head-major gc and β ``[B, HV, NT·64]`` take one small copy each
(:func:`head_major_as_segments`). The walk, unchanged, runs on the views with dht = dS_out: its chunks are the same
chunks (gc is the chunk-local cumsum, h the state entering each chunk), its partials come back in the viewed layout
(dq, dk, dv reshape to ``[.., B, T, ..]`` as views; the head-major dg, dβ need one small transpose), its dh0 of
segment s is the gradient entering s, and sequence b's dh0 is its first segment's. Other T (a partial last chunk)
walk unsegmented: the segments would not be equal views, and padding would copy every input (decisions).

Or (``segment_method="warm"``, :func:`warm_state_grads`) every dS_out comes from a reverse warm-up
(``chunk_bwd.reverse_warm_ups_hopper``, one launch): the dS chain alone from zero, w chunks after the segment,
w found in-kernel from the pre-pass's chunk bounds (their sum below −30: error ≤ 2⁻³⁰ of ‖dS‖), or from dht where
the warm-up reaches the sequence's end (exact); no W, dv_local, maps or scan. The maps stay the default until the
GPU's A/B (benchmarks/gpu_check_hopper_bwd.py --warm) decides.

:func:`plan_walk_segments` picks L among the divisors of NT with a cost model in µs whose constants are estimates
(benchmarks/gpu_check_hopper_bwd.py --segments measures what calibrates them); the warm-ups take the same L.
Everything is a fixed-order computation: deterministic.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..common import CHUNK, num_sms
from ..common.local_bwd_dv import local_bwd_dv
from ..common.seq_parallel import segment_layout
from ..common.seq_parallel_bwd import segment_grads, split_tile_v
from ..common.wy import wy_fwd
from ..utils import cdiv, flat_offsets

WALK_CHUNK_US = 14.0       # one chunk step of a walk program (H100, K = V = 128, BV = 64: 7.3 ms / 512 chunks at
                           # B=1 T=32768 H=HV=16, and 28 µs per step with two programs queued per SM at B=8 T=4096)
WALK_OCCUPANCY = 1         # walk programs per SM (213 KB of shared memory each at K = V = 128)
MAP_CHUNK_US = 12.0        # estimate: one chunk step of a phase A' program (Triton, split_tile_v columns of the
                           # K × (K + V) map), two per SM (seq_parallel.OCCUPANCY)
MAP_OCCUPANCY = 2
SCAN_STEP_US = 3.0         # estimate: one segment step of phase B' (a 128 × 256 fp32 map read per step)
PREP_US = 0.05             # estimate: W and dv_local per (chunk, value head) (two Triton stages, ≈ 0.4 ms at
                           # B=1 T=32768 HV=16)
MIN_SEGMENT_CHUNKS = 8     # shorter segments spend more on the maps and the scan than the walk saves
MAX_SEGMENTS = 64          # per sequence: bounds the scan's sequential length
SPLIT_MARGIN = 0.9         # split only where the model predicts a 10% saving (its constants are rough)


def walk_cost_us(B: int, NT: int, HV: int, K: int, V: int, BV: int, L: int, sms: int) -> float:
    """Modelled µs of the reverse walk over B sequences of NT chunks in segments of L chunks (L = NT: unsegmented,
    no maps, scan or W): a phase whose programs walk c chunks each takes c · waves · its chunk cost, waves =
    ceil(programs / slots)."""
    waves = lambda programs, occupancy: -(-programs // (occupancy * sms))
    S = NT // L
    walk = WALK_CHUNK_US * L * waves(B * S * HV * (V // BV), WALK_OCCUPANCY)
    if S == 1:
        return walk
    map_bv = split_tile_v(K, V)
    maps = MAP_CHUNK_US * L * waves(B * S * HV * cdiv(K + V, map_bv), MAP_OCCUPANCY)
    return walk + maps + SCAN_STEP_US * S + PREP_US * B * NT * HV


@functools.lru_cache(maxsize=256)
def plan_walk_segments(B: int, T: int, HV: int, K: int, V: int, BV: int, sms: int) -> Optional[int]:
    """Segment length L (chunks) for the walk over B sequences of T tokens, or None (unsegmented): the cheapest
    divisor L of NT = T/64 (T a multiple of 64; 2 … MAX_SEGMENTS segments of at least MIN_SEGMENT_CHUNKS chunks)
    by :func:`walk_cost_us`, if it saves SPLIT_MARGIN of the unsegmented cost; ties go to the longer L (fewer
    maps and scan steps). Cached: host time on every backward call."""
    NT = T // CHUNK
    if T % CHUNK or NT < 2 * MIN_SEGMENT_CHUNKS:
        return None
    best_cost, best = SPLIT_MARGIN * walk_cost_us(B, NT, HV, K, V, BV, NT, sms), None
    for S in range(2, min(MAX_SEGMENTS, NT // MIN_SEGMENT_CHUNKS) + 1):
        if NT % S:
            continue
        cost = walk_cost_us(B, NT, HV, K, V, BV, NT // S, sms)
        if cost < best_cost:
            best_cost, best = cost, NT // S
    return best


def segment_length(segment_chunks: Optional[int], B: int, T: int, HV: int, K: int, V: int, BV: int,
                   device: torch.device) -> Optional[int]:
    """L for the walk: ``segment_chunks`` as forced (an int ≥ 1 dividing T/64, T a multiple of 64; ≥ T/64 walks
    unsegmented), or None → :func:`plan_walk_segments`. Returns None for the unsegmented walk."""
    if segment_chunks is None:
        return plan_walk_segments(B, T, HV, K, V, BV, num_sms(device))
    if not isinstance(segment_chunks, int) or isinstance(segment_chunks, bool) or segment_chunks < 1:
        raise ValueError(f"segment_chunks must be None or an int >= 1, got {segment_chunks!r}")
    NT = cdiv(T, CHUNK)
    if segment_chunks >= NT:
        return None
    if T % CHUNK or NT % segment_chunks:
        raise ValueError(f"segments of {segment_chunks} chunks need T a multiple of 64 and of 64·{segment_chunks} "
                         f"(equal views), got T = {T}")
    return segment_chunks


def as_segments(x: torch.Tensor, S: int) -> torch.Tensor:
    """``[B, N, ...]`` → ``[B·S, N/S, ...]`` (a view of a contiguous x): segment s of sequence b at b·S + s."""
    return x.view(x.shape[0] * S, x.shape[1] // S, *x.shape[2:])


def head_major_as_segments(x: torch.Tensor, S: int) -> torch.Tensor:
    """Head-major ``[B, HV, N]`` → ``[B·S, HV, N/S]`` (segment s of sequence b at b·S + s; one copy, x itself at
    S = 1): the walk's gc and β for its segment views."""
    if S == 1:
        return x
    B, HV, N = x.shape
    return x.view(B, HV, S, N // S).transpose(1, 2).reshape(B * S, HV, N // S)


def head_major_from_segments(x: torch.Tensor, B: int) -> torch.Tensor:
    """The walk's head-major partials ``[NV, B·S, HV, Ls]`` → ``[NV, B, HV, S·Ls]`` (sequence-major tokens; the
    identity at S = 1)."""
    NV, BS, HV, Ls = x.shape
    if BS == B:
        return x
    S = BS // B
    return x.view(NV, B, S, HV, Ls).transpose(2, 3).reshape(NV, B, HV, S * Ls)


def segment_state_grads(q, k, v, beta, gc, a_inv, do, dht: Optional[torch.Tensor], scale: float, L: int
                        ) -> torch.Tensor:
    """dS_out ``[B·S, HV, K, V]`` fp32, the gradient of the state leaving every segment of L chunks (the last
    segment's of sequence b is dht[b], zeros without dht), segment s of b at b·S + s: W (``wy_fwd``, its U
    unused) and dv_local (``local_bwd_dv``) from gc and T (the pre-pass's bf16 values in fp32: the walk's own
    operator), then ``segment_grads``. Tensors ``[B, T, ...]`` contiguous, as the Triton backward takes them."""
    B, T = q.shape[:2]
    w, _ = wy_fwd(k, v, beta, gc, a_inv)
    dv_local = local_bwd_dv(q, k, gc, do, scale)
    layout = segment_layout(flat_offsets(B, T), L, CHUNK, q.device)
    flat = lambda t: t.view(1, B * T, *t.shape[2:])
    dht = dht.float().contiguous() if dht is not None else None
    return segment_grads(flat(q), flat(k), flat(w), flat(gc), flat(do), flat(dv_local), dht, scale, layout)


def warm_state_grads(q, k, do, gc_hm, beta_hm, t_inv, bound, dht: Optional[torch.Tensor], scale: float, L: int,
                     BV: int) -> torch.Tensor:
    """dS_out ``[B·S, HV, K, V]`` fp32 (as :func:`segment_state_grads`) from the reverse warm-ups
    (``chunk_bwd.reverse_warm_ups_hopper``): the whole sequences' q, k, do ``[B, T, ...]`` bf16, the pre-pass's gc,
    β head-major ``[B, HV, NT·64]``, T ``[B, T, HV, 64]`` bf16 and chunk bounds ``[B, HV, NT]``; S = NT / L."""
    from . import chunk_bwd
    NT = bound.shape[-1]
    return chunk_bwd.reverse_warm_ups_hopper(q, k, do, gc_hm, beta_hm, t_inv, bound, dht, scale, NT // L, BV)
