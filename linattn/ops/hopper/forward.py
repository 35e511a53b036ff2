"""The Hopper forward end to end, for a plan of ``plan.py``: the pre-pass (``prepass.py``: gc, β head-major, each
chunk's A_inv diag(β) in bf16 and the chunks' map bounds), then the fused walk (``walk_launch.chunk_fwd_hopper_hm``),
unsegmented or cut into segments (sequence parallelism). A signature seen before takes its prepared call
(``prepared.py``: the same launches without the checks and the plan's Python).

    forward_hopper(plan, q, k, v, g, beta, scale, initial_state, cu_seqlens) -> (o, final_state)
"""
from __future__ import annotations

from typing import Optional

import torch

from ..common import seq_parallel
from ..common.seq_parallel import affine_scan
from . import map_bound, prepared, route, walk_launch
from . import prepass as prepass_module
from .chunk_fwd import BT
from .map_bound import SegmentPlan, segment_plan
from .plan import (
    DEFAULT,
    HopperPlan,
    HopperPlanConfig,
    fitted_launch,
    map_slots,
    scan_options,
    warm_up_max,
)
from .prepass import prepass_hopper
from .varlen import from_padded, to_padded
from .walk_launch import chunk_fwd_hopper_hm


def forward_hopper(plan: HopperPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
                   cu_seqlens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """o ``[B, T, HV, V]`` and the final state ``[N, HV, K, V]`` fp32 from bf16 q, k ``[B, T, H, K]``, v
    ``[B, T, HV, V]``, fp32 log decays g and β ``[B, T, HV]``, run as ``plan`` says (``plan.plan_inputs``). Packed
    sequences (``cu_seqlens``, B = 1) run as an ``[N, plan.padded_rows]`` batch (``varlen.py``)."""
    if cu_seqlens is None:
        return forward_equal_lengths(plan, q, k, v, g, beta, scale, initial_state)
    N, Tp, total = cu_seqlens.shape[0] - 1, plan.padded_rows, q.shape[1]
    if q.shape[0] != 1 or Tp is None:
        raise ValueError(f"packed sequences need B = 1 and a plan made for them, got B = {q.shape[0]}")
    o, final_state = forward_equal_lengths(plan, *(to_padded(x, cu_seqlens, N, Tp) for x in (q, k, v, g, beta)),
                                           scale, initial_state)
    return from_padded(o, cu_seqlens, total), final_state


def forward_equal_lengths(plan: HopperPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward_hopper` on ``[B, T, ...]`` batches: the prepared call of this signature where there is one,
    else the plain forward (:func:`forward_plain`), after which the signature is prepared."""
    key = prepared.signature(q, k, v, g, beta, scale, initial_state, plan)
    call = prepared.prepared_call(key)
    if call is not None:
        route.served(call)          # the public op may record its route to this call
        return call(q, k, v, g, beta, initial_state)
    result = forward_plain(plan, q, k, v, g, beta, scale, initial_state)
    if kernels_in_place():
        prepared.remember(key, plan, q, v, beta, scale, initial_state)
    return result


def kernels_in_place() -> bool:
    """Whether the plain forward ran on the functions ``prepared.py`` repeats (tests swap in twins, benchmarks timed
    wrappers: those calls are not prepared, so they keep running through them)."""
    return (prepass_hopper is prepass_module.prepass_hopper and chunk_fwd_hopper_hm is walk_launch.chunk_fwd_hopper_hm
            and segment_plan is map_bound.segment_plan and affine_scan is seq_parallel.affine_scan)


def forward_plain(plan: HopperPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks, the pre-pass and the walks, on every call.

    ``plan.segments`` = S > 1 (T a multiple of 64·S): each sequence is cut into S segments of L = T/S tokens, which
    the kernels take as B·S sequences of their own (views: the pre-pass's gc is chunk-local and its A_inv per chunk,
    so they hold for the segments as they are). With ``plan.planned_walk`` the walk finds each segment's warm-up
    itself from the pre-pass's chunk bounds (two launches in all: :func:`planned_walk`); else the five launches of
    :func:`segmented_walk`."""
    T, S = q.shape[1], plan.segments
    if S > 1 and T % (BT * S):
        raise ValueError(f"{S} segments need T a multiple of {BT * S}, got T={T}")
    launch = fitted_launch(v.shape[3], plan.kernel_launch)
    gc_hm, beta_hm, a_inv, bound = prepass_hopper(k, g, beta, S)
    if S == 1:
        return chunk_fwd_hopper_hm(q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state, **launch)
    if plan.planned_walk:
        return planned_walk(q, k, v, gc_hm, beta_hm, a_inv, bound, scale, initial_state, plan.config, launch)
    return segmented_walk(q, k, v, gc_hm, beta_hm, a_inv, bound, scale, initial_state, S, plan.config, launch)


def planned_walk(q, k, v, gc_hm, beta_hm, a_inv, bound, scale, initial_state, config: HopperPlanConfig,
                 launch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The segmented forward's walk that plans its own warm-ups: each segment's walk starts the fewest chunks before
    it whose bounds sum below ``config.negligible_m_log2`` (or at the sequence's start, from its initial state,
    which is exact), so no plan, maps or scan are launched. For small shapes, whose five launches' host time would
    be the call's; a head that never forgets walks its whole prefix there."""
    o, ht = chunk_fwd_hopper_hm(q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state, warm_bound=bound,
                                warm_threshold=config.negligible_m_log2, lean=True, **launch)
    return o.reshape(v.shape), ht


def segmented_walk(q, k, v, gc_hm, beta_hm, a_inv, bound, scale, initial_state, segments: int,
                   config: HopperPlanConfig, launch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The five-launch segmented forward after the pre-pass:

        plan  per segment and head: negligible maps, warm-ups, heads that walk their maps (segment_flags)
        A     [M_s | N_s] = affine walk of the mapped heads' segments    chunk_fwd_hopper_hm(affine=True)
        B     h_in(s+1) = M_s h_in(s) + N_s                               seq_parallel.affine_scan, fp32
        C     o and the final states, each segment's walk started w_s chunks before it (from zero, or from S_0 at
              the sequence's start) or from its entering state h_in       chunk_fwd_hopper_hm(warm_chunks=)

    Heads that forget fast skip phases A and B: a warm-up from zero reaches the entering state within fp32 where
    the map over the warm-up's chunks is negligible. Phase A skips the M tiles of negligible maps and leaves the
    warmed heads' maps unwritten; the scan leaves their entering states unwritten (phase C starts those from zero
    itself), and phase C writes only each sequence's final state (``lean``)."""
    B, T, H, K = q.shape
    S = segments

    def seg(x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] → [B·S, T/S, ...], a view (the op passes contiguous tensors)."""
        return x.reshape(B * S, T // S, *x.shape[2:])

    flags = segment_flags(bound, S, q.device, B, config)
    _, mn = chunk_fwd_hopper_hm(seg(q), seg(k), seg(v), gc_hm, beta_hm, seg(a_inv), scale, None, affine=True,
                                skip_m=flags.skip_m, lean=True, **fitted_launch(K, launch))
    h_in = affine_scan(mn, initial_state.float().contiguous() if initial_state is not None else None, v.shape[3], B,
                       nseg=S, BV=config.scan_bv, skip=flags.skip_m, skip_writes=True, **scan_options(K, config))
    o, ht = chunk_fwd_hopper_hm(q, k, v, gc_hm, beta_hm, a_inv, scale, h_in, warm_chunks=flags.warm, lean=True,
                                **launch)
    return o.reshape(v.shape), ht


def segment_flags(bound: torch.Tensor, segments: int, device: torch.device, num_sequences: int,
                  config: HopperPlanConfig = DEFAULT) -> SegmentPlan:
    """``map_bound.SegmentPlan``, each flag ``[B·S, HV]``, from the pre-pass's chunk bounds ``[B·S, HV, L/64]``:
    the negligible maps (phase A skips their M tiles), the warm-ups (at most ``config.warm_up_max_fraction`` of a
    segment), the heads that walk their maps (phase A skips the others' maps), with the wave-fill rule. On the
    device, no host sync."""
    chunks = bound.shape[2]
    return segment_plan(bound, segments, warm_up_max(chunks, config), config.negligible_m_log2, True, True,
                        map_slots(device, num_sequences))

