"""The public op's repeated calls sent straight to their prepared Hopper forward (``hopper/prepared.py``).

Why: on the host-bound rows of issue 4 the op's own work before the Hopper forward is a fifth to a quarter of a
call. Run 31 measured 278 µs per call through the op at B=1 T=32768 H=16 against 245 in ``forward_hopper``, and
run 32 measured 104–153 µs per call at B=1 T=4096 H=16 after prepared calls. That work is the input checks, the
backend choice, the dispatch, ``hopper_plan`` (the device gates and the plan) and ``forward_hopper``'s own signature.
A route skips it for a signature whose last plain call ended in a prepared Hopper forward.

A route is the prepared call itself. It is keyed by what the plain path's checks and choices read: each input's
shape, dtype and device, the initial state's, the scale, the backend argument, and the module switches along the
way (:func:`switches`). Values are not part of it, and none of those checks or choices reads one. A route serves only
calls that the plain path would send the same way, whatever their values:
* plain tensors, not traced (``eager_call``);
* no gradient to record;
* no packed sequences and no in-op pre-processing (their arguments are None or False);
* inputs on 16-byte boundaries (``hopper.chunk_fwd.misaligned``, which reads addresses: checked on every call).

A route is recorded once the plain path has ended in a prepared call (``forward_hopper`` says so through
:func:`served`): that call's checks passed under this key, and its plan chose the prepared signature.
"""
from __future__ import annotations

import functools
import operator
import threading
from typing import Callable, Optional

import torch

# Whether the op takes recorded routes. Session 26, CPU only (benchmarks/host_hopper.py, the kernels as no-ops, a
# 2-core CPU): the op's µs per call prepared → routed 70.9 → 32.9 at row 1 (B=1 T=4096 H=16, two launches) and
# 141.3 → 113.8 at row 7 (B=1 T=32768 H=2 HV=8, five launches). Predicted −25 to −40 µs of host time per call at
# both rows on the H200. Run 33 (H200, op_time_check --routes-ab, host µs per call, off/on pairs): row 1 152 → 138
# and 164 → 116; row 7 297 → 360, 293 → 341, then 321 → 289, 315 → 322, 368 → 321, 365 → 277 (means of the last
# four 342 → 302; that host's calls spread by ±15% between pairs). With kept scratch (both off → both on, three
# pairs): row 1 146 → 56, 94 → 82, 96 → 53, and its op 0.144 / 0.077 / 0.079 → 0.077 / 0.078 / 0.078 ms (its GPU
# time, 0.077); row 7 375 → 294, 391 → 262, 339 → 255. o and the state bitwise; the GPU test passes: on.
ROUTES = True

_routes: dict[tuple, Callable] = {}
MAX_ROUTES = 256                 # keys kept (a process that sees more starts over: a route holds no tensors)
_served = threading.local()      # the prepared Hopper forward that served this thread's last plain call, if any


def served(call: Callable) -> None:
    """``forward_hopper``: the prepared call ``call`` served this thread's current call."""
    _served.call = call


@functools.cache
def _modules():
    """(triton_chunk, hopper.chunk_fwd, hopper.forward, hopper.prepared), imported on first use (a route exists
    only after the Hopper forward ran)."""
    from ..hopper import chunk_fwd, forward, prepared
    from . import triton_chunk
    return triton_chunk, chunk_fwd, forward, prepared


# The module settings the plain route reads before forward_hopper (by module; hopper.prepared.SWITCHES holds those
# forward_hopper reads). tests/ops/test_prepared_route.py checks that every other upper-case setting of these modules
# is one the route does not read.
SWITCHES = {
    "triton_chunk": ("FORWARD_PATH",),
    "chunk_fwd": ("COMPILE_FAILED",),
    "forward": ("LAUNCH", "FILL_FRACTION", "MIN_SEGMENT_CHUNKS", "MIN_SEGMENTED_HEAD_TOKENS", "SMALL_SEGMENTED",
                "SMALL_PLAN_IN_WALK", "SEGMENTED_WHEN_CAPTURED", "SEGMENTED_AUTO", "WIDE_SEGMENTS", "SPLIT_HEADS",
                "SPLIT_HEADS_NARROW_FIRST", "TWO_PER_SM", "TWO_PER_SM_LAUNCH"),
}
_getters = tuple(operator.attrgetter(*names) for names in SWITCHES.values())


def switches() -> tuple:
    """The values of :data:`SWITCHES` and of ``hopper.prepared``'s now (dicts as their items)."""
    triton_chunk, chunk_fwd, forward, prepared = _modules()
    path, failed, plan = (get(m) for get, m in zip(_getters, (triton_chunk, chunk_fwd, forward)))
    plan = tuple(tuple(v.items()) if isinstance(v, dict) else v for v in plan)
    return (path, failed), plan, prepared.PREPARED, prepared.switches()


def key(q, k, v, g, beta, scale, initial_state, backend) -> tuple:
    """What the plain route's checks and choices read of these arguments (no values)."""
    state = None if initial_state is None else (initial_state.shape, initial_state.dtype, initial_state.device)
    # the scale's type too: True == 1 as a key, yet the checks refuse a bool
    return (q.shape, k.shape, v.shape, g.shape, beta.shape, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
            q.device, k.device, v.device, g.device, beta.device, state, type(scale), scale, backend, switches())


def servable(tensors: tuple) -> bool:
    """Whether a call on ``tensors`` (q, k, v, g, β, the initial state) may take a route: plain, untraced tensors,
    no gradient to record, and a capture that cannot change the plan (``forward.SEGMENTED_WHEN_CAPTURED``)."""
    from ..utils import eager_call
    if not eager_call(*tensors):
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    forward = _modules()[2]
    return not (forward.SEGMENTED_WHEN_CAPTURED and torch.cuda.is_current_stream_capturing())


def lookup(q, k, v, g, beta, scale, initial_state, backend) -> Optional[Callable]:
    """The route of this call, or None (none recorded, or a call a route may not serve). The op asks only with
    :data:`ROUTES` on."""
    if not _routes or not servable((q, k, v, g, beta, initial_state)):
        return None
    return _routes.get(key(q, k, v, g, beta, scale, initial_state, backend))


def start() -> None:
    """Before a plain call: nothing served it yet."""
    _served.call = None


def remember(q, k, v, g, beta, scale, initial_state, backend) -> None:
    """After a plain call: record its route if a prepared Hopper forward served it."""
    call = getattr(_served, "call", None)
    if call is None or not servable((q, k, v, g, beta, initial_state)):
        return
    _served.call = None
    if len(_routes) >= MAX_ROUTES:
        _routes.clear()
    _routes[key(q, k, v, g, beta, scale, initial_state, backend)] = call


def run(route: Callable, q, k, v, g, beta, initial_state) -> Optional[tuple]:
    """``route`` on the inputs as the plain route passes them (contiguous), or None where they start off a 16-byte
    boundary (the plain route then takes the Triton paths)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if _modules()[1].misaligned(q, v, k, g, beta, initial_state) is not None:
        return None
    return route(q, k, v, g, beta, initial_state)
