"""The Hopper forward end to end: a pre-pass (gc, β head-major and each chunk's A_inv), then the fused chunk kernel
(``chunk_fwd.py``), unsegmented or cut into segments (sequence parallelism). :func:`plan` decides for
``triton_chunk``'s "auto" path on sm_90 and for ``FORWARD_PATH = "hopper"``, which forces it wherever the inputs
suit it.

The pre-pass (:data:`PREPASS`) is ``prepass.py``'s TileLang kernel with a blocked solve (0.131 ms at B=8 T=4096
H=16 in run 22) or the split forward's (``fused_prepass(write_wy=False)``: 0.268 ms there, plus two small
head-major copies). A first TileLang pre-pass (gc, K Kᵀ on wgmma, A_inv by an fp32 forward substitution of whole
64-row columns, gc and β written head-major) measured 0.76 ms there (run 20) and was removed.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch

from ..common import num_sms
from ..common.fused_prepass import fused_prepass
from ..common.seq_parallel import affine_scan
from . import prepass as prepass_module
from .chunk_fwd import BT, head_major
from .map_bound import SegmentPlan, chunk_bounds, segment_plan
from .prepass import prepass_hopper
from .walk_launch import chunk_fwd_hopper_hm

# The pre-pass: "tilelang" (``prepass.py``: gc, β per segment head-major and A_inv bf16 from one kernel whose solve
# has no cross-lane reductions) or "triton" (``fused_prepass(write_wy=False)`` and two head-major copies). Run 22
# (H200, B=8 T=4096 H=16): 0.131 against 0.268 ms alone; the forward on it 0.530 against 0.665, errors against
# float64 equal (o 3.37e-3, state 2.40e-3). An fp32 A_inv (the tf32 A_inv X) always takes the Triton one
PREPASS = "tilelang"
PREPASSES = ("triton", "tilelang")

# The fused kernel's launch when the caller names none (the public op's "hopper" path): run 20 (H200, B=8 T=4096
# H=16, the kernel alone, ms) measured one warpgroup at BV=64 0.70 (tf32 A_inv X) / 0.66 (bf16 A_inv, async first
# dots), two warpgroups 0.60 / 0.55, and two warpgroups at BV=128 with bf16 A_inv 0.385: the fastest, taken here.
# Run 22: X stored as its tile and the per-row factors in registers 0.314, o stored by TMA (tma_o) 0.263; the
# role-split kernel (roles=True) 0.373, so not taken. BV=64 where 128 does not divide V (fitted_launch)
# Run 24: the element-wise steps' stores by stmatrix and the scale folded into P and Γ (stsm; 1240 → 1063 SASS
# instructions per chunk and consumer thread): 0.256 → 0.218 ms alone at B=8 T=4096 H=16, 2.09 → 1.64 at B=1
# T=32768 unsegmented; o's error 3.37e-3 → 3.36e-3, every case of gpu_check_core within 1.51× the baseline
LAUNCH = dict(BV=128, threads=256, num_stages=2, async_dots=True, tma_o=True, stsm=True)
A_INV_DTYPE = torch.bfloat16
# The unsegmented kernel only where its (sequence, value head, V tile) programs fill the card: one program walks
# all the chunks of its sequence, so with fewer programs than SMs the card idles (then the segmented forward, plan).
# Run 20: B=8 T=4096 H=16 (128 programs at BV=128 on 132 SMs) 0.653 ms with the pre-pass against the split's 1.005;
# B=1 (16 programs) 0.451 (BV=64, 32 programs: 0.330) against 0.261, and B=1 T=32768 2.42 against 1.68. BV=128
# where its programs fill FILL_FRACTION of the SMs, else BV=64 where those do, else None. Run 23 (B=2 T=16384 H=32,
# BV=64's 128 programs) 1.025 ms, against 0.852 for two segments at BV=128 with warm-ups at the anchors' gates; not
# taken: where heads decay slowly the segments walk their maps (about twice the state work, not measured there),
# and the plan cannot see the gates without a host sync
FILL_FRACTION = 0.9
# Two walking programs per SM (``TWO_PER_SM_LAUNCH``), where they fill two per SM: the walk is latency-bound (issue
# slots ≈ 34% busy at one program per SM, run 24), so a second program's chain could fill the first's waits. What
# fits two: BV = 64 (the state's accumulator halves) and one load stage (105 KB of shared memory per program against
# 153 with two). The costs: Q Kᵀ once per V tile (twice per head: ≈ +10% of the tensor work) and no load pipelining
# within a program. Rows 2 and 5 of issue 4 (256 programs at BV=64) would take it; row 6's 128 programs fill only
# one per SM. Built in session 21 with two consumer warpgroups per program, which never finished on the H200 (run
# 28: the GPU test and the A/B ran out of 300 s and 166 s). Session 22 found why: the consumers asked setmaxnreg for
# 112 registers per thread, the program's pool held 80 per thread at launch (ptxas under __launch_bounds__(384, 2)),
# so 8,192 asked against 7,168 freed by the producer, and setmaxnreg.inc waits for its own program's pool forever
# (chunk_fwd.consumer_registers). Two warpgroups fit only 104 per thread (128 bytes of spills); one consumer
# warpgroup per program (threads=128) gets 232 with no spills (sm_90a, ptxas 13.0): two programs per SM, each one
# chain, the SM's two consumer warpgroups as at one program per SM. Run 29: correct (its GPU test), but slower, so
# off: 0.349 against 0.295 ms at B=8 T=4096 H=16 and 0.663 against 0.566 at B=4 T=8192 16/32 heads (+17-18%; not
# profiled: the doubled Q Kᵀ and the single load stage are the costs named above)
TWO_PER_SM = False
TWO_PER_SM_LAUNCH = dict(LAUNCH, BV=64, threads=128, num_stages=1, min_blocks=2)


def fitted_launch(width: int, launch: Optional[dict] = None) -> dict:
    """``launch`` (None: :data:`LAUNCH`) with BV = 64 where its BV does not divide ``width`` (a multiple of 64:
    V, or K for the affine walk, whose tiles must not straddle M and N)."""
    launch = launch or LAUNCH
    return launch if width % launch["BV"] == 0 else dict(launch, BV=64)


def fills_card(programs: int, sms: int) -> bool:
    """Whether ``programs`` walking programs fill :data:`FILL_FRACTION` of the card's ``sms`` SMs."""
    return programs >= FILL_FRACTION * sms


