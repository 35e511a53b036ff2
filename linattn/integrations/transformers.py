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
    """Whether any GatedDeltaNet module of ``model`` runs linattn (patched by :func:`patch_model`)."""
    return any(getattr(m, _PATCHED_ATTR, None) is not None for m in _gdn_modules(model))


@torch.no_grad()
def gated_deltanet_from_transformers(module: torch.nn.Module, backend: Optional[str] = None):
    """A :class:`linattn.layers.GatedDeltaNet` holding the weights of a transformers Qwen3-Next / Qwen3.5
    GatedDeltaNet ``module`` (copied, on the module's device and dtype): the same function of the hidden states.

    Qwen3-Next packs q, k, v, z per key head (``in_proj_qkvz`` rows ``[H, 2K + 2·r·V]``, r = HV/H) and b, a the
    same way (``in_proj_ba`` rows ``[H, 2r]``); Qwen3.5 keeps ``in_proj_qkv`` (``[q | k | v]``), ``in_proj_z``,
    ``in_proj_b`` and ``in_proj_a`` apart. The convolution runs over ``[q | k | v]`` channels in both, as in linattn.
    """
    from ..layers import GatedDeltaNet
    if not (type(module).__name__.endswith("GatedDeltaNet") and type(module).__module__ in SUPPORTED_MODULES):
        raise TypeError(f"expected a GatedDeltaNet module of {', '.join(SUPPORTED_MODULES)}, got "
                        f"{type(module).__module__}.{type(module).__name__}")
    H, HV = module.num_k_heads, module.num_v_heads
    K, V = module.head_k_dim, module.head_v_dim
    if module.activation not in ("silu", "swish"):
        raise ValueError(f"linattn's GatedDeltaNet uses SiLU after the convolution, the module uses "
                         f"{module.activation!r}")
    w_ref = module.out_proj.weight
    layer = GatedDeltaNet(module.hidden_size, num_heads=H, head_dim=K, num_v_heads=HV, expand_v=V / K,
                          conv_size=module.conv_kernel_size, conv_bias=module.conv1d.bias is not None,
                          norm_eps=module.layer_norm_epsilon, backend=backend, layer_idx=module.layer_idx)
    layer.to(device=w_ref.device, dtype=w_ref.dtype)
    r = HV // H
    if hasattr(module, "in_proj_qkvz"):
        w = module.in_proj_qkvz.weight.view(H, 2 * K + 2 * r * V, -1)
        q, k, v, z = w.split([K, K, r * V, r * V], dim=1)
        ba = module.in_proj_ba.weight.view(H, 2 * r, -1)
        b, a = ba[:, :r], ba[:, r:]
    else:
        q, k, v = module.in_proj_qkv.weight.split([H * K, H * K, HV * V], dim=0)
        z, b, a = module.in_proj_z.weight, module.in_proj_b.weight, module.in_proj_a.weight
    for dst, src in ((layer.q_proj, q), (layer.k_proj, k), (layer.v_proj, v), (layer.g_proj, z),
                     (layer.b_proj, b), (layer.a_proj, a)):
        dst.weight.copy_(src.reshape(dst.weight.shape))
    layer.conv1d.weight.copy_(module.conv1d.weight)
    if module.conv1d.bias is not None:
        layer.conv1d.bias.copy_(module.conv1d.bias)
    layer.A_log.copy_(module.A_log)
    layer.dt_bias.copy_(module.dt_bias)
    layer.o_norm.weight.copy_(module.norm.weight)
    layer.o_proj.weight.copy_(module.out_proj.weight)
    return layer
