"""The Hopper forward's host work done once per signature: the checks, the plan's arithmetic and the compiled
kernels' lookups of ``forward.forward_plain``, so that a repeated call only allocates, takes views and launches.

A signature (the inputs' shapes and dtypes, the initial state's, the scale, the device and the plan) is prepared
only after the plain forward has run once under it and returned, so its checks passed for those shapes (none of
them reads a value). The prepared call then issues the launches the plain forward issues, in the same order, with
the same kernels and arguments (``tests/ops/test_hopper_prepared.py`` records both with the kernels stubbed and
compares them).
"""
from __future__ import annotations

import contextlib
import functools
import operator
import threading
from typing import Callable, Iterator, NamedTuple, Optional

import torch

from ..common.seq_parallel import affine_scan_launcher
from . import chunk_fwd, map_bound, prepass, walk_launch
from . import plan as plan_module
from .plan import HopperPlan, fitted_launch, map_slots, scan_options, warm_up_max
from .precompile import Build


def signature(q, k, v, g, beta, scale, initial_state, plan: HopperPlan) -> tuple:
    """The key of a prepared call: what the plain forward's path and launches depend on (not the values)."""
    state = None if initial_state is None else (initial_state.shape, initial_state.dtype)
    return (q.shape, k.shape, v.shape, g.shape, beta.shape, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, state,
            float(scale), q.device, plan)


_prepared: dict[tuple, Optional[Callable]] = {}


def prepared_call(key: tuple) -> Optional[Callable]:
    """The prepared call of ``key``, or None before the plain forward has run under it."""
    return _prepared.get(key)


def remember(key: tuple, plan: HopperPlan, q, v, beta, scale, initial_state) -> None:
    """After the plain forward returned for these arguments: prepare ``key``."""
    if key in _prepared:
        return
    if len(_prepared) >= plan_module.CACHE_LIMITS.prepared:
        _prepared.clear()
    _prepared[key] = build(plan, q, v, beta.dtype, scale, initial_state is not None)


class _Kept:
    """One kept scratch set: the prepared call that made it, its tensors and bytes, and whether a call holds it."""
    __slots__ = ("owner", "tensors", "nbytes", "busy")

    def __init__(self, owner: Callable, tensors, nbytes: int):
        self.owner, self.tensors, self.nbytes, self.busy = owner, tensors, nbytes, False


_scratch: dict[tuple, _Kept] = {}    # (device, stream) → its kept set, least recently used first
_scratch_lock = threading.Lock()


def stream_key(device: torch.device) -> tuple:
    """Where a kept set may be used again: the device and the caller's current stream on it (one key off CUDA)."""
    if device.type != "cuda":
        return (device.type, None)
    stream = torch.cuda.current_stream(device)
    return (device.type, stream.device_index, stream.cuda_stream)


@contextlib.contextmanager
def scratch(owner: Callable, make: Callable, device: torch.device, nbytes: int) -> Iterator[Scratch]:
    """The scratch tensors of prepared call ``owner`` for the launches issued inside the ``with``: ``make(device)``'s,
    kept from its last call on this device and stream, else new.

    Why reading a kept set is the same computation: torch.empty's contents are whatever its block last held, so the
    plain forward's results cannot depend on anything its kernels did not write in the same call; a kept set holds
    just such contents. It is never read stale:
    * one set per (device, stream), used only by calls on that stream, which runs them in order: the next call's
      pre-pass starts after the last call's walk has read A_inv;
    * a set is held for the duration of one call's launches; a call on the same stream meanwhile (another thread's)
      gets new tensors, so two calls' launches never interleave on one set;
    * a call under CUDA graph capture allocates as before, so a graph never shares memory with the eager calls;
    * what a call returns is never kept.
    Kept sets are bounded by ``plan.CACHE_LIMITS.scratch_bytes`` per device, least recently used first out (a set
    larger than that is never kept); threads share their stream's set, so no thread leaves one behind. A set that
    goes goes back to the caching allocator on the stream that used it."""
    cuda, limit = device.type == "cuda", plan_module.CACHE_LIMITS.scratch_bytes
    if nbytes > limit or (cuda and torch.cuda.is_current_stream_capturing()):
        yield make(device)
        return
    where = stream_key(device)
    with _scratch_lock:
        kept = _scratch.get(where)
        if kept is not None and kept.busy:
            kept = None                      # another call holds this stream's set: new tensors, not kept
        elif kept is not None and kept.owner is owner:
            _scratch[where] = _scratch.pop(where)        # the most recently used last
        else:
            _scratch.pop(where, None)        # the stream's last set back to the allocator before the new one is made
            _evict(where[:2], limit - nbytes)
            kept = _scratch[where] = _Kept(owner, make(device), nbytes)
        if kept is not None:
            kept.busy = True
    if kept is None:
        yield make(device)
        return
    try:
        yield kept.tensors
    finally:
        kept.busy = False


