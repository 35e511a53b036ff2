"""Run linattn's Gated DeltaNet ops inside fla (flash-linear-attention), and load fla's GatedDeltaNet weights.

    import linattn.integrations.fla as linattn_fla
    linattn_fla.patch_fla()      # fla's GDN layers, models and op calls now run linattn's chunked / recurrent ops

How: fla's layers and models call ``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule`` through the
names they imported from ``fla.ops.gated_delta_rule``. :func:`patch_fla` replaces those two functions (and their
aliases ``chunk_gdn`` / ``fused_recurrent_gdn``) in every loaded ``fla`` module by adapters with fla's signature,
and in ``fla.ops.gated_delta_rule`` itself, so modules imported later get the adapters too. Each adapter maps
fla's keywords onto linattn's (fla_keywords.py: state layout, in-kernel gate, β = 2·sigmoid(b), ...), or rejects
the few it cannot honour with a message. :func:`unpatch_fla` puts fla's functions back. Weights, caches,
convolutions and norms stay fla's own, so patched and unpatched fla agree to the kernels' rounding
(tests/integrations/test_fla.py).

:func:`gated_deltanet_from_fla` builds a :class:`linattn.layers.GatedDeltaNet` holding an fla ``GatedDeltaNet``
layer's weights (or a :class:`FlaGatedDeltaNet`: the same with fla's forward signature and cache, a drop-in inside
fla's models; :func:`replace_fla_layers` swaps them into a whole model), and :func:`convert_fla_state_dict` maps an
fla state dict (a layer's or a whole model's) onto linattn's parameter names: fla's ``q_conv1d`` / ``k_conv1d`` /
``v_conv1d`` become the one ``conv1d`` over ``[q | k | v]`` channels.
"""
from __future__ import annotations

import functools
import sys
from typing import Optional

import torch

from ..layers import GatedDeltaNet, GatedDeltaNetState
from ..ops.gated_delta.chunk import chunk_gated_delta_rule as linattn_chunk
from ..ops.gated_delta.fla_keywords import resolve_fla_keywords
from ..ops.gated_delta.recurrent import fused_recurrent_gated_delta_rule as linattn_recurrent

FLA_OPS_MODULE = "fla.ops.gated_delta_rule"
# fla's exported names -> which adapter replaces them
_NAMES = {"chunk_gated_delta_rule": "chunk", "chunk_gdn": "chunk",
          "fused_recurrent_gated_delta_rule": "recurrent", "fused_recurrent_gdn": "recurrent"}
# calls routed to linattn, per op (tests read it to prove linattn really ran)
CALLS = {"chunk": 0, "recurrent": 0}


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, *, chunk_size=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                           head_first=False, transpose_state_layout=None, backend=None):
    """fla 0.6's ``chunk_gated_delta_rule`` (same arguments and meaning), computed by linattn's chunked op;
    ``backend`` is linattn's."""
    CALLS["chunk"] += 1
    return _run(linattn_chunk, "chunk_gated_delta_rule", q, k, v, g, beta, scale, initial_state,
                output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, cu_seqlens,
                use_gate_in_kernel, A_log, dt_bias, backend,
                dict(head_first=head_first, chunk_size=chunk_size, chunk_indices=chunk_indices,
                     cu_seqlens_cpu=cu_seqlens_cpu, allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                     transpose_state_layout=transpose_state_layout, cp_context=cp_context))


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, transpose_state_layout=None, backend=None):
    """fla 0.6's ``fused_recurrent_gated_delta_rule`` (same arguments and meaning), computed by linattn's
    recurrent op; ``backend`` is linattn's."""
    CALLS["recurrent"] += 1
    return _run(linattn_recurrent, "fused_recurrent_gated_delta_rule", q, k, v, g, beta, scale, initial_state,
                output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, cu_seqlens,
                use_gate_in_kernel, A_log, dt_bias, backend,
                dict(gk=gk, gv=gv, allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                     transpose_state_layout=transpose_state_layout))


def _run(op, name, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, beta_sigmoid, cu_seqlens,
         use_gate_in_kernel, A_log, dt_bias, backend, fla_keywords: dict):
    if not use_gate_in_kernel:
        # fla ignores A_log and dt_bias unless use_gate_in_kernel=True: g is then already the log decay
        A_log = dt_bias = None
    args = resolve_fla_keywords(name, q, v, g, beta, initial_state, A_log, dt_bias, beta_sigmoid,
                                cu_seqlens=cu_seqlens, use_gate_in_kernel=bool(use_gate_in_kernel) or None,
                                **fla_keywords)
    o, ht = op(q, k, v, args.g, args.beta, scale=scale, initial_state=args.initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=l2norm,
               A_log=args.A_log, dt_bias=args.dt_bias, use_beta_sigmoid_in_kernel=args.use_beta_sigmoid_in_kernel,
               backend=backend)
    return o, args.final_state(ht)


_ADAPTERS = {"chunk": chunk_gated_delta_rule, "recurrent": fused_recurrent_gated_delta_rule}


