"""HybridConfig: the shape of a hybrid causal LM made of Gated DeltaNet and softmax-attention layers."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

# one letter per layer kind in ``layer_pattern``
LAYER_KINDS = {
    "G": "Gated DeltaNet (linattn.layers.GatedDeltaNet)",
    "S": "sliding-window softmax attention (window_size tokens)",
    "A": "full causal softmax attention",
    "L": "gated linear attention (linattn.layers.GatedLinearAttention, the GDN layer without the delta term)",
}


@dataclass
class HybridConfig:
    """Configuration of :class:`linattn.models.HybridLM`.

    ``layer_pattern`` gives the kind of each layer, one letter per layer (see ``LAYER_KINDS``); a pattern shorter
    than ``num_layers`` is repeated: ``"GGGS"`` with 8 layers is ``GGGSGGGS`` (three GDN layers per attention
    layer, the Qwen3-Next ratio). ``"SSSS"`` and ``"AAAA"`` give the softmax-only baselines of the same size.
    """
    vocab_size: int = 256
    hidden_size: int = 512
    num_layers: int = 8
    layer_pattern: str = "GGGS"
    # Gated DeltaNet (and gated linear attention) layers
    gdn_num_heads: int = 4
    gdn_head_dim: int = 64
    gdn_num_v_heads: Optional[int] = None
    gdn_expand_v: float = 1.0
    gdn_conv_size: int = 4
    gdn_use_gate: bool = True
    gdn_allow_neg_eigval: bool = False
    gdn_backend: Optional[str] = None
    # softmax attention layers
    attn_num_heads: int = 8
    attn_num_kv_heads: Optional[int] = 2
    attn_head_dim: Optional[int] = None
    window_size: int = 512
    rope_theta: float = 10000.0
    attn_qk_norm: bool = True
    attn_backend: str = "sdpa"
    # the rest
    intermediate_size: Optional[int] = None
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "gdn_num_heads", "gdn_head_dim", "attn_num_heads",
                     "window_size"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"HybridConfig.{name} must be a positive integer, got {val!r}")
        if not self.layer_pattern or any(c not in LAYER_KINDS for c in self.layer_pattern):
            raise ValueError(f"HybridConfig.layer_pattern must be a non-empty string of {sorted(LAYER_KINDS)}, "
                             f"got {self.layer_pattern!r}")
        if self.intermediate_size is None:
            # SwiGLU at ~8/3 of the width keeps the parameter count of a 4x GELU MLP; rounded to 64 for the GEMMs
            self.intermediate_size = 64 * -(-(8 * self.hidden_size // 3) // 64)

    @property
    def layer_kinds(self) -> str:
        """The kind of every layer, ``num_layers`` letters."""
        p = self.layer_pattern
        return (p * -(-self.num_layers // len(p)))[: self.num_layers]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HybridConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown HybridConfig fields {unknown}")
        return cls(**d)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path) -> HybridConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
