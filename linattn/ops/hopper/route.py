"""The public op's repeated calls sent straight to their prepared Hopper forward (``prepared.py``).

Why: on host-bound shapes the op's own work before the Hopper forward (the input checks, the backend and path
choice, the plan, the prepared forward's signature) is a fifth to a quarter of a call. A route skips it for a
signature whose last plain call ended in a prepared Hopper forward.

A route is the prepared call itself, keyed by what the plain path's checks and choices read: each input's shape,
dtype and device, the initial state's, the scale, the backend and the forward path asked for. Values are not part
of it, and none of those checks or choices reads one. A route serves only calls that the plain path would send the
same way, whatever their values:
* plain tensors, not traced (``eager_call``);
* no gradient to record;
* no packed sequences and no in-op pre-processing (the op asks only then);
* inputs on 16-byte boundaries (``chunk_fwd.misaligned``, which reads addresses: checked on every call).

A route is recorded once the plain path has ended in a prepared call (the forward says so through :func:`served`):
that call's checks passed under this key, and its plan chose the prepared signature.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from ..utils import eager_call
from .chunk_fwd import misaligned

_routes: dict[tuple, Callable] = {}
_served = threading.local()      # the prepared Hopper forward that served this thread's last plain call, if any


def served(call: Callable) -> None:
    """The Hopper forward: the prepared call ``call`` served this thread's current call."""
    _served.call = call


def key(q, k, v, g, beta, scale, initial_state, backend, forward_path) -> tuple:
    """What the plain route's checks and choices read of these arguments (no values)."""
    state = None if initial_state is None else (initial_state.shape, initial_state.dtype, initial_state.device)
    # the scale's type too: True == 1 as a key, yet the checks refuse a bool
    return (q.shape, k.shape, v.shape, g.shape, beta.shape, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
            q.device, k.device, v.device, g.device, beta.device, state, type(scale), scale, backend, forward_path)


def servable(tensors: tuple) -> bool:
    """Whether a call on ``tensors`` (q, k, v, g, β, the initial state) may take a route: plain, untraced tensors
    and no gradient to record."""
    if not eager_call(*tensors):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def lookup(q, k, v, g, beta, scale, initial_state, backend, forward_path) -> Optional[Callable]:
    """The route of this call, or None (none recorded, or a call a route may not serve)."""
    if not _routes or not servable((q, k, v, g, beta, initial_state)):
        return None
    return _routes.get(key(q, k, v, g, beta, scale, initial_state, backend, forward_path))


def start() -> None:
    """Before a plain call: nothing served it yet."""
    _served.call = None


def remember(q, k, v, g, beta, scale, initial_state, backend, forward_path) -> None:
    """After a plain call: record its route if a prepared Hopper forward served it."""
    call = getattr(_served, "call", None)
    if call is None or not servable((q, k, v, g, beta, initial_state)):
        return
    _served.call = None
    from . import plan as plan_module  # here, not at import: the plan imports triton, optional on CPU machines
    if len(_routes) >= plan_module.CACHE_LIMITS.routes:
        _routes.clear()
    _routes[key(q, k, v, g, beta, scale, initial_state, backend, forward_path)] = call


def run(route: Callable, q, k, v, g, beta, initial_state) -> Optional[tuple]:
    """``route`` on the inputs as the plain route passes them (contiguous), or None where they start off a 16-byte
    boundary (the plain route then takes the Triton paths)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if misaligned(q, v, k, g, beta, initial_state) is not None:
        return None
    return route(q, k, v, g, beta, initial_state)
