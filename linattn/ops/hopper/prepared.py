"""The Hopper forward's host work done once per signature: the checks, the plan's arithmetic and the compiled
kernels' lookups of ``forward.forward_hopper``, so that a repeated call only allocates, takes views and launches.

Why: rows 1, 3 and 7 of issue 4 are host-bound on the H200's hosts (run 31: B=1 T=32768 H=16 takes 0.322 ms of GPU
time on five launches and ≈ 240 µs of host time per call, ≈ 475 in a slow process state; B=1 T=4096 H=16 0.077 ms
on two launches and 164–200 µs). ``benchmarks/host_hopper.py`` (the kernels replaced by no-ops) measures the Python
around the launches on a CPU.

How it stays the same computation: a signature (the inputs' shapes and dtypes, the initial state's, the scale,
the device, the plan's keywords and every module switch the forward reads, :func:`switches`) is prepared only after
the plain forward has run once under it and returned (so its checks passed for those shapes; none of them reads a
value); the prepared call then issues the launches the plain forward issues, in the same order, with the same
kernels and arguments (``tests/ops/test_hopper_prepared.py`` records both with the kernels stubbed and compares
them, under every switch). Configurations it does not cover (the Triton pre-pass, an fp32 A_inv, the role-split
kernel, the segmented forward without warm-ups) always take the plain forward.
"""
from __future__ import annotations

import functools
import operator
import threading
from typing import Callable, NamedTuple, Optional

import torch

from ..common.seq_parallel import affine_scan, affine_scan_launcher
from . import chunk_fwd, map_bound, prepass, walk_launch
from . import forward as fwd

# Whether forward_hopper prepares repeated signatures (off: the plain forward on every call)
PREPARED = True

# Whether a prepared call keeps its scratch tensors for the next call on the same stream and thread: the
# pre-pass's gc, β, A_inv and chunk bounds, the kernels' unread stand-ins (h0 without an initial state, skip_m),
# and phase A's maps and unread final states. It never keeps what it returns. Why: the host-bound rows allocate
# 6–9 tensors per call (issue 4's row 1: five of its seven). At ≈ 3–5 µs each on the H200's hosts, that is
# 15–35 µs of a 104–153 µs call (run 32). Predicted there: −15 to −25 µs of host time at rows 1 and 7. Run 33
# (H200, op_time_check --kept-scratch-ab, two off/on pairs, host µs per call): row 1 178 → 121 and 168 → 141, row 7
# 333 → 273 and 385 → 340 (GPU time unchanged, o and the state bitwise; the GPU test passes): on.
#
# Why it is the same computation: torch.empty's contents are whatever its block last held. So the plain forward's
# results cannot depend on anything its kernels did not write in the same call (the lean maps, the stand-ins).
# A kept set holds just such contents. A stream runs its calls in order, so the next call's pre-pass starts after
# the last call's walk has read A_inv. Each thread and stream has its own set (two threads on one stream would
# interleave their launches). A call under CUDA graph capture allocates as before, so a graph never shares memory
# with the eager calls. Only the latest signature's set is kept per stream and thread, and only up to
# SCRATCH_MAX_BYTES. A set that is replaced goes back to the caching allocator on its own stream, the only one
# that used it; release_scratch() gives every kept set back (torch.cuda.empty_cache() does not reach them).
REUSE_SCRATCH = True
SCRATCH_MAX_BYTES = 64 << 20       # 64 MiB: row 7's five launches hold ≈ 60 MB; larger calls are GPU-bound


# Every module setting the Hopper forward's plain path reads (part of a signature: flipping one prepares anew), by
# module; tests/ops/test_hopper_prepared.py checks that every other upper-case setting of these modules is one the
# path does not read (the plan's, which shape the launch keywords instead, and constants)
SWITCHES = {
    "forward": ("PREPASS", "A_INV_DTYPE", "SKIP_NEGLIGIBLE_MAPS", "WARM_UP", "WARM_UP_MAX_FRACTION",
                "NEGLIGIBLE_M_LOG2", "LEAN_SEGMENTS", "SCAN_BV", "SCAN_WHOLE_MAP", "SCAN_PRECISION", "OVERLAP_WARM",
                "MAP_WAVE_FILL", "SPLIT_HEADS_CAP"),
    "prepass": ("BETA_IN_A_INV", "MIN_BLOCKS_PER_SM", "TMA_KEYS", "A_ROW_PAD", "T_ROW_PAD", "STEP4_BLOCKED",
                "A_BEFORE_STORES", "STEP4_MMA", "T_HI_ROW_PAD", "STEP6_BETA"),
    "chunk_fwd": ("ASYNC_O_STORE", "ASYNC_AX", "DEFERRED_DECAY", "DEFERRED_DECAY_LIMIT", "FOLD_P_DECAY",
                  "UNIFORM_WARPGROUP", "STATE_ONLY_WARMUPS", "DIRECT_LAUNCH", "EXECUTION_BACKEND"),
    "map_bound": ("BLOCK", "TILE", "PLAN_WARPS", "MAP_CHUNK_COST", "SCAN_STEP_COST", "WALK_CHUNK_COST"),
}
_get_forward, _get_prepass, _get_chunk_fwd, _get_map_bound = (operator.attrgetter(*names) for names in
                                                              SWITCHES.values())


