from .chunk import gated_linear_attention

__all__ = ["gated_linear_attention"]
