"""Context-parallel gated delta rule: exact outputs, final states and gradients over a sequence split across ranks.

Per (sequence, value head) the recurrence is affine in the state, and the state map of a run of tokens acts on
the key side: ``S_t = P_t h_in + S_t⁰`` with ``P_t`` ``K × K``, so ``o_t = o_t⁰ + h_inᵀ (scale · P_tᵀ q_t)`` and
``h_out = M h_in + N`` (M = P_T, N = S_T⁰). Any op of this family gives all of it from its own forward: the run
from a zero entering state gives o⁰ and N; a run with ``v = 0`` (K columns) from ``initial_state = I_K`` gives
``M`` as its final state and ``o_M[t] = scale · P_tᵀ q_t`` as its output — exact, not an approximation. Per rank
(see :class:`~linattn.parallel.ShardPlan` for *continues* / *carries*):

forward
    1. the shard from its known initial states (zero where it continues): o⁰, the final states, N;
    2. if it continues, the ``v = 0`` run over the tokens the entering state reaches (its first segment): o_M, M;
    3. an exclusive scan of the packed ``[B, HV, K, K + V]`` maps ``[M | N]`` over the ranks, ⌈log₂ R⌉ rounds of
       point-to-point exchange in fp32 (:func:`~linattn.parallel.collectives.scan_maps`): the N part of the
       composition of the earlier ranks' maps is its entering state h_in (a rank that does not carry sends
       ``[0 | 0]``, one whose leaving state does not depend on its entering one ``[0 | N]``, an empty shard
       ``[I | 0]``);
    4. ``o = o⁰ + o_M h_in`` and ``h_out = M h_in + N``: a correction, not a re-run. Both runs are independent of
       h_in, so they run before the scan and nothing but a ``T_r × K × V`` product per head waits on it.
backward
    1. ``D = ∂L/∂h_in = Σ_t o_M[t] do_tᵀ + Mᵀ dh_T`` (the final states ending here) — products, no op backward;
    2. ``dh_out_r = D_{r+1} + M_{r+1}ᵀ dh_out_{r+1}``: the same scan in reverse rank order over ``[Mᵀ | D]``;
    3. one autograd pass through both runs with ``do``, the final states' gradients (``dh_out`` on the carried
       row), ``d o_M = do h_inᵀ`` and ``dM = dh_T h_inᵀ``: exact dq, dk, dv, dg, dβ (and dA_log, d dt_bias).
    No rank needs another's activations.

Loss semantics: the objective is the sum over ranks of each rank's loss. Inputs held by one rank (its tokens) get
their full gradient on that rank. Inputs replicated on every rank (``initial_state``, ``A_log``, ``dt_bias``,
layer weights) get each rank's share, which the trainer sums over the group as it does for weights. The returned
final states are replicated on every rank (one all-reduce, only with ``output_final_state``), and their gradient
is the sum of every rank's.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence

import torch

from ..ops.gated_delta.chunk import chunk_gated_delta_rule
from ..ops.gated_linear import gated_linear_attention
from ..ops.utils import gate_from_raw, l2norm
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
        # the local tokens the entering state reaches: the first segment (packed) or the whole shard
        self.entering_span = plan.segments[0].end if plan.packed and plan.segments else plan.local_len

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
    def forward(ctx, rule: Rule, plan: ShardPlan, n_tokens: int, output_final_state: bool, build_graph: bool,
                reach: int, initial_state, *tensors):
        q, k, v = tensors[:3]
        B, _, _, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        sdt = _state_dtype(v)
        lay = _LocalLayout(plan, B)
        Bc = 1 if plan.packed else B
        dev = v.device
        state_like = v.new_zeros(1, HV, K, V, dtype=sdt)
        eye = torch.eye(K, dtype=sdt, device=dev).expand(Bc, HV, K, K)
        main = through_h = None
        # the local runs keep their autograd graphs for the backward (only when a gradient can be asked for)
        with torch.set_grad_enabled(build_graph):
            leaves = [t.detach().requires_grad_(n and build_graph) if isinstance(t, torch.Tensor) else t
                      for t, n in zip(tensors, ctx.needs_input_grad[7:])]
            if plan.local_len:
                # the shard from its known initial states, zero on the rows entering from the previous rank
                init = lay.initial_rows(initial_state, state_like.new_zeros(Bc, HV, K, V), state_like)
                init = init.detach().requires_grad_(ctx.needs_input_grad[6] and build_graph)
                main = (*rule(*leaves, initial_state=init, cu_seqlens=plan.local_cu_seqlens(dev)), init)
            # ``reach`` ≤ the entering span: the tokens the entering state provably reaches (beyond, ‖P_t‖₂ is
            # under the caller's tolerance and the map counts as zero: ``cut``)
            cut = reach < lay.entering_span
            if plan.local_len and lay.entering and reach:
                # the entering span's map: v = 0 from I_K gives M as the final state and, as the output,
                # o_M[t] = scale · P_tᵀ q_t (P_t the map up to token t): the output's entering-state term is o_M h_in
                span = reach
                sliced = [t[:, :span] if i < n_tokens and isinstance(t, torch.Tensor) else t
                          for i, t in enumerate(leaves)]
                sliced[2] = v.new_zeros(B, span, HV, K)
                through_h = rule(*sliced, initial_state=eye.contiguous(), cu_seqlens=None)
        own_map, h_in = None, None
        if plan.any_open:
            M, N = torch.zeros_like(eye), v.new_zeros(Bc, HV, K, V, dtype=sdt)
            if plan.local_len == 0 and lay.continues:
                M = eye.clone()                                             # an empty shard passes the state on
            elif lay.leaving:
                N = main[1][lay.leaving].detach().to(sdt)
                if lay.through and not cut:
                    M = through_h[1].detach().to(sdt)
            own_map = torch.cat([M, N], dim=-1)                                             # [Bc, HV, K, K + V]
            h_in = scan_maps(own_map, plan)[..., K:]
        o = v.new_zeros(v.shape) if main is None else main[0].detach().clone()
        ht = None if main is None else main[1].detach().to(sdt).clone()
        if through_h is not None:
            o_m = through_h[0].detach().to(sdt)
            o[:, :reach] = (o[:, :reach].to(sdt) + torch.einsum("bthk,bhkv->bthv", o_m, h_in)).to(o.dtype)
            if not cut:
                ht[lay.entering] = through_h[1].detach().to(sdt) @ h_in + ht[lay.entering]
        ctx.plan, ctx.lay, ctx.K, ctx.sdt, ctx.reach, ctx.cut = plan, lay, K, sdt, reach, cut
        ctx.output_final_state, ctx.own_map, ctx.h_in = output_final_state, own_map, h_in
        ctx.leaves, ctx.main, ctx.through_h = leaves, main, through_h
        ctx.shapes = [(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else None for t in tensors]
        ctx.initial_like = None if initial_state is None else initial_state.new_zeros(()).expand(initial_state.shape)
        ht_all = None
        if output_final_state:
            ht_all = _replicated_final_states(plan, lay, ht, initial_state, v, (B, HV, K, V), sdt)
        return o, ht_all

    @staticmethod
    def backward(ctx, do, dht_all):
        plan, lay, K, sdt = ctx.plan, ctx.lay, ctx.K, ctx.sdt
        main, through_h, h_in = ctx.main, ctx.through_h, ctx.h_in
        if ctx.output_final_state and dht_all is not None:
            dht_all = all_reduce_sum(dht_all, plan)
        dht = None
        if main is not None:
            dht = torch.zeros_like(main[1], dtype=sdt)
            if ctx.output_final_state and dht_all is not None:
                for row, (seq, ends) in enumerate(zip(lay.seq_of_row, lay.ends)):
                    if ends:
                        dht[row] = dht_all[seq] if plan.packed else dht_all[row]
        d_o_m = None
        if through_h is not None:
            # the entering state's direct effect: through o = ... + o_M h_in and the final states ending here
            do_span = do[:, :ctx.reach].to(sdt)
            m_ent = torch.zeros_like(through_h[1], dtype=sdt) if ctx.cut else through_h[1].detach().to(sdt)
            D = torch.einsum("bthk,bthv->bhkv", through_h[0].detach().to(sdt), do_span)
            D = D + m_ent.transpose(-1, -2) @ dht[lay.entering]
            d_o_m = torch.einsum("bthv,bhkv->bthk", do_span, h_in)
        if ctx.own_map is not None:
            if through_h is None:
                D = torch.zeros_like(ctx.own_map[..., K:])
            dh_out = scan_maps(transpose_map(ctx.own_map, D), plan, reverse=True)[..., K:]
            if dht is not None and lay.leaving:
                dht[lay.leaving] += dh_out
        grads = [None] * len(ctx.shapes)
        d_init = None
        if main is not None:
            outs, grad_outs = [main[0], main[1]], [do, dht.to(main[1].dtype)]
            if through_h is not None:
                outs += [through_h[0], through_h[1]]
                d_m = dht[lay.entering] @ h_in.transpose(-1, -2)
                grad_outs += [d_o_m.to(through_h[0].dtype), (0 * d_m if ctx.cut else d_m).to(through_h[1].dtype)]
            wanted = [t for t in ctx.leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if main[2].requires_grad:
                wanted.append(main[2])
            got = torch.autograd.grad(outs, wanted, grad_outs, allow_unused=True) if wanted else ()
            it = iter(got)
            for i, t in enumerate(ctx.leaves):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    grads[i] = next(it)
            d_init = next(it, None)
        for i, meta in enumerate(ctx.shapes):
            # an empty shard, or an input this rank's outputs do not reach: a zero share, not None
            if ctx.needs_input_grad[7 + i] and grads[i] is None:
                grads[i] = torch.zeros(meta[0], dtype=meta[1], device=meta[2])
        d_initial = None
        if ctx.needs_input_grad[6]:
            d_initial = _initial_state_grad(plan, lay, d_init, dht_all if ctx.output_final_state else None,
                                            ctx.initial_like)
        ctx.leaves = ctx.main = ctx.through_h = None
        return (None, None, None, None, None, None, d_initial, *grads)


def _replicated_final_states(plan, lay, ht, initial_state, v, shape, sdt):
    """Every sequence's final state on every rank: the owner's rows, summed over the group."""
    B, HV, K, V = shape
    n = plan.num_seqs if plan.packed else B
    out = v.new_zeros(n, HV, K, V, dtype=sdt)
    if ht is not None:
        for row, (seq, ends) in enumerate(zip(lay.seq_of_row, lay.ends)):
            if ends:
                out[seq if plan.packed else row] = ht[row]
    if plan.rank == 0 and plan.packed:
        # a zero-length sequence ends where it starts
        for i in range(plan.num_seqs):
            if plan.offsets[i] == plan.offsets[i + 1] and initial_state is not None:
                out[i] = initial_state[i].to(sdt)
    return all_reduce_sum(out, plan)


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


def context_parallel_rule(rule: Rule, plan: ShardPlan, tokens: Sequence[Optional[torch.Tensor]],
                          params: Sequence[Optional[torch.Tensor]] = (), *,
                          initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                          log_decay_bound: Optional[Callable] = None, map_tolerance: float = 0.0,
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run a state-affine recurrence ``rule`` over a sequence split across the ranks of ``plan.group``.

    ``rule(*tokens, *params, initial_state=..., cu_seqlens=...)`` must return ``(o, final_state)`` and be affine in
    its initial state with the map acting on the key side (the gated delta rule, gated linear attention).
    ``tokens`` are this rank's per-token tensors ``[B, T_r, ...]``, starting with q, k, v; ``params`` the rest
    (``A_log``, ``dt_bias``); any of them may require a gradient. ``log_decay_bound(tokens, params)`` returns
    ``[B, T, HV]`` per-token bounds on ``log ‖token map‖₂`` (used with ``map_tolerance > 0``, see
    :func:`entering_reach`). Shapes as :func:`context_parallel_gated_delta_rule`.
    """
    q, k, v = tokens[:3]
    B, T_r = q.shape[:2]
    if T_r != plan.local_len:
        raise ValueError(f"q holds {T_r} tokens, this rank's shard (plan) {plan.local_len}")
    if plan.packed and B != 1:
        raise ValueError(f"a packed batch (plan with cu_seqlens) needs batch size 1, got B={B}")
    for t in tokens:
        if t is not None and tuple(t.shape[:2]) != (B, T_r):
            raise ValueError(f"every per-token tensor must be [B, T_r, ...] = [{B}, {T_r}, ...], got "
                             f"{tuple(t.shape)}")
    if initial_state is not None:
        n = plan.num_seqs if plan.packed else B
        want = (n, v.shape[2], q.shape[3], v.shape[3])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [N, HV, K, V] = {want} (N = the global sequences), "
                             f"got {tuple(initial_state.shape)}")
    if map_tolerance < 0 or (map_tolerance > 0 and log_decay_bound is None):
        raise ValueError(f"map_tolerance must be >= 0, and > 0 only with a log_decay_bound, got {map_tolerance}")
    reach = entering_reach(plan, tokens, params, log_decay_bound, map_tolerance)
    inputs = (initial_state, *tokens, *params)
    build_graph = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
    return _ContextParallelRule.apply(rule, plan, len(tokens), bool(output_final_state), build_graph, reach,
                                      *inputs)