def _fla_modules():
    return [m for name, m in list(sys.modules.items()) if m is not None and (name == "fla" or name.startswith("fla."))]


def _bound_adapter(kind: str, original, backend: Optional[str]):
    adapter = _ADAPTERS[kind]

    @functools.wraps(adapter)
    def routed(*args, **kwargs):
        return adapter(*args, backend=backend, **kwargs)

    routed._linattn_fla_original = original
    return routed


def patch_fla(backend: Optional[str] = None) -> int:
    """Route every fla call of ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` (fla's GDN layers
    and models included) to linattn's ops, process-wide; return how many module names were bound.

    Args:
        backend: linattn backend (None: triton on CUDA, torch on the CPU). Calling again changes the backend.
    Raises:
        ImportError: fla (``pip install flash-linear-attention`` or ``fla-core``) is not installed.
    """
    import importlib
    ops = importlib.import_module(FLA_OPS_MODULE)
    originals = {name: getattr(getattr(ops, name), "_linattn_fla_original", getattr(ops, name)) for name in _NAMES}
    routed = {id(fn): _bound_adapter(_NAMES[name], fn, backend) for name, fn in originals.items()}
    n = 0
    for module in _fla_modules():
        for name in _NAMES:
            fn = getattr(module, name, None)
            key = id(getattr(fn, "_linattn_fla_original", fn))
            if fn is not None and key in routed:
                setattr(module, name, routed[key])
                n += 1
    return n


def unpatch_fla() -> int:
    """Give fla its own functions back, in every fla module (those imported after :func:`patch_fla` too); return how
    many names were restored."""
    n = 0
    for module in _fla_modules():
        for name in _NAMES:
            original = getattr(getattr(module, name, None), "_linattn_fla_original", None)
            if original is not None:
                setattr(module, name, original)
                n += 1
    return n


def is_patched() -> bool:
    """Whether :func:`patch_fla` is in effect."""
    ops = sys.modules.get(FLA_OPS_MODULE)
    return ops is not None and hasattr(ops.chunk_gated_delta_rule, "_linattn_fla_original")


# ------------------------------------------------------------------------------------------------- weights
def convert_fla_state_dict(state_dict: dict) -> dict:
    """An fla state dict (one GatedDeltaNet layer's, or a model's with prefixes) with linattn's names: every
    ``<p>q_conv1d.weight``, ``<p>k_conv1d.weight``, ``<p>v_conv1d.weight`` (each ``[D, 1, W]``) becomes one
    ``<p>conv1d.weight`` over ``[q | k | v]`` channels (biases alike); every other entry is kept as it is."""
    out = {}
    for key, val in state_dict.items():
        for part in ("q_conv1d.", "k_conv1d.", "v_conv1d."):
            if part in key:
                prefix, _, leaf = key.rpartition(part)
                if part == "q_conv1d.":
                    try:
                        out[f"{prefix}conv1d.{leaf}"] = torch.cat(
                            [state_dict[f"{prefix}{p}{leaf}"] for p in ("q_conv1d.", "k_conv1d.", "v_conv1d.")])
                    except KeyError as e:
                        raise ValueError(f"{key} without its partner {e} in the fla state dict") from None
                break
        else:
            out[key] = val
    return out


def _check_fla_layer(module) -> None:
    cls = type(module)
    if cls.__name__ != "GatedDeltaNet" or not cls.__module__.startswith("fla."):
        raise TypeError(f"expected fla's GatedDeltaNet layer (fla.layers.GatedDeltaNet), got "
                        f"{cls.__module__}.{cls.__name__}")
    activation = getattr(module.o_norm, "activation", "swish") if module.use_gate else "swish"
    if activation not in ("swish", "silu"):
        raise ValueError(f"linattn's GatedDeltaNet gates its output with SiLU; this fla layer uses "
                         f"output_gate_activation={activation!r}")
    if module.use_short_conv:
        for conv in (module.q_conv1d, module.k_conv1d, module.v_conv1d):
            if conv.activation not in ("silu", "swish"):
                raise ValueError(f"linattn's GatedDeltaNet applies SiLU after the convolution; this fla layer "
                                 f"uses {conv.activation!r}")


