"""Extra linattn implementations for the anchors' side-by-side script, by ``--impl MODULE:FUNCTION``:

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python .anchors/bench_anchors.py \\
        --impl linattn:chunk_gated_delta_rule --impl anchor_impls:chunk_gated_delta_rule_split --shapes ...

times the op's default forward and its split forward (``triton_chunk.FORWARD_PATH = "split"``) in the same run
as fla, FlashQLA and SDPA. The path is switched only for the call and restored after it; the backward is the same
code on both paths.
"""
from __future__ import annotations

from linattn import chunk_gated_delta_rule
from linattn.ops.gated_delta import triton_chunk


def chunk_gated_delta_rule_split(*args, **kwargs):
    """``linattn.chunk_gated_delta_rule`` with the split forward."""
    previous = triton_chunk.FORWARD_PATH
    triton_chunk.FORWARD_PATH = "split"
    try:
        return chunk_gated_delta_rule(*args, **kwargs)
    finally:
        triton_chunk.FORWARD_PATH = previous
