"""Extra linattn implementations for the anchors' side-by-side script, by ``--impl MODULE:FUNCTION``:

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python .anchors/bench_anchors.py \\
        --impl linattn:chunk_gated_delta_rule --impl anchor_impls:chunk_gated_delta_rule_split --shapes ...

times the op's default forward ("auto": the walk from 128 (sequence, value head) pairs, else the split) and one
forced path (``triton_chunk.FORWARD_PATH`` = "split", "walk" or the experimental "hopper") in the same run as fla,
FlashQLA and SDPA. The
path is switched only for the call and restored after it; the backward is the same code on both paths.
"""
from __future__ import annotations

from linattn import chunk_gated_delta_rule
from linattn.ops.gated_delta import triton_chunk


def _on_path(path, args, kwargs):
    previous = triton_chunk.FORWARD_PATH
    triton_chunk.FORWARD_PATH = path
    try:
        return chunk_gated_delta_rule(*args, **kwargs)
    finally:
        triton_chunk.FORWARD_PATH = previous


def chunk_gated_delta_rule_split(*args, **kwargs):
    """``linattn.chunk_gated_delta_rule`` with the split forward."""
    return _on_path("split", args, kwargs)


def chunk_gated_delta_rule_walk(*args, **kwargs):
    """``linattn.chunk_gated_delta_rule`` with the walk forward."""
    return _on_path("walk", args, kwargs)


def chunk_gated_delta_rule_hopper(*args, **kwargs):
    """``linattn.chunk_gated_delta_rule`` with the experimental Hopper forward (``FORWARD_PATH = "hopper"``: the
    TileLang kernel where it takes the inputs, the auto path elsewhere; TileLang from the anchors' site packages)."""
    return _on_path("hopper", args, kwargs)