def _evict(device_key: tuple, budget: int) -> None:
    """Drop this device's least recently used sets until they hold at most ``budget`` bytes (held sets stay)."""
    on_device = [(where, kept) for where, kept in _scratch.items() if where[:2] == device_key]
    total = sum(kept.nbytes for _, kept in on_device)
    for where, kept in on_device:
        if total <= budget:
            break
        if not kept.busy:
            del _scratch[where]
            total -= kept.nbytes


def kept_bytes() -> int:
    """The bytes of every kept scratch set."""
    return sum(kept.nbytes for kept in _scratch.values())


class Scratch(NamedTuple):
    """A prepared call's scratch tensors: prepass.prepass_hopper's outputs (A_inv [B, T, HV, 64] and its view as the
    segments' [B·S, L, HV, 64], gc and β [B·S, HV, Lp], the chunk bounds [B·S, HV, L/64]), then the plan's own."""
    a_inv: torch.Tensor
    a_inv_segments: torch.Tensor
    gc: torch.Tensor
    beta: torch.Tensor
    bound: torch.Tensor
    extra: tuple


def release_scratch() -> None:
    """Give every kept scratch set back to the caching allocator (``torch.cuda.empty_cache()`` does not reach
    them); a set held by a call in flight goes when that call ends."""
    with _scratch_lock:
        _scratch.clear()


def walk_builds(H: int, HV: int, K: int, V: int, scale: float, launch: dict, has_state: bool,
                beta_dtype: torch.dtype, threshold: float) -> dict:
    """The kernels the plain forward launches for this signature, by role, as builds (``precompile.Build``: call
    one for its compiled kernel, cached since its first call): "prepass", "walk" (unsegmented), "planned" (the warm
    walk that plans its warm-ups below ``threshold``), "affine" (phase A), "warm" (phase C); ``launch``: the walk's
    BV, threads and num_stages. The one place that names the kernel builders' positional options."""
    BV, threads, stages = launch["BV"], launch["threads"], launch["num_stages"]
    walk = lambda *options: Build(walk_launch.walk_kernel, (H, HV, K, V) + options)
    warm = lambda *options: Build(walk_launch.warm_kernel, (H, HV, K, V, BV, scale, threads, stages) + options)
    return dict(
        prepass=Build(prepass.prepass_kernel, (H, HV, K, beta_dtype)),
        walk=walk(BV, scale, threads, stages, has_state, beta_dtype, False, False),
        planned=warm(has_state, beta_dtype, threshold, True),
        affine=walk(fitted_launch(K, launch)["BV"], scale, threads, stages, False, beta_dtype, True, True),
        warm=warm(True, beta_dtype, None, True),
    )


def forward_builds(plan: HopperPlan, H: int, HV: int, K: int, V: int, scale: float, has_state: bool,
                   beta_dtype: torch.dtype) -> list:
    """The builds of the kernels the forward launches under ``plan`` (:func:`walk_builds`' roles that the plan
    takes: the pre-pass, then the walk, the planned walk, or phases A and C), for ``precompile.precompile``."""
    builds = walk_builds(H, HV, K, V, scale, fitted_launch(V, plan.kernel_launch), has_state, beta_dtype,
                         plan.config.negligible_m_log2)
    roles = ("walk",) if plan.segments == 1 else ("planned",) if plan.planned_walk else ("affine", "warm")
    return [builds["prepass"]] + [builds[role] for role in roles]