def entering_reach(plan: ShardPlan, tokens, params, log_decay_bound: Optional[Callable], map_tolerance: float) -> int:
    """How many tokens of this rank's entering span the entering state reaches: all of them, unless the bound
    ``log ‖P_t‖₂ ≤ Σ_{s ≤ t} log_decay_bound[s]`` stays under ``log(map_tolerance)`` (every row and head) from some
    token on; then the span ends there, and the map after it counts as zero (an error ≤ map_tolerance · ‖h_in‖
    in the state, ≤ scale · ‖q_t‖ · map_tolerance · ‖h_in‖ in an output)."""
    if not plan.local_len or not plan.continues():
        return 0
    span = plan.segments[0].end if plan.packed else plan.local_len
    if map_tolerance == 0:
        return span
    with torch.no_grad():
        head = [t[:, :span] if isinstance(t, torch.Tensor) else t for t in tokens]
        cum = log_decay_bound(head, params).to(torch.float64).cumsum(1)                      # [B, span, HV]
        above = (cum > math.log(map_tolerance)).flatten(2).any(-1).any(0)                    # [span]
        idx = torch.nonzero(above)
    return int(idx[-1]) + 1 if idx.numel() else 0


def _gdn_rule(q, k, v, g, beta, A_log, dt_bias, *, initial_state, cu_seqlens, scale, use_qk_l2norm_in_kernel,
              use_beta_sigmoid_in_kernel, backend):
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=True, cu_seqlens=cu_seqlens,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=A_log, dt_bias=dt_bias,
                                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, backend=backend)


