"""The Hopper backward's host work done once per signature: the checks, the plans (the walk's segments, the states'
and the warm-ups' paths) and the compiled kernels' lookups of ``backward.backward_equal_lengths``, so that a
repeated call only allocates, takes views and launches.

Why: at host-bound sizes (B = 1, T = 4096, 16 heads: 0.43 ms on the GPU, ≈ 1 ms of host time a call) the plain
backward's own Python — the checks of every launcher, its ``.contiguous()`` and ``.float()`` calls on tensors that
already are, the plans and the kernel caches' keys — is a large share of the call.

A signature (every input's shape and dtype, the initial state's and dht's, the scale and the device) is prepared
only after the plain backward has run once under it and returned, so its checks passed for those shapes (none of
them reads a value), and only where it walks the role-split walk (the slice walk's signatures keep the plain
backward). The prepared call issues the plain backward's launches in
the same order, with the same kernels and arguments (``tests/ops/test_hopper_backward_prepared.py`` records both
with the kernels stubbed and compares them), so its outputs are the plain backward's bit for bit.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..common import partial_sum
from ..common.seq_parallel import affine_scan_launcher
from ..utils import cdiv
from . import chunk_bwd, chunk_bwd_roles, chunk_fwd, map_bound, prepass, reverse_maps, segments, walk_launch
from . import plan as plan_module
from .chunk_fwd import BT, padded_length
from .plan import DEFAULT, fitted_launch, hopper_launch, map_slots, scan_options, warm_up_max

_prepared: dict[tuple, Optional[Callable]] = {}
f32, bf16, i32 = torch.float32, torch.bfloat16, torch.int32


def signature(q, k, v, g, beta, scale, initial_state, do, dht) -> tuple:
    """The key of a prepared call: what the plain backward's checks and path read of its arguments (no values)."""
    state = lambda x: None if x is None else (x.shape, x.dtype)
    return (q.shape, k.shape, v.shape, g.shape, beta.shape, do.shape, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
            do.dtype, state(initial_state), state(dht), type(scale), scale, q.device)


def prepared_call(key: tuple) -> Optional[Callable]:
    """The prepared call of ``key``, or None (not prepared yet, or a signature the plain backward keeps)."""
    return _prepared.get(key)


def remember(key: tuple, build_call: Callable[[], Optional[Callable]]) -> None:
    """After the plain backward returned under ``key``: prepare it (``build_call()``: :func:`build`'s call, or None
    where the signature keeps the plain backward)."""
    if key in _prepared:
        return
    if len(_prepared) >= plan_module.CACHE_LIMITS.prepared:
        _prepared.clear()
    _prepared[key] = build_call()


def build(q, v, beta_dtype: torch.dtype, scale: float, has_state: bool, state_dtype, has_dht: bool, BV: int,
          walk_plan: segments.WalkPlan, sms: int) -> Optional[Callable]:
    """The prepared call ``(q, k, v, g, beta, do, initial_state, dht) -> (dq, dk, dv, dg, dβ, dh0)`` of
    ``backward.backward_equal_lengths`` for these arguments (checked), the walk ``BV`` and ``walk_plan`` being
    ``backward.choose_walk``'s; None where it takes a path not prepared here (the module docstring)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT, L = cdiv(T, BT), walk_plan.L
    S = NT // L if L else 1
    if not (K == V == BV and K in chunk_bwd_roles.SIZES):      # the slice walk: not prepared
        return None
    per_batch = segments.walk_batch_rows(B * S, HV, V, BV, sms, walk_plan.parts)
    solve = _solve(B, T, H, HV, K, beta_dtype)
    warm = _warm_ups(B, T, H, HV, K, V, scale, S, L, segments.warm_slice(BV), sms) if L else None
    states = _states(B, T, H, HV, K, V, has_state, q.device, sms)
    # the walk's state gradients (dS_out in, dh0 out): where the warm-ups give dS_out, or dht or h0 is given
    state_grads = bool(L) or has_dht or has_state
    walk = _walk(B, T, H, HV, K, V, scale, S, state_grads, per_batch)

    def call(q, k, v, g, beta, do, initial_state, dht):
        """backward.backward_equal_lengths' launches, in its order."""
        q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
        gc_hm, beta_hm, t_inv, bound = solve(k, g, beta)
        gc_walk, beta_walk = (segments.head_major_as_segments(x, S) for x in (gc_hm, beta_hm))
        dS_out = warm(q, k, v, do, gc_hm, beta_hm, gc_walk, beta_walk, t_inv, bound, dht) if L else dht
        h = states(k, v, gc_hm, beta_hm, t_inv, bound, initial_state)
        del gc_hm, beta_hm, bound
        dq, dk = (torch.empty_like(q) for _ in range(2))
        dv, dg = torch.empty_like(v), torch.empty_like(g)
        dbeta = torch.empty(B, T, HV, dtype=beta.dtype, device=q.device)
        if not state_grads:
            dh0 = None
        elif dS_out is None:
            dS_out = dh0 = torch.zeros(B, HV, K, V, dtype=f32, device=q.device)
        else:
            dh0 = dS_out if L else torch.empty(B, HV, K, V, dtype=f32, device=q.device)
        seg = lambda x: segments.as_segments(x, S)
        walk([seg(q), seg(k), seg(v), seg(do), gc_walk, beta_walk, seg(t_inv), seg(h), dS_out], seg(g),
             (seg(dq), seg(dk), seg(dv), seg(dg), seg(dbeta), dh0))
        del h
        if initial_state is None:
            return dq, dk, dv, dg, dbeta, None
        dh0 = dh0.view(B, S, HV, K, V)[:, 0].contiguous()
        return dq, dk, dv, dg, dbeta, dh0.to(state_dtype)
    return call


