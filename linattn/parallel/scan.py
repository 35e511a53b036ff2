"""Context-parallel gated delta rule: exact outputs, final states and gradients over a sequence split across ranks.

Per (sequence, value head) the recurrence is affine in the state, and the state map of a run of tokens acts on
the key side: ``h_out = M h_in + N`` with M ``K × K`` and N the state reached from zero. Any op of this family
gives both from its own forward: N is the final state from ``initial_state = 0``; M is the final state of a run
with ``v = 0`` (K columns) from ``initial_state = I_K``, since then ``N = 0`` and ``M · I = M`` — exact, not an
approximation. Per rank (see :class:`~linattn.parallel.ShardPlan` for *continues* / *carries*):

forward
    1. a rank that carries computes the map of its last segment: ``(M, N)`` if that segment also continues (one
       pass with v, one with v = 0 from I), else ``(0, N)`` (its entering state does not reach the boundary);
       an empty shard passes the state through, ``(I, 0)``; a rank that does not carry sends ``(0, 0)``;
    2-3. an exclusive scan of the packed ``[B, HV, K, K + V]`` maps over the ranks (fp32; fp64 for fp64 inputs),
       ⌈log₂ R⌉ rounds of point-to-point exchange (:func:`~linattn.parallel.collectives.scan_maps`): the N part
       of the composition of the earlier ranks' maps is its entering state;
    4. the shard re-runs from its true entering state, giving o and the final states. Re-running (rather than
       correcting o from the zero-state run) costs one forward, the same as the correction would (the correction
       ``scale · Qᵀ`` of the propagated state is itself a run with v = 0 from h_in), and it leaves an autograd
       graph of the exact computation for the backward. A rank that does not continue runs once, exactly.
backward
    1. the local backward with the leaving state's gradient at zero gives ``D = ∂L/∂h_in`` (the entering
       state's direct effect on this rank's outputs) and the gradients of everything but the carried state;
    2. ``dh_out_r = D_{r+1} + M_{r+1}ᵀ dh_out_{r+1}``: the same scan in reverse rank order over the maps
       ``[Mᵀ | D]``;
    3. a rank that carries adds the local backward of its leaving state with gradient ``dh_out``.
    Gradients are exact: every term is the chain rule of the true computation; no rank needs another's
    activations.

Loss semantics: the objective is the sum over ranks of each rank's loss. Inputs held by one rank (its tokens) get
their full gradient on that rank. Inputs replicated on every rank (``initial_state``, ``A_log``, ``dt_bias``,
layer weights) get each rank's share, which the trainer sums over the group as it does for weights. The returned
final states are replicated on every rank (one all-reduce, only with ``output_final_state``), and their gradient
is the sum of every rank's.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ..ops.gated_delta.chunk import chunk_gated_delta_rule
from ..ops.gated_linear import gated_linear_attention
from .collectives import all_reduce_sum, scan_maps
from .fold import transpose_map
from .plan import ShardPlan

Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _state_dtype(v: torch.Tensor) -> torch.dtype:
    return torch.float64 if v.dtype == torch.float64 else torch.float32


class _LocalLayout:
    """Where this rank's rows of the local op's initial/final states come from and go to."""

    def __init__(self, plan: ShardPlan, batch: int):
        self.plan = plan
        self.continues, self.carries = plan.continues(), plan.carries()
        if plan.packed:
            segs = plan.segments
            self.rows = len(segs)
            self.seq_of_row = [s.seq for s in segs]
            # rows whose sequence ends inside this shard own that sequence's final state
            self.ends = [plan.start + s.end == plan.offsets[s.seq + 1] for s in segs]
        else:
            self.rows = batch
            self.seq_of_row = list(range(batch))
            self.ends = [plan.end == plan.total_len and plan.local_len > 0] * batch
        # rows that enter from the previous rank (the first segment, or every row of an unpacked batch)
        self.entering = ([0] if plan.packed else list(range(batch))) if self.continues and self.rows else []
        self.leaving = ([self.rows - 1] if plan.packed else list(range(batch))) if self.carries and self.rows else []
        # whether the leaving rows' state depends on the entering state (one continuing segment, or unpacked)
        self.through = bool(self.entering) and bool(self.leaving) and (not plan.packed or self.rows == 1)

    def initial_rows(self, initial_state, h_in, like: torch.Tensor) -> torch.Tensor:
        """``[rows, HV, K, V]``: the whole sequences' initial states, ``h_in`` on the entering rows."""
        if self.plan.packed:
            base = (initial_state[self.seq_of_row] if initial_state is not None
                    else like.new_zeros(self.rows, *like.shape[1:]))
        else:
            base = initial_state if initial_state is not None else like.new_zeros(self.rows, *like.shape[1:])
        if self.entering:
            base = base.clone()
            base[self.entering] = h_in
        return base


