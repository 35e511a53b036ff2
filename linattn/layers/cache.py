"""Decode states of the layers, and the per-model cache that holds one per layer.

States are plain values: a layer takes the previous state and returns a new one, never writing into the old one
(so a cache can be kept, copied or rolled back by holding on to the objects).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch


@dataclass
class GatedDeltaNetState:
    """State of one Gated DeltaNet layer after some tokens of N sequences.

    conv: ``[N, D_conv, W − 1]`` the last inputs of the short convolution (None without one);
    recurrent: ``[N, HV, K, V]`` fp32, the delta-rule state S.
    """
    conv: Optional[torch.Tensor]
    recurrent: torch.Tensor


@dataclass
class AttentionState:
    """State of one softmax attention layer: the keys and values a next query may still see.

    key, value: ``[N, H_kv, L, D]`` (after RoPE), L ≤ window − 1 for sliding-window attention;
    offset: the number of tokens seen so far (the position of the next token).
    """
    key: torch.Tensor
    value: torch.Tensor
    offset: int


LayerState = Union[GatedDeltaNetState, AttentionState]


@dataclass
class Cache:
    """The decode cache of a model: one state per layer (None until the layer has seen a token)."""
    states: list = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def empty(cls, num_layers: int) -> Cache:
        return cls(states=[None] * num_layers, seen_tokens=0)

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> Optional[LayerState]:
        return self.states[i]

    def nbytes(self) -> int:
        """Memory held by the cache (bytes): constant in the sequence length for GDN and sliding-window layers."""
        total = 0
        for s in self.states:
            if s is None:
                continue
            for t in vars(s).values():
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total
