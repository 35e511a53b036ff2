"""The loss of a sequence-split batch: each rank's share of the global token mean."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .collectives import all_reduce_sum
from .plan import ShardPlan


def cross_entropy_share(logits: torch.Tensor, labels: torch.Tensor, plan: ShardPlan,
                        ignore_index: int = -100) -> torch.Tensor:
    """This rank's share of the mean cross-entropy over every rank's tokens: its sum divided by the global count
    of labelled tokens (one all-reduce of an int), so the shares sum to the unsplit batch's mean loss and their
    gradients, summed over the group, are the unsplit gradients.

    Args:
        logits: ``[B, T_r, vocab]``.
        labels: ``[B, T_r]`` (already shifted: the next token, possibly held by the next rank), ``ignore_index``
            where no loss is taken.
    """
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=ignore_index,
                            reduction="sum")
    count = all_reduce_sum((labels != ignore_index).sum().to(torch.int64), plan)
    return total / count.clamp(min=1)
