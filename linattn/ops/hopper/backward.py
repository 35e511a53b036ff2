"""The Hopper backward of the chunked gated delta rule (issue 45), equal-length sequences: the host chain around
the fused reverse walk (``chunk_bwd_roles.py`` or ``chunk_bwd.py``: :func:`choose_walk`), walked whole or in
segments (``segments.py``). Packed sequences
(``cu_seqlens``) run it on a batch padded to one length (``varlen.py``: exact; the copies are its cost). The op's
backward runs it where ``gated_delta/dispatch.choose_backward_path`` says (bf16 on sm_90, from HOPPER_BWD_MIN_WORK
pairs × tokens).

    recompute   on the Hopper forward's kernels: the pre-pass (``prepass.py``, ``beta_in_a_inv=False``) gives gc =
                chunk-local cumsum of g and β head-major, T = (I + A)⁻¹ in bf16 (β inside A, none on the right:
                the walk needs T without diag(β)) and the chunks' map bounds; the forward walk's ``store_states``
                build (``chunk_fwd.py``, ``walk_launch.chunk_states_hopper``) gives h = the bf16 state entering each
                chunk ``[B, NT, HV, K, V]``, the walk's layout: two launches; where the forward's plan cuts the
                sequences into segments, five (:func:`segmented_states`: the segmented forward's plan, maps, scan
                and warm walk), or two at the host-bound sizes whose forward plans its own warm-ups
                (:func:`planned_states`), with three small copies either way
    segments    where ``segments.plan_walk`` (or segment_chunks) cuts the sequences: the reverse warm-ups
                (``chunk_bwd.reverse_warm_ups_hopper``, one launch) give dS_out, the gradient of the state leaving
                every segment; where ``segments.takes_maps`` says so (long uncapped chains) the warm-ups walk one
                segment at most, and the maps of the segments whose gates keep the state longer, and their scan,
                give the rest (``reverse_maps.py``, two launches)
    walk        the role-split walk (``chunk_bwd_roles.chunk_bwd_roles_hopper``, K = V = 64 or 128: one program per
                (sequence or segment, value head) over the whole V) or the slice walk (``chunk_bwd.chunk_bwd_hopper``:
                one per V slice, the slices of a head one thread-block cluster, their dq, dk tiles added in the
                walk in a fixed order), whichever the segment model prices lower: dv, dh0, dq and dk per value head
                (fp32; the gradients themselves where HV = H), dg, dβ (per slice); segments are views of the
                sequences, walked from their dS_out
    reductions  ``common/partial_sum.py``, one launch: dg, dβ added over the slices (dg masked below the gate
                floor), dq, dk over the value heads of each qk head (HV > H), in a fixed order, every gradient in
                its dtype: no atomics, the same bits every run

A signature's repeated calls take its prepared call (``backward_prepared.py``: the same launches without the
checks, the plans and the kernel lookups) where it takes the paths prepared there.

The walk and its reductions run over the rows (sequences, or segments) in batches (``segments.walk_batch_rows``): one
batch where HV = H; where HV > H each batch's per-value-head dq, dk (bf16, fp32) are summed into the gradients before
the next batch is walked (``segments.plan_walk``: a quarter or a half of the rows, a wave of programs at most, where the
model puts that within ``segments.GVA_TIME_MARGIN`` of one launch's walk).

Twin: ``chunk_bwd_ref.chunk_bwd_v_slices_ref`` + ``sum_partials_ref`` (the recompute there comes from its own
forward twin). benchmarks/gpu_check_hopper_bwd.py checks and times it on the GPU.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from ..common import num_sms, seq_parallel
from ..common.partial_sum import partial_sums
from ..utils import cdiv
from . import (
    backward_prepared,
    chunk_bwd,
    chunk_bwd_roles,
    forward,
    prepass,
    reverse_maps,
    segments,
    varlen,
    walk_launch,
)
from .chunk_fwd import BT
from .plan import DEFAULT, HopperPlanConfig, fitted_launch, hopper_launch, plan, scan_options

SIZES = (64, 128)       # K and V the walk is compiled and checked for (its shared memory: docs/backward.md §4)


def size_limit(K: int, V: int) -> Optional[str]:
    """Why the walk does not take heads of these sizes (None: it does): it is compiled and checked for K and V in
    :data:`SIZES`. The dispatch routes on it, :func:`check_inputs` raises it."""
    if K not in SIZES or V not in SIZES:
        return f"takes K and V in {SIZES} only, got K={K}, V={V}"
    return None


def defect_limit(K: int, V: int) -> Optional[str]:
    """Why the walk does not take heads of these sizes although it compiles for them (None: it does). K = V = 64
    takes the role-split walk (:func:`takes_roles`), whose producer loads a chunk only once every role has read the
    chunk before (the hand-off model, tests/ops/roles_protocol.py, checks the order): through the op against float64
    (H100, bf16, h0 and dht) every gradient is within 1.41× the rounded baseline at B = 2, T = 4096, H = HV = 4 and
    within 1.40× at T = 32768, H = 2, HV = 4 (dβ the largest), bit for bit on repeat. The slice walk at K = 64 had dβ
    not repeatable (H100, T = 32768, H = 2, HV = 4: four runs on the same inputs gave dβ differing by 2.8e-2
    relative, 6.4× the rounded baseline's error in one run of two): the staged v tile was refilled under the X terms'
    reads (docs/decisions.md). v now loads after k and dβ repeats bit for bit there; K = 64 with V = 128 keeps the
    Triton route until the core check measures that walk's dβ within the bound. V = 64 at K = 128 walks one slice per
    head as K = 64 does and takes the same route. The dispatch routes on it."""
    if K == V == 64:
        return None
    if K == 64:
        return "K = 64: dβ's race fixed, its accuracy not yet re-measured on a GPU"
    if V == 64:
        return "V = 64: one slice per head, as at K = 64 (routed with it until re-measured)"
    return None


def dtype_limit(g: torch.dtype, **operands: torch.dtype) -> Optional[str]:
    """Why the walk does not take these dtypes (None: it does): bf16 ``operands`` (named as the caller knows them;
    the walk's wgmma operands) and float32 g (log decays). The dispatch routes on it, :func:`check_inputs` raises it."""
    if g != torch.float32 or any(dtype != torch.bfloat16 for dtype in operands.values()):
        got = ", ".join(f"{name} {dtype}" for name, dtype in operands.items())
        return f"takes bf16 {', '.join(operands)} and float32 g only, got {got}, g {g}"
    return None


def check_inputs(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens=None, offsets=None) -> None:
    """ValueError / TypeError for inputs :func:`chunk_gated_delta_rule_bwd_hopper` cannot take (shapes and dtypes
    first, packed sequences' offsets (``varlen.check_packed``) and the states' count, the device last)."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, HV, V], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    if HV % H:
        raise ValueError(f"HV = {HV} must be a multiple of H = {H}")
    if (reason := size_limit(K, V)) is not None:
        raise ValueError(f"the Hopper backward {reason}")
    if (reason := dtype_limit(g.dtype, q=q.dtype, k=k.dtype, v=v.dtype, do=do.dtype)) is not None:
        raise TypeError(f"the Hopper backward {reason}")
    if do.shape != v.shape:
        raise ValueError(f"do must have v's shape {tuple(v.shape)}, got {tuple(do.shape)}")
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g and beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    N = B if cu_seqlens is None else varlen.check_packed(cu_seqlens, offsets, B, T, q.device)
    for name, x in (("initial_state", initial_state), ("dht", dht)):
        if x is not None and x.shape != (N, HV, K, V):
            count = "B (no varlen)" if cu_seqlens is None else "the packed sequences"
            raise ValueError(f"{name} must be [N, HV, K, V] = {(N, HV, K, V)}, N = {count}, got {tuple(x.shape)}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        raise ValueError(f"the Hopper backward runs on an sm_90 GPU, got a tensor on {q.device}")


def recompute(k, v, g, beta, initial_state) -> tuple[torch.Tensor, ...]:
    """The forward's stages the walk reads, in its layouts: :func:`solve` then :func:`states`."""
    gc_hm, beta_hm, t_inv, bound = solve(k, g, beta)
    return gc_hm, beta_hm, t_inv, states(k, v, gc_hm, beta_hm, t_inv, bound, initial_state)


def solve(k, g, beta) -> tuple[torch.Tensor, ...]:
    """The pre-pass (``prepass_hopper(beta_in_a_inv=False)``): gc and β head-major ``[B, HV, NT·64]`` fp32
    (zero-padded), T = (I + A)⁻¹ ``[B, T, HV, 64]`` bf16 (without β on the right) and the chunks' map bounds
    ``[B, HV, NT]`` fp32 (log2 units: the reverse warm-ups' plan)."""
    T = k.shape[1]
    if beta.dtype not in (torch.bfloat16, torch.float32):    # the pre-pass reads bf16 or fp32 β
        beta = beta.float()
    gc_hm, beta_hm, t_inv, bound = prepass.prepass_hopper(k, g, beta, beta_in_a_inv=False)
    return whole_chunks(gc_hm, T), whole_chunks(beta_hm.float(), T), t_inv, bound


def states(k, v, gc_hm, beta_hm, t_inv, bound, initial_state) -> torch.Tensor:
    """h ``[B, NT, HV, K, V]`` bf16, the state entering each chunk, from :func:`solve`'s outputs, laid out as the
    forward's plan (``plan.plan``) lays out its walk: in the plan's segments where it cuts the sequences, in two
    launches where the plan's walk plans its own warm-ups (``planned_walk``, the host-bound sizes:
    :func:`planned_states`), else in five (:func:`segmented_states`); unsegmented, the forward walk's states build
    from T and β, one program per sequence, value head and V tile (BV = 64 where 128 leaves the card idle)."""
    B, T, HV, V = k.shape[0], k.shape[1], *v.shape[2:]
    sms = num_sms(k.device)
    chosen = plan(B, HV, V, T, sms)
    if chosen is not None and chosen.segments > 1:
        run = planned_states if chosen.planned_walk else segmented_states
        return run(k, v, gc_hm, beta_hm, t_inv, bound, initial_state, chosen.segments, chosen.kernel_launch,
                   chosen.config)
    launch = hopper_launch(B, HV, V, sms) or DEFAULT.launch(64)
    return walk_launch.chunk_states_hopper(k, v, gc_hm, beta_hm, t_inv, initial_state, **launch)[0]


def segmented_states(k, v, gc_hm, beta_hm, t_inv, bound, initial_state, num_segments: int, launch: dict,
                     config: HopperPlanConfig = DEFAULT) -> torch.Tensor:
    """h as :func:`states` gives it, each sequence cut into S = ``num_segments`` segments of L = T/S tokens (T a
    multiple of 64·S), on the segmented forward's machinery (``forward.segmented_walk``) with the states walk's
    operator (T without β, X = β ⊙ (V − Γ ⊙ K S)):

        plan  per segment and head: negligible maps, warm-ups, heads that walk their maps   forward.segment_flags
        A     [M_s | N_s] = affine walk of the mapped heads' segments          chunk_fwd_hopper_hm(affine=True,
                                                                                   beta_in_a_inv=False)
        B     h_in(s+1) = M_s h_in(s) + N_s, fp32                              seq_parallel.affine_scan
        C     each segment's states walk from h_in, or from zero w chunks before it (a warm-up: the state's dots,
              no h stored), h stored at the segment's own chunks               chunk_states_hopper(warm_chunks=)

    The flags, the maps' skips and the warm-ups are the forward's (``config``), so h equals the unsegmented walk's up
    to the maps' rounding (bf16 dot operands, the scan's tf32: the forward's) where a map is walked, and within
    2^negligible_m_log2 of the state where a warm-up or a skipped map stands for it. k, v and T are viewed as
    ``[B·S, L, ...]``; gc, β ``[B, HV, NT·64]`` and the chunk bounds ``[B, HV, NT]`` take one copy each into
    per-segment rows. ``launch``: phase C's (the plan's), BV = 64 for phase A where the plan's does not divide K."""
    B, T, H, K = k.shape
    V, S = v.shape[3], num_segments
    if S < 2 or T % (BT * S):
        raise ValueError(f"{S} segments need S ≥ 2 and T a multiple of {BT * S}, got T={T}")
    view = lambda x: segments.as_segments(x, S)
    gc_s, beta_s, bound_s = (segments.head_major_as_segments(x, S) for x in (gc_hm, beta_hm, bound))
    flags = forward.segment_flags(bound_s, S, k.device, B, config)
    mn = walk_launch.states_maps(view(k), view(v), gc_s, beta_s, view(t_inv), flags.skip_m, **fitted_launch(K, launch))
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    h_in = seq_parallel.affine_scan(mn, h0, V, B, nseg=S, BV=config.scan_bv, skip=flags.skip_m, skip_writes=True,
                                    **scan_options(K, config))
    return walk_launch.chunk_states_hopper(k, v, gc_s, beta_s, t_inv, h_in, warm_chunks=flags.warm, **launch)[0]


def planned_states(k, v, gc_hm, beta_hm, t_inv, bound, initial_state, num_segments: int, launch: dict,
                   config: HopperPlanConfig = DEFAULT) -> torch.Tensor:
    """h as :func:`segmented_states` gives it, in one launch after the pre-pass (the planned forward's walk,
    ``forward.planned_walk``, with the states walk's operator): each segment's program starts the fewest chunks
    before it whose bounds sum below ``config.negligible_m_log2`` (from zero: within 2^negligible_m_log2 of the
    state), or at the sequence's start from its initial state (exact), and stores h at its own chunks. gc, β and
    the chunk bounds take one copy each into per-segment rows. A head that never forgets walks its whole prefix, so
    the plan takes this only for the host-bound sizes, as it does forwards."""
    S = num_segments
    gc_s, beta_s, bound_s = (segments.head_major_as_segments(x, S) for x in (gc_hm, beta_hm, bound))
    return walk_launch.chunk_states_hopper(k, v, gc_s, beta_s, t_inv, initial_state, warm_bound=bound_s,
                                           warm_threshold=config.negligible_m_log2, **launch)[0]


def whole_chunks(x_hm: torch.Tensor, T: int) -> torch.Tensor:
    """Head-major ``[B, HV, Tp]`` (the pre-pass's, Tp = T rounded up to 8) → ``[B, HV, NT·64]``, zero-padded: the
    walk's rows (its dg, dβ partials have them too); x_hm itself where T is a multiple of 64."""
    pad = cdiv(T, BT) * BT - x_hm.shape[-1]
    return torch.nn.functional.pad(x_hm, (0, pad)) if pad else x_hm


def chunk_gated_delta_rule_bwd_hopper(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                                      do: torch.Tensor, dht: Optional[torch.Tensor], BV: Optional[int] = None,
                                      segment_chunks: Optional[int] = None, cu_seqlens: Optional[torch.Tensor] = None,
                                      offsets: Optional[list[int]] = None):
    """Backward of the chunked gated delta rule on the Hopper walk (sm_90, bf16): equal-length sequences, or packed
    ones (``cu_seqlens``) run as a padded batch of one length (``varlen.py``).

    Args:
        q, k: ``[B, T, H, K]`` bf16; v: ``[B, T, HV, V]`` bf16 (K, V in :data:`SIZES`); g: ``[B, T, HV]`` fp32 log
            decays; beta: ``[B, T, HV]`` (as given to the forward). scale: the query scale.
        initial_state: ``[N, HV, K, V]`` or None (N = B, or the packed sequences' count). do: ``[B, T, HV, V]``
            bf16, the output's gradient.
        dht: ``[N, HV, K, V]``, the final state's gradient, or None (zeros).
        BV: the V columns per program (None: ``chunk_bwd.BV_DEFAULT``, at most V).
        segment_chunks: walk in segments of this many chunks (``segments.py``; an int dividing T/64, T a multiple
            of 64; ≥ T/64 walks unsegmented; with ``cu_seqlens``, of the padded batch's T): tests and benchmarks.
            None: ``segments.plan_walk``. Each segment's dS_out comes from a reverse warm-up: within
            2⁻³⁰ of ‖dS‖, exact where the warm-up reaches the sequence's end.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of N sequences packed along T (B = 1), or None.
        offsets: cu_seqlens' values on the host where the caller holds them (None: read from the device).
    Returns:
        dq, dk ``[B, T, H, K]`` bf16, dv ``[B, T, HV, V]`` bf16, dg (g's dtype), dbeta (beta's dtype) ``[B, T, HV]``
        and dh0 ``[N, HV, K, V]`` in initial_state's dtype (None without initial_state): the contract of
        ``triton_bwd.chunk_gated_delta_rule_bwd_triton``.
    """
    preparable = cu_seqlens is None and BV is None and segment_chunks is None
    if preparable:
        key = backward_prepared.signature(q, k, v, g, beta, scale, initial_state, do, dht)
        call = backward_prepared.prepared_call(key)
        if call is not None:
            return call(q, k, v, g, beta, do, initial_state, dht)
    if isinstance(cu_seqlens, torch.Tensor) and offsets is None:
        offsets = cu_seqlens.tolist()
    check_inputs(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens, offsets)
    options = dict(BV=BV, segment_chunks=segment_chunks)
    if cu_seqlens is not None:
        return backward_packed(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens, offsets, **options)
    grads = backward_equal_lengths(q, k, v, g, beta, scale, initial_state, do, dht, **options)
    if preparable and stages_in_place():
        backward_prepared.remember(key, lambda: prepare(q, v, beta, scale, initial_state, dht))
    return grads


def prepare(q, v, beta, scale: float, initial_state: Optional[torch.Tensor], dht: Optional[torch.Tensor]):
    """The prepared call of these (checked) arguments' signature (``backward_prepared.build``), or None."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    sms = num_sms(q.device)
    BV, walk_plan = choose_walk(B, T, H, HV, K, V, None, None, sms)
    return backward_prepared.build(q, v, beta.dtype, scale, initial_state is not None,
                                   None if initial_state is None else initial_state.dtype, dht is not None, BV,
                                   walk_plan, sms)


def stages_in_place() -> bool:
    """Whether the plain backward ran on the functions ``backward_prepared.py`` repeats (tests swap in twins,
    benchmarks timed wrappers: those calls are not prepared, so they keep running through them)."""
    return all(getattr(module, name) is original for module, name, original in _PREPARED_STAGES)


def backward_packed(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], do: torch.Tensor,
                    dht: Optional[torch.Tensor], cu_seqlens: torch.Tensor, offsets: list[int], **options):
    """:func:`backward_equal_lengths` on packed rows ``[1, total, ...]`` (checked): q, k, v, g, β and dO padded
    into the ``[N, Tp, ...]`` batch (``varlen.to_padded``: views where the sequences share one length, Tp =
    ``varlen.padded_rows``), the initial state and dht per sequence as they are, dq, dk, dv, dg and dβ gathered back
    to the packed rows (``varlen.from_padded``), dh0 per sequence as the batch's. Exact: ``varlen.py``."""
    N, total, Tp = len(offsets) - 1, q.shape[1], varlen.padded_rows(offsets)
    batch = [varlen.to_padded(x, cu_seqlens, N, Tp) for x in (q, k, v, g, beta, do)]
    *grads, dh0 = backward_equal_lengths(*batch[:5], scale, initial_state, batch[5], dht, **options)
    del batch           # the padded inputs freed before the gradients are copied out
    return (*(varlen.from_padded(x, cu_seqlens, total) for x in grads), dh0)


def backward_equal_lengths(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor], do: torch.Tensor,
                           dht: Optional[torch.Tensor], BV: Optional[int], segment_chunks: Optional[int]):
    """:func:`chunk_gated_delta_rule_bwd_hopper` on ``[B, T, ...]`` batches of equal-length sequences (checked
    inputs): the recompute, the segments' dS_out (the reverse warm-ups), then the walk and the reductions over the
    rows (sequences, or segments) in the batches of ``segments.walk_batch_rows`` (:func:`walk_rows`)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    sms = num_sms(q.device)
    BV, plan = choose_walk(B, T, H, HV, K, V, BV, segment_chunks, sms)
    L = plan.L
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    gc_hm, beta_hm, t_inv, bound = solve(k, g, beta)
    S = cdiv(T, BT) // L if L else 1
    seg = lambda x: segments.as_segments(x, S)
    # the walk's gc and β in its segments' rows (copies where S > 1; the reverse maps read them too), made before the
    # gradients are allocated and the pre-pass's own dropped: the walk's peak, the backward's, holds one of each
    gc_walk, beta_walk = (segments.head_major_as_segments(x, S) for x in (gc_hm, beta_hm))
    dS_out = segments.warm_state_grads(q, k, v, do, gc_hm, beta_hm, gc_walk, beta_walk, t_inv, bound, dht, scale,
                                       L, segments.warm_slice(BV), sms) if L else dht
    h = states(k, v, gc_hm, beta_hm, t_inv, bound, initial_state)
    del gc_hm, beta_hm, bound
    # the gradients, written a batch of rows at a time through segment views (dq, dk, dv, dg, dβ) and rows (dh0)
    dq, dk = (torch.empty_like(q) for _ in range(2))
    dv = torch.empty_like(v)
    dg = torch.empty_like(g)
    dbeta = torch.empty(B, T, HV, dtype=beta.dtype, device=q.device)
    # dh0 of every row written over the row's own dS_out where that buffer is the backward's (the warm-ups', or
    # zeros for dht None): each program reads its block of dS_out before its walk and writes the same block of dh0
    # after it, and no other program touches that block. Neither an initial state nor dht: the walk's build
    # without state gradients, and no [B, HV, K, V] buffer
    if dS_out is None and initial_state is None:
        dh0 = None
    elif dS_out is None:
        dS_out = dh0 = torch.zeros(B, HV, K, V, dtype=torch.float32, device=q.device)
    elif L:
        dh0 = dS_out
    else:
        dh0 = torch.empty(B, HV, K, V, dtype=torch.float32, device=q.device)
    walk_inputs = [seg(q), seg(k), seg(v), seg(do), gc_walk, beta_walk, seg(t_inv), seg(h), dS_out]
    per_batch = segments.walk_batch_rows(B * S, HV, V, BV, sms, plan.parts)
    grads = (seg(dq), seg(dk), seg(dv), seg(dg), seg(dbeta), dh0)
    if per_batch == B * S:          # one batch: the views themselves (no slices: host time on small calls)
        walk_rows(walk_inputs, scale, BV, seg(g), H, grads)
    else:
        for r in range(0, B * S, per_batch):
            batch = lambda x, rows=slice(r, r + per_batch): None if x is None else x[rows]  # dS_out, dh0 may be None
            walk_rows([batch(x) for x in walk_inputs], scale, BV, batch(seg(g)), H, tuple(batch(x) for x in grads))
    del h
    if initial_state is None:
        return dq, dk, dv, dg, dbeta, None
    dh0 = dh0.view(B, S, HV, K, V)[:, 0].contiguous()     # each sequence's first segment's
    return dq, dk, dv, dg, dbeta, dh0.to(initial_state.dtype)


def choose_walk(B: int, T: int, H: int, HV: int, K: int, V: int, BV: Optional[int], segment_chunks: Optional[int],
                sms: int) -> tuple[int, segments.WalkPlan]:
    """The walk's V columns per program and its plan (``segments.plan_walk``). The role-split walk
    (``chunk_bwd_roles``: one program over the whole V, built for K = V in its sizes) where ``BV`` is V, the slice
    walk where ``BV`` is another width; ``BV`` None: whichever of the two the segment model prices lower (the
    role-split walk's step is longer, but it runs half the programs: it wins where the slice walk needs a second
    wave or fewer, longer segments). At K = V = 64 the slice width is V: the role-split walk is the one priced."""
    slice_width = min(V, chunk_bwd.BV_DEFAULT)
    if BV is None:     # V first: a tie keeps the role-split walk
        widths = sorted({V, slice_width}, reverse=True) if takes_roles(K, V, V) else [slice_width]
    else:
        widths = [BV]
    NT = cdiv(T, BT)
    best = None
    for width in widths:
        step_us = segments.ROLES_CHUNK_US if takes_roles(K, V, width) else segments.WALK_CHUNK_US
        plan = segments.plan_walk(segment_chunks, B, T, HV, V, width, HV // H, sms, step_us)
        cost = segments.walk_cost_us(B, NT, HV, V, width, plan.L or NT, sms, plan.parts, step_us)
        if best is None or cost < best[0]:
            best = cost, width, plan
    return best[1], best[2]


def takes_roles(K: int, V: int, BV: int) -> bool:
    """Whether a walk over ``BV`` columns per program is the role-split one: BV = V = K in its sizes."""
    return K == V == BV and K in chunk_bwd_roles.SIZES


def walk_rows(walk_inputs: list, scale: float, BV: int, g: torch.Tensor, H: int, out: tuple) -> None:
    """The walk over some rows (sequences, or segment views) and its reductions (:func:`gradients_from_partials`)
    into ``out`` = (dq, dk, dv, dg, dβ, dh0) of those rows; g theirs. The walk: the role-split one
    (``chunk_bwd_roles``) where ``BV`` is the whole V and it takes K, V (:func:`takes_roles`), else the slice walk
    (``chunk_bwd.chunk_bwd_hopper``). Where HV = H the walk writes dq, dk themselves (no reduction but the gates');
    else its per-value-head dq, dk live only within this call. dh0 None (and dht None among the inputs): the
    walk without state gradients."""
    dq, dk, dv, dg, dbeta, dh0 = out
    K, V = walk_inputs[0].shape[3], walk_inputs[2].shape[3]
    G = walk_inputs[2].shape[2] // H
    direct = dict(dq=dq, dk=dk) if G == 1 else {}
    state = dict(dh0=dh0) if dh0 is not None else dict(want_dh0=False)
    if takes_roles(K, V, BV):
        walk = chunk_bwd_roles.chunk_bwd_roles_hopper(*walk_inputs, scale, dv=dv, **state, **direct)
    else:
        walk = chunk_bwd.chunk_bwd_hopper(*walk_inputs, scale, BV, dv=dv, **state, **direct)
    dq_heads, dk_heads, _, dg_p, dbeta_p, _ = walk
    gradients_from_partials(dq_heads, dk_heads, dg_p, dbeta_p, g, dbeta.dtype, dq.dtype, H, out=(dq, dk, dg, dbeta))


def gradients_from_partials(dq_heads, dk_heads, dg_p, dbeta_p, g: torch.Tensor, beta_dtype: torch.dtype,
                            qk_dtype: torch.dtype, H: int, out: Optional[tuple] = None) -> tuple[torch.Tensor, ...]:
    """The reductions after the walk, one launch (``common/partial_sum.partial_sums``): dq, dk ``[B, T, H, K]`` in
    ``qk_dtype`` from the walk's per value head ``[B, T, HV, K]`` (the gradients themselves where HV = H); dg (g's
    dtype, zero where the gate is below the floor: such gates do not move the output) and dβ (``beta_dtype``)
    ``[B, T, HV]`` from the head-major partials ``[NV, B, HV, Lp]``; written into ``out`` = (dq, dk, dg, dβ) where
    given."""
    return partial_sums(dq_heads, dk_heads, dg_p, dbeta_p, g, H, qk_dtype, beta_dtype, out=out)


# what the prepared calls repeat (stages_in_place): this module's stages and the launchers under them
_PREPARED_STAGES = [(module, name, getattr(module, name)) for module, names in (
    (sys.modules[__name__], ("backward_equal_lengths", "solve", "states", "planned_states", "walk_rows",
                             "gradients_from_partials")),
    (segments, ("warm_state_grads",)), (prepass, ("prepass_hopper",)), (chunk_bwd, ("reverse_warm_ups_hopper",)),
    (reverse_maps, ("segment_maps", "reverse_map_scan")), (chunk_bwd_roles, ("chunk_bwd_roles_hopper",)),
    (walk_launch, ("chunk_states_hopper", "states_maps", "chunk_fwd_hopper_hm"))) for name in names]
