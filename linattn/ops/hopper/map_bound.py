"""The state maps' norm bound, per chunk, and the segmented Hopper forward's two plans made from it (``forward.py``:
the negligible maps phase A skips, and the warm-ups), in one Triton launch (two where the pre-pass is not the
TileLang one, which writes the chunk sums itself) instead of ≈ 30 small PyTorch ops.

A token's transition S ← γ_t (I − β_t k_t k_tᵀ) S has 2-norm γ_t · max(1, |1 − β_t ‖k_t‖²|), so the map over a run
of tokens has a norm below 2 to the sum of

    b_t = g_t log2 e + log2 max(1, |1 − β_t ‖k_t‖²|)                  (g_t = log γ_t)

over the run. :func:`chunk_bounds` sums b_t per 64-token chunk ([B·S, HV, LC], fp32 accumulated: each sequence's
chunks cut into the forward's S segments of LC); :func:`segment_plan` turns those sums into, per segment s and value
head, (1) whether the segment's own map is negligible (its sum below ``threshold``), (2) the warm-up: the fewest
w ≤ ``w_max`` chunks before s ≥ 1 whose sum is below ``threshold``, (3) whether the head has a segment with no such
w (it then walks its maps, and its warm-ups are 0), and (4) phase A's flag made from them. With ``map_slots``
the plan also weighs, per sequence, phase C's longest walk against phase A's waves: the wave-fill rule, which sends
the heads of the longest warm-ups to their maps where that is cheaper. The twins are :func:`chunk_bounds_ref` and
:func:`segment_plan_ref` (PyTorch, float64 sums).

Time: the plan runs one program per sequence (the rule needs every head's warm-ups), and its cost is that
program's chain of loads. The program holds every segment side by side ([S, heads, BLOCK] tiles), so the chain is
one segment's LC / BLOCK steps whatever S.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from ..common.launch import BoundLaunch, launch
from ..utils import cdiv

BT = 64
LOG2E = math.log2(math.e)
# The plan's chunks per step of its chunk loop, at most a warp's width: its tiles [segments, heads, BLOCK] then keep
# each row in one warp, so the step's suffix scan, maximum and sum need no barrier. Not derived from the segment's
# length: a new T must compile nothing
BLOCK = 32
# The elements of the plan's tile (segments × heads × chunks, powers of two): 8 per thread of its sixteen warps. BLOCK
# shrinks to fit where segments × heads is larger than TILE / 32
TILE = 4096
# The plan's warps. Its tiles put a row's chunks across lanes (the loads' mask varies per chunk, so Triton does not
# vectorise them), so each step of the loop is ≈ 19 shuffles per element, the same issue count per scheduler at any
# warp count; more warps hide the shuffles' latency
PLAN_WARPS = 16


@triton.jit(do_not_specialize=["T", "NC", "LC"])      # lengths: a new T compiles nothing
def chunk_bounds_kernel(k, g, beta, bound, T, NC, LC, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                        BK: tl.constexpr, BT: tl.constexpr, LOG2E: tl.constexpr):
    # grid (NC, B·HV): one chunk of one value head. Reads its 64 rows of k (the head's qk head), g and β; writes the
    # sum of b_t over them (rows past T add nothing: g = β = 0 there) to bound [B·S, HV, LC], the chunk's segment
    # (of LC chunks) as its sequence
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    rows = i_b.to(tl.int64) * T + o_t
    o_k = tl.arange(0, BK)
    b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < K),
                  other=0).to(tl.float32)
    norm2 = tl.sum(b_k * b_k, 1)
    b_g = tl.load(g + rows * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    b_beta = tl.load(beta + rows * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    b_t = b_g * LOG2E + tl.log2(tl.maximum(tl.abs(1 - b_beta * norm2), 1.0))
    S = NC // LC
    tl.store(bound + ((i_b.to(tl.int64) * S + i_c // LC) * HV + i_hv) * LC + i_c % LC, tl.sum(b_t, 0))


def chunk_bounds(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """``[B·S, HV, LC]`` fp32: Σ b_t over each 64-token chunk from keys ``[B, T, H, K]``, log decays g and β
    ``[B, T, HV]``, each sequence's NC = ⌈T/64⌉ chunks cut into ``segments`` = S segments of LC = NC/S (the
    segmented forward's sequences; T a multiple of 64·S when S > 1). One launch; reads k once. The TileLang
    pre-pass writes the same sums (``prepass.prepass_hopper``), from the K Kᵀ it forms anyway."""
    B, T, H, K = k.shape
    HV = g.shape[2]
    NC = cdiv(T, BT)
    if segments < 1 or (segments > 1 and T % (BT * segments)):
        raise ValueError(f"{segments} segments need T a multiple of {BT * segments}, got T={T}")
    bound = torch.empty(B * segments, HV, NC // segments, dtype=torch.float32, device=k.device)
    chunk_bounds_kernel[(NC, B * HV)](k.contiguous(), g.contiguous(), beta.contiguous(), bound, T, NC,
                                      NC // segments, H=H, HV=HV, K=K, BK=triton.next_power_of_2(K), BT=BT,
                                      LOG2E=LOG2E, num_warps=4)
    return bound


def chunk_bounds_ref(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """The twin of :func:`chunk_bounds`, in float64."""
    B, T, H, _ = k.shape
    HV = g.shape[2]
    norm2 = k.double().square().sum(-1).repeat_interleave(HV // H, dim=2)
    b_t = g.double() * LOG2E + torch.log2(torch.clamp((1 - beta.double() * norm2).abs(), min=1.0))
    NC = cdiv(T, BT)
    b_t = torch.nn.functional.pad(b_t, (0, 0, 0, NC * BT - T))
    sums = b_t.view(B, NC, BT, HV).sum(2).transpose(1, 2)                     # [B, HV, NC]
    return sums.reshape(B, HV, segments, NC // segments).transpose(1, 2).reshape(B * segments, HV, -1)


# The wave-fill rule's costs (segment_plan's map_slots), in hundredths of one phase C chunk (the walk at BV=128):
# phase A walks a chunk in 0.66 of one, and the scan takes 2.3 per segment it steps over (profiled on an H200).
# Integers, so that the kernel and its twin take the same decision
MAP_CHUNK_COST = 66
SCAN_STEP_COST = 230
WALK_CHUNK_COST = 100


@triton.jit(do_not_specialize=["S", "LC", "W_MAX", "MAP_SLOTS"])
def segment_plan_kernel(bound, negligible, warm, walk, skip_m, S, LC, W_MAX, THRESHOLD, MAP_SLOTS, HV: tl.constexpr,
                        SB: tl.constexpr, HB: tl.constexpr, BLOCK: tl.constexpr, SKIP_MAPS: tl.constexpr,
                        WARM_UP: tl.constexpr, MAP_CHUNK_COST: tl.constexpr, SCAN_STEP_COST: tl.constexpr,
                        WALK_CHUNK_COST: tl.constexpr):
    # grid (B,): one sequence, its S segments (SB lanes) and HV value heads (HB lanes) side by side, so the run-time
    # chain is one pass over a segment's LC chunks, LC/BLOCK loads long, whatever S. Reads the S·HV·LC chunk sums
    # (bound [B·S, HV, LC]: segment s's are one row); writes, per segment s and head, negligible / warm / walk /
    # skip_m [B·S, HV]: the segment's sum below THRESHOLD; the fewest w ≤ W_MAX chunks before it whose running sum
    # (from the chunk just before it backwards) falls below THRESHOLD (0 for s = 0); for every segment, whether the
    # head walks its maps (some s ≥ 1 has no such w, or the wave-fill rule below chose it; then its warm-ups are 0);
    # and phase A's flag (0 walk the map, 1 skip its M: SKIP_MAPS and negligible, 2 skip it all: WARM_UP and the head
    # does not walk)
    i_b = tl.program_id(0)
    o_s = tl.arange(0, SB)
    o_h = tl.arange(0, HB)
    m_h = o_h < HV
    m_sh = (o_s < S)[:, None] & m_h[None, :]                                 # [SB, HB]
    o = tl.arange(0, BLOCK)
    NONE = 1 << 30
    out = (i_b * S + o_s[:, None]) * HV + o_h[None, :]                        # [SB, HB]: the flags' rows
    row = bound + out.to(tl.int64)[:, :, None] * LC
    # one pass over every segment's chunks at once, last block first: each segment's sum, and the next segment's
    # warm-up, the fewest w ≤ W_MAX of its last chunks whose sum (the suffix sum from chunk LC − w on, added nearest
    # first) falls below THRESHOLD. A while loop: the bounds are run-time values (Triton's interpreter cannot range
    # over them)
    carry = tl.zeros([SB, HB], dtype=tl.float32)
    start = tl.full([SB, HB], -1, dtype=tl.int32)      # the latest chunk where such a suffix starts
    c0 = (LC - 1) // BLOCK * BLOCK
    while c0 >= 0:
        c = c0 + o
        vals = tl.load(row + c[None, None, :], mask=m_sh[:, :, None] & (c < LC)[None, None, :], other=0)
        suffix = carry[:, :, None] + tl.cumsum(vals, 2, reverse=True)
        hit = (suffix < THRESHOLD) & ((c >= LC - W_MAX) & (c < LC))[None, None, :]
        start = tl.maximum(start, tl.max(tl.where(hit, c[None, None, :], -1), 2))
        carry += tl.sum(vals, 2)
        c0 -= BLOCK
    is_negligible = (carry < THRESHOLD).to(tl.int32)
    nxt = tl.where(start >= 0, LC - start, NONE)       # segment s + 1's warm-up, found in segment s's chunks
    before_last = (o_s < S - 1)[:, None] & m_h[None, :]
    missing = tl.max(tl.where(before_last, (nxt == NONE).to(tl.int32), 0), 0)          # [HB]
    longest = tl.max(tl.where(before_last & (nxt != NONE), nxt, 0), 0)   # each head's longest warm-up found
    # phase A's walking programs, were the head to walk its maps: its N tiles, and its M tiles unless skipped
    programs = tl.sum(tl.where(m_sh, 2 - is_negligible * SKIP_MAPS, 0), 0)
    walks = (missing != 0) & m_h
    if MAP_SLOTS > 0:
        # the wave-fill rule: phase C lasts as long as its longest walk (a segment and the longest warm-up of a head
        # that warms up), phase A as many waves of MAP_SLOTS programs as the walking heads' maps need, and the scan
        # steps over the segments once any head walks. Candidate j maps the walking heads and every head whose
        # longest warm-up is above head j's; the cheapest wins (ties: the fewest maps), or mapping every head
        above = (walks[None, :] | (longest[None, :] > longest[:, None])) & m_h[None, :]          # [j, i]
        # (the waves in int32, the costs in int64: a 64-bit division is a subroutine call per element)
        mapped = tl.sum(tl.where(above, programs[None, :], 0), 1)
        chain = (S - 1).to(tl.int64) * SCAN_STEP_COST
        phase_a = ((mapped + MAP_SLOTS - 1) // MAP_SLOTS).to(tl.int64) * LC * MAP_CHUNK_COST + chain
        cost = tl.where(mapped > 0, phase_a, 0) + (LC + longest).to(tl.int64) * WALK_CHUNK_COST
        cost = tl.where(m_h & ~walks, cost, 1 << 62)
        every = tl.sum(tl.where(m_h, programs, 0), 0)
        cost_every = (((every + MAP_SLOTS - 1) // MAP_SLOTS).to(tl.int64) * LC * MAP_CHUNK_COST + chain
                      + LC * WALK_CHUNK_COST)
        best = tl.min(cost, 0)
        cut = tl.max(tl.where(cost == best, longest, -1), 0)       # map the heads whose warm-ups are above it
        cut = tl.where(cost_every < best, -1, cut)
        walks = walks | (m_h & (longest > cut))
    # every flag from registers, stored once: segment s's warm-up sits at segment s − 1's lane (shifted by a row of HV)
    walks_sh = walks[None, :] & m_sh
    tl.store(negligible + out, is_negligible.to(tl.int8), mask=m_sh)
    tl.store(walk + out, walks_sh.to(tl.int8), mask=m_sh)
    tl.store(warm + out, tl.zeros([SB, HB], dtype=tl.int32), mask=m_sh & (o_s == 0)[:, None])
    tl.store(warm + out + HV, tl.where(walks[None, :], 0, nxt), mask=before_last)
    phase_a_flag = is_negligible * SKIP_MAPS
    if WARM_UP:
        phase_a_flag = tl.where(walks_sh, phase_a_flag, 2)
    tl.store(skip_m + out, phase_a_flag, mask=m_sh)


class SegmentPlan(NamedTuple):
    """:func:`segment_plan`'s flags, each ``[B·S, HV]``: whether the segment's own map is negligible, its warm-up
    in chunks, whether its head walks its maps, and phase A's flag for it (``chunk_fwd``'s skip_m: 0, 1 or 2)."""
    negligible: torch.Tensor
    warm: torch.Tensor
    walk: torch.Tensor
    skip_m: torch.Tensor


def segment_plan(bound: torch.Tensor, segments: int, w_max: int, threshold: float, skip_maps: bool = False,
                 warm_up: bool = False, map_slots: int = 0) -> SegmentPlan:
    """The flags of :class:`SegmentPlan` (bool, int32, bool, int32) from chunk sums ``[B·S, HV, LC]``
    (:func:`chunk_bounds`) of ``segments`` = S segments: see the module's docstring. phase A's skip_m is 1 for
    the negligible maps with ``skip_maps``, 2 for every map of a head that warms up with ``warm_up``, else 0.
    ``w_max`` ≤ LC. ``map_slots`` > 0 (phase A's programs per wave for each sequence): the wave-fill rule also
    sends the heads of the longest warm-ups to their maps where the costs (:data:`MAP_CHUNK_COST`,
    :data:`SCAN_STEP_COST`, :data:`WALK_CHUNK_COST`) say the shorter phase C pays for phase A's waves and the
    scan: typically where some head walks its maps anyway and phase A's wave has room. One launch; no host sync."""
    BS, HV, LC = bound.shape
    grid, scalars, constexprs = _plan_launch(BS, HV, LC, segments, w_max, threshold, skip_maps, warm_up, map_slots)
    negligible, warm, walk, skip_m = plan_outputs(BS, HV, bound.device)
    launch(segment_plan_kernel, grid, bound.contiguous(), negligible, warm, walk, skip_m, *scalars, **constexprs)
    # int8 → bool is a view (same size), not a kernel
    return SegmentPlan(negligible.view(torch.bool), warm, walk.view(torch.bool), skip_m)


# segment_plan_kernel's four flag tensors, each [BS, HV]: negligible, warm, walk, skip_m
PLAN_FLAG_DTYPES = (torch.int8, torch.int32, torch.int8, torch.int32)


def plan_outputs(BS: int, HV: int, device) -> tuple:
    """segment_plan_kernel's four flag tensors ``[BS, HV]`` (:data:`PLAN_FLAG_DTYPES`)."""
    return tuple(torch.empty(BS, HV, dtype=dtype, device=device) for dtype in PLAN_FLAG_DTYPES)


def _plan_launch(BS: int, HV: int, LC: int, S: int, w_max: int, threshold: float, skip_maps: bool, warm_up: bool,
                 map_slots: int) -> tuple[tuple, tuple, dict]:
    """segment_plan_kernel's grid, its arguments after the five tensors and its constexprs (num_warps among them),
    for chunk sums [BS, HV, LC] of S segments; the arguments checked."""
    if S < 1 or BS % S or not 1 <= w_max <= LC:
        raise ValueError(f"{S} segments of {LC} chunks ({BS} rows) with warm-ups of at most {w_max}: need S | B·S "
                         f"and 1 ≤ w_max ≤ LC")
    if map_slots < 0:
        raise ValueError(f"map_slots must be >= 0 (0: no wave-fill rule), got {map_slots}")
    HB, SB = triton.next_power_of_2(HV), triton.next_power_of_2(S)
    constexprs = dict(HV=HV, SB=SB, HB=HB, BLOCK=max(1, min(BLOCK, TILE // (SB * HB))), SKIP_MAPS=int(skip_maps),
                      WARM_UP=bool(warm_up), MAP_CHUNK_COST=MAP_CHUNK_COST, SCAN_STEP_COST=SCAN_STEP_COST,
                      WALK_CHUNK_COST=WALK_CHUNK_COST, num_warps=PLAN_WARPS)
    return (BS // S,), (S, LC, w_max, float(threshold), map_slots), constexprs


def segment_plan_launcher(BS: int, HV: int, LC: int, segments: int, w_max: int, threshold: float,
                          skip_maps: bool = False, warm_up: bool = False, map_slots: int = 0
                          ) -> Callable[[torch.Tensor, tuple], SegmentPlan]:
    """:func:`segment_plan` for a prepared call (``hopper/prepared.py``): its checks and launch configuration once;
    then ``plan(bound, out)`` on contiguous chunk sums ``[BS, HV, LC]`` fp32 into ``out``, the four flag tensors
    (``[BS, HV]``, :data:`PLAN_FLAG_DTYPES`: negligible, warm, walk, skip_m) held by the caller, launches through
    ``common.launch.BoundLaunch`` (the same kernel and arguments, none of the per-call checks)."""
    grid, scalars, constexprs = _plan_launch(BS, HV, LC, segments, w_max, threshold, skip_maps, warm_up, map_slots)
    num_warps = constexprs.pop("num_warps")
    run = BoundLaunch(segment_plan_kernel, grid, num_warps, **constexprs)

    def plan(bound: torch.Tensor, out: tuple) -> SegmentPlan:
        negligible, warm, walk, skip_m = out
        run(bound, negligible, warm, walk, skip_m, *scalars)
        return SegmentPlan(negligible.view(torch.bool), warm, walk.view(torch.bool), skip_m)
    return plan


def warm_from_bound_ref(bound: torch.Tensor, segments: int, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The warm-ups the planned warm walk finds for itself (``chunk_fwd``'s ``warm_planned``), from chunk sums
    ``[B·S, HV, LC]`` of ``segments`` = S segments: for segment s ≥ 1 the fewest w ≥ 1 chunks before it whose sums,
    added in fp32 nearest first (the kernel's order), fall below ``threshold``, else s·LC (the whole prefix); 0 for
    s = 0. Unlike :func:`segment_plan`'s, no cap and no maps: a warm-up that finds no such w starts at the
    sequence's start, from its initial state, which is exact. Returns w ``[B·S, HV]`` int32 and whether the walk
    starts at the sequence's start (w = s·LC) ``[B·S, HV]`` bool."""
    BS, HV, LC = bound.shape
    S, B = segments, bound.shape[0] // segments
    b = bound.float().view(B, S, HV, LC).permute(0, 2, 1, 3).reshape(B, HV, S * LC)     # [B, HV, NC]
    warm = torch.zeros(B, HV, S, dtype=torch.int32, device=bound.device)
    for s in range(1, S):
        run = torch.zeros(B, HV, dtype=torch.float32, device=bound.device)
        found = torch.zeros(B, HV, dtype=torch.bool, device=bound.device)
        w = torch.full((B, HV), s * LC, dtype=torch.int32, device=bound.device)
        for j in range(1, s * LC + 1):                      # chunk s·LC − j, nearest first
            run = run + b[:, :, s * LC - j]
            hit = ~found & (run < threshold)
            w = w.masked_fill(hit, j)
            found |= hit
        warm[:, :, s] = w
    warm = warm.permute(0, 2, 1).reshape(BS, HV)
    starts = (torch.arange(BS, device=bound.device) % S * LC)[:, None]
    return warm, warm == starts


def segment_plan_ref(bound: torch.Tensor, segments: int, w_max: int, threshold: float, skip_maps: bool = False,
                     warm_up: bool = False, map_slots: int = 0) -> SegmentPlan:
    """The twin of :func:`segment_plan` (float64 sums)."""
    BS, HV, LC = bound.shape
    S = segments
    B = BS // S
    b = bound.double().view(B, S, HV, LC).permute(0, 1, 3, 2).reshape(B, S * LC, HV)   # [B, NC, HV]
    negligible = b.view(B, S, LC, HV).sum(2) < threshold                    # [B, S, HV]
    cs = torch.cat([b.new_zeros(B, 1, HV), b.cumsum(1)], 1)                 # over chunks [c, p): cs[p] − cs[c]
    starts = torch.arange(1, S, device=b.device) * LC
    w = torch.arange(1, w_max + 1, device=b.device)
    ok = (cs[:, starts, None, :] - cs[:, starts[:, None] - w[None, :], :]) < threshold   # [B, S − 1, w_max, HV]
    found = ok.any(2)
    walk = ~found.all(1)                                                    # [B, HV]
    first = torch.where(found, ok.int().argmax(2) + 1, 0)                   # [B, S − 1, HV]
    if map_slots:
        walk = walk | _wave_fill_ref(walk, first.amax(1), (2 - negligible.long() * int(skip_maps)).sum(1), S, LC,
                                     map_slots)
    warm = torch.where(~walk[:, None], first, 0)
    warm = torch.cat([warm.new_zeros(B, 1, HV), warm], 1)
    walk = walk[:, None].expand(B, S, HV)
    skip_m = torch.where(~walk & warm_up, 2, negligible.int() * int(skip_maps))
    return SegmentPlan(negligible.reshape(BS, HV), warm.reshape(BS, HV).to(torch.int32), walk.reshape(BS, HV),
                       skip_m.reshape(BS, HV).to(torch.int32))


def _wave_fill_ref(walk: torch.Tensor, longest: torch.Tensor, programs: torch.Tensor, S: int, LC: int,
                   map_slots: int) -> torch.Tensor:
    """The heads ``[B, HV]`` the wave-fill rule adds to the walking ones (``segment_plan_kernel``'s costs), from
    whether each walks, its longest warm-up and phase A's programs were it to walk its maps."""
    B, HV = walk.shape
    added = torch.zeros_like(walk)

    def cost(n: int, maps: torch.Tensor, rest: int) -> int:
        """Sequence n's cost with the heads ``maps`` walking and ``rest`` the longest warm-up left."""
        count = int(programs[n][maps].sum())
        phase_a = -(-count // map_slots) * LC * MAP_CHUNK_COST + (S - 1) * SCAN_STEP_COST if count else 0
        return phase_a + (LC + rest) * WALK_CHUNK_COST

    for n in range(B):
        options = [(cost(n, walk[n] | (longest[n] > longest[n, j]), int(longest[n, j])), -int(longest[n, j]))
                   for j in range(HV) if not walk[n, j]]
        if not options:
            continue
        best, cut = min(options)
        if cost(n, torch.ones_like(walk[n]), 0) < best:
            cut = 1                                  # −cut = −1: every head
        added[n] = ~walk[n] & (longest[n] > -cut)
    return added
