"""Intra-card sequence parallelism for the fused forward: split long sequences into segments, stitch them exactly.

The sequential kernel (``fused_fwd.py``) walks one (sequence, value head, V slice) per program, so when
B·HV·(V slices) programs cannot fill the SMs most of the card idles while a few programs walk thousands of chunks.
The state map across chunks is affine (../docs/architecture.md): S_out = M S_in + N, with M (K×K) the walk of the
identity with U = 0 and N the walk of a zero state. A sequence cut into segments of L chunks runs in three phases:

    A  mn[s] = [M_s | N_s]            fused_fwd_kernel, AFFINE: one walk of the augmented K×(K+V) state per
                                      segment, no output                        grid (cdiv(K+V, BV), NS·HV)
    B  h_in[s+1] = M_s h_in[s] + N_s  affine_scan_kernel: fp32 (tf32x3 dots) over the segments of a sequence,
                                      from its initial state (or 0)             grid (cdiv(V, BV), N·HV)
    C  o, final state                 fused_fwd_kernel, SEGMENTED: each segment's walk from its true h_in,
                                      with the output                           grid (cdiv(V, BV), NS·HV)

Phase C is the plain walk started from a different (exactly stitched) state, so o equals the unsegmented one up to
the rounding of h_in: fp32 rounding for fp32 inputs. Phase A reads what a walk reads (W, K, gc, and U for the N
columns) but runs two of the five dots per chunk and writes nothing per chunk; phase B reads NS·HV·K·(K+V) fp32.

Twins (float64, from torch_chunk's ``state_pass_fwd_ref`` / ``output_fwd_ref``): :func:`affine_maps_ref` (phase A),
:func:`affine_scan_ref` (phase B) and :func:`segmented_fwd_ref` (A → B → C for one sequence). The split itself is
chosen by :func:`plan_segments` (the model is in :func:`_plan_segments`' docstring and in docs/architecture.md).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..gated_delta import torch_chunk as tc
from ..utils import cdiv
from . import CHUNK, block_size
from .fused_fwd import fused_fwd, fused_fwd_config, launch_walk, num_sms
from .launch import BoundLaunch, launch
from .varlen import chunk_tables

OCCUPANCY = 2             # programs of the walk one SM holds at once: 255 registers × 128 threads each (ptxas,
                          # sm_90, K = 128, every BV), so the 64K-register file takes two
MIN_SEGMENT_CHUNKS = 8    # shorter segments spend more on phases A and B than they save
MAX_SEGMENTS = 64         # per sequence: bounds phase B's sequential length and the planner's search
AFFINE_COST = 0.5         # a chunk of phase A per column slice, relative to a chunk of the walk with output
SCAN_COST = 1.0           # a segment of phase B, in chunks of the walk
SPLIT_MARGIN = 0.9        # split only when the model predicts at least a 10% saving (its constants are rough)


# ----------------------------------------------------------------------------------------------------------------
# the planner
# ----------------------------------------------------------------------------------------------------------------
def plan_segments(chunks: list[int], HV: int, K: int, V: int, BV: int, sms: int, occupancy: int = OCCUPANCY,
                  min_chunks: int = MIN_SEGMENT_CHUNKS, affine_cost: float = AFFINE_COST,
                  split_bv: Optional[int] = None) -> Optional[int]:
    """Segment length L (in chunks) for sequences of ``chunks`` chunks each, or None for no split: see
    :func:`_plan_segments`. Cached per argument set: the search is host time on every forward call, a cache hit
    almost none."""
    return _plan_segments(tuple(chunks), HV, K, V, BV, sms, occupancy, min_chunks, affine_cost, split_bv or BV)


@functools.lru_cache(maxsize=256)
def _plan_segments(chunks: tuple, HV: int, K: int, V: int, BV: int, sms: int, occupancy: int, min_chunks: int,
                   affine_cost: float, split_bv: int) -> Optional[int]:
    """Segment length L (in chunks) for sequences of ``chunks`` chunks each, or None for no split.

    Model, in units of one chunk of the walk: ``occupancy·sms`` programs run at once; a phase whose programs each
    walk c chunks takes c · waves, waves = ceil(programs / (occupancy·sms)). Without a split that is
    NT_max · waves(P) with P = HV·cdiv(V, BV)·N. With segments of L chunks (a sequence shorter than L keeps one),
    whose phases A and C run V tiles of ``split_bv`` columns (the backward's: as wide as its registers allow, since
    the segments fill the SMs; the forward's: BV):

        phase C  L · waves(P_L)             P_L = HV·cdiv(V, split_bv)·Σ_n cdiv(NT_n, L)
        phase A  affine_cost · L · waves(P_L · cdiv(K+V, split_bv) / cdiv(V, split_bv))   (AFFINE_COST for the walk)
        phase B  SCAN_COST · cdiv(NT_max, L)

    and L ranges over cdiv(NT_max, j), j = 2 … min(MAX_SEGMENTS, NT_max // min_chunks). The cheapest wins if it
    costs under SPLIT_MARGIN × the unsplit walk. Splitting pays only while the unsplit grid leaves slots idle: the
    best it can do is occupancy·sms / P shorter phases, paid for by phase A (≈ 1 + AFFINE_COST·(K+V)/V in all).
    The constants are first estimates; benchmarks/bench_seq_parallel.py measures what calibrates them. Nothing here depends on T beyond the chunk counts,
    and nothing is compiled per plan (L and the segment count are runtime kernel arguments).
    """
    nt_max = max(chunks, default=0)
    slots = occupancy * sms
    per_seq = HV * cdiv(V, split_bv)
    widen = cdiv(K + V, split_bv) / cdiv(V, split_bv)
    waves = lambda p: -(-p // slots)
    unsplit = nt_max * waves(HV * cdiv(V, BV) * len(chunks))
    best_cost, best = SPLIT_MARGIN * unsplit, None
    for j in range(2, min(MAX_SEGMENTS, nt_max // min_chunks) + 1):
        L = -(-nt_max // j)
        progs = per_seq * sum(-(-nt // L) for nt in chunks)
        cost = L * waves(progs) + affine_cost * L * waves(int(progs * widen)) + SCAN_COST * -(-nt_max // L)
        if cost < best_cost:
            best_cost, best = cost, L
    return best


@functools.lru_cache(maxsize=16)
def _segment_tables(offsets: tuple, L: int, chunk_size: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    seg, first = [], [0]
    for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        nt = -(-(eos - bos) // chunk_size)
        starts = range(0, nt, L) if nt else [0]      # an empty sequence keeps one (empty) segment: its final state
        seg += [(n, c, min(c + L, nt)) for c in starts]
        first.append(len(seg))
    both = torch.tensor([x for s in seg for x in s] + first, dtype=torch.int32).to(device)
    return both[:3 * len(seg)].view(-1, 3), both[3 * len(seg):]


def segment_offsets(offsets: list[int], L: int, chunk_size: int) -> list[int]:
    """Token offsets of every segment of L chunks, sequence by sequence (``segment_tables``' order); a sequence of
    at most L chunks, empty included, is one segment."""
    out = [0]
    for bos, eos in zip(offsets[:-1], offsets[1:]):
        nt = -(-(eos - bos) // chunk_size)
        out += [bos + c * chunk_size for c in range(L, nt, L)] + [eos]
    return out


class SegmentLayout(NamedTuple):
    """The segments of L chunks of a batch, as pseudo-sequences a per-sequence kernel walks (chunk-aligned: their
    chunks are the real ones in the same global order). Cached (:func:`segment_layout`): callers must not write
    into the tensors."""
    cu_seqlens: torch.Tensor         # [N + 1] int64: the sequences' token offsets (the flat layout's, B > 1 too)
    seg_cu_seqlens: torch.Tensor     # [NS + 1] int64: the segments' token offsets
    seg_chunk_offsets: torch.Tensor  # [NS + 1] int32: each segment's first global chunk (varlen.chunk_tables')
    segment_first: torch.Tensor      # [N + 1] int32: each sequence's first segment (segment_tables')
    num_segments: int                # NS


def segment_layout(offsets: list[int], L: int, chunk_size: int, device) -> SegmentLayout:
    """The :class:`SegmentLayout` of sequences at token ``offsets`` (host list, [N + 1]) cut into segments of L
    chunks: built once per batch layout and split (a training step's repeated shapes hit the cache)."""
    return _segment_layout(tuple(offsets), L, chunk_size, str(device))


@functools.lru_cache(maxsize=16)
def _segment_layout(offsets: tuple, L: int, chunk_size: int, device: str) -> SegmentLayout:
    seg = segment_offsets(list(offsets), L, chunk_size)
    both = torch.tensor(list(offsets) + seg, dtype=torch.int64).to(device)
    first = segment_tables(list(offsets), L, chunk_size, device)[1]
    return SegmentLayout(both[:len(offsets)], both[len(offsets):], chunk_tables(seg, chunk_size, device)[1], first,
                         len(seg) - 1)


def segment_tables(offsets: list[int], L: int, chunk_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen segment tables as int32 tensors on ``device`` (one host-to-device copy, cached by their arguments):

        segments       [NS, 3]  (sequence n, first chunk, end chunk) of every segment, in sequence order
        segment_first  [N + 1]  first segment of each sequence (segment_first[N] = NS)

    Segments never cross a sequence; a sequence of at most L chunks (empty included) is one segment. Callers must
    not write into the returned tensors."""
    return _segment_tables(tuple(offsets), L, chunk_size, str(device))


# ----------------------------------------------------------------------------------------------------------------
# phase B: the scan over segments
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _map_tiles(p_mn, o_k, o_v, m_kk, m_kv, K: tl.constexpr, V: tl.constexpr):
    """M_s ``[BK, BK]`` and N_s's V slice ``[BK, BV]`` of the map at ``p_mn`` (a row of mn ``[.., K, K + V]``),
    zeros where the masks are false (a masked load reads nothing)."""
    b_m = tl.load(p_mn + o_k[:, None] * (K + V) + o_k[None, :], mask=m_kk, other=0)
    b_nv = tl.load(p_mn + o_k[:, None] * (K + V) + K + o_v[None, :], mask=m_kv, other=0)
    return b_m, b_nv


@triton.jit(do_not_specialize=["NSEG"])
def affine_scan_kernel(mn, h0, h_in, segment_first, skip, NSEG, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
                       IS_VARLEN: tl.constexpr, HAS_SKIP: tl.constexpr, SKIP_WRITES: tl.constexpr,
                       DOT_PREC: tl.constexpr, PREFETCH: tl.constexpr, REVERSE: tl.constexpr):
    # grid (cdiv(V, BV), N·HV): one program walks the segments of one (sequence, value head) for a BV slice of V.
    # Per segment it reads M_s [K, K] and N_s [K, BV] (fp32, mn [NS, HV, K, K + V]) and writes h_in [K, BV]; where
    # skip [NS, HV] is 2 (HAS_SKIP: a map the Hopper forward's phase A did not walk, [M_s | N_s] = 0) it reads
    # neither and writes h_in[s+1] = 0, or with SKIP_WRITES nothing (the reader starts that segment from zero itself).
    # BR == BK (the whole M_s in one tile): the new state stays in registers for the next step (no barrier, no
    # re-read), and with PREFETCH the next step's M and N are loaded before this step's product and store (the
    # compiler cannot move a load above a store to h_in itself: the two might alias), so the L2 latency of the
    # 64 KB map overlaps the product instead of heading each step.
    # REVERSE (the backward's phase B', seq_parallel_bwd.py): the same steps from the sequence's last segment back,
    # h_in[last] = h0 and h_in[s − 1] = M_s h_in[s] + N_s, with [M_sᵀ | D_s] in mn and dht in h0.
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    if IS_VARLEN:
        i_s0 = tl.load(segment_first + i_n)
        i_s1 = tl.load(segment_first + i_n + 1)
    else:
        i_s0 = i_n * NSEG
        i_s1 = i_s0 + NSEG
    o_k = tl.arange(0, BK)
    o_r = tl.arange(0, BR)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    o_kv = o_k[:, None] * V + o_v[None, :]
    if USE_INITIAL_STATE:
        b_h = tl.load(h0 + i_nh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    # step j maps segment i_s to the next one, i_s + STEP, for j < n_steps
    if REVERSE:
        i_s = i_s1 - 1
        STEP: tl.constexpr = -1
    else:
        i_s = i_s0
        STEP: tl.constexpr = 1
    n_steps = i_s1 - i_s0 - 1
    tl.store(h_in + (i_s * HV + i_hv).to(tl.int64) * K * V + o_kv, b_h, mask=m_kv)
    m_kk = (o_k[:, None] < K) & (o_k[None, :] < K)
    if PREFETCH:
        # the first step's map (nothing where no step follows, or where its map is skipped: a masked load reads
        # nothing)
        wanted = n_steps > 0
        if HAS_SKIP:
            wanted = wanted & (tl.load(skip + i_s * HV + i_hv, mask=wanted, other=2) != 2)
        b_m, b_nv = _map_tiles(mn + (i_s * HV + i_hv).to(tl.int64) * K * (K + V), o_k, o_v, m_kk & wanted,
                               m_kv & wanted, K, V)

    j = 0
    while j < n_steps:
        p_mn = mn + (i_s * HV + i_hv).to(tl.int64) * K * (K + V)
        p_h = h_in + ((i_s + STEP) * HV + i_hv).to(tl.int64) * K * V
        skipped = False
        if HAS_SKIP:
            skipped = tl.load(skip + i_s * HV + i_hv) == 2
        if PREFETCH:
            # this step's map came with the last step; the next one's loads go out before this step's product
            b_m_now, b_nv_now = b_m, b_nv
            wanted = j + 1 < n_steps
            if HAS_SKIP:
                wanted = wanted & (tl.load(skip + (i_s + STEP) * HV + i_hv, mask=wanted, other=2) != 2)
            b_m, b_nv = _map_tiles(p_mn + STEP * HV * K * (K + V), o_k, o_v, m_kk & wanted, m_kv & wanted, K, V)
        if skipped:
            b_h = tl.zeros([BK, BV], dtype=tl.float32)
            if not SKIP_WRITES:
                tl.store(p_h + o_kv, b_h, mask=m_kv)
        elif BR == BK:
            if not PREFETCH:
                b_m_now, b_nv_now = _map_tiles(p_mn, o_k, o_v, m_kk, m_kv, K, V)
            b_h = tl.dot(b_m_now, b_h, input_precision=DOT_PREC) + b_nv_now
            tl.store(p_h + o_kv, b_h, mask=m_kv)
        else:
            # h_in[s+1] = M_s h_in[s] + N_s, BR rows at a time (a whole [BK, BK] tile of M would not fit in registers
            # for K > 128); each row block reads M_s[rows, :] and N_s[rows, slice] and writes h_in[s+1][rows,
            # slice]. tf32x3 (≈ fp32 products on the tensor cores): "ieee" made ptxas spill 2.7 KB per thread
            # (sm_90, K = 128)
            for i_r in tl.static_range(0, BK, BR):
                m_r = (i_r + o_r) < K
                b_m_r = tl.load(p_mn + (i_r + o_r)[:, None] * (K + V) + o_k[None, :],
                                mask=m_r[:, None] & (o_k[None, :] < K), other=0)
                b_nv_r = tl.load(p_mn + (i_r + o_r)[:, None] * (K + V) + K + o_v[None, :],
                                 mask=m_r[:, None] & (o_v[None, :] < V), other=0)
                b_new = tl.dot(b_m_r, b_h, input_precision=DOT_PREC) + b_nv_r
                tl.store(p_h + (i_r + o_r)[:, None] * V + o_v[None, :], b_new,
                         mask=m_r[:, None] & (o_v[None, :] < V))
            # the next segment reads back the whole state this program just wrote: a CTA barrier makes it visible
            tl.debug_barrier()
            b_h = tl.load(p_h + o_kv, mask=m_kv, other=0)
        i_s += STEP
        j += 1


SCAN_PRECISIONS = ("tf32x3", "tf32")


def affine_scan(mn: torch.Tensor, initial_state: Optional[torch.Tensor], V: int, num_seqs: int,
                segment_first: Optional[torch.Tensor] = None, nseg: int = 1, BV: int = 32,
                skip: Optional[torch.Tensor] = None, skip_writes: bool = False, precision: str = "tf32x3",
                whole_map: bool = False, num_warps: int = 4, reverse: bool = False) -> torch.Tensor:
    """State entering every segment: h_in ``[NS, HV, K, V]`` fp32 from mn ``[NS, HV, K, K + V]`` (phase A) and
    initial_state ``[N, HV, K, V]`` or None, over ``num_seqs`` sequences whose segments are listed by
    segment_first ``[N + 1]`` (varlen) or are ``nseg`` consecutive ones each. ``skip`` ``[NS, HV]`` int32: where 2,
    the segment's map is zero and not read (the Hopper forward's warmed heads, ``hopper/forward.py``), and the
    next segment's h_in is zero, or with ``skip_writes`` left unwritten (its reader, the Hopper forward's lean warm
    walk, starts such a segment from zero itself: ``forward.LEAN_SEGMENTS``). ``precision``: the products' (tf32x3,
    ≈ fp32; or tf32, one product, where the maps themselves carry bf16 operands' rounding, as the Hopper forward's
    do). ``whole_map`` (K ≤ 128): each step's M_s as one tile, the state kept in registers between steps and the
    next step's map loaded during this step's product (``num_warps`` then 8 keeps two maps in registers).
    ``reverse``: the scan from each sequence's last segment back (h_in[last] = initial_state, h_in[s − 1] =
    M_s h_in[s] + N_s): the backward's gradients of the states leaving the segments (``seq_parallel_bwd.py``)."""
    NS, HV, K = mn.shape[:3]
    if skip is not None and (skip.shape != (NS, HV) or skip.dtype != torch.int32):
        raise ValueError(f"skip must be int32 [NS, HV] = {[NS, HV]}, got {skip.dtype} {list(skip.shape)}")
    grid, constexprs = _scan_launch(HV, K, V, num_seqs, BV, initial_state is not None, segment_first is not None,
                                    skip is not None, skip_writes, precision, whole_map, num_warps, reverse)
    h_in = torch.empty(NS, HV, K, V, dtype=torch.float32, device=mn.device)
    launch(affine_scan_kernel, grid, mn, initial_state, h_in, segment_first, skip, nseg, **constexprs)
    return h_in


def _scan_launch(HV: int, K: int, V: int, num_seqs: int, BV: int, has_state: bool, varlen: bool, has_skip: bool,
                 skip_writes: bool, precision: str, whole_map: bool, num_warps: int, reverse: bool = False
                 ) -> tuple[tuple, dict]:
    """affine_scan_kernel's grid and constexprs (num_warps among them); the options checked."""
    if precision not in SCAN_PRECISIONS:
        raise ValueError(f"precision must be one of {SCAN_PRECISIONS}, got {precision!r}")
    BK = block_size(K, 256)
    if whole_map and BK > 128:
        raise ValueError(f"whole_map holds M_s [K, K] in registers: K ≤ 128, got K = {K}")
    return (cdiv(V, BV), num_seqs * HV), dict(
        HV=HV, K=K, V=V, BK=BK, BV=BV, BR=BK if whole_map else min(BK, 32), USE_INITIAL_STATE=has_state,
        IS_VARLEN=varlen, HAS_SKIP=has_skip, SKIP_WRITES=has_skip and skip_writes, DOT_PREC=precision,
        PREFETCH=whole_map, REVERSE=reverse, num_warps=num_warps)


def affine_scan_launcher(NS: int, HV: int, K: int, V: int, num_seqs: int, nseg: int, BV: int, has_state: bool,
                         skip_writes: bool = False, precision: str = "tf32x3", whole_map: bool = False,
                         num_warps: int = 4) -> Callable:
    """:func:`affine_scan` for a prepared call (``hopper/prepared.py``: equal segments, a skip flag always): its
    checks and launch configuration once; then ``scan(mn, initial_state, skip)`` → h_in ``[NS, HV, K, V]`` fp32, on
    contiguous tensors of the shapes given (``initial_state`` None exactly when not ``has_state``), launched
    through ``common.launch.BoundLaunch`` (the same kernel and arguments, none of the per-call checks)."""
    grid, constexprs = _scan_launch(HV, K, V, num_seqs, BV, has_state, False, True, skip_writes, precision,
                                    whole_map, num_warps)
    warps = constexprs.pop("num_warps")
    run = BoundLaunch(affine_scan_kernel, grid, warps, foreign=(1,), **constexprs)     # the caller's initial state

    def scan(mn: torch.Tensor, initial_state: Optional[torch.Tensor], skip: torch.Tensor) -> torch.Tensor:
        h_in = torch.empty(NS, HV, K, V, dtype=torch.float32, device=mn.device)
        run(mn, initial_state, h_in, None, skip, nseg)
        return h_in
    return scan


# ----------------------------------------------------------------------------------------------------------------
# phases A → B → C
# ----------------------------------------------------------------------------------------------------------------
def fused_fwd_seq_parallel(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gc: torch.Tensor,
                           scale: float, initial_state: Optional[torch.Tensor], out_dtype: torch.dtype,
                           cu_seqlens: Optional[torch.Tensor] = None, offsets: Optional[list[int]] = None,
                           segment_chunks: Optional[int] = None, BV: Optional[int] = None,
                           num_warps: Optional[int] = None, dot_prec: Optional[str] = None,
                           state_prec: Optional[str] = None, chunk_size: int = CHUNK,
                           p: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_fwd` with long sequences split into segments when the unsplit walk cannot fill the SMs.

    Args: as :func:`fused_fwd` (q, k ``[B, T, H, K]``; w ``[B, T, HV, K]``, u ``[B, T, HV, V]``, gc
        ``[B, T, HV]`` fp32; initial_state ``[N, HV, K, V]`` or None), plus
        offsets: host list of cu_seqlens (read from the device if None and cu_seqlens is given);
        segment_chunks: force segments of this many chunks (≥ 1; tests and benchmarks); None: :func:`plan_segments`.
        dot_prec, state_prec: precision overrides of the walk's dots, as :func:`fused_fwd` (benchmarks); phases A
            and C both use them.
        p: P of every chunk from ``fused_prepass`` with q, or None (:func:`fused_fwd`'s ``p``): phase C reads it;
            phase A has no output and never needs it.
    Returns:
        o ``[B, T, HV, V]`` in ``out_dtype``, final state ``[N, HV, K, V]`` fp32.
    """
    B, T, H, K = q.shape
    HV, V = u.shape[2], u.shape[3]
    if cu_seqlens is not None and offsets is None:
        offsets = cu_seqlens.tolist()
    chunks = ([-(-(e - b) // chunk_size) for b, e in zip(offsets[:-1], offsets[1:])] if cu_seqlens is not None
              else [cdiv(T, chunk_size)] * B)
    N = len(chunks)
    _, BV_default, warps_default = fused_fwd_config(K, V, N * HV, num_sms(q.device))
    BV, num_warps = BV or BV_default, num_warps or warps_default
    if segment_chunks is not None and segment_chunks < 1:
        raise ValueError(f"segment_chunks must be >= 1, got {segment_chunks}")
    L = segment_chunks or plan_segments(chunks, HV, K, V, BV, num_sms(q.device))
    if L is None or L >= max(chunks, default=0):
        return fused_fwd(q, k, w, u, gc, scale, initial_state, out_dtype, cu_seqlens, BV=BV, num_warps=num_warps,
                         dot_prec=dot_prec, state_prec=state_prec, chunk_size=chunk_size, p=p)

    if cu_seqlens is not None:
        segments, segment_first = segment_tables(offsets, L, chunk_size, q.device)
        NS, nseg = segments.shape[0], 1
    else:
        # equal segments: nseg of them per sequence, the last one possibly shorter
        nseg = -(-chunks[0] // L)
        L = -(-chunks[0] // nseg)
        segments = segment_first = None
        NS = N * nseg
    walk = dict(cu_seqlens=cu_seqlens, num_warps=num_warps, dot_prec=dot_prec, state_prec=state_prec,
                chunk_size=chunk_size, num_segments=NS, segments=segments, nseg=nseg, seg_len=L, segmented=True)
    mn = torch.empty(NS, HV, K, K + V, dtype=torch.float32, device=q.device)
    launch_walk(q, k, w, u, gc, None, None, mn, scale, BV=BV, affine=True, **walk)
    h_in = affine_scan(mn, initial_state, V, N, segment_first, nseg, BV=BV)
    o = torch.empty(B, T, HV, V, dtype=out_dtype, device=q.device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    launch_walk(q, k, w, u, gc, o, h_in, ht, scale, BV=BV, p=p, **walk)
    return o, ht


# ----------------------------------------------------------------------------------------------------------------
# twins (chunked layout [B, HV, NT, C, d] of torch_chunk.py; one segment or one sequence)
# ----------------------------------------------------------------------------------------------------------------
def affine_maps_ref(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, gc: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(M ``[B, HV, K, K]``, N ``[B, HV, K, V]``) of the chunks given: S_out = M S_in + N over them (no chunk:
    the identity map)."""
    B, HV, NT, _, K = w.shape
    eye = torch.eye(K, dtype=w.dtype, device=w.device).expand(B, HV, K, K)
    if NT == 0:
        return eye, w.new_zeros(B, HV, K, u.shape[-1])
    M = tc.state_pass_fwd_ref(w, torch.zeros_like(w), k, gc, eye)[2]
    N = tc.state_pass_fwd_ref(w, u, k, gc, w.new_zeros(B, HV, K, u.shape[-1]))[2]
    return M, N


def affine_scan_ref(M: torch.Tensor, N: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """States entering each segment ``[S, ..., K, V]`` and the state leaving the last, from M ``[S, ..., K, K]``,
    N ``[S, ..., K, V]`` and h0 ``[..., K, V]``."""
    h, hs = h0, []
    for s in range(M.shape[0]):
        hs.append(h)
        h = M[s] @ h + N[s]
    return torch.stack(hs), h


def segmented_fwd_ref(q, k, w, u, gc, scale: float, h0: torch.Tensor, L: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Phases A → B → C on one batch of equal sequences in the chunked layout, segments of L chunks: o
    ``[B, HV, NT, C, V]`` and the final state. Equal to ``state_pass_fwd_ref`` → ``output_fwd_ref`` in exact
    arithmetic."""
    NT = w.shape[2]
    cuts = [(c, min(c + L, NT)) for c in range(0, NT, L)]
    maps = [affine_maps_ref(w[:, :, a:b], u[:, :, a:b], k[:, :, a:b], gc[:, :, a:b]) for a, b in cuts]
    h_in, _ = affine_scan_ref(torch.stack([m for m, _ in maps]), torch.stack([n for _, n in maps]), h0)
    outs, ht = [], h0
    for (a, b), h in zip(cuts, h_in):
        hc, v_new, ht = tc.state_pass_fwd_ref(w[:, :, a:b], u[:, :, a:b], k[:, :, a:b], gc[:, :, a:b], h)
        outs.append(tc.output_fwd_ref(q[:, :, a:b], k[:, :, a:b], v_new, hc, gc[:, :, a:b], scale))
    return torch.cat(outs, 2), ht