@torch.no_grad()
def gated_deltanet_from_fla(module: torch.nn.Module, backend: Optional[str] = None, fla_forward: bool = False):
    """A :class:`linattn.layers.GatedDeltaNet` with the weights of fla's ``GatedDeltaNet`` layer ``module`` (copied, on
    the module's device and dtype): the same function of the hidden states.

    fla's defaults (``expand_v=2``, ``norm_eps=1e-5``, ...) are read from the module, not assumed. fla's layer picks
    the recurrent kernel for inputs of at most 64 tokens in eval mode without gradients; linattn's ``mode="auto"``
    does the same (``recurrent_max_len=64``).

    Args:
        module: an ``fla.layers.GatedDeltaNet``.
        backend: linattn backend of the layer's ops (None: triton on CUDA, torch on the CPU).
        fla_forward: return a :class:`FlaGatedDeltaNet` (fla's forward signature, fla's cache; a drop-in for the
            module inside an fla model) instead of linattn's layer (``layer(x, state, output_state, cu_seqlens)``).
    """
    _check_fla_layer(module)
    ref = module.o_proj.weight
    cls = FlaGatedDeltaNet if fla_forward else GatedDeltaNet
    layer = cls(module.hidden_size, num_heads=module.num_heads, head_dim=module.head_k_dim,
                          num_v_heads=module.num_v_heads, expand_v=module.head_v_dim / module.head_k_dim,
                          use_gate=module.use_gate, use_short_conv=module.use_short_conv,
                          conv_size=module.conv_size, conv_bias=bool(module.conv_bias),
                          allow_neg_eigval=module.allow_neg_eigval, norm_eps=module.o_norm.eps, mode="auto",
                          recurrent_max_len=64, backend=backend, layer_idx=module.layer_idx)
    layer.to(device=ref.device, dtype=ref.dtype)
    state = convert_fla_state_dict(module.state_dict())
    layer.load_state_dict({k: v.to(layer.state_dict()[k].dtype) for k, v in state.items()}, strict=True)
    return layer


def replace_fla_layers(model: torch.nn.Module, backend: Optional[str] = None) -> int:
    """Swap every fla ``GatedDeltaNet`` layer inside ``model`` (an fla model, e.g. ``GatedDeltaNetForCausalLM``) for a
    :class:`FlaGatedDeltaNet` holding its weights; return how many. The model keeps fla's forward, cache and
    generation; its GDN layers are linattn's."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child).__name__ == "GatedDeltaNet" and type(child).__module__.startswith("fla.")]
    for parent, name, child in targets:
        setattr(parent, name, gated_deltanet_from_fla(child, backend=backend, fla_forward=True))
    return len(targets)


class FlaGatedDeltaNet(GatedDeltaNet):
    """linattn's :class:`~linattn.layers.GatedDeltaNet` with fla's forward signature and cache, a drop-in for
    ``fla.layers.GatedDeltaNet`` inside fla's models (build one with ``gated_deltanet_from_fla(m, fla_forward=True)``).

    ``forward(hidden_states [B, T, D], attention_mask=None, past_key_values=None, use_cache=False,
    output_attentions=False, cu_seqlens=None) -> (o [B, T, D], None, past_key_values)``, as fla's:
    ``attention_mask`` ``[B, T]`` (1 = token, 0 = padding) unpads to packed sequences; the layer's entry of fla's
    cache holds fla's layouts (recurrent state ``[N, HV, V, K]``, one ``[N, D, W]`` convolution state per q, k, v),
    so fla's generation code and other layers read it unchanged. State dicts load with fla's names (``q_conv1d``,
    ...) or linattn's.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_load_state_dict_pre_hook(_fla_names_on_load)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values=None, use_cache: Optional[bool] = False, output_attentions: Optional[bool] = False,
                cu_seqlens: Optional[torch.Tensor] = None, **kwargs):
        from fla.layers.utils import get_layer_cache, repad_hidden_states, unpad_hidden_states, update_layer_cache
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a [B, T] 0/1 padding mask (as fla's), got shape "
                             f"{tuple(attention_mask.shape)}")
        B, T, _ = hidden_states.shape
        last = get_layer_cache(self, past_key_values)
        x, indices, cu_seqlens = unpad_hidden_states(hidden_states=hidden_states, cu_seqlens=cu_seqlens,
                                                     attention_mask=attention_mask, q_len=T)
        state = None if last is None or last["recurrent_state"] is None else self._state_from_fla(last)
        o, new = GatedDeltaNet.forward(self, x, state=state, output_state=bool(use_cache), cu_seqlens=cu_seqlens)
        if use_cache:
            update_layer_cache(module=self, past_key_values=past_key_values,
                               recurrent_state=new.recurrent.transpose(-1, -2).contiguous(),
                               conv_state=self._conv_state_to_fla(new.conv), offset=T)
        return repad_hidden_states(hidden_states=o, indices=indices, batch_size=B, q_len=T), None, past_key_values

    def _state_from_fla(self, last: dict) -> GatedDeltaNetState:
        conv = None
        if self.conv1d is not None:
            # fla keeps the last W inputs; the oldest one never enters the next output, linattn keeps W − 1
            conv = torch.cat(list(last["conv_state"]), dim=1)[..., 1:]
        return GatedDeltaNetState(conv=conv, recurrent=last["recurrent_state"].transpose(-1, -2))

    def _conv_state_to_fla(self, conv: Optional[torch.Tensor]):
        if conv is None:
            return None
        full = torch.nn.functional.pad(conv, (1, 0))
        return tuple(t.contiguous() for t in full.split([self.key_dim, self.key_dim, self.value_dim], dim=1))


def _fla_names_on_load(module, state_dict, prefix, *args):
    converted = convert_fla_state_dict({k: v for k, v in state_dict.items() if k.startswith(prefix)})
    for key in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[key]
    state_dict.update(converted)
