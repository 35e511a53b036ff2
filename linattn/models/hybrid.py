"""HybridLM: a causal LM whose blocks mix with Gated DeltaNet or (sliding-window) softmax attention.

    tokens → Embedding → [ x + mixer(RMSNorm(x));  x + SwiGLU(RMSNorm(x)) ] × num_layers → RMSNorm → lm_head

Each mixer is a :class:`~linattn.layers.GatedDeltaNet` (letter G in the config's pattern), a
:class:`~linattn.layers.GatedLinearAttention` (L), or a :class:`~linattn.layers.SlidingWindowAttention` with a
window (S) or without (A). Weights save to and load from
``config.json`` + ``model.safetensors`` (``model.pt``, torch.save's format, is read when a run was saved without
safetensors installed).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..layers import Cache, GatedDeltaNet, GatedLinearAttention, RMSNorm, SlidingWindowAttention
from .config import HybridConfig

CONFIG_NAME, WEIGHTS_NAME, FALLBACK_WEIGHTS_NAME = "config.json", "model.safetensors", "model.pt"


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) ⊙ up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def make_mixer(config: HybridConfig, kind: str, layer_idx: int) -> nn.Module:
    """The token mixer of one layer: ``kind`` "G" GatedDeltaNet, "L" GatedLinearAttention, "S" sliding-window
    attention, "A" full causal attention; its forward maps x ``[B, T, hidden_size]`` to (y of x's shape, state)."""
    if kind in "GL":
        cls = GatedDeltaNet if kind == "G" else GatedLinearAttention
        return cls(config.hidden_size, num_heads=config.gdn_num_heads, head_dim=config.gdn_head_dim,
                   num_v_heads=config.gdn_num_v_heads, expand_v=config.gdn_expand_v, use_gate=config.gdn_use_gate,
                   conv_size=config.gdn_conv_size, allow_neg_eigval=config.gdn_allow_neg_eigval and kind == "G",
                   norm_eps=config.norm_eps, backend=config.gdn_backend, layer_idx=layer_idx)
    return SlidingWindowAttention(config.hidden_size, num_heads=config.attn_num_heads,
                                  num_kv_heads=config.attn_num_kv_heads, head_dim=config.attn_head_dim,
                                  window_size=config.window_size if kind == "S" else None,
                                  rope_theta=config.rope_theta, qk_norm=config.attn_qk_norm, norm_eps=config.norm_eps,
                                  attn_backend=config.attn_backend, layer_idx=layer_idx)


class HybridBlock(nn.Module):
    """Pre-norm residual block: x + mixer(RMSNorm(x)), then + SwiGLU(RMSNorm(x)); x ``[B, T, hidden_size]``.
    ``forward`` returns the new x and the mixer's state (or None)."""

    def __init__(self, config: HybridConfig, kind: str, layer_idx: int):
        super().__init__()
        self.kind = kind
        self.mixer_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mixer = make_mixer(config, kind, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x, state=None, output_state=False, cu_seqlens=None, cp=None):
        if cp is not None:      # context parallelism: the mixer exchanges its halo / state maps (linattn.parallel)
            h, state = self.mixer(self.mixer_norm(x), cp=cp)
        else:
            h, state = self.mixer(self.mixer_norm(x), state=state, output_state=output_state, cu_seqlens=cu_seqlens)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), state


@dataclass
class CausalLMOutput:
    """What :meth:`HybridLM.forward` returns."""

    logits: torch.Tensor                 # [B, T, vocab] (fp32)
    loss: Optional[torch.Tensor] = None  # mean cross-entropy over labels != -100
    cache: Optional[Cache] = None        # the decode cache after these tokens (use_cache=True)


