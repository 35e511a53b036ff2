"""The communication of context parallelism, on torch.distributed: the logarithmic scan of the state maps over
ranks, and the autograd-aware halo fetch (a rank reads the tokens just before its shard from the ranks that hold
them, and their gradients go back to those ranks in the backward).

Only operations that both NCCL and gloo implement are used (all-reduce, batched isend/irecv; no reduce_scatter,
which gloo lacks), so the same code runs on GPUs and in the CPU tests.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .fold import compose, identity_map
from .plan import ShardPlan


def _through_host(plan: ShardPlan, t: torch.Tensor) -> bool:
    # gloo's CUDA support is partial (no point-to-point): CUDA tensors travel through host copies, so several ranks
    # can share one GPU for a single-card check of the split; NCCL takes them as they are
    return t.is_cuda and dist.get_backend(plan.group) == "gloo"


def all_reduce_sum(x: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """The sum of every rank's ``x`` (a new tensor; ``x`` is not modified). A one-rank plan needs no process
    group."""
    x = x.clone(memory_format=torch.contiguous_format)
    if plan.world > 1:
        y = x.cpu() if _through_host(plan, x) else x
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=plan.group)
        if y is not x:
            x.copy_(y)
    return x


def _peer(group: Optional[dist.ProcessGroup], rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def exchange(plan: ShardPlan, sends: list[tuple[int, torch.Tensor]],
             recvs: list[tuple[int, torch.Tensor]]) -> None:
    """Point-to-point: send each ``(rank, tensor)`` of ``sends`` and fill each buffer of ``recvs`` from its rank,
    all posted at once (so two ranks sending to each other cannot deadlock), then wait."""
    host = any(_through_host(plan, t) for _, t in sends + recvs)
    out = [(r, t.contiguous().cpu() if host else t.contiguous()) for r, t in sends]
    into = [(r, buf.new_empty(buf.shape, device="cpu") if host else buf) for r, buf in recvs]
    ops = [dist.P2POp(dist.isend, t, _peer(plan.group, r), plan.group) for r, t in out]
    ops += [dist.P2POp(dist.irecv, buf, _peer(plan.group, r), plan.group) for r, buf in into]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if host:
        for (_, buf), (_, staged) in zip(recvs, into):
            buf.copy_(staged)


def scan_maps(own: torch.Tensor, plan: ShardPlan, reverse: bool = False) -> torch.Tensor:
    """The composition of the packed maps ``[M | N]`` of every earlier rank (``reverse``: every later rank, the
    latest applied first), an exclusive scan in ⌈log₂ R⌉ rounds of point-to-point exchange (Hillis–Steele).

    After round ``d = 2^i`` rank r holds ``inclusive`` = the maps of ranks ``(r − 2d, r]`` composed and
    ``exclusive`` = those of ``(r − 2d, r − 1]``; each round it sends ``inclusive`` to rank ``r + d`` and composes
    what rank ``r − d`` sent in front of both. Each rank sends and receives one map per round: ``⌈log₂ R⌉ ·
    4·B·HV·K·(K + V)`` bytes in fp32, instead of an all-gather's ``(R − 1)`` times that. Call on every rank.

    Args:
        own: this rank's packed map ``[..., K, K + V]`` (the same shape and dtype on every rank).
    Returns:
        the composed map of the earlier ranks (``[I | 0]`` on the first); its N part is the state they leave.
    """
    R = plan.world
    pos = R - 1 - plan.rank if reverse else plan.rank          # position in scan order
    rank_at = (lambda p: R - 1 - p) if reverse else (lambda p: p)
    inclusive, exclusive = own.contiguous(), None          # None: the identity, composed for free
    d = 1
    while d < R:
        sends = [(rank_at(pos + d), inclusive)] if pos + d < R else []
        buf = torch.empty_like(own) if pos - d >= 0 else None
        exchange(plan, sends, [(rank_at(pos - d), buf)] if buf is not None else [])
        if buf is not None:
            exclusive = buf if exclusive is None else compose(exclusive, buf)
            if 2 * d < R:                                  # the last round's inclusive map goes nowhere
                inclusive = compose(inclusive, buf)
        d *= 2
    return identity_map(own) if exclusive is None else exclusive


def halo_range(plan: ShardPlan, rank: int, length: Optional[int]) -> tuple[int, int]:
    """Global tokens ``[lo, hi)`` that ``rank`` reads before its shard: at most ``length`` (None: all) tokens of
    the sequence that runs into the shard, none if no sequence does or the shard is empty."""
    a, b = plan.bounds[rank], plan.bounds[rank + 1]
    seq = plan.open_boundary(a)
    if seq is None or a == b:
        return a, a
    lo = plan.offsets[seq] if length is None else max(a - length, plan.offsets[seq])
    return lo, a


def _pieces_others_need(plan: ShardPlan, length: Optional[int]) -> list[tuple[int, int, int]]:
    """(rank, lo, hi) for every piece of this rank's shard (local token offsets) that another rank's halo holds."""
    pieces = []
    for r in range(plan.world):
        if r == plan.rank:
            continue
        r_lo, r_hi = halo_range(plan, r, length)
        pieces += [(r, p_lo - plan.start, p_hi - plan.start) for owner, p_lo, p_hi in plan.sources(r_lo, r_hi)
                   if owner == plan.rank]
    return pieces


class _FetchPreceding(torch.autograd.Function):
    """``x`` ``[B, T_r, ...]`` → ``[B, L + T_r, ...]``: the L halo tokens from their owners, then ``x``."""

    @staticmethod
    def forward(ctx, x, plan: ShardPlan, length: Optional[int]):
        lo, hi = halo_range(plan, plan.rank, length)
        sends = [(r, x[:, p_lo:p_hi]) for r, p_lo, p_hi in _pieces_others_need(plan, length)]
        pieces = plan.sources(lo, hi)
        bufs = [x.new_empty(x.shape[0], p_hi - p_lo, *x.shape[2:]) for _, p_lo, p_hi in pieces]
        recvs = [(owner, buf) for (owner, _, _), buf in zip(pieces, bufs)]
        exchange(plan, sends, recvs)
        ctx.plan, ctx.length, ctx.halo = plan, length, hi - lo
        return torch.cat(bufs + [x], dim=1)

    @staticmethod
    def backward(ctx, grad):
        plan, length = ctx.plan, ctx.length
        grad_x = grad[:, ctx.halo:].clone()
        lo, hi = halo_range(plan, plan.rank, length)
        sends, off = [], 0
        for owner, p_lo, p_hi in plan.sources(lo, hi):
            sends.append((owner, grad[:, off:off + p_hi - p_lo]))
            off += p_hi - p_lo
        pieces = _pieces_others_need(plan, length)
        recvs = [(r, grad.new_empty(grad.shape[0], p_hi - p_lo, *grad.shape[2:])) for r, p_lo, p_hi in pieces]
        targets = [(p_lo, p_hi) for _, p_lo, p_hi in pieces]
        exchange(plan, sends, recvs)
        for (_, buf), (t_lo, t_hi) in zip(recvs, targets):
            grad_x[:, t_lo:t_hi] += buf
        return grad_x, None, None


def with_halo(x: torch.Tensor, plan: ShardPlan, length: Optional[int]) -> torch.Tensor:
    """This rank's tokens ``x`` ``[B, T_r, ...]`` preceded by the ``length`` tokens before its shard (None: all of
    them) that belong to the sequence running into the shard: ``[B, L + T_r, ...]`` with ``L`` from
    :func:`halo_range`. Autograd-aware: the halo's gradient is sent back to the ranks that own those tokens.
    Call it on every rank of the plan's group, in the same order."""
    if length is not None and length < 0:
        raise ValueError(f"halo length must be >= 0 or None, got {length}")
    if x.shape[1] != plan.local_len:
        raise ValueError(f"x holds {x.shape[1]} tokens, this rank's shard {plan.local_len}")
    return _FetchPreceding.apply(x, plan, length)
