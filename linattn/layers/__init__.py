"""nn.Module layers built on linattn's operators (see docs/layers.md)."""
from .attention import SlidingWindowAttention
from .cache import AttentionState, Cache, GatedDeltaNetState
from .conv import ShortConvolution
from .gated_deltanet import GatedDeltaNet
from .norm import GatedRMSNorm, RMSNorm

__all__ = ["GatedDeltaNet", "SlidingWindowAttention", "ShortConvolution", "RMSNorm", "GatedRMSNorm",
           "Cache", "GatedDeltaNetState", "AttentionState"]