def _solve(B: int, T: int, H: int, HV: int, K: int, beta_dtype: torch.dtype) -> Callable:
    """``backward.solve``: the pre-pass (β read in its dtype where bf16 or fp32, else as fp32)."""
    read_dtype = beta_dtype if beta_dtype in (bf16, f32) else f32
    exe = prepass.launcher(prepass.prepass_kernel(H, HV, K, read_dtype, False))
    Tp, NT = padded_length(T), cdiv(T, BT)
    pad = NT * BT - Tp

    def run(k, g, beta):
        beta = beta if beta.dtype == read_dtype else beta.float()
        a_inv = torch.empty(B, T, HV, BT, dtype=bf16, device=k.device)
        gc_hm = torch.empty(B, HV, Tp, dtype=f32, device=k.device)
        beta_hm = torch.empty(B, HV, Tp, dtype=read_dtype, device=k.device)
        bound = torch.empty(B, HV, NT, dtype=f32, device=k.device)
        exe(k, g, beta, a_inv, gc_hm, beta_hm, bound)
        beta_hm = beta_hm.float()
        if pad:         # backward.whole_chunks
            gc_hm, beta_hm = (torch.nn.functional.pad(x, (0, pad)) for x in (gc_hm, beta_hm))
        return gc_hm, beta_hm, a_inv, bound
    return run


def _warm_ups(B: int, T: int, H: int, HV: int, K: int, V: int, scale: float, S: int, L: int, BV: int,
              sms: int) -> Callable:
    """``segments.warm_state_grads``: the reverse warm-ups, and where ``segments.takes_maps`` says so the segments'
    maps (M alone) and their scan."""
    maps = segments.takes_maps(S, L)
    warm_exe = chunk_bwd.launcher(chunk_bwd.compiled_warm_kernel(H, HV, K, V, scale, BV, capped=maps))
    rows = B * S
    if maps:        # reverse_maps.segment_maps (walk_launch.states_maps) and reverse_map_scan
        maps_exe = _maps_executable(H, HV, K, V, reverse_maps.maps_tiles(rows, HV, K, sms), m_only=True)
        scan = reverse_maps.reverse_map_scan_launcher(B, HV, K, V)

    def run(q, k, v, do, gc_hm, beta_hm, gc_s, beta_s, t_inv, bound, dht):
        dht = dht.float().contiguous() if dht is not None else q.new_zeros(B, HV, K, V, dtype=f32)
        ds_out = torch.empty(rows, HV, K, V, dtype=f32, device=q.device)
        flags = torch.empty(rows, HV, dtype=i32, device=q.device)
        warm_exe(q, k, do, gc_hm, beta_hm, t_inv, dht, bound, ds_out, flags)
        if maps:
            seg = lambda x: segments.as_segments(x, S)
            ks, vs = seg(k), seg(v)
            m = torch.empty(rows, HV, K, K, dtype=f32, device=q.device)
            maps_exe(ks, ks, vs, gc_s, beta_s, seg(t_inv), torch.empty(rows, HV, K, V, dtype=f32, device=q.device),
                     flags, vs, m)
            scan(ds_out, m, flags, S)
        return ds_out
    return run


