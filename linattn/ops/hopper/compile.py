"""Compiling and launching the Hopper TileLang kernels (the forward's walk, ``chunk_fwd.py``, and pre-pass,
``prepass.py``; the backward's reverse walk and warm-ups, ``chunk_bwd.py``), and whether they can take an input at all
(:func:`unsupported_reason`). A compile failure is recorded once per process (:func:`mark_compile_failed`): from then
on the op keeps to its Triton paths."""
import functools
from typing import Optional

import torch


@functools.cache
def tilelang_available() -> bool:
    """Whether TileLang (an optional dependency) imports. Any failure counts as absent: a broken install must send
    the op to its Triton path, not raise from it."""
    try:
        import tilelang  # noqa: F401
    except Exception:
        return False
    return True


class HopperCompileError(RuntimeError):
    """TileLang could not build the kernel on this machine (a CUDA toolkit it needs missing, an incompatible
    TileLang, ...): the op then runs its Triton forward (``triton_chunk``) or backward (``triton_bwd``), see
    :func:`mark_compile_failed`."""


# The first compile error of this process (:func:`mark_compile_failed`), process-wide fallback state
_compile_failure: Optional[str] = None


def mark_compile_failed(reason: str) -> None:
    """Record this process's first compile failure: from then on :func:`unsupported_reason` turns every input away,
    so the op warns once and keeps to its Triton paths instead of failing (or trying again) on every call."""
    global _compile_failure
    if _compile_failure is None:
        _compile_failure = reason


def compile_failed() -> Optional[str]:
    """The compile failure :func:`mark_compile_failed` recorded in this process, or None."""
    return _compile_failure


@functools.lru_cache(maxsize=256)
def launcher(kernel):
    """What to call to launch a compiled kernel: its tvm_ffi executable where TileLang exposes one (0.1.15's tvm_ffi
    adapter), else the kernel itself. The executable skips TileLang's Python wrapper, which loops over the parameters
    to allocate outputs these kernels do not have (out_idx None: every output is passed in); it checks each tensor's
    shape, dtype and strides and takes Torch's current stream, as the wrapper's call does."""
    adapter = getattr(kernel, "adapter", None)
    get = getattr(adapter, "_get_executable", None)
    if callable(get) and not getattr(adapter, "result_idx", None):
        return get()
    return kernel


def tile_dtype(dtype: torch.dtype) -> str:
    """A torch dtype as TileLang names it in a kernel's signature ("bfloat16", "float32")."""
    return str(dtype).removeprefix("torch.")


def compile_prim_func(func, target: Optional[str] = None):
    """Compile a TileLang prim_func of the Hopper kernels (``chunk_fwd``, ``prepass``, ``chunk_bwd``) with TileLang's
    default launcher (tvm_ffi in 0.1.15; its "cython" launcher costs more host time per launch).
    ``target``: None for the current GPU, or an arch such as "sm_90a" to compile without one (the CPU compile
    checks). Fast math: e^x as ex2.approx (relative error ≈ 2⁻²², far below the bf16 rounding of every operand it
    scales). Any failure is a :class:`HopperCompileError` (the op then keeps to its Triton paths)."""
    import tilelang
    tgt = {"kind": "cuda", "arch": target} if target else "auto"
    try:
        return tilelang.compile(func, target=tgt, pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})
    except Exception as e:
        raise HopperCompileError(f"{type(e).__name__}: {e}"[:500]) from e


@functools.cache
def _cuda_major(index: Optional[int]) -> int:
    """The compute capability's major version of CUDA device ``index`` (None: the current one), cached: the op asks
    on every call, and the property lookup is host time."""
    return torch.cuda.get_device_capability(index)[0]


def unsupported_reason(q: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why the Hopper kernels cannot take these inputs (None: they can): bf16 on an sm_90 GPU with TileLang
    installed, K and V multiples of 64, K up to 128 and V up to 256 (the TMA boxes). Packed sequences are the
    callers' (``varlen.py``'s padding). The backward asks it too, then ``backward.size_limit`` and
    ``dtype_limit``."""
    if q.dtype != torch.bfloat16:
        return f"takes bf16 inputs, got {q.dtype}"
    if q.device.type != "cuda" or _cuda_major(q.device.index) != 9:
        return "needs an sm_90 (Hopper) GPU"
    K, V = q.shape[-1], v.shape[-1]
    if K % 64 or V % 64 or K > 128 or V > 256:
        return f"K and V must be multiples of 64 (K <= 128, V <= 256), got K={K}, V={V}"
    if not tilelang_available():
        return "TileLang is not installed"
    if compile_failed() is not None:
        return f"its compile failed earlier in this process ({compile_failed()})"
    return None


def misaligned(*tensors: Optional[torch.Tensor]) -> Optional[int]:
    """The position of the first of ``tensors`` (None skipped) whose data does not start on a 16-byte boundary, or
    None. The kernels read their inputs by TMA, whose descriptors need a 16-byte aligned start, and by 16-byte
    vector loads. A contiguous view can still start off that boundary: a flat buffer cut at an odd element, as a
    memory planner may. Such inputs take the Triton paths, which specialise on alignment instead of assuming it."""
    for i, x in enumerate(tensors):
        if x is not None and x.data_ptr() % 16:
            return i
    return None
