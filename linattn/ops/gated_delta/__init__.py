"""The gated delta rule: chunked op (chunk.py) and its forward's dispatch (dispatch.py), torch twin
(torch_chunk.py), reference (reference.py)."""
from .chunk import chunk_gated_delta_rule
from .reference import gated_delta_rule_reference

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_reference"]
