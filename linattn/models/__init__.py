"""Models built from linattn's layers: a hybrid GDN / sliding-window-attention causal LM (see docs/layers.md)."""
from .config import LAYER_KINDS, HybridConfig
from .generation import generate, sample_next, stream_generate
from .hybrid import CausalLMOutput, HybridLM

__all__ = ["HybridConfig", "HybridLM", "CausalLMOutput", "LAYER_KINDS", "generate", "stream_generate", "sample_next"]
