"""linattn: fast, verified gated linear attention (Gated DeltaNet) for PyTorch.

Public API only; see README.md and docs/api.md.
"""
from .ops.gated_delta.chunk import chunk_gated_delta_rule
from .ops.gated_delta.decode import gated_delta_rule_decode
from .ops.gated_delta.recurrent import fused_recurrent_gated_delta_rule
from .ops.gated_linear import gated_linear_attention

__version__ = "0.1.0"

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "gated_delta_rule_decode",
           "gated_linear_attention", "__version__"]