def hopper_launch(num_sequences: int, HV: int, V: int, sms: int) -> Optional[dict]:
    """The fused kernel's launch for ``num_sequences`` sequences of ``HV`` value heads of width ``V`` on ``sms``
    SMs, or None where no V tile gives enough programs to fill the card (:func:`fills_card`); with
    :data:`TWO_PER_SM`, :data:`TWO_PER_SM_LAUNCH` where its programs fill two per SM."""
    if TWO_PER_SM and V % 64 == 0 and fills_card(num_sequences * HV * (V // 64), 2 * sms):
        return dict(TWO_PER_SM_LAUNCH)
    for BV in (LAUNCH["BV"], 64):
        if V % BV == 0 and fills_card(num_sequences * HV * (V // BV), sms):
            return dict(LAUNCH, BV=BV)
    return None


# Phase B's V slice: its (slice, sequence × head) programs walk the segments one after another, so at B=1 the
# narrower slice's twice as many programs finish sooner. Run 21 (H200, ms) at 16 / 32 / 64 columns: B=1 T=4096
# H=16 (4 segments) 0.032 / 0.048 / 0.051, T=32768 (8) 0.069 / 0.105 / 0.112, T=32768 2/8 heads (16) 0.136 /
# 0.216 / 0.232
SCAN_BV = 16
# Phase B's step as one [K, K] tile of M_s (K ≤ 128), at 8 warps: the state kept in registers from step to step (no
# barrier and re-read) and the next step's M and N loaded during this step's product (``affine_scan(whole_map=True)``).
# Why: at gates where heads keep their state the scan is a chain of S − 1 steps at ≈ 6.5 µs each (run 34: 113 µs of
# B=1 T=32768 H=2 HV=8's 359 at mixed gates), each waiting on its map's 64 KB from L2 before four dependent row
# blocks; session 28's prefetch by row blocks spilled at 238 registers. Compiled for sm_90 on the CPU (K = 128,
# BV = 16): wgmma (HGMMA) instead of mma.sync, 254 registers at tf32x3 and 134 at tf32, no spill (the row blocks:
# 238 and 152). Predicted 2–3.5 µs per step, row 7 at mixed gates −55 to −80 µs. Run 37 (H200, eager ms, both at
# tf32x3, bitwise equal): mixed gates B=1 T=32768 H=16 0.482 → 0.454, H=2 HV=8 0.336 → 0.282 (−54 µs): on
SCAN_WHOLE_MAP = True
# Phase B's products: "tf32x3" (≈ fp32) or "tf32" (one product, a third of the tensor work and 134 registers). The
# Hopper forward's maps come from phase A's walk, whose dots take the state as bf16 (2⁻⁹ per rounding), so tf32's
# 2⁻¹¹ is below what the maps already carry. Run 37 (H200): the op's error against float64 within 15% of tf32x3's
# at slow gates (tests/ops/test_hopper_scan.py); row blocks at tf32x3 → whole map at tf32, eager ms, slow gates
# B=1 T=32768 H=16 0.580 → 0.538, H=2 HV=8 0.390 → 0.304; mixed gates 0.483 → 0.443, 0.337 → 0.258: tf32
SCAN_PRECISION = "tf32"


def scan_options(K: int) -> dict:
    """:func:`seq_parallel.affine_scan`'s keywords under :data:`SCAN_WHOLE_MAP` and :data:`SCAN_PRECISION`."""
    whole = SCAN_WHOLE_MAP and K <= 128
    return dict(precision=SCAN_PRECISION, whole_map=whole, num_warps=8 if whole else 4)


# The segmented forward (sequence parallelism, where the unsegmented kernel's programs do not fill the card):
# segments of at least this many chunks
MIN_SEGMENT_CHUNKS = 16


def segment_count(num_sequences: int, HV: int, V: int, T: int, sms: int, widths: Optional[tuple] = None
                  ) -> Optional[int]:
    """Segments per sequence for :func:`forward_hopper` where the unsegmented kernel's programs do not fill the
    card: the fewest S in 2, 4, …, 64 that divides T's chunks (T a multiple of 64: the segments are views), leaves
    segments of at least :data:`MIN_SEGMENT_CHUNKS` chunks and gives phase C programs that fill the card
    (:data:`FILL_FRACTION`) at BV=128, else at BV=64 (run 20: a 128-wide program walks a chunk in ≈ 6 µs, a 64-wide
    one in ≈ 4, so the wider tile with twice the segments does the same work in ⅔ of the time); None where none
    does. ``widths``: the V tiles to try, widest first (None: BV=128, then 64)."""
    if T % BT:
        return None
    chunks = T // BT
    candidates = [S for S in (2, 4, 8, 16, 32, 64) if chunks % S == 0 and chunks // S >= MIN_SEGMENT_CHUNKS]
    for BV in widths or (LAUNCH["BV"], 64):
        for S in candidates:
            if V % BV == 0 and fills_card(num_sequences * S * HV * (V // BV), sms):
                return S
    return None


# "auto" segments only from this many (sequence × token × value head) rows: below it the call is host-bound (the
# segmented forward issues two TileLang launches, two Triton ones and four small copies; ≈ 0.35 ms of host time per
# call in run 21 against ≈ 0.22 of GPU time at B=1 T=4096 H=16, 2¹⁶ rows), and run 21 measured it both ahead of the
# split and behind it there (0.242 vs 0.319 ms in one call, 0.336 vs 0.230 in another, on other machines). From
# 2¹⁸ rows (T=32768 at 8 or 16 heads) it won in every call; between, nothing was measured and the split stays.
# Run 23 (warm-ups on, three TileLang and two Triton launches, ≈ 200 µs of host time): 0.284 against the split's
# 0.229 at B=1 T=4096 H=16. With SMALL_SEGMENTED, "auto" segments below it without the levers (no plan launch,
# four launches in all). Run 24 at B=1 T=4096 H=16: forward_hopper 0.144 ms plain against
# 0.187 with the map skip, 0.180 with warm-ups and the split's 0.231 through the op (call 1), but through the op the
# plain segmented forward measured 0.602 and 0.464 ms (calls 3 and 4: 478 µs of host time per call): off
MIN_SEGMENTED_HEAD_TOKENS = 2 ** 18
# Whether "auto" takes the segmented forward without its levers below MIN_SEGMENTED_HEAD_TOKENS (else the split)
SMALL_SEGMENTED = False
# Whether "auto" takes the two-launch segmented forward below MIN_SEGMENTED_HEAD_TOKENS (``plan_in_walk``: the
# pre-pass, then a warm walk whose programs find their own warm-ups; before SMALL_SEGMENTED). Run 27 at B=1 T=4096
# H=16: the five-launch segmented forward takes 0.092 ms of GPU time but ≈ 230 µs of host time per call (≈ 80 of it
# its four launches, ≈ 60 in the plan's and the scan's Python and Triton launches), so it tied the split's 0.228
# eagerly. Two launches: predicted ≈ 120–130 µs of host time and 0.07–0.08 ms of GPU time, so ≈ 0.12–0.14 ms eagerly
# (SDPA 0.152, FlashQLA 0.148 in run 27). Its worst case, heads that never forget, walks each segment from the
# sequence's start: at most the unsegmented kernel's 64 chunks here (≈ 0.2 ms). Run 28 (H200, through the op,
# benchmarks/op_time_check.py; the GPU tests of both decays passed): off / on 0.264 / 0.162 ms and 0.231 / 0.177 (host
# µs per call 263 / 126 and 166 / 147; CUDA graph replay 0.228 / 0.082), and 0.085 ms (host 114 µs) in a later call;
# in bench_anchors' process 0.253 (FlashQLA 0.339 and SDPA 0.151 in the same run: that host was slow). Larger shapes
# keep the five-launch forward: two launches measured 0.184 against its 0.371 at B=1 T=32768 H=2 HV=8 and 0.325
# against ≈ 0.35 at H=16, but there a head that never forgets would walk up to the whole sequence per segment
# (the unsegmented kernel: 3.35 ms at the first, run 21) where the maps keep ≈ 0.4
SMALL_PLAN_IN_WALK = True
# Under CUDA graph capture the host's cost is paid once, at capture, not at each replay, so "auto" may pick by GPU
# time alone there: the segmented forward with its levers below MIN_SEGMENTED_HEAD_TOKENS too. Run 27 (H200, B=1
# T=4096 H=16 through the op, the call captured in a graph and replayed): 0.092 ms segmented (4 segments, warm-ups)
# against the split's 0.228; eager both ≈ 0.230 (the segmented call host-bound at ≈ 230 µs per call, the split
# GPU-bound). Run 28: its GPU tests pass (the replay bitwise the same plan's eager call; a capture whose kernels
# never ran eagerly) and the replay took 0.0915 ms against the split's 0.2285; but with SMALL_PLAN_IN_WALK on, a
# capture already takes the two-launch forward (replayed 0.082 ms, and the same numbers as the eager call), so it
# stays off: it would trade 10% of replay time for the maps' bound on heads that never forget
SEGMENTED_WHEN_CAPTURED = False
# Whether "auto" takes the segmented forward at all. Run 22 checked it at a slow decay (1/65536 of the anchors'
# gates, so the entering state survives the whole segment and every map M counts): o / state errors against
# float64 4.03e-3 / 3.29e-3 segmented, 4.03e-3 / 3.27e-3 unsegmented (B=1 T=32768 H=16, 8 segments)
SEGMENTED_AUTO = True


# Segments at BV=128 before the unsegmented kernel at BV=64, where BV=128's programs alone do not fill the card but
# BV=64's do (B=2 T=16384 H=32, issue 4's row 6: 64 programs at BV=128, 128 at 64) and the shape is large enough for
# the five-launch forward (MIN_SEGMENTED_HEAD_TOKENS). At BV=64 every program does the whole K side of the chunk (Q
# Kᵀ, K S, the solve's operand) for half the columns; two segments at BV=128 do it once per head and walk half the
# chunks each. Run 23 (H200, before stsm and session 23's switches, anchors' gates, warm-ups): 0.852 against 1.025
# ms at row 6's shape (0.83×); row 6 is 0.712 today (run 30), its goal 0.625: 0.83× would be ≈ 0.59. The worst
# case: heads that never forget walk their maps (phase A, about twice a segment's state work on top of phase C),
# predicted ≈ 1.2–1.4× the unsegmented BV=64 time there. Off until measured (op_time_check.py --wide-segments-ab,
# with --slow-gates for the worst case); session 25, CPU only
WIDE_SEGMENTS = False
# Where WIDE_SEGMENTS would cut (only the narrow tile fills the card), each head takes the walk that suits its gates,
# decided on the device from the pre-pass's chunk bounds (no host sync): the heads that warm up within SPLIT_HEADS_CAP
# of a segment take two segments at BV=128 (the planned warm walk: no plan, maps or scan), the others ("cold") the
# unsegmented walk at BV=64; two launches of the planned warm walk (``chunk_fwd``'s ``head_split``), the narrow one
# on the high-priority side stream beside the wide one, each program of either walking its head or nothing. Either
# way a head takes two programs (two segments × one tile, or one sequence × two tiles), so every head's programs are
# resident at once (issue 4's row 6: 128 on 132 SMs) and the call lasts as long as the longer of the two walks. Why:
# at row 6 (B=2 T=16384 H=32) the narrow walk takes ≈ 0.50 ms after the pre-pass's ≈ 0.17 (run 37: 0.672 beside
# FlashQLA's 0.783, the goal 0.626), two segments at BV=128 ≈ (128 + w) chunks × 2.7 µs ≈ 0.37 where every head warms
# up (w ≈ 7 chunks at the anchors' gates), and WIDE_SEGMENTS' five launches pay phase A and the scan where heads do
# not forget (1.05 ms at slow gates, run 35). Predicted: row 6 0.672 → 0.54–0.58 at the anchors' gates; at slow gates
# (every head cold) today's narrow walk, ± the routing's ≤ 48 loads per program; at mixed gates the narrow walk's
# time (its cold heads). The cap: a head whose warm-up w fits walks 128 + w chunks at 2.7 µs against the narrow
# walk's 256 at ≈ 1.95, even at w ≈ 57; 3/8 (48 chunks at row 6) leaves room for the estimate's error.
# Measured (run 39, commit df98ef7, op_time_check.py eager / CUDA graph ms, off → on): anchors' gates 0.673 / 0.673 →
# 0.575 / 0.600 (bench_anchors 0.574 beside FlashQLA's 0.784: the goal met), mixed gates 0.717 / 0.711 → 0.948 / 0.731,
# slow gates 0.668 / 0.667 → 0.723 / 0.706. Off: it loses where heads keep their state, as a real model's may. The
# traces (gate_sensitivity.py --phases --trace): every program that walks nothing still holds its SM ≈ 20–29 µs (the
# suspect, found after the run: each of the route's 48 loads divided by the symbolic chunk count in 64 bits, ≈ 1,200
# prologue instructions and 16 division calls per 8 loads; ≈ 280 and none since b4c8a2d, not yet measured; predicted ≈ 5
# µs per exit, row 6 at the anchors' gates ≈ 0.555, mixed ≈ 0.70, slow ≈ 0.69), and at mixed gates the wide launch,
# dispatched first, held 128 SMs while the narrow one's exiting programs went through the few left (its cold walks
# started up to 270 µs late); the cold walk itself is ≈ 5% slower per chunk than the plain BV=64 kernel's
SPLIT_HEADS = False
SPLIT_HEADS_CAP = 0.375
# SPLIT_HEADS' launch order: the wide launch on the caller's stream (dispatched first, the pre-pass's stream) and the
# narrow one on the critical side stream, or (on) the other way round. Off until measured: narrow first, its 128
# programs take the card at once and the cold walks start at once, but the wide launch's exiting programs then go
# through the 4 SMs left (slow gates: 128 of them at ≈ 20 µs each, ≈ 0.6 ms, longer than the walks) — right only
# if exits are made cheap
SPLIT_HEADS_NARROW_FIRST = False


def plan(num_sequences: int, HV: int, V: int, T: int, sms: int, forced: bool, capturing: bool = False
         ) -> Optional[dict]:
    """:func:`forward_hopper`'s keywords for ``num_sequences`` equal-length sequences of ``T`` tokens and ``HV``
    value heads of width ``V`` on ``sms`` SMs, or None for the Triton paths: the unsegmented kernel where its
    programs fill the card (:func:`hopper_launch`), else the segmented forward where segments do
    (:func:`segment_count`; the plan's "segments"; under "auto" only with :data:`SEGMENTED_AUTO`), else None — or,
    ``forced`` (``FORWARD_PATH = "hopper"``), the unsegmented kernel at :func:`fitted_launch`. With
    :data:`WIDE_SEGMENTS`, segments at BV=128 before the unsegmented kernel at BV=64; with :data:`SPLIT_HEADS`
    there, each head's choice between them on the device (``split_heads``).

    Run 21 (H200, bf16, K = V = 128, ms with the pre-pass against the Triton split, no grad): segmented B=1 T=4096
    H=16 (4 segments) 0.242 vs 0.319 (and 0.336 vs 0.230 on another machine), T=32768 (8) 1.222 vs 1.679 (1.196
    with the 16-column scan), T=131072 (8) 4.51 vs 6.62, T=32768 2/8 heads (16) 0.769 vs 1.231; the unsegmented
    kernel at those shapes 0.338, 3.52, 14.0, 3.35. Where the unsegmented kernel fills the card, 2 segments were
    slower (8×4096 H=16: 1.20 vs 0.666): phase A walks K + V columns. Under "auto", below
    :data:`MIN_SEGMENTED_HEAD_TOKENS` the segments come planned in the walk (``plan_in_walk``:
    :data:`SMALL_PLAN_IN_WALK`) or without the levers (``skip_maps``, ``warm_up`` False: :data:`SMALL_SEGMENTED`),
    or, ``capturing`` (a CUDA graph capture), with them (:data:`SEGMENTED_WHEN_CAPTURED`)."""
    launch = hopper_launch(num_sequences, HV, V, sms)
    if launch is not None and (WIDE_SEGMENTS or SPLIT_HEADS) and launch == dict(LAUNCH, BV=64) and \
            V % LAUNCH["BV"] == 0 and num_sequences * T * HV >= MIN_SEGMENTED_HEAD_TOKENS:
        wide = segment_count(num_sequences, HV, V, T, sms, widths=(LAUNCH["BV"],))
        if wide == 2 and SPLIT_HEADS:           # each head its walk: two segments at the wide tile or one narrow
            return dict(LAUNCH, segments=2, split_heads=True)
        if wide is not None and WIDE_SEGMENTS:  # segments at the wide tile (WIDE_SEGMENTS)
            return dict(LAUNCH, segments=wide)
    if launch is not None:
        return launch
    segments = segment_count(num_sequences, HV, V, T, sms)
    if segments is None:
        return fitted_launch(V) if forced else None
    segmented = dict(hopper_launch(num_sequences * segments, HV, V, sms), segments=segments)
    small = num_sequences * T * HV < MIN_SEGMENTED_HEAD_TOKENS and not (capturing and SEGMENTED_WHEN_CAPTURED)
    if forced or (SEGMENTED_AUTO and not small):
        return segmented
    if SEGMENTED_AUTO and SMALL_PLAN_IN_WALK:                           # host-bound: two launches
        return dict(segmented, plan_in_walk=True)
    if SEGMENTED_AUTO and SMALL_SEGMENTED:                              # host-bound: four launches
        return dict(segmented, skip_maps=False, warm_up=False)
    return None


# A segment's map M is dropped (phase A writes M = 0 without walking those K columns; SKIP_NEGLIGIBLE_MAPS) where
# the bound ‖M‖₂ ≤ Π_t γ_t · max(1, |1 − β_t ‖k_t‖²|) over the segment's tokens (map_bound.py) is below
# 2^NEGLIGIBLE_M_LOG2: the entering state then moves the next segment's by less than 2⁻³⁰ of its own norm (fp32
# keeps 2⁻²⁴). Each token's transition is γ_t (I − β_t k_t k_tᵀ), whose 2-norm is γ_t max(1, |1 − β_t ‖k_t‖²|).
# With the anchors' gates (mean −0.05 per token) a 4096-token segment's bound is ≈ 2⁻²⁹⁵, so every M tile ends at
# once (phase A: one wave of N tiles instead of two waves); heads that decay slowly keep theirs
NEGLIGIBLE_M_LOG2 = -30.0
# Whether phase A skips the negligible maps' M tiles (half of its programs where every map is negligible, as at the
# anchors' gates). Run 23 (H200, `hopper_fwd_check.py --segmented`, before the map bound moved into the pre-pass):
# errors against float64 equal to the plain segmented forward's at both decays; B=1 T=32768 H=16 0.675 ms against
# 0.758 at the anchors' gates, 0.817 against 0.749 at a slow decay (no map negligible: the plan's cost alone)
SKIP_NEGLIGIBLE_MAPS = True
# Warm-ups instead of state maps (the segmented forward's phases A and B) for the heads that forget fast: the state
# entering segment s equals the walk from zero started w chunks earlier up to the map of those w chunks, whose norm
# the same bound keeps below 2^NEGLIGIBLE_M_LOG2 (relative to the state where the warm-up starts). One pass, w
# chunks longer per segment, instead of phase A (twice phase C's state work) and the scan; a head whose some
# segment needs more than WARM_UP_MAX_FRACTION of a segment's chunks takes the maps (phase A walks only those
# heads; the others' programs end at once). The cap is one whole segment: a warm-up of w ≤ L/64 chunks makes its
# walk at most twice phase C's, while the maps cost phase A (about twice phase C) on top of phase C; beyond it the
# warm-up would read more than the previous segment (where phase A runs anyway, MAP_WAVE_FILL below weighs a long
# warm-up against the maps per call). Run 23 (H200, `hopper_fwd_check.py --segmented`, before the
# map bound moved into the pre-pass and the scan skipped warmed heads): errors equal to the plain segmented
# forward's (o 3.370e-3, state 2.405e-3 at the anchors' gates); B=1 T=32768 H=16 0.568 ms against 0.758 (predicted
# 0.55), at a slow decay (no head warms up) 0.828 against 0.749
WARM_UP = True
WARM_UP_MAX_FRACTION = 1.0
# The wave-fill rule (``map_bound.segment_plan``'s map_slots): the plan also sends the heads of the longest warm-ups
# to their maps where its cost model (phase C lasts as long as its longest walk; phase A as many waves as the maps'
# programs need; the scan steps over the segments once any head walks) says so, typically where some head walks its
# maps anyway and phase A's wave has room. Why: run 34's profile at gates drawn like a Mamba-style initialisation
# (B=1 T=32768 H=16, 8 segments of 64 chunks): four heads walk their maps (phase A 122 µs, one wave of 64 programs
# on 132 SMs), while a head that warms up over a whole segment makes phase C 334 µs (184 at no warm-up): the wave
# has room for that head's and three others' maps (8 programs each: their maps' M tiles are negligible). Predicted
# there: phase C 334 → ≈ 225 µs, the call 0.62 → ≈ 0.51 ms; B=1 T=32768 H=2 HV=8 0.40 → ≈ 0.37; unchanged where
# no head walks (the anchors' gates, row 4 at mixed gates: a first wave costs more than it saves) and where every
# head walks (slow gates). Run 34 (H200, ef98815, op_time_check.py --map-wave-fill-ab, eager / replayed, ms): its
# GPU test passes (the compiled plan equals its twin; errors against float64 within 15% of the rule-free ones); at
# mixed gates B=1 T=32768 H=16 0.630 / 0.624 → 0.517 / 0.511, H=2 HV=8 0.408 / 0.403 → 0.369 / 0.363, T=131072 H=16
# 1.475 → 1.481–1.488 (the same flags: bitwise equal, noise); at the anchors' and at slow gates bitwise equal and
# within noise. The plan kernel (one program per sequence since this rule) takes 20 µs at the first two against
# 9.2 and 16.5 for the per-head programs before it (run 34's profile): see map_bound.py. On
MAP_WAVE_FILL = True

# The segmented forwards without the writes nobody reads (``chunk_fwd_hopper_hm(lean=True)``): at bench_anchors'
# gates every head warms up, yet phase A writes each map as zeros ([B·S, HV, K, K + V] fp32: 16.8 MB at B=1 T=32768
# H=16, 8 segments), the scan writes each entering state as zeros (8.4 MB) and phase C reads them back (8.4 MB) to
# start its warm-ups from, and the warm walks write every segment's final state (8.4 MB) for a copy kernel to pick
# the last ones out. Lean: phase A leaves the maps flagged 2 unwritten, the scan their entering states
# (``affine_scan(skip_writes=True)``), phase C starts a warm-up from zero itself, and the warm walks write the
# sequences' final states from their last segments: ≈ 42 MB and one launch fewer at B=1 T=32768 H=16. Predicted
# −10 to −15 µs of GPU time there (0.330 ms, run 30: the goal 0.316) and at B=1 T=32768 H=2 HV=8 (0.207), ≈ −3 µs
# and one launch's host time (≈ 6 µs) for the two-launch forward at B=1 T=4096 H=16. The same values (o and the
# final state bitwise equal expected). Run 31 (H200, f15445b): its GPU tests pass (o and the final state bitwise the
# plain forwards'); ``op_time_check.py --lean-segments-ab --repeat 2 --graph``, CUDA graph replay off → on:
# B=1 T=32768 H=16 0.3285 / 0.3328 → 0.3215 / 0.3222 ms (−7 to −11 µs), B=1 T=32768 H=2 HV=8 0.1996 / 0.1993 →
# 0.1905 / 0.1912 (−9 µs), B=1 T=4096 H=16 0.0774 / 0.0777 → 0.0774 / 0.0769 (the same), B=1 T=131072 H=16
# 1.192 / 1.152 → 1.239 / 1.234 replayed but 1.195 / 1.232 → 1.198 / 1.197 eagerly (GPU-bound there too: the two
# disagree by more than the change, so not a measured loss; re-check it; phase C's chunk loop is the plain one's,
# 1120 against 1121 SASS instructions for sm_90a): on
LEAN_SEGMENTS = True
# Phase C's warmed segments (warm-up above zero) beside phase A, not after the scan (with LEAN_SEGMENTS and warm-ups;
# ``chunk_fwd.build_kernel``'s ``warm_subset``). Those walks read no entering state, so they need only the plan:
# they run on the caller's stream, while phase A, the scan and phase C's other segments (the maps' heads, and each
# head's first segment) run on a high-priority side stream, the chain that decides the call's end. Why: where some
# heads keep their state over a segment (gates drawn like a Mamba-style initialisation), phase A walks only those
# heads' maps, and the rest of the card waits; run 33 measured B=1 T=32768 H=16 at 0.623 ms there against 0.328 at
# the anchors' gates (FlashQLA 0.680 and 0.547). Predicted at those mixed gates: ≈ 0.45 (the warmed walks fill phase
# A's idle SMs); at the anchors' gates within ±2% of GPU time (the same programs in two launches), and +25–35 µs of
# host time per call (a launch, the fork and the join), which the host-bound row 7 pays. Session 27, CPU only (the
# twins): off until its GPU test has run and op_time_check.py --overlap-warm-ab is measured at both gates. Run 34
# (H200, b9ea464, --overlap-warm-ab --repeat 2 --graph, off → on): its GPU test passes (bitwise); at mixed gates
# B=1 T=32768 H=16 replayed 0.617 / 0.620 → 0.545 / 0.544 but eagerly 0.620 / 0.622 → 0.609 / 0.610, H=2 HV=8
# replayed 0.400 / 0.401 → 0.363 / 0.363 but eagerly 0.405 → 0.418 (host 265 → 358–382 µs per call), T=131072 no
# gain; at the anchors' gates within 1% replayed, host +4–54 µs. Predicted 0.62 → 0.45: the warmed half alone
# walks 334 µs there (a head warming up over a whole segment) and shares the SMs with phase A's programs; why the
# eager calls keep less of the replayed gain than the host time explains was not found (the traces were lost).
# With MAP_WAVE_FILL those long warm-ups mostly go to the maps instead. Off
OVERLAP_WARM = False


_critical_streams: dict[int, torch.cuda.Stream] = {}


def no_fork():
    """:func:`critical_fork`'s pair where nothing forks: no context, no join."""
    return contextlib.nullcontext(), lambda: None


def critical_fork(device: torch.device):
    """(a context in which launches go to this device's high-priority side stream, after the caller's stream's work
    so far; the join: the caller's stream waits for them), for :data:`OVERLAP_WARM`. The side stream is made on the
    first eager call (one per device; a thread that forks onto it joins back before its call returns). Off CUDA (the
    tests' twins), or under a CUDA graph capture before any eager call made it: one stream, nothing to wait for."""
    if device.type != "cuda":
        return no_fork()
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _critical_streams.get(index)
    if side is None:
        if torch.cuda.is_current_stream_capturing():        # no stream made inside a capture
            return no_fork()
        side = _critical_streams[index] = torch.cuda.Stream(device=index, priority=-1)
    main = torch.cuda.current_stream(device)
    side.wait_stream(main)
    return torch.cuda.stream(side), functools.partial(main.wait_stream, side)


def map_slots(device: torch.device, num_sequences: int) -> int:
    """``segment_plan``'s map_slots under :data:`MAP_WAVE_FILL` (phase A's programs per wave for each sequence: one
    program per SM, the SMs shared evenly), else 0 (no wave-fill rule)."""
    return max(1, num_sms(device) // num_sequences) if MAP_WAVE_FILL else 0


def segment_flags(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, segments: int,
                  bound: Optional[torch.Tensor] = None, skip_maps: bool = False, warm_up: bool = False
                  ) -> SegmentPlan:
    """``map_bound.SegmentPlan``, each flag ``[B·S, HV]``, for the segmented forward's ``segments`` = S segments
    (T a multiple of 64·S), from keys ``[B, T, H, K]``, log decays g and β ``[B, T, HV]``: the segments whose own
    map is negligible, the warm-ups in chunks (at most :data:`WARM_UP_MAX_FRACTION` of a segment, 0 for the first
    segment), the heads that walk their maps (a segment of theirs cannot warm up; their warm-ups are 0), and phase
    A's flags (``skip_maps``: 1 for the negligible maps; ``warm_up``: 2 for the maps of the heads that warm up).
    ``bound``: the chunk sums ``[B·S, HV, T/64/S]`` where the pre-pass wrote them (the TileLang one), else computed
    here (``map_bound.chunk_bounds``: one more launch, which reads k). On the device, no host sync."""
    chunks = k.shape[1] // BT // segments
    if bound is None:
        bound = chunk_bounds(k, g, beta, segments)
    return segment_plan(bound, segments, max(1, int(chunks * WARM_UP_MAX_FRACTION)), NEGLIGIBLE_M_LOG2, skip_maps,
                        warm_up, map_slots(k.device, k.shape[0]) if warm_up else 0)


def resolve_prepass(prepass: Optional[str], a_inv_dtype: Optional[torch.dtype]) -> tuple[str, torch.dtype]:
    """The pre-pass and A_inv dtype :func:`run_prepass` uses for these arguments: ``prepass`` (None:
    :data:`PREPASS`, or "triton" for an fp32 A_inv, which the TileLang pre-pass cannot write) and ``a_inv_dtype``
    (None: :data:`A_INV_DTYPE`)."""
    a_inv_dtype = a_inv_dtype or A_INV_DTYPE
    prepass = prepass or (PREPASS if a_inv_dtype == torch.bfloat16 else "triton")
    if prepass not in PREPASSES:
        raise ValueError(f"prepass must be one of {PREPASSES}, got {prepass!r}")
    return prepass, a_inv_dtype


def a_inv_has_beta(prepass: Optional[str], a_inv_dtype: Optional[torch.dtype]) -> bool:
    """Whether the A_inv :func:`run_prepass` writes for these arguments is A_inv diag(β): the TileLang pre-pass's
    with ``prepass.BETA_IN_A_INV`` (the fused kernel then reads no β)."""
    return resolve_prepass(prepass, a_inv_dtype)[0] == "tilelang" and prepass_module.BETA_IN_A_INV


def run_prepass(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, segments: int = 1,
                prepass: Optional[str] = None, a_inv_dtype: Optional[torch.dtype] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """What the fused kernel reads, from the pre-pass ``prepass`` names (None: :data:`PREPASS`, or "triton" for an
    fp32 A_inv): gc and β head-major per segment ``[B·S, HV, Lp]`` and A_inv ``[B, T, HV, 64]`` in ``a_inv_dtype``
    (None: :data:`A_INV_DTYPE`; the TileLang pre-pass writes bf16 only), and the map bound's chunk sums
    ``[B·S, HV, T/64/S]`` (the TileLang pre-pass; None from the Triton one). ``segments`` = S divides T into the
    kernels' B·S sequences (T a multiple of 64·S when S > 1). The TileLang pre-pass's A_inv is A_inv diag(β) where
    ``prepass.BETA_IN_A_INV`` (:func:`a_inv_has_beta`)."""
    prepass, a_inv_dtype = resolve_prepass(prepass, a_inv_dtype)
    if prepass == "tilelang":
        if a_inv_dtype != torch.bfloat16:
            raise ValueError(f"the TileLang pre-pass writes a bf16 A_inv, got a_inv_dtype={a_inv_dtype}")
        return prepass_hopper(k, g, beta, segments)
    B, T = k.shape[:2]
    gc, a_inv = fused_prepass(g, k, v, beta, write_wy=False, store_dtype=a_inv_dtype)
    gc_hm, beta_hm = (head_major(x.reshape(B * segments, T // segments, x.shape[2])) for x in (gc, beta))
    return gc_hm, beta_hm, a_inv, None


def forward_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float, initial_state: Optional[torch.Tensor], a_inv_dtype: Optional[torch.dtype] = None,
                   segments: Optional[int] = None, prepass: Optional[str] = None,
                   skip_maps: Optional[bool] = None, warm_up: Optional[bool] = None, plan_in_walk: bool = False,
                   split_heads: bool = False, **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """o ``[B, T, HV, V]`` and the final state ``[B, HV, K, V]`` fp32 from bf16 q, k ``[B, T, H, K]``, v
    ``[B, T, HV, V]``, fp32 log decays g and β ``[B, T, HV]``. ``prepass``, ``a_inv_dtype``: the pre-pass and the
    dtype it writes A_inv in (:func:`run_prepass`); ``launch``: the fused kernel's (``chunk_fwd_hopper_hm``; none:
    :func:`fitted_launch`).

    ``segments`` = S > 1 (T a multiple of 64·S): sequence parallelism, exact. Each sequence is cut into S segments
    of L = T/S tokens, which the kernels take as B·S sequences of their own (views: the pre-pass's gc is
    chunk-local and its A_inv per chunk, so they hold for the segments as they are):

        A  [M_s | N_s] = affine walk of every segment       chunk_fwd_hopper_hm(affine=True): from [I | 0] with
                                                            values [0 | V], the state's three dots, no output
        B  h_in(s+1) = M_s h_in(s) + N_s                    seq_parallel.affine_scan, fp32, from S_0 (or 0)
        C  o and the final states from the true h_in        chunk_fwd_hopper_hm, B·S programs' worth of rows

    Phase A walks K + V columns (twice phase C's state work for K = V) without the output's three dots. It also
    walks each sequence's last segment, whose map phase B does not use (1/S of it wasted: the segments of B > 1
    sequences are not one contiguous prefix). With ``skip_maps`` (None: :data:`SKIP_NEGLIGIBLE_MAPS`) it skips the
    M tiles of the maps :func:`segment_flags` marks negligible (M = 0 there).

    With ``warm_up`` (None: :data:`WARM_UP`; the default kernel only) the heads whose every segment is reached by a
    short warm-up (:func:`segment_flags`) skip phases A and B: phase C starts their segment s's walk w_s chunks
    before it from zero (from S_0 at the start), writing o from the segment on; the other heads take the maps.

    With ``plan_in_walk`` the segmented forward is two launches, the pre-pass and a warm walk that finds each
    segment's warm-up itself from the pre-pass's chunk bounds (``chunk_fwd_hopper_hm(warm_bound=)``): no plan, no
    maps, no scan. A head that never forgets within the chunks before a segment walks from the sequence's start
    (exact, but then that segment's program walks the whole prefix): for the small shapes where the five launches'
    host time is the call's (:data:`SMALL_PLAN_IN_WALK`).

    With ``split_heads`` (``segments`` = 2, the launch at BV=128; :data:`SPLIT_HEADS`) the pre-pass, then the
    planned warm walk twice into one o and final state (:func:`split_heads_order`'s streams): at BV=64 for the heads
    that do not warm up within :data:`SPLIT_HEADS_CAP` of a segment (each walked whole from its initial state), and
    at the launch's tile for the others (their segments with warm-ups); each head's route is decided in both
    kernels from the pre-pass's chunk bounds alike (``chunk_fwd``'s ``head_split``).

    With :data:`LEAN_SEGMENTS` both segmented forwards leave out the writes nobody reads: phase A's maps of the
    warmed heads, the scan's entering states of their segments (phase C starts those from zero itself), and every
    segment's final state but each sequence's last (the warm walks write ``[B, HV, K, V]``: no copy).

    A signature seen before (the inputs' shapes and dtypes, these keywords, the module switches) takes its
    prepared call (``prepared.py``: the same launches without the checks and the plan's Python)."""
    key = None                   # with prepared.PREPARED off: no signature, and below no lookup and no build
    if prepared.PREPARED:
        options = (a_inv_dtype, segments, prepass, skip_maps, warm_up, plan_in_walk, split_heads,
                   tuple(launch.items()))
        key = prepared.signature(q, k, v, g, beta, scale, initial_state, options)
    call = prepared.prepared_call(key)
    if call is not None:
        prepared_route.served(call)          # the public op may record its route to this call
        return call(q, k, v, g, beta, initial_state)
    result = _forward_hopper_plain(q, k, v, g, beta, scale, initial_state, a_inv_dtype, segments, prepass,
                                   skip_maps, warm_up, plan_in_walk, split_heads, **launch)
    if launch:                   # the op always names the launch; others take the plain forward every time
        prepared.remember(key, q, k, v, beta, scale, initial_state, a_inv_dtype, segments, prepass, skip_maps,
                          warm_up, plan_in_walk, launch, split_heads)
    return result


def _forward_hopper_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          scale: float, initial_state: Optional[torch.Tensor], a_inv_dtype: Optional[torch.dtype],
                          segments: Optional[int], prepass: Optional[str], skip_maps: Optional[bool],
                          warm_up: Optional[bool], plan_in_walk: bool, split_heads: bool = False,
                          **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward_hopper`'s checks, plan and launches, on every call."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    launch = launch or fitted_launch(V)
    segmented = bool(segments) and segments > 1
    S = segments if segmented else 1
    if segmented and T % (BT * S):
        raise ValueError(f"{segments} segments need T a multiple of {BT * segments}, got T={T}")
    gc_hm, beta_hm, a_inv, bound = run_prepass(k, v, g, beta, S, prepass, a_inv_dtype)
    launch = dict(launch, beta_in_a_inv=a_inv_has_beta(prepass, a_inv_dtype))     # what A_inv holds
    if not segmented:
        return chunk_fwd_hopper_hm(q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state, **launch)

    if (split_heads or plan_in_walk) and bound is None:
        bound = chunk_bounds(k, g, beta, S)     # the planned walks read the bounds; the Triton pre-pass writes none
    if split_heads:
        return split_heads_walks(q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state, bound, S, launch)
    if plan_in_walk:
        if launch.get("roles"):
            raise ValueError("the planned warm walk runs on the default kernel: not with roles")
        o, ht = chunk_fwd_hopper_hm(q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state, warm_bound=bound,
                                    warm_threshold=NEGLIGIBLE_M_LOG2, lean=LEAN_SEGMENTS, **launch)
        return o.reshape(B, T, HV, V), last_segments(ht, B, segments, LEAN_SEGMENTS)

    def seg(x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] → [B·S, T/S, ...], a view (the op passes contiguous tensors)."""
        return x.reshape(B * S, T // S, *x.shape[2:])

    qs, ks, vs, a_s = seg(q), seg(k), seg(v), seg(a_inv)
    # phase A skips the negligible maps' M tiles (skip_m 1) and, with warm-ups, the maps of warmed heads (2)
    skip = SKIP_NEGLIGIBLE_MAPS if skip_maps is None else skip_maps
    warm = WARM_UP if warm_up is None else warm_up
    if warm and launch.get("roles"):
        raise ValueError("the warm-up walk runs on the default kernel: not with roles")
    flags = segment_flags(k, g, beta, S, bound, skip, warm) if skip or warm else None
    # phase A's skip_m: 1 the M tiles of a negligible map, 2 a warmed head's whole map
    skip_m = flags.skip_m if flags is not None else None
    lean = LEAN_SEGMENTS and warm         # without warm-ups every map and entering state is read
    # OVERLAP_WARM: phase A, the scan and phase C's unwarmed half on the critical side stream, the warmed half on the
    # caller's after them (its walks need only the plan), both into one o and final state allocated here
    overlap = lean and OVERLAP_WARM
    critical, join = critical_fork(q.device) if overlap else no_fork()
    out = (torch.empty_like(v), torch.empty(B, HV, K, V, dtype=torch.float32, device=q.device)) if overlap else None
    with critical:
        _, mn = chunk_fwd_hopper_hm(qs, ks, vs, gc_hm, beta_hm, a_s, scale, None, affine=True, skip_m=skip_m,
                                    lean=lean, **fitted_launch(K, launch))
        # the entering states; a warmed head's are S_0 (or 0) for its first segment and 0 after (the scan reads none
        # of its maps, which are zero: skip_m 2), or with lean unwritten after the first (phase C starts those from
        # zero)
        h_in = affine_scan(mn, initial_state.float().contiguous() if initial_state is not None else None, V, B,
                           nseg=segments, BV=SCAN_BV, skip=skip_m, skip_writes=lean, **scan_options(K))
        if overlap:
            chunk_fwd_hopper_hm(q, k, v, gc_hm, beta_hm, a_inv, scale, h_in, warm_chunks=flags.warm, lean=True,
                                warm_subset=2, out=out, **launch)
    if warm:         # (the warmed half reads no entering state: h_in only stands in for the argument)
        o, ht = chunk_fwd_hopper_hm(q, k, v, gc_hm, beta_hm, a_inv, scale, h_in, warm_chunks=flags.warm, lean=lean,
                                    warm_subset=1 if overlap else 0, out=out, **launch)
    else:
        o, ht = chunk_fwd_hopper_hm(qs, ks, vs, gc_hm, beta_hm, a_s, scale, h_in, **launch)
    join()
    return o.reshape(B, T, HV, V), last_segments(ht, B, segments, lean)


def split_heads_walks(q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state, bound, segments: int, launch: dict
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward_hopper`'s walks with ``split_heads`` after its pre-pass: the cold heads' whole walks at BV=64
    and the others' segments at ``launch``'s tile, on the streams :func:`split_heads_order` puts them on, into one o
    and final state."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if segments != 2 or launch.get("roles") or V % 64:
        raise ValueError(f"split_heads takes 2 segments on the default kernel and V a multiple of 64, got "
                         f"segments={segments}, V={V}" + (", roles" if launch.get("roles") else ""))
    out = (torch.empty_like(v), torch.empty(B, HV, K, V, dtype=torch.float32, device=q.device))
    walk = functools.partial(chunk_fwd_hopper_hm, q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state,
                             warm_bound=bound, warm_threshold=NEGLIGIBLE_M_LOG2, lean=True,
                             split_cap=SPLIT_HEADS_CAP, out=out)
    split_heads_order(lambda: walk(head_split=2, **dict(launch, BV=64)), lambda: walk(head_split=1, **launch),
                      q.device)
    return out


def split_heads_order(narrow: Callable[[], None], wide: Callable[[], None], device: torch.device) -> None:
    """Launch :func:`split_heads_walks`' two walks: the narrow one on the critical side stream and the wide one on
    the caller's, or with :data:`SPLIT_HEADS_NARROW_FIRST` the other way round (the caller's stream's launch, right
    after the pre-pass in its stream, is dispatched first); the caller's stream waits for both."""
    side, caller = (wide, narrow) if SPLIT_HEADS_NARROW_FIRST else (narrow, wide)
    critical, join = critical_fork(device)
    with critical:
        side()
    caller()
    join()


def last_segments(ht: torch.Tensor, B: int, segments: int, lean: bool) -> torch.Tensor:
    """The sequences' final states ``[B, HV, K, V]`` from a segmented walk's: its segments' ``[B·S, HV, K, V]``
    (each sequence's last one copied out), or, ``lean``, the sequences' own already."""
    return ht if lean else ht.view(B, segments, *ht.shape[1:])[:, -1].contiguous()


# last: prepared.py reads this module's switches and helpers (an import cycle, resolved at call time)
from ..gated_delta import prepared_route  # noqa: E402
from . import prepared  # noqa: E402