class _ContextParallelRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rule: Rule, plan: ShardPlan, output_final_state: bool, initial_state, *tensors):
        q, k, v = tensors[:3]
        B, _, _, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        sdt = _state_dtype(v)
        lay = _LocalLayout(plan, B)
        cu = plan.local_cu_seqlens(q.device)
        Bc = 1 if plan.packed else B
        state_like = v.new_zeros(1, HV, K, V, dtype=sdt)
        needs = ctx.needs_input_grad[4:]

        def run(init, with_graph):
            with torch.set_grad_enabled(with_graph):
                leaves = [t.detach().requires_grad_(n) if isinstance(t, torch.Tensor) else t
                          for t, n in zip(tensors, needs)]
                init = init.detach().requires_grad_(with_graph)
                o, ht = rule(*leaves, initial_state=init, cu_seqlens=cu)
            return o, ht, leaves, init

        final = None
        own_map = None
        if plan.local_len and not lay.entering:
            final = run(lay.initial_rows(initial_state, None, state_like), True)     # exact in one pass
        if plan.any_open:
            M = v.new_zeros(Bc, HV, K, K, dtype=sdt)
            N = v.new_zeros(Bc, HV, K, V, dtype=sdt)
            if plan.local_len == 0 and lay.continues:
                M = torch.eye(K, dtype=sdt, device=v.device).expand(Bc, HV, K, K).clone()
            elif lay.leaving:
                ht = final[1] if final is not None else run(
                    lay.initial_rows(initial_state, state_like.new_zeros(Bc, HV, K, V), state_like), False)[1]
                N = ht[lay.leaving].to(sdt)
                if lay.through:
                    eye = torch.eye(K, dtype=sdt, device=v.device).expand(Bc, HV, K, K).contiguous()
                    zero_v = v.new_zeros(*v.shape[:3], K)
                    with torch.no_grad():
                        M = rule(q, k, zero_v, *tensors[3:], initial_state=eye, cu_seqlens=cu)[1].to(sdt)
            own_map = torch.cat([M, N], dim=-1)                                            # [Bc, HV, K, K + V]
            h_in = scan_maps(own_map, plan)[..., K:]
            if plan.local_len and lay.entering:
                final = run(lay.initial_rows(initial_state, h_in, state_like), True)
        ctx.rule, ctx.plan, ctx.lay, ctx.K = rule, plan, lay, K
        ctx.output_final_state, ctx.own_map, ctx.final = output_final_state, own_map, final
        ctx.shapes = [(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None for t in tensors]
        ctx.initial_like = None if initial_state is None else initial_state.new_zeros(()).expand(initial_state.shape)
        o = final[0].detach() if final is not None else v.new_zeros(v.shape)
        ht_all = None
        if output_final_state:
            ht_all = _replicated_final_states(plan, lay, final, initial_state, v, (B, HV, K, V), sdt)
        return o, ht_all

    @staticmethod
    def backward(ctx, do, dht_all):
        plan, lay, K = ctx.plan, ctx.lay, ctx.K
        final = ctx.final
        n_tensors = len(ctx.needs_input_grad) - 4
        grads = [None] * n_tensors
        d_init = None
        if final is not None:
            o, ht, leaves, init = final
            dht_local = torch.zeros_like(ht)
            if ctx.output_final_state and dht_all is not None:
                dht_all = all_reduce_sum(dht_all, plan.group)
                for row, (seq, ends) in enumerate(zip(lay.seq_of_row, lay.ends)):
                    if ends:
                        dht_local[row] = dht_all[seq] if plan.packed else dht_all[row]
            inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad] + [init]
            first = torch.autograd.grad((o, ht), inputs, (do, dht_local), retain_graph=bool(lay.leaving),
                                        allow_unused=True)
            grads_in, d_init = list(first[:-1]), first[-1]
        elif ctx.output_final_state and dht_all is not None:
            dht_all = all_reduce_sum(dht_all, plan.group)
        if ctx.own_map is not None:
            own = ctx.own_map
            D = torch.zeros_like(own[..., K:])
            if d_init is not None and lay.entering:
                D = d_init[lay.entering].to(D.dtype)
            dh_out = scan_maps(transpose_map(own, D), plan, reverse=True)[..., K:]
            if final is not None and lay.leaving:
                dht_carry = torch.zeros_like(final[1])
                dht_carry[lay.leaving] = dh_out.to(dht_carry.dtype)
                second = torch.autograd.grad(final[1], inputs, dht_carry, allow_unused=True)
                grads_in = [a if b is None else (b if a is None else a + b) for a, b in zip(grads_in, second[:-1])]
                d_init = d_init + second[-1] if d_init is not None else second[-1]
        if final is not None:
            it = iter(grads_in)
            for i, t in enumerate(leaves):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    grads[i] = next(it)
        for i, meta in enumerate(ctx.shapes):
            # an empty shard, or an input this rank's outputs do not reach: a zero share, not None
            if ctx.needs_input_grad[4 + i] and grads[i] is None:
                grads[i] = torch.zeros(meta[0], dtype=meta[1], device=meta[2])
        d_initial = None
        if ctx.needs_input_grad[3]:
            d_initial = _initial_state_grad(plan, lay, d_init, dht_all if ctx.output_final_state else None,
                                            ctx.initial_like)
        ctx.final = None
        return (None, None, None, d_initial, *grads)