def switches() -> tuple:
    """The values of :data:`SWITCHES` now (read per call: ≈ 1 µs)."""
    return _get_forward(fwd), _get_prepass(prepass), _get_chunk_fwd(chunk_fwd), _get_map_bound(map_bound)


def signature(q, k, v, g, beta, scale, initial_state, options: tuple) -> tuple:
    """The key of a prepared call: what the plain forward's path and launches depend on (not the values)."""
    state = None if initial_state is None else (initial_state.shape, initial_state.dtype)
    return (q.shape, k.shape, v.shape, g.shape, beta.shape, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, state,
            float(scale), q.device, options, switches())


_prepared: dict[tuple, Callable] = {}
MAX_PREPARED = 256          # signatures kept (a process that sees more starts over: each holds no tensors)


def prepared_call(key: Optional[tuple]) -> Optional[Callable]:
    """The prepared call of ``key`` (None: not prepared, :data:`PREPARED` off), or None before the plain forward
    has run under it."""
    return _prepared.get(key) if key is not None else None


def remember(key: tuple, q, k, v, beta, scale, initial_state, a_inv_dtype, segments, prepass_name, skip_maps,
             warm_up, plan_in_walk, launch: dict, split_heads: bool = False) -> None:
    """After the plain forward returned for these arguments: prepare ``key`` where :func:`build` covers it."""
    if key is None or key in _prepared or not plain_functions_in_place():
        return
    if len(_prepared) >= MAX_PREPARED:
        _prepared.clear()
    # None where build covers it not: the plain forward keeps it, and build does not run again for it
    _prepared[key] = build(q, k, v, beta.dtype, scale, initial_state is not None, a_inv_dtype, segments,
                           prepass_name, skip_maps, warm_up, plan_in_walk, launch, split_heads)


def plain_functions_in_place() -> bool:
    """Whether the plain forward ran on the functions this module repeats (tests and ``op_time_check.py
    --host-parts`` swap in twins or timed wrappers: their calls are not prepared, so they keep running through
    them)."""
    return (fwd.prepass_hopper is prepass.prepass_hopper and fwd.chunk_fwd_hopper_hm is walk_launch.chunk_fwd_hopper_hm
            and fwd.segment_plan is map_bound.segment_plan and fwd.affine_scan is affine_scan)


_scratch: dict[tuple, tuple] = {}     # (thread, stream) → (the prepared call that made it, its tensors)


def scratch(owner: Callable, make: Callable, device: torch.device, nbytes: int) -> Scratch:
    """The scratch tensors of prepared call ``owner`` on this thread and stream: ``make(device)``'s, kept from its
    last call there with :data:`REUSE_SCRATCH` (see its comment), else new."""
    if not REUSE_SCRATCH or nbytes > SCRATCH_MAX_BYTES:
        return make(device)
    cuda = device.type == "cuda"
    if cuda and torch.cuda.is_current_stream_capturing():
        return make(device)
    where = (threading.get_ident(), torch.cuda.current_stream(device).cuda_stream if cuda else None)
    kept = _scratch.get(where)
    if kept is not None and kept[0] is owner:
        return kept[1]
    _scratch.pop(where, None)        # the stream's last set back to the allocator before the new one is made
    tensors = make(device)
    _scratch[where] = (owner, tensors)
    return tensors


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
    """Give every kept scratch set back to the caching allocator (:data:`REUSE_SCRATCH`)."""
    _scratch.clear()


