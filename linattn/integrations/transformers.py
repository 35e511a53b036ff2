"""Run linattn's Gated DeltaNet kernels inside transformers' Qwen3-Next and Qwen3.5 models.

    from transformers import AutoModelForCausalLM
    from linattn.integrations.transformers import patch_model
    model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-Next-80B-A3B-Instruct", dtype="bfloat16")
    patch_model(model)           # every GatedDeltaNet layer now calls linattn's chunked / recurrent ops

How: transformers' GatedDeltaNet modules call two module-level functions of their modeling file,
``torch_chunk_gated_delta_rule`` (prefill, training) and ``torch_recurrent_gated_delta_rule`` (one-token decode) —
the seam transformers itself uses to plug in fla when it is installed; linattn's ops are drop-ins for fla's.
:func:`patch_model` replaces those two names, once per modeling file, by dispatchers, and wraps the ``forward`` of
each GatedDeltaNet *instance* of the given model so that, while it runs, the dispatchers call linattn; any other
model in the process (unpatched) keeps the functions it had. :func:`unpatch_model` undoes the instance part.
Weights, cache handling, convolutions and norms stay transformers' own, so patched and unpatched models agree to
the kernels' rounding (tests/integrations/test_transformers.py checks the logits and greedy generation).
"""
from __future__ import annotations

import contextvars
import functools
import sys
from typing import Optional

import torch

from ..ops.gated_delta.chunk import chunk_gated_delta_rule
from ..ops.gated_delta.recurrent import fused_recurrent_gated_delta_rule

# modeling files whose GatedDeltaNet modules call the two functions below (transformers >= 4.57 / 5.x)
SUPPORTED_MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)
_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_PATCHED_ATTR = "_linattn_patched_forward"

# set to (backend,) while the forward of a patched GatedDeltaNet instance runs; None otherwise
_ACTIVE: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("linattn_active", default=None)
# calls routed to linattn, per function name (tests read it to prove the kernels were really used)
CALLS = {"chunk": 0, "recurrent": 0}


def _transformers_signature(query, key, value, g=None, beta=None, chunk_size=64, initial_state=None,
                            output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """The arguments transformers passes to both functions (the recurrent one has no chunk_size). Model-wide
    kwargs it forwards (masks, position ids, ...) are unused by a GDN kernel: accepted and ignored, here only."""
    return query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens


def _make_dispatcher(original, op, key):
    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        active = _ACTIVE.get()
        if active is None:          # an unpatched model: its own function, called exactly as it was
            return original(*args, **kwargs)
        q, k, v, g, beta, h0, output_final_state, l2, cu = _transformers_signature(*args, **kwargs)
        CALLS[key] += 1
        return op(q, k, v, g, beta, initial_state=h0, output_final_state=output_final_state, cu_seqlens=cu,
                  use_qk_l2norm_in_kernel=l2, backend=active[0])

    dispatch._linattn_original = original
    return dispatch


def _install_dispatchers(module) -> None:
    for name, op, key in ((_FUNCS[0], chunk_gated_delta_rule, "chunk"),
                          (_FUNCS[1], fused_recurrent_gated_delta_rule, "recurrent")):
        current = getattr(module, name)
        if getattr(current, "_linattn_original", None) is None:
            setattr(module, name, _make_dispatcher(current, op, key))


def _gdn_modules(model: torch.nn.Module):
    for mod in model.modules():
        cls = type(mod)
        if cls.__name__.endswith("GatedDeltaNet") and cls.__module__ in SUPPORTED_MODULES:
            yield mod


def patch_model(model: torch.nn.Module, backend: Optional[str] = None) -> int:
    """Make every Qwen3-Next / Qwen3.5 GatedDeltaNet layer of ``model`` run linattn's ops; return how many.

    Args:
        model: a transformers model (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``, ... or any module holding
            their GatedDeltaNet layers).
        backend: linattn backend (None: triton on CUDA, torch on the CPU).
    Raises:
        ValueError: the model has no supported GatedDeltaNet layer.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"patch_model needs a torch.nn.Module, got {type(model).__name__}")
    layers = list(_gdn_modules(model))
    if not layers:
        raise ValueError(f"{type(model).__name__} has no GatedDeltaNet layer from {', '.join(SUPPORTED_MODULES)}")
    for mod in layers:
        _install_dispatchers(sys.modules[type(mod).__module__])
        if getattr(mod, _PATCHED_ATTR, None) is not None:
            mod.__dict__.pop("forward", None)
        bound = type(mod).forward.__get__(mod)

        @functools.wraps(bound)
        def forward(*args, _bound=bound, **kwargs):
            token = _ACTIVE.set((backend,))
            try:
                return _bound(*args, **kwargs)
            finally:
                _ACTIVE.reset(token)

        mod.forward = forward
        setattr(mod, _PATCHED_ATTR, True)
    return len(layers)


def unpatch_model(model: torch.nn.Module) -> int:
    """Give the GatedDeltaNet layers of ``model`` their own (transformers') kernels back; return how many."""
    n = 0
    for mod in _gdn_modules(model):
        if getattr(mod, _PATCHED_ATTR, None) is not None:
            mod.__dict__.pop("forward", None)
            delattr(mod, _PATCHED_ATTR)
            n += 1
    return n


def is_patched(model: torch.nn.Module) -> bool:
    return any(getattr(m, _PATCHED_ATTR, None) is not None for m in _gdn_modules(model))