def _replicated_final_states(plan, lay, final, initial_state, v, shape, sdt):
    """Every sequence's final state on every rank: the owner's rows, summed over the group."""
    B, HV, K, V = shape
    n = plan.num_seqs if plan.packed else B
    out = v.new_zeros(n, HV, K, V, dtype=sdt)
    if final is not None:
        ht = final[1].detach().to(sdt)
        for row, (seq, ends) in enumerate(zip(lay.seq_of_row, lay.ends)):
            if ends:
                out[seq if plan.packed else row] = ht[row]
    if plan.rank == 0 and plan.packed:
        # a zero-length sequence ends where it starts
        for i in range(plan.num_seqs):
            if plan.offsets[i] == plan.offsets[i + 1] and initial_state is not None:
                out[i] = initial_state[i].to(sdt)
    return all_reduce_sum(out, plan.group)


def _initial_state_grad(plan, lay, d_init, dht_all, initial_like):
    """This rank's share of the gradient of the whole sequences' initial states: the rows that start here."""
    out = torch.zeros_like(initial_like)
    if d_init is not None:
        for row, seq in enumerate(lay.seq_of_row):
            if row not in lay.entering:
                out[seq if plan.packed else row] += d_init[row].to(out.dtype)
    if plan.rank == 0 and plan.packed and dht_all is not None:
        for i in range(plan.num_seqs):
            if plan.offsets[i] == plan.offsets[i + 1]:
                out[i] += dht_all[i].to(out.dtype)
    return out


def context_parallel_rule(rule: Rule, plan: ShardPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          *rest: Optional[torch.Tensor], initial_state: Optional[torch.Tensor] = None,
                          output_final_state: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run a state-affine recurrence ``rule`` over a sequence split across the ranks of ``plan.group``.

    ``rule(q, k, v, *rest, initial_state=..., cu_seqlens=...)`` must return ``(o, final_state)`` and be affine in
    its initial state with the map acting on the key side (the gated delta rule, gated linear attention); every
    tensor argument may require a gradient. Shapes as :func:`context_parallel_gated_delta_rule`.
    """
    B, T_r = q.shape[:2]
    if T_r != plan.local_len:
        raise ValueError(f"q holds {T_r} tokens, this rank's shard (plan) {plan.local_len}")
    if plan.packed and B != 1:
        raise ValueError(f"a packed batch (plan with cu_seqlens) needs batch size 1, got B={B}")
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k, v must share [B, T]: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if initial_state is not None:
        n = plan.num_seqs if plan.packed else B
        want = (n, v.shape[2], q.shape[3], v.shape[3])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [N, HV, K, V] = {want} (N = the global sequences), "
                             f"got {tuple(initial_state.shape)}")
    return _ContextParallelRule.apply(rule, plan, bool(output_final_state), initial_state, q, k, v, *rest)


def _gdn_rule(q, k, v, g, beta, A_log, dt_bias, *, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel,
              use_beta_sigmoid_in_kernel, backend):
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=True, cu_seqlens=cu_seqlens,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=A_log, dt_bias=dt_bias,
                                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, backend=backend)


def context_parallel_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, plan: ShardPlan,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None, use_beta_sigmoid_in_kernel: bool = False, backend: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`linattn.chunk_gated_delta_rule` over a sequence split along T across the ranks of ``plan.group``.

    Call it on every rank with that rank's shard; the result on each rank is the unsplit op's result restricted
    to the shard, exactly (up to the rounding of a different summation order).

    Args:
        q, k (torch.Tensor): this rank's queries and keys, ``[B, T_r, H, K]`` (``B == 1`` for a packed plan).
        v (torch.Tensor): this rank's values, ``[B, T_r, HV, V]``.
        g, beta (torch.Tensor): ``[B, T_r, HV]``, as the op takes them.
        plan (ShardPlan): the split (global ``cu_seqlens`` of a packed batch live in the plan).
        initial_state (torch.Tensor): ``[N, HV, K, V]`` initial states of the N global sequences (N = B
            unpacked), the same on every rank.
        output_final_state (bool): also return the final states ``[N, HV, K, V]``, replicated on every rank.
        scale, use_qk_l2norm_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, backend: as the op's.
    Returns:
        ``(o [B, T_r, HV, V], final_state or None)``.
    """
    rule = functools.partial(_gdn_rule, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, backend=backend)
    return context_parallel_rule(rule, plan, q, k, v, g, beta, A_log, dt_bias, initial_state=initial_state,
                                 output_final_state=output_final_state)


def _gla_rule(q, k, v, g, beta, *, initial_state, cu_seqlens, scale, backend):
    return gated_linear_attention(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=True, cu_seqlens=cu_seqlens, backend=backend)


def context_parallel_gated_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: Optional[torch.Tensor] = None, *,
    plan: ShardPlan, scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, backend: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`linattn.gated_linear_attention` over a sequence split across ranks (its map is ``M = e^{ΣG} I``,
    found the same way); arguments as :func:`context_parallel_gated_delta_rule`."""
    rule = functools.partial(_gla_rule, scale=scale, backend=backend)
    return context_parallel_rule(rule, plan, q, k, v, g, beta, initial_state=initial_state,
                                 output_final_state=output_final_state)