def build(plan: HopperPlan, q, v, beta_dtype, scale, has_state) -> Callable:
    """The prepared call ``(q, k, v, g, beta, initial_state) -> (o, final state)`` of ``forward.forward_plain``
    under ``plan`` for these arguments (after its checks passed). Each step below names the plain function whose
    allocations and launch it repeats."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    S, config = plan.segments, plan.config
    launch = fitted_launch(V, plan.kernel_launch)
    kernels = walk_builds(H, HV, K, V, scale, launch, has_state, beta_dtype, config.negligible_m_log2)
    BT, bf16, f32, i32 = chunk_fwd.BT, torch.bfloat16, torch.float32, torch.int32
    BS, L = B * S, T // S
    Lp, LC = chunk_fwd.padded_length(L), -(-L // BT)
    prepass_exe = chunk_fwd.launcher(kernels["prepass"]())

    # the pre-pass's outputs (shape, dtype): A_inv, gc, β, the chunk bounds
    prepass_outputs = (((B, T, HV, BT), bf16), ((BS, HV, Lp), f32), ((BS, HV, Lp), beta_dtype), ((BS, HV, LC), f32))

    def prepass_scratch(device, extra: tuple) -> Scratch:
        """New scratch tensors: the pre-pass's outputs (and A_inv's view as the segments'), then one per (shape,
        dtype) of ``extra``."""
        a_inv, gc, beta, bound = (torch.empty(shape, dtype=dtype, device=device) for shape, dtype in prepass_outputs)
        return Scratch(a_inv, a_inv.view(BS, L, HV, BT), gc, beta, bound,
                       tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in extra))

    def scratch_of(extra: tuple) -> Callable:
        """``held_by(owner, device)``: a context holding the owner's :class:`Scratch` with ``extra``
        (:func:`scratch`)."""
        nbytes = sum(functools.reduce(operator.mul, shape, 1) * dtype.itemsize
                     for shape, dtype in prepass_outputs + extra)
        make = functools.partial(prepass_scratch, extra=extra)
        return lambda owner, device: scratch(owner, make, device, nbytes)

    def run_prepass(k, g, beta, held: Scratch) -> None:
        """prepass.prepass_hopper into the scratch: gc and β per segment, A_inv and the chunk bounds."""
        prepass_exe(k.contiguous().view(BS, L, H, K), g.float().contiguous().view(BS, L, HV),
                    beta.contiguous().view(BS, L, HV), held.a_inv_segments, held.gc, held.beta, held.bound)

    # walk_launch.state_arg's h0 without an initial state: uninitialised, never read (the first of the extras)
    h0_extra = () if has_state else (((B, HV, K, V), f32),)

    def h0_of(initial_state, held: Scratch) -> torch.Tensor:
        """walk_launch.state_arg: the initial state in fp32, or the scratch's stand-in."""
        return initial_state.float().contiguous() if has_state else held.extra[0]

    if S == 1:
        walk_exe = chunk_fwd.launcher(kernels["walk"]())
        held_by = scratch_of(h0_extra + (((B, HV), i32),))     # and skip_m's stand-in (read by affine walks only)

        def unsegmented(q, k, v, g, beta, initial_state):
            """The pre-pass, then walk_launch.chunk_fwd_hopper_hm's walk."""
            device = q.device
            o = torch.empty_like(v)
            ht = torch.empty(B, HV, K, V, dtype=f32, device=device)
            with held_by(unsegmented, device) as held:
                run_prepass(k, g, beta, held)
                walk_exe(q.contiguous(), k.contiguous(), v.contiguous(), held.gc, held.beta, held.a_inv,
                         h0_of(initial_state, held), held.extra[-1], o, ht)
            return o, ht
        return unsegmented

    if plan.planned_walk:
        planned_exe = chunk_fwd.launcher(kernels["planned"]())
        held_by = scratch_of(h0_extra)

        def planned(q, k, v, g, beta, initial_state):
            """forward.planned_walk: the pre-pass, then the walk that plans its warm-ups from the chunk bounds."""
            device = q.device
            o = torch.empty_like(v)
            ht = torch.empty(B, HV, K, V, dtype=f32, device=device)
            with held_by(planned, device) as held:
                run_prepass(k, g, beta, held)
                planned_exe(q.contiguous(), k.contiguous(), v.contiguous(), held.gc, held.beta, held.a_inv,
                            h0_of(initial_state, held), held.bound, o, ht)
            return o, ht
        return planned

    affine_exe = chunk_fwd.launcher(kernels["affine"]())
    warm_exe = chunk_fwd.launcher(kernels["warm"]())
    # phase A's maps [M | N] and its h0 stand-in (the affine walk starts from [I | 0] and reads none), then the
    # plan's flags (map_bound.plan_outputs': negligible, warm, walk, skip_m)
    held_by = scratch_of((((BS, HV, K, K + V), f32), ((BS, HV, K, V), f32))
                         + tuple(((BS, HV), dtype) for dtype in map_bound.PLAN_FLAG_DTYPES))
    # the plan's and the scan's launches configured once (forward.segment_flags, seq_parallel.affine_scan)
    segment_plan = map_bound.segment_plan_launcher(BS, HV, LC, S, warm_up_max(LC, config), config.negligible_m_log2,
                                                   True, True, map_slots(q.device, B))
    scan = affine_scan_launcher(BS, HV, K, V, B, S, config.scan_bv, has_state, True, **scan_options(K, config))

    def five_launches(q, k, v, g, beta, initial_state):
        """forward.segmented_walk: the pre-pass, the plan, phase A (the affine walk on the segments as sequences:
        views), the scan, phase C (the warm walk from the entering states)."""
        device = q.device
        qs, ks, vs = (x.contiguous().view(BS, L, *x.shape[2:]) for x in (q, k, v))
        initial = initial_state.float().contiguous() if initial_state is not None else None
        o = torch.empty_like(v)
        ht = torch.empty(B, HV, K, V, dtype=f32, device=device)
        with held_by(five_launches, device) as held:
            run_prepass(k, g, beta, held)
            flags = segment_plan(held.bound, held.extra[2:])
            mn, h0_stand_in = held.extra[:2]
            affine_exe(qs, ks, vs, held.gc, held.beta, held.a_inv_segments, h0_stand_in, flags.skip_m, vs, mn)
            h_in = scan(mn, initial, flags.skip_m)
            warm_exe(q.contiguous(), k.contiguous(), v.contiguous(), held.gc, held.beta, held.a_inv, h_in,
                     flags.warm, o, ht)
        return o, ht
    return five_launches
