"""Extra linattn implementations for the anchors' side-by-side script, by ``--impl MODULE:FUNCTION``:

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python .anchors/bench_anchors.py \\
        --impl linattn:chunk_gated_delta_rule --impl anchor_impls:chunk_gated_delta_rule_split --shapes ...

times the op's default forward ("auto") beside one forced path ("split", "walk" or "hopper":
``chunk_gated_delta_rule_on_path``) in the same run as fla, FlashQLA and SDPA; the backward is the same code.
"""
from __future__ import annotations

from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path


def chunk_gated_delta_rule_split(*args, **kwargs):
    """``linattn.chunk_gated_delta_rule`` with the split forward."""
    return chunk_gated_delta_rule_on_path("split", *args, **kwargs)


def chunk_gated_delta_rule_walk(*args, **kwargs):
    """``linattn.chunk_gated_delta_rule`` with the walk forward."""
    return chunk_gated_delta_rule_on_path("walk", *args, **kwargs)


def chunk_gated_delta_rule_hopper(*args, **kwargs):
    """``linattn.chunk_gated_delta_rule`` with the Hopper forward where it takes the inputs, the "auto" path
    elsewhere (TileLang from the anchors' site packages)."""
    return chunk_gated_delta_rule_on_path("hopper", *args, **kwargs)