def build(q, k, v, beta_dtype, scale, has_state, a_inv_dtype, segments, prepass_name, skip_maps, warm_up,
          plan_in_walk, launch: dict, split_heads: bool = False) -> Optional[Callable]:
    """The prepared call ``(q, k, v, g, beta, initial_state) -> (o, final state)`` for these arguments of
    ``forward_hopper`` (after its checks passed), or None where it covers them not: the TileLang pre-pass with a
    bf16 A_inv, the default kernel (no roles), and segmented, the planned warm walk (also split between two tiles
    by head), or the five launches with warm-ups. Each step below names the plain function whose allocations and
    launch it repeats."""
    name, a_dtype = fwd.resolve_prepass(prepass_name, a_inv_dtype)
    if name != "tilelang" or a_dtype != torch.bfloat16 or launch.get("roles"):
        return None
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    S = segments if segments and segments > 1 else 1
    warm = fwd.WARM_UP if warm_up is None else warm_up
    if S > 1 and not plan_in_walk and not warm:
        return None
    opts = dict(launch)
    BV, threads, num_stages = opts.pop("BV", 64), opts.pop("threads", 128), opts.pop("num_stages", 2)
    async_dots, tma_o, stsm = opts.pop("async_dots", False), opts.pop("tma_o", False), opts.pop("stsm", False)
    min_blocks = opts.pop("min_blocks", 1)
    if opts:            # a launch option this module does not know: the plain forward keeps it
        return None
    BT, bf16, f32, i32 = chunk_fwd.BT, torch.bfloat16, torch.float32, torch.int32
    BS, L = B * S, T // S
    Lp, LC = chunk_fwd.padded_length(L), -(-L // BT)
    beta_in_a = fwd.a_inv_has_beta(prepass_name, a_inv_dtype)
    lean = S > 1 and fwd.LEAN_SEGMENTS      # segmented here means with warm-ups, planned or not
    # the compiled kernels (cached since the plain forward's call) and their tvm_ffi executables
    prepass_exe = chunk_fwd.launcher(prepass.prepass_kernel(H, HV, K, beta_dtype, prepass.BETA_IN_A_INV))
    walk = functools.partial(walk_launch.walk_kernel, H, HV, K, V)
    warm_walk = functools.partial(walk_launch.warm_kernel, H, HV, K, V, BV, scale, threads, num_stages)

    # the pre-pass's outputs (shape, dtype): A_inv, gc, β, the chunk bounds
    prepass_outputs = (((B, T, HV, BT), bf16), ((BS, HV, Lp), f32), ((BS, HV, Lp), beta_dtype), ((BS, HV, LC), f32))

    def prepass_scratch(device, extra: tuple) -> Scratch:
        """New scratch tensors: the pre-pass's outputs (and A_inv's view as the segments'), then one per (shape,
        dtype) of ``extra``."""
        a_inv, gc, beta, bound = (torch.empty(shape, dtype=dtype, device=device) for shape, dtype in prepass_outputs)
        return Scratch(a_inv, a_inv.view(BS, L, HV, BT), gc, beta, bound,
                       tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in extra))

    def scratch_of(extra: tuple) -> Callable:
        """``held(owner, device)``: the owner's :class:`Scratch` with ``extra`` (:func:`scratch`)."""
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
        walk_exe = chunk_fwd.launcher(walk(BV, scale, threads, num_stages, has_state, beta_dtype, bf16, async_dots,
                                           False, tma_o, stsm, beta_in_a, min_blocks, False))
        held_by = scratch_of(h0_extra + (((B, HV), i32),))     # and skip_m's stand-in (read by affine walks only)

        def unsegmented(q, k, v, g, beta, initial_state):
            """forward_hopper unsegmented: the pre-pass, then walk_launch.chunk_fwd_hopper_hm's walk."""
            device = q.device
            held = held_by(unsegmented, device)
            run_prepass(k, g, beta, held)
            o = torch.empty_like(v)
            ht = torch.empty(B, HV, K, V, dtype=f32, device=device)
            walk_exe(q.contiguous(), k.contiguous(), v.contiguous(), held.gc, held.beta, held.a_inv,
                     h0_of(initial_state, held), held.extra[-1], o, ht)
            return o, ht
        return unsegmented

    if split_heads:
        # forward.split_heads_walks: the cold heads' whole walks at BV=64 and the others' segments at the launch's
        # tile, on forward.split_heads_order's streams
        split_exes = [chunk_fwd.launcher(walk_launch.warm_kernel(
            H, HV, K, V, width, scale, threads, num_stages, has_state, beta_dtype, bf16, async_dots, stsm, beta_in_a,
            fwd.NEGLIGIBLE_M_LOG2, min_blocks, lean=True, head_split=subset, split_cap=fwd.SPLIT_HEADS_CAP))
            for width, subset in ((64, 2), (BV, 1))]
        held_by = scratch_of(h0_extra * 2)          # each launch its own h0 stand-in, as state_arg makes them

        def split(q, k, v, g, beta, initial_state):
            """forward_hopper with split_heads: the pre-pass, then the two planned warm walks into one o and final
            state (forward.split_heads_walks)."""
            device = q.device
            held = held_by(split, device)
            run_prepass(k, g, beta, held)
            o = torch.empty_like(v)
            ht = torch.empty(B, HV, K, V, dtype=f32, device=device)
            inputs = (q.contiguous(), k.contiguous(), v.contiguous(), held.gc, held.beta, held.a_inv)
            h0s = (h0_of(initial_state, held),) * 2 if has_state else held.extra
            fwd.split_heads_order(lambda: split_exes[0](*inputs, h0s[0], held.bound, o, ht),
                                  lambda: split_exes[1](*inputs, h0s[1], held.bound, o, ht), device)
            return o, ht
        return split

    if plan_in_walk:
        planned_exe = chunk_fwd.launcher(warm_walk(has_state, beta_dtype, bf16, async_dots, stsm, beta_in_a,
                                                   fwd.NEGLIGIBLE_M_LOG2, min_blocks, lean))
        held_by = scratch_of(h0_extra)

        def planned(q, k, v, g, beta, initial_state):
            """forward_hopper with plan_in_walk: the pre-pass, then the walk that plans its warm-ups
            (walk_launch._warm_walk with the bounds)."""
            device = q.device
            held = held_by(planned, device)
            run_prepass(k, g, beta, held)
            o = torch.empty_like(v)
            ht = torch.empty(B if lean else BS, HV, K, V, dtype=f32, device=device)
            planned_exe(q.contiguous(), k.contiguous(), v.contiguous(), held.gc, held.beta, held.a_inv,
                        h0_of(initial_state, held), held.bound, o, ht)
            return o, fwd.last_segments(ht, B, S, lean)
        return planned

    skip = fwd.SKIP_NEGLIGIBLE_MAPS if skip_maps is None else skip_maps
    w_max = max(1, int(LC * fwd.WARM_UP_MAX_FRACTION))
    slots = fwd.map_slots(q.device, B)       # the wave-fill rule's (0: off)
    affine_exe = chunk_fwd.launcher(walk(fwd.fitted_launch(K, launch)["BV"], scale, threads, num_stages, False,
                                         beta_dtype, bf16, async_dots, True, tma_o, stsm, beta_in_a, min_blocks,
                                         lean))
    overlap = lean and fwd.OVERLAP_WARM
    # phase C's warm walk, or under OVERLAP_WARM its two halves: the warmed segments', then the others'
    warm_exes = [chunk_fwd.launcher(warm_walk(True, beta_dtype, bf16, async_dots, stsm, beta_in_a, None, min_blocks,
                                              lean, subset)) for subset in ((1, 2) if overlap else (0,))]
    # phase A's maps [M | N] and its h0 stand-in (the affine walk starts from [I | 0] and reads none), then the
    # plan's flags (map_bound.plan_outputs': negligible, warm, walk, skip_m)
    held_by = scratch_of((((BS, HV, K, K + V), f32), ((BS, HV, K, V), f32))
                         + tuple(((BS, HV), dtype) for dtype in map_bound.PLAN_FLAG_DTYPES))
    # the plan's and the scan's launches configured once (map_bound.segment_plan, seq_parallel.affine_scan)
    plan = map_bound.segment_plan_launcher(BS, HV, LC, S, w_max, fwd.NEGLIGIBLE_M_LOG2, skip, True, slots)
    scan = affine_scan_launcher(BS, HV, K, V, B, S, fwd.SCAN_BV, has_state, lean, **fwd.scan_options(K))

    def five_launches(q, k, v, g, beta, initial_state):
        """forward_hopper segmented with warm-ups: the pre-pass, the plan (map_bound.segment_plan), phase A
        (chunk_fwd_hopper_hm's affine walk on the segments as sequences: views), the scan, phase C (the warm
        walk from the entering states)."""
        device = q.device
        held = held_by(five_launches, device)
        run_prepass(k, g, beta, held)
        flags = plan(held.bound, held.extra[2:])
        qs, ks, vs = (x.contiguous().view(BS, L, *x.shape[2:]) for x in (q, k, v))
        mn, h0_stand_in = held.extra[:2]
        initial = initial_state.float().contiguous() if initial_state is not None else None
        o = torch.empty_like(v)
        ht = torch.empty(B if lean else BS, HV, K, V, dtype=f32, device=device)
        # forward._forward_hopper_plain's fork under OVERLAP_WARM: the maps' chain on the critical side stream
        critical, join = fwd.critical_fork(device) if overlap else fwd.no_fork()
        with critical:
            affine_exe(qs, ks, vs, held.gc, held.beta, held.a_inv_segments, h0_stand_in, flags.skip_m, vs, mn)
            h_in = scan(mn, initial, flags.skip_m)
            if overlap:
                warm_exes[1](q.contiguous(), k.contiguous(), v.contiguous(), held.gc, held.beta, held.a_inv, h_in,
                             flags.warm, o, ht)
        warm_exes[0](q.contiguous(), k.contiguous(), v.contiguous(), held.gc, held.beta, held.a_inv, h_in, flags.warm,
                     o, ht)
        join()
        return o, fwd.last_segments(ht, B, S, lean)
    return five_launches
