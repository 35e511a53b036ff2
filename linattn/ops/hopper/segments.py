"""The Hopper backward's reverse walk in segments (issue 45): equal-length sequences cut into S chunk-aligned segments
of L chunks, all walked at once, stitched exactly.

The unsegmented walk runs one program per (sequence, value head, V slice): at B = 1 and 16 value heads that is 32
programs of T/64 chunks each on 132 SMs. The reverse chain is linear (docs/backward.md §5): walking segment s from
the gradient of the state leaving it, dS_out(s), gives exactly the unsegmented walk's outputs over its chunks, and
the gradient entering it. Every dS_out comes from a reverse warm-up (:func:`warm_state_grads`,
``chunk_bwd.reverse_warm_ups_hopper``, one launch before the walk): the dS chain alone from zero, w chunks after
the segment, w found in-kernel from the pre-pass's chunk bounds (their sum below −30: error ≤ 2⁻³⁰ of ‖dS‖), or
from dht where the warm-up reaches the sequence's end (exact). Where the uncapped warm-ups could walk long chains
(:func:`takes_maps`) a warm-up walks one segment at most, and where the gates keep the state longer the next
segment's map and a scan over the segments give the rest (``reverse_maps.py``).

With T a multiple of 64·L a segment is a view: q ``[B, T, H, K]`` → ``[B·S, T/S, H, K]`` (likewise k, v, do and
T = A_inv) and h ``[B, NT, HV, K, V]`` → ``[B·S, NT/S, HV, K, V]``, segment s of sequence b at b·S + s; the
head-major gc and β ``[B, HV, NT·64]`` take one small copy each (:func:`head_major_as_segments`). The walk,
unchanged, runs on the views with dht = dS_out: its chunks are the same chunks (gc is the chunk-local cumsum, h the
state entering each chunk), it writes dv (and dq, dk where HV = H) into views of the gradients, its partials
are summed per segment row into views of the others (the reductions take any rows: a segment's tokens are
contiguous in its sequence's), its dh0 of segment s is the gradient entering s, and sequence b's dh0 is its first
segment's. Other T (a partial last chunk) walk unsegmented: the segments would not be
equal views, and padding would copy every input (decisions).

:func:`plan_walk_segments` picks L among the divisors of NT with a cost model in µs (:func:`walk_cost_us`: the
walk's waves and the warm-ups' waves); :func:`plan_walk` also decides, where the value heads share qk heads
(G > 1), whether the walk runs its rows in batches (:func:`walk_batch_rows`: its per-value-head dq, dk alive
a batch at a time). Everything is a fixed-order computation: deterministic.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ..common import CHUNK
from ..utils import cdiv

WALK_CHUNK_US = 18.5       # one chunk step of a walk program (H100, K = V = 128, BV = 64, the slices' dq, dk
                           # handoff included: 9.4 ms / 512 chunks at B=1 T=32768 H=HV=16, the same per step at 16
                           # programs or 256: the step is latency-bound)
ROLES_CHUNK_US = 15.3      # one chunk step of the role-split walk (H100, K = V = 128, one program per value head
                           # over the whole V: 0.98 ms / 64 chunks at B=8 T=4096 H=HV=16, 128 programs in one wave)
WALK_OCCUPANCY = 1         # walk programs per SM (213 KB of shared memory each at K = V = 128)
WARM_CHAIN_US = 7.0        # one dS chain step of a warm-up program (H100, K = V = 128, BV = 64: 0.05 ms for the
                           # ≈ 7-chunk warm-ups of 128 programs in one wave at B=1 T=32768 H=HV=16, S=4)
WARM_BV = 64               # V columns of a warm-up program at most (whichever walk follows: warm_slice)
WARM_OCCUPANCY = 1         # warm-up programs per SM (125 KB of shared memory each at K = V = 128)
W_TYPICAL = 8              # chunks a warm-up walks: the kernel finds w from the gates, which the host does not
                           # see; the anchors' gates (logsigmoid / 16) give w ≈ 8 at K = V = 128
MIN_SEGMENT_CHUNKS = 8     # a segment shorter than a typical warm-up (W_TYPICAL) warms up longer than it walks
MAX_SEGMENTS = 64          # per sequence: bounds dS_out (B·S·HV·K·V fp32) and the warm-ups' programs
GVA_BATCHES = (4, 2)       # where G > 1: the walk's rows in the most of these launches (walk_batch_rows) that the
GVA_TIME_MARGIN = 1.25     # model costs at most this much above one launch's plan (plan_walk): admits the
                           # role-split walk's four batches at B=4 T=8192 HV=32 (model 1.23×), whose dq, dk per
                           # value head a quarter at a time keep the fwd+bwd peak under FlashQLA's (decisions.md)
SPLIT_MARGIN = 0.9         # split only where the model predicts a 10% saving (its constants are rough)
MAPS_MIN_SEGMENTS = 3      # from 3 segments a warm-up can stop short of the sequence's end: capped at one segment,
                           # the maps and their scan (reverse_maps.py) stand for the rest (at 2 the cap is the end)
MAPS_MIN_CHAIN = 64        # and where the first segment's uncapped warm-up would walk more chunks than this
                           # ((S − 1)·L): a shorter chain hides under the host time of the maps' two launches
                           # (decisions.md: T = 4096, S = 8, L = 8 ahead uncapped; L = 8 at S = 32 behind)


@dataclasses.dataclass(frozen=True)
class WalkPlan:
    """How the walk runs: segments of ``L`` chunks (None: unsegmented), its rows (sequences, or segments) in
    ``parts`` launches (:func:`walk_batch_rows`)."""
    L: Optional[int]
    parts: int


def walk_batch_rows(rows: int, HV: int, V: int, BV: int, sms: int, parts: int) -> int:
    """Rows per launch of the walk over ``rows`` rows (sequences, or segments) in ``parts`` launches: all of them
    at one part; else at most ⌈rows / parts⌉ and at most one wave's (``sms`` programs, one per SM), so a batch
    never splits a wave the whole launch would fill. Batches are for GVA (G = HV / H > 1): the walk leaves dq and dk
    per value head (``[rows, Ls, HV, K]`` each, dq bf16 and dk fp32: 1.5× the bf16 h's bytes at K = V; the group
    summed after it), and each batch's are summed into the gradients before the next is walked."""
    if parts == 1 or rows == 1:
        return rows
    per_wave = max(1, sms // (HV * (V // BV)))
    return min(per_wave, -(-rows // parts))


def warm_slice(BV: int) -> int:
    """The V columns of a reverse warm-up program before a walk over ``BV`` columns a program."""
    return min(BV, WARM_BV)


def walk_cost_us(B: int, NT: int, HV: int, V: int, BV: int, L: int, sms: int, parts: int = 1,
                 step_us: float = WALK_CHUNK_US) -> float:
    """Modelled µs of the reverse walk over B sequences of NT chunks in segments of L chunks (L = NT: unsegmented,
    no warm-ups): a phase whose programs walk c chunks each takes c · waves · its chunk cost, waves =
    ceil(programs / slots) per launch; the walk runs one program per (segment, value head, V slice) in the
    launches of :func:`walk_batch_rows`, the warm-ups the same programs in one launch, W_TYPICAL chain steps each."""
    waves = lambda rows, width, occupancy: -(-(rows * HV * (V // width)) // (occupancy * sms))
    S = NT // L
    rows = B * S
    per_batch = walk_batch_rows(rows, HV, V, BV, sms, parts)
    full, rest = divmod(rows, per_batch)
    walk = step_us * L * (full * waves(per_batch, BV, WALK_OCCUPANCY) + waves(rest, BV, WALK_OCCUPANCY))
    if S == 1:
        return walk
    return walk + WARM_CHAIN_US * W_TYPICAL * waves(rows, warm_slice(BV), WARM_OCCUPANCY)


@functools.lru_cache(maxsize=256)
def plan_walk_segments(B: int, T: int, HV: int, V: int, BV: int, sms: int, parts: int = 1,
                       step_us: float = WALK_CHUNK_US) -> Optional[int]:
    """Segment length L (chunks) for the walk over B sequences of T tokens in ``parts`` launches, or None
    (unsegmented): the cheapest divisor L of NT = T/64 (T a multiple of 64; 2 … MAX_SEGMENTS segments of at least
    MIN_SEGMENT_CHUNKS chunks) by :func:`walk_cost_us`, if it saves SPLIT_MARGIN of the unsegmented cost; ties go
    to the longer L (fewer warm-ups). Cached: host time on every backward call."""
    NT = T // CHUNK
    if T % CHUNK or NT < 2 * MIN_SEGMENT_CHUNKS:
        return None
    best_cost, best = SPLIT_MARGIN * walk_cost_us(B, NT, HV, V, BV, NT, sms, parts, step_us), None
    for S in range(2, min(MAX_SEGMENTS, NT // MIN_SEGMENT_CHUNKS) + 1):
        if NT % S:
            continue
        cost = walk_cost_us(B, NT, HV, V, BV, NT // S, sms, parts, step_us)
        if cost < best_cost:
            best_cost, best = cost, NT // S
    return best


@functools.lru_cache(maxsize=256)
def plan_walk(segment_chunks: Optional[int], B: int, T: int, HV: int, V: int, BV: int, G: int,
              sms: int, step_us: float = WALK_CHUNK_US) -> WalkPlan:
    """The walk's segments and batches on ``sms`` SMs. L: ``segment_chunks`` as forced (:func:`segment_length`),
    else :func:`plan_walk_segments`'. Parts: one where G = 1; where G > 1, the most of GVA_BATCHES (the
    per-value-head dq, dk a quarter or a half at a time, with the segments that keep each batch a full wave) that the
    model puts within GVA_TIME_MARGIN of the one-launch plan, else one (small shapes, where the buffers are small
    too). Cached: host time on every backward call."""
    NT = cdiv(T, CHUNK)

    def planned(parts: int) -> tuple[float, WalkPlan]:
        L = segment_length(segment_chunks, T) if segment_chunks is not None else plan_walk_segments(
            B, T, HV, V, BV, sms, parts, step_us)
        return walk_cost_us(B, NT, HV, V, BV, L or NT, sms, parts, step_us), WalkPlan(L, parts)
    one_cost, one = planned(1)
    if G == 1:
        return one
    for parts in GVA_BATCHES:
        batched_cost, batched = planned(parts)
        if batched_cost <= GVA_TIME_MARGIN * one_cost:
            return batched
    return one


def segment_length(segment_chunks: int, T: int) -> Optional[int]:
    """L for a forced ``segment_chunks`` (an int ≥ 1 dividing T/64, T a multiple of 64; ≥ T/64 walks unsegmented:
    None)."""
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
    """Head-major ``[B, HV, N]`` → ``[B·S, HV, N/S]`` (segment s of sequence b at b·S + s; one contiguous copy, x
    itself at S = 1): the walk's gc and β for its segment views. Contiguous at every B: at B = 1 a reshape would
    return a strided view, and every launch that reads it would copy it again."""
    if S == 1:
        return x
    B, HV, N = x.shape
    return x.view(B, HV, S, N // S).transpose(1, 2).contiguous().view(B * S, HV, N // S)


def takes_maps(S: int, L: int) -> bool:
    """Whether S segments of L chunks a sequence take the reverse maps (capped warm-ups, the maps, their scan)
    rather than warm-ups that may walk to the sequence's end: :data:`MAPS_MIN_SEGMENTS`, :data:`MAPS_MIN_CHAIN`."""
    return S >= MAPS_MIN_SEGMENTS and (S - 1) * L > MAPS_MIN_CHAIN


def warm_state_grads(q, k, v, do, gc_hm, beta_hm, gc_s, beta_s, t_inv, bound, dht: Optional[torch.Tensor],
                     scale: float, L: int, BV: int, sms: int) -> torch.Tensor:
    """dS_out ``[B·S, HV, K, V]`` fp32, the gradient of the state leaving every segment of L chunks (the last
    segment's of sequence b is dht[b], zeros without dht), segment s of b at b·S + s, from the reverse warm-ups
    (``chunk_bwd.reverse_warm_ups_hopper``): the whole sequences' q, k ``[B, T, ...]``, do ``[B, T, HV, V]`` bf16,
    the pre-pass's gc, β head-major ``[B, HV, NT·64]``, T ``[B, T, HV, 64]`` bf16 and chunk bounds ``[B, HV, NT]``;
    S = NT / L. Where :func:`takes_maps` says so each warm-up walks one segment at most, and the segments'
    maps and their scan (``reverse_maps.py``: v and the segments' gc_s, β_s ``[B·S, HV, L·64]`` read there) give
    dS_out where the gates keep the state longer."""
    from . import chunk_bwd, reverse_maps
    S = bound.shape[-1] // L
    if not takes_maps(S, L):
        return chunk_bwd.reverse_warm_ups_hopper(q, k, do, gc_hm, beta_hm, t_inv, bound, dht, scale, S, BV)
    flags = torch.empty(q.shape[0] * S, v.shape[2], dtype=torch.int32, device=q.device)
    ds_out = chunk_bwd.reverse_warm_ups_hopper(q, k, do, gc_hm, beta_hm, t_inv, bound, dht, scale, S, BV,
                                               map_flags=flags)
    seg = lambda x: as_segments(x, S)
    maps = reverse_maps.segment_maps(seg(k), seg(v), gc_s, beta_s, seg(t_inv), flags, sms)
    reverse_maps.reverse_map_scan(ds_out, maps, flags, S)
    return ds_out
