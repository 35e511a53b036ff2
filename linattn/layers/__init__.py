"""nn.Module layers built on linattn's operators (see docs/layers.md)."""
from .attention import SlidingWindowAttention
from .cache import AttentionState, Cache, GatedDeltaNetState
from .conv import ShortConvolution
from .feature_maps import FEATURE_MAPS, make_feature_map
from .gated_deltanet import GatedDeltaNet
from .gated_linear_attention import GatedLinearAttention
from .linear_attention import LinearAttention
from .norm import GatedRMSNorm, RMSNorm

__all__ = ["GatedDeltaNet", "GatedLinearAttention", "LinearAttention", "FEATURE_MAPS", "make_feature_map",
           "SlidingWindowAttention", "ShortConvolution", "RMSNorm", "GatedRMSNorm", "Cache", "GatedDeltaNetState",
           "AttentionState"]