class HybridLM(nn.Module):
    """Hybrid causal language model (see the module docstring).

    Args:
        config (HybridConfig): the model's shape.
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(config, kind, i) for i, kind in enumerate(config.layer_kinds))
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for embeddings and projections; output projections scaled by
        1/√(2·num_layers) (GPT-2's residual scaling); norms at 1; GDN gate parameters by their own rule."""
        std = self.config.initializer_range
        for name, mod in self.named_modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                s = std / (2 * self.config.num_layers) ** 0.5 if name.endswith(("o_proj", "down_proj")) else std
                nn.init.normal_(mod.weight, 0.0, s)
            elif isinstance(mod, GatedDeltaNet):
                mod.reset_gate_parameters()

    def set_gradient_checkpointing(self, enabled: bool = True) -> HybridLM:
        """Recompute each block in the backward instead of storing its activations (less memory, ~1/3 more time)."""
        self.gradient_checkpointing = bool(enabled)
        return self

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor, cache: Optional[Cache] = None, use_cache: bool = False,
                cu_seqlens: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                cp=None) -> CausalLMOutput:
        """Args:
            input_ids: ``[B, T]`` token ids.
            cache: the cache after the previous tokens of these B sequences (from an earlier call), or None.
            use_cache: return the cache after these tokens (prefill / decode).
            cu_seqlens: ``[N + 1]`` offsets of packed sequences (B == 1; no cache).
            labels: ``[B, T]`` the target of every position (already shifted: the next token); -100 is ignored.
            cp: a :class:`~linattn.parallel.ShardPlan`: input_ids (and labels) are this rank's shard of a batch
                split along T across ranks (context parallelism; no cache or cu_seqlens, the plan holds the
                global cu_seqlens); the loss is then this rank's share of the global mean (the shares sum to it).
        Returns:
            :class:`CausalLMOutput` with fp32 logits ``[B, T, vocab]``, the loss if labels were given, the cache.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
                torch.int32, torch.int64):
            raise ValueError("input_ids must be an integer tensor [B, T]")
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache holds {len(cache)} layers, the model has {len(self.layers)}")
        if cp is not None and (cache is not None or use_cache or cu_seqlens is not None):
            raise ValueError("HybridLM: with cp (context parallelism) pass no cache, use_cache or cu_seqlens")
        x = self.embed(input_ids)
        new_cache = Cache.empty(len(self.layers)) if use_cache else None
        for i, block in enumerate(self.layers):
            state = None if cache is None else cache[i]
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x, st = checkpoint(block, x, state, use_cache, cu_seqlens, cp, use_reentrant=False)
            else:
                x, st = block(x, state, use_cache, cu_seqlens, cp)
            if use_cache:
                new_cache.states[i] = st
        if use_cache:
            new_cache.seen_tokens = (0 if cache is None else cache.seen_tokens) + input_ids.shape[1]
        logits = self.lm_head(self.norm(x)).float()
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got "
                                 f"{tuple(labels.shape)}")
            if cp is not None:
                from ..parallel import cross_entropy_share  # lazy: it imports torch.distributed
                loss = cross_entropy_share(logits, labels, cp)
            else:
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return CausalLMOutput(logits=logits, loss=loss, cache=new_cache)

    # ------------------------------------------------------------------------------------------------ save / load
    def save_pretrained(self, path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (tied weights stored once) into the folder ``path``."""
        from safetensors.torch import save_model
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path / CONFIG_NAME)
        save_model(self, str(path / WEIGHTS_NAME))
        return path

    @classmethod
    def from_pretrained(cls, path, device=None, dtype: Optional[torch.dtype] = None) -> HybridLM:
        """Build the model from ``path/config.json`` and load ``path/model.safetensors`` (strict), or
        ``path/model.pt`` (a state dict written by torch.save) when the folder has no safetensors file."""
        path = Path(path)
        fallback = not (path / WEIGHTS_NAME).is_file() and (path / FALLBACK_WEIGHTS_NAME).is_file()
        for name in (CONFIG_NAME, FALLBACK_WEIGHTS_NAME if fallback else WEIGHTS_NAME):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{path / name} not found (a folder written by HybridLM.save_pretrained?)")
        model = cls(HybridConfig.load(path / CONFIG_NAME))
        if fallback:
            state = torch.load(path / FALLBACK_WEIGHTS_NAME, map_location=str(device or "cpu"), weights_only=True)
            model.load_state_dict(state, strict=True)
        else:
            from safetensors.torch import load_model
            load_model(model, str(path / WEIGHTS_NAME), strict=True, device=str(device or "cpu"))
        if device is not None:
            model.to(device)
        if dtype is not None:
            model.to(dtype)
        return model