def _states(B: int, T: int, H: int, HV: int, K: int, V: int, has_state: bool, device: torch.device,
            sms: int) -> Callable:
    """``backward.states``: unsegmented, in the planned walk's two launches (``planned_states``) or in the forward's
    five (``segmented_states``: the segment plan, the maps, their scan, the warm states walk)."""
    chosen = plan_module.plan(B, HV, V, T, sms)
    S = chosen.segments if chosen is not None else 1
    launch = chosen.kernel_launch if S > 1 else hopper_launch(B, HV, V, sms) or DEFAULT.launch(64)
    five = S > 1 and not chosen.planned_walk
    kernel = lambda **options: chunk_fwd.launcher(walk_launch.states_kernel(
        H, HV, K, V, launch["BV"], launch["threads"], launch["num_stages"], **options))
    NT = cdiv(T, BT)
    if S == 1:
        exe = kernel(use_initial_state=has_state, beta_dtype=f32)
    elif not five:
        exe = kernel(use_initial_state=has_state, beta_dtype=f32, warm=True,
                     threshold=chosen.config.negligible_m_log2)
    else:
        config, BS, LC = chosen.config, B * S, NT // S
        flags_of = map_bound.segment_plan_launcher(BS, HV, LC, S, warm_up_max(LC, config), config.negligible_m_log2,
                                                   True, True, map_slots(device, B))
        maps_exe = _maps_executable(H, HV, K, V, fitted_launch(K, launch), m_only=False)
        scan = affine_scan_launcher(BS, HV, K, V, B, S, config.scan_bv, has_state, True, **scan_options(K, config))
        exe = kernel(use_initial_state=True, beta_dtype=f32, warm=True)

    def run(k, v, gc_hm, beta_hm, t_inv, bound, initial_state):
        device = k.device
        if S > 1:
            gc_hm, beta_hm, bound = (segments.head_major_as_segments(x, S) for x in (gc_hm, beta_hm, bound))
        if five:        # backward.segmented_states
            flags = flags_of(bound, map_bound.plan_outputs(BS, HV, device))
            seg = lambda x: segments.as_segments(x, S)
            ks, vs = seg(k), seg(v)
            mn = torch.empty(BS, HV, K, K + V, dtype=f32, device=device)
            maps_exe(ks, ks, vs, gc_hm, beta_hm, seg(t_inv), torch.empty(BS, HV, K, V, dtype=f32, device=device),
                     flags.skip_m, vs, mn)
            h0 = initial_state.float().contiguous() if initial_state is not None else None
            entering, ctl = scan(mn, h0, flags.skip_m), flags.warm
        else:
            entering = walk_launch.state_arg(initial_state, (B, HV, K, V), device)
            ctl = bound if S > 1 else torch.empty(B, HV, dtype=i32, device=device)
        h = torch.empty(B, NT, HV, K, V, dtype=bf16, device=device)
        ht = torch.empty(B, HV, K, V, dtype=f32, device=device)
        exe(k, k, v, gc_hm, beta_hm, t_inv, entering, ctl, h, ht)
        return h
    return run


def _maps_executable(H: int, HV: int, K: int, V: int, tiles: dict, m_only: bool) -> Callable:
    """``walk_launch.states_maps``' kernel: the lean affine walk of the states walk's operator (no initial state,
    fp32 β) at ``tiles`` (BV, threads, num_stages), M alone with ``m_only``."""
    return chunk_fwd.launcher(walk_launch.walk_kernel(H, HV, K, V, tiles["BV"], 1.0, tiles["threads"],
                                                      tiles["num_stages"], use_initial_state=False,
                                                      beta_dtype=f32, affine=True, lean=True,
                                                      beta_in_a_inv=False, m_only=m_only))


def _walk(B: int, T: int, H: int, HV: int, K: int, V: int, scale: float, S: int, state_grads: bool,
          per_batch: int) -> Callable:
    """``backward.walk_rows`` over the rows in batches of ``per_batch`` (``segments.walk_batch_rows``): the role-split
    walk (``chunk_bwd_roles_hopper``), then the reductions (``partial_sum.partial_sums``), a batch at a time."""
    exe = chunk_bwd_roles.launcher(chunk_bwd_roles.compiled_kernel(H, HV, K, V, scale, state_grads=state_grads))
    rows, Ls, G = B * S, T // S, HV // H
    Lp = cdiv(Ls, BT) * BT
    heads_dtypes = chunk_bwd.qk_heads_dtypes(G)
    sums = {n: partial_sum.partial_sums_launcher(n, Ls, H, HV, K, 1, Lp)
            for n in {min(per_batch, rows - r) for r in range(0, rows, per_batch)}}

    def walk_batch(inputs: list, g, out: tuple) -> None:
        q, k, v, do, gc, beta, t_inv, h, dht = inputs
        dq, dk, dv, dg, dbeta, dh0 = out
        n, device = q.shape[0], q.device
        if state_grads:
            dht = dht.float().contiguous()
        else:
            dht, dh0 = torch.zeros(1, dtype=f32, device=device), torch.empty(1, dtype=f32, device=device)
        if G > 1:       # the walk's dq, dk per value head, summed by the reductions
            dq_heads, dk_heads = (torch.empty(n, Ls, HV, K, dtype=dtype, device=device) for dtype in heads_dtypes)
        else:
            dq_heads, dk_heads = dq, dk
        dg_p, dbeta_p = (gc.new_empty(1, n, HV, Lp) for _ in range(2))
        exe(q, k, v, do, gc, beta, t_inv, h, dht, dq_heads, dk_heads, dv, dg_p[0], dbeta_p[0], dh0)
        sums[n](dq_heads, dk_heads, dg_p, dbeta_p, g, dq, dk, dg, dbeta)

    def run(inputs: list, g, out: tuple) -> None:
        if per_batch == rows:
            walk_batch(inputs, g, out)
            return
        for r in range(0, rows, per_batch):
            batch = lambda x, part=slice(r, r + per_batch): None if x is None else x[part]
            walk_batch([batch(x) for x in inputs], batch(g), tuple(batch(x) for x in out))
    return run
