"""Extra linattn implementations for the anchors' side-by-side script, by ``--impl MODULE:FUNCTION``:

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python .anchors/bench_anchors.py \\
        --impl linattn:chunk_gated_delta_rule --impl anchor_impls:chunk_gated_delta_rule_split --shapes ...

times the op's default forward ("auto") and one forced path (``triton_chunk.FORWARD_PATH`` = "split", "walk" or
"hopper"), or the default path without the segmented Hopper forward's two levers (``chunk_gated_delta_rule_maps``:
``SKIP_NEGLIGIBLE_MAPS`` and ``WARM_UP`` off, on by default since run 23: every head walks its state maps, what a
model whose every head keeps its state for a segment pays), in the same run as fla, FlashQLA and
SDPA. The path or switches change only for the call and are restored after it; the backward is the same code.
"""
from __future__ import annotations

from linattn import chunk_gated_delta_rule
from linattn.ops.gated_delta import triton_chunk
from linattn.ops.hopper import forward as hopper_forward


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


def chunk_gated_delta_rule_maps(*args, **kwargs):
    """``linattn.chunk_gated_delta_rule`` on the default path with the segmented Hopper forward's negligible-map
    skip and warm-ups off (``hopper.forward.SKIP_NEGLIGIBLE_MAPS``, ``WARM_UP``): phases A and B for every head."""
    previous = hopper_forward.SKIP_NEGLIGIBLE_MAPS, hopper_forward.WARM_UP
    hopper_forward.SKIP_NEGLIGIBLE_MAPS = hopper_forward.WARM_UP = False
    try:
        return chunk_gated_delta_rule(*args, **kwargs)
    finally:
        hopper_forward.SKIP_NEGLIGIBLE_MAPS, hopper_forward.WARM_UP = previous
