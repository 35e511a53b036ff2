"""Context parallelism on torch.distributed: a sequence split along T across ranks, computed exactly.

    plan = ShardPlan.build(local_len, cu_seqlens=global_cu_seqlens)     # once per batch, on every rank
    o, ht = context_parallel_gated_delta_rule(q, k, v, g, beta, plan=plan, output_final_state=True)
    y = with_halo(x, plan, length)                                       # the tokens before the shard, then x

See docs/parallel.md for the algorithm, its communication volume and its scaling model.
"""
from .collectives import with_halo
from .fold import compose, fold_affine_ref
from .loss import cross_entropy_share
from .plan import Segment, ShardPlan
from .scan import (
    context_parallel_gated_delta_rule,
    context_parallel_gated_linear_attention,
    context_parallel_rule,
)

__all__ = ["ShardPlan", "Segment", "context_parallel_gated_delta_rule", "context_parallel_gated_linear_attention",
           "context_parallel_rule", "with_halo", "compose", "fold_affine_ref", "cross_entropy_share"]
