"""No Triton kernel of the chunked op specialises on a length.

Triton compiles a separate variant of a kernel for an int argument equal to 1 or divisible by 16 unless the
argument is in ``do_not_specialize``. For the chunked op's lengths (T, chunk counts, token counts, segment counts)
that would mean a fresh compile of the whole forward + backward (70–90 s on an H200 for fp32) when a batch's T
changes from a multiple of 16 to another length — issue 4 asks that a new T costs < 2 s. The recurrent kernels are
exempt: decode keeps T fixed (usually 1), and specialising on it is free there.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import linattn.ops

# runtime int arguments that carry a length or a count derived from one
LENGTH_ARGS = {"T", "NT", "NTB", "NTOK", "NB", "NSEG", "L", "BT_total", "NC", "LC", "W_MAX"}
EXEMPT_MODULES = {"linattn.ops.gated_delta.recurrent_kernels"}


def _unspecialised_args(kernel) -> tuple[list[str], set[str]]:
    """(runtime argument names, those in do_not_specialize) of a compiled-mode JITFunction or of the
    interpreter's InterpretedFunction (the tests run under TRITON_INTERPRET)."""
    if hasattr(kernel, "params"):
        return ([p.name for p in kernel.params if not p.is_constexpr],
                {p.name for p in kernel.params if p.do_not_specialize})
    sig = inspect.signature(kernel.fn).parameters
    runtime = [n for n in kernel.arg_names if "constexpr" not in str(sig[n].annotation)]
    return runtime, set(kernel.kwargs.get("do_not_specialize") or ())


def _kernels():
    for info in pkgutil.walk_packages(linattn.ops.__path__, "linattn.ops."):
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if name.endswith("_kernel") and hasattr(obj, "arg_names") and obj.fn.__module__ == mod.__name__:
                yield info.name, name, obj


def test_kernels_are_found():
    names = {name for _, name, _ in _kernels()}
    assert {"fused_fwd_kernel", "fused_prepass_kernel", "state_pass_bwd_kernel", "local_bwd_dqk_kernel",
            "preprocess_fwd_kernel"} <= names, names


def test_length_arguments_are_not_specialised():
    offenders = []
    for mod, name, kernel in _kernels():
        runtime, unspecialised = _unspecialised_args(kernel)
        if mod not in EXEMPT_MODULES:
            offenders += [f"{mod}.{name}({a})" for a in runtime if a in LENGTH_ARGS and a not in unspecialised]
    assert not offenders, f"add these to do_not_specialize: {offenders}"
