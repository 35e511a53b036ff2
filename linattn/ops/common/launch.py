"""Launching a Triton kernel for less host time: the compiled kernel's own runner instead of the JIT launcher.

``kernel[grid](*args, **constexprs)`` costs tens of µs of host time per launch: Triton binds the arguments,
computes each one's specialisation and the cache key, then calls the compiled kernel. Where a call site launches the
same compiled kernel every time, the returned ``CompiledKernel``'s runner (``compiled[grid](*all_params)``) does
only the last step.

:func:`launch` keys each launch by what Triton specialises on (the constexprs, num_warps, each tensor's dtype and device, which arguments are None), takes
the first launch under a key on the JIT path and caches the compiled kernel it returns; later launches under that
key take the runner. What the key leaves out must not vary: every other integer argument must be in the kernel's
``do_not_specialize`` and fit in 32 bits, and every tensor must be 16-byte aligned (Triton specialises pointers on
it); a launch that breaks either takes the JIT path. Under the interpreter (``TRITON_INTERPRET=1``) the JIT path
returns no compiled kernel, so every launch takes it.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional

import torch

_compiled: dict[Hashable, Any] = {}


def _signature(kernel, args: tuple) -> tuple[tuple, bool]:
    """In one pass over the leading arguments: what Triton specialises them on that the runner cannot check (each
    tensor's dtype and device, which arguments are None), and whether the runner would launch what the JIT path
    would: 16-byte aligned tensors, and every integer argument unspecialised and 32-bit (Triton types an integer by
    its value: i32 below 2³¹)."""
    kinds = []
    same = True
    unspecialised = getattr(kernel, "do_not_specialize", ())   # the interpreter's kernels have none (nor a runner)
    for name, arg in zip(kernel.arg_names, args):
        if isinstance(arg, torch.Tensor):
            kinds.append((arg.dtype, arg.get_device()))
            if arg.data_ptr() % 16:
                same = False
        else:
            kinds.append(arg is None)
            if isinstance(arg, int) and not isinstance(arg, bool) and (
                    name not in unspecialised or not -2 ** 31 <= arg < 2 ** 31):
                same = False
    return tuple(kinds), same


def launch(kernel, grid: tuple, *args, num_warps: int = 4, **constexprs) -> Optional[tuple]:
    """``kernel[grid](*args, num_warps=num_warps, **constexprs)``; after the first launch
    under the same key, through the compiled kernel's runner (the module's docstring). ``args``: the kernel's
    leading non-constexpr parameters, positionally; ``constexprs``: every later parameter, by name. Returns the
    key's (compiled kernel, constexprs in the kernel's order) once there is one, else None."""
    kinds, same = _signature(kernel, args)
    key = (kernel, kinds, num_warps, tuple(constexprs.items()))
    entry = _compiled.get(key)
    if entry is not None and same:
        compiled, tail = entry      # the constexprs in the kernel's order: part of the key, so fixed per entry
        compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *tail)
        return entry
    result = kernel[grid](*args, num_warps=num_warps, **constexprs)
    # the JIT path returns the CompiledKernel it launched (None under the interpreter); only an aligned,
    # unspecialised launch may stand for the later ones
    if result is not None and hasattr(result, "__getitem__") and same:
        _compiled[key] = entry = (result, tuple(constexprs[name] for name in kernel.arg_names[len(args):]))
        return entry
    return None


class BoundLaunch:
    """:func:`launch` of one kernel on one grid with fixed constexprs, for a call site whose arguments keep what
    Triton specialises on from call to call (each tensor's dtype and device, which arguments are None, each
    integer's value class): a prepared call, whose signature fixes them. Its calls take :func:`launch` until that
    returns the compiled kernel, then its runner straight, with only the alignment of the tensors at positions
    ``foreign`` checked (the caller's own allocations come 16-byte aligned from the caching allocator; a misaligned
    foreign tensor takes :func:`launch` again: Triton would specialise on it). It skips :func:`_signature` and the
    key, a fifth to a quarter of a launch's host time."""

    def __init__(self, kernel, grid: tuple, num_warps: int = 4, foreign: tuple = (), **constexprs):
        self.kernel, self.grid, self.num_warps, self.constexprs = kernel, tuple(grid), num_warps, constexprs
        self.foreign = foreign
        self.runner: Optional[Callable] = None
        self.tail: tuple = ()

    def __call__(self, *args) -> None:
        if self.runner is not None and all(
                args[i] is None or args[i].data_ptr() % 16 == 0 for i in self.foreign):
            self.runner(*args, *self.tail)
            return
        entry = launch(self.kernel, self.grid, *args, num_warps=self.num_warps, **self.constexprs)
        if entry is not None:
            compiled, self.tail = entry
            self.runner = compiled[self.grid + (1,) * (3 - len(self.grid))]