def _gdn_log_decay_bound(tokens, params, *, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel):
    """Per token, ``log ‖e^{g} (I − β k kᵀ)‖₂ = g + log max(1, |1 − β‖k‖²|)`` with the op's preprocessing."""
    _, k, v, g, beta = tokens
    A_log, dt_bias = params
    g = gate_from_raw(g, A_log, dt_bias) if A_log is not None else g.float()
    k = l2norm(k) if use_qk_l2norm_in_kernel else k
    beta = beta.float().sigmoid() if use_beta_sigmoid_in_kernel else beta.float()
    kk = k.float().square().sum(-1).repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    return g.float() + torch.log((1 - beta * kk).abs().clamp(min=1.0))


def context_parallel_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, plan: ShardPlan,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None, use_beta_sigmoid_in_kernel: bool = False, backend: Optional[str] = None,
    map_tolerance: float = 0.0,
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
        map_tolerance (float): 0 (the default) is exact. Above 0, the entering state's map is computed only over
            the tokens before the norm bound ``Π e^{g_t} max(1, |1 − β_t‖k_t‖²|)`` falls below it for good (every
            head), and counts as zero after them: an error ≤ map_tolerance · ‖h_in‖ in the states, for a shorter
            K-wide run on strongly decaying shards (:func:`entering_reach`).
    Returns:
        ``(o [B, T_r, HV, V], final_state or None)``.
    """
    flags = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    rule = functools.partial(_gdn_rule, scale=scale, backend=backend, **flags)
    return context_parallel_rule(rule, plan, (q, k, v, g, beta), (A_log, dt_bias), initial_state=initial_state,
                                 output_final_state=output_final_state, map_tolerance=map_tolerance,
                                 log_decay_bound=functools.partial(_gdn_log_decay_bound, **flags))


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
    return context_parallel_rule(rule, plan, (q, k, v, g, beta), initial_state=initial_state,
                                 output_final_state=output_final_state)
