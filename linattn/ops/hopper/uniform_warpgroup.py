"""The walk kernel's warpgroup index made warp-uniform in TileLang's generated CUDA (``chunk_fwd.compiled_kernel``).

Why: TileLang writes the consumer warpgroup's index as ``(((int)threadIdx.x) >> 7)`` wherever a fragment layout or
a wgmma operand depends on it. ptxas cannot tell that this value is the same in every lane of a warp, so it keeps it
in a per-thread register, and everything derived from it too: each of the walk's 40 wgmma per chunk then takes its
shared-memory descriptor from per-thread registers, moved to uniform registers by two R2UR, and the descriptor
arithmetic runs per thread. Broadcast from lane 0 (``__shfl_sync``, as CUTLASS's ``canonical_warp_group_idx``
does), ptxas knows the index is uniform and keeps that arithmetic in uniform registers (the R2UR moves and the
per-thread descriptor arithmetic leave the chunk loop).

How: the kernel is compiled with a marker attribute (so TileLang's disk cache keys it apart from the plain kernel),
and while it compiles, a CUDA post-processing callback (TileLang's ``tilelang_callback_cuda_postproc``, chained to
any callback registered before) declares ``const int linattn_warpgroup = __shfl_sync(0xffffffff, threadIdx.x >> 7,
0)`` at the kernel's entry (every thread of every warp reaches it) and writes it for each ``(((int)threadIdx.x) >>
7)``. The rewrite changes no value: 128 is a multiple of the warp size, so every lane of a warp holds its lane 0's
``threadIdx.x >> 7``. Kernels compiled without the marker, this package's or another's, pass through unchanged.
"""
from __future__ import annotations

import contextlib
import re
import threading

# what TileLang 0.1.15 writes for the warpgroup index, and what replaces it
WARPGROUP_INDEX = "(((int)threadIdx.x) >> 7)"
UNIFORM_NAME = "linattn_warpgroup"
MARKER = "linattn.uniform_warpgroup"
# a kernel's definition (not its declaration, which ends in ";"): the opening brace of its body
_KERNEL_BODY = re.compile(r"__global__ void (?:__launch_bounds__\([^)]*\) )?\w+\([^;{]*\)\s*\{")

_state = threading.local()
_install_lock = threading.Lock()
_previous = None


def rewrite(code: str) -> str:
    """``code`` (one module's CUDA source) with the warpgroup index of each kernel read from a warp-uniform copy
    declared at the kernel's entry; unchanged where it has no kernel definition or no such index."""
    bodies = list(_KERNEL_BODY.finditer(code))
    if WARPGROUP_INDEX not in code or not bodies:
        return code
    out, pos = [], 0
    for body in bodies:
        out.append(code[pos:body.end()].replace(WARPGROUP_INDEX, UNIFORM_NAME))
        out.append(f"\n  const int {UNIFORM_NAME} = __shfl_sync(0xffffffffu, ((int)threadIdx.x) >> 7, 0);")
        pos = body.end()
    out.append(code[pos:].replace(WARPGROUP_INDEX, UNIFORM_NAME))
    return "".join(out)


def _postproc(code, target):
    """TileLang's CUDA post-processing callback: :func:`rewrite` while a marked kernel compiles, then the callback
    that was registered before this one, if any."""
    if getattr(_state, "active", False):
        code = rewrite(code)
    return _previous(code, target) if _previous is not None else code


def _install() -> None:
    """Register :func:`_postproc` once per process, keeping the callback it replaces to chain to."""
    global _previous
    with _install_lock:
        if getattr(_install, "done", False):
            return
        import tvm_ffi
        _previous = tvm_ffi.get_global_func("tilelang_callback_cuda_postproc", allow_missing=True)
        tvm_ffi.register_global_func("tilelang_callback_cuda_postproc", f=_postproc, override=True)
        _install.done = True


def marked(func):
    """The prim_func with the marker attribute: another TileLang cache key than the plain kernel's."""
    return func.with_attr(MARKER, 1)


@contextlib.contextmanager
def rewriting():
    """While inside, the CUDA that TileLang generates in this thread is rewritten (:func:`rewrite`)."""
    _install()
    _state.active = True
    try:
        yield
    finally:
        _state.active = False
