"""``chunk_gated_delta_rule``: the public chunked GDN op — input checks, autograd, and the forward chosen by
``dispatch.py`` (which path runs, and why).

The core (q, k, v, g, beta, initial_state → o, final_state) is a pair of ``torch.library`` custom ops,
``linattn::chunk_gated_delta_rule_fwd`` and ``..._bwd``, with fake implementations, so ``torch.compile(
fullgraph=True)`` traces a call without a graph break. The optional pre-processing (q/k L2 norm, the
Qwen3-Next gate −exp(A_log)·softplus(g + dt_bias), β = sigmoid(b)) runs before the core: on the triton backend in
eager mode as one Triton launch forward and one backward (common/preprocess.py), elsewhere as the PyTorch twin
(utils.l2norm / gate_from_raw; torch.compile fuses those ops itself).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..hopper import route
from ..utils import (
    check_gated_delta_inputs,
    compute_dtype,
    dispatch_forward,
    eager_autograd_function,
    eager_call,
    gate_from_raw,
    host_offsets,
    l2norm,
    select_backend,
)
from .dispatch import ForwardPath, run_backward, run_forward, zero_state_gradient
from .fla_keywords import fla_keywords_given, resolve_fla_keywords
from .reference import gated_delta_rule_reference


def _preprocess_impl():
    from ..common import preprocess  # lazy: triton is optional on CPU machines
    return preprocess


def _fused_preprocess(q: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> bool:
    return _preprocess_impl().preprocess_supported(q, g, beta)


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
              initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], backend: str,
              forward_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    return run_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, host_offsets(cu_seqlens, q.shape[1]),
                       backend, forward_path)


_fwd_op = torch.library.custom_op("linattn::chunk_gated_delta_rule_fwd", _fwd_impl, mutates_args=())


@_fwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, backend, forward_path):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return v.new_empty(B, T, HV, V), v.new_empty(N, HV, K, V, dtype=compute_dtype(v))


def _bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], do: torch.Tensor,
            dht: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor, torch.Tensor]:
    grads = run_backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, host_offsets(cu_seqlens, q.shape[1]),
                         do, dht, backend)
    dh0 = grads[5] if grads[5] is not None else torch.zeros_like(dht)
    return (*grads[:5], dh0)


_bwd_op = torch.library.custom_op("linattn::chunk_gated_delta_rule_bwd", _bwd_impl, mutates_args=())


@_bwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, backend):
    dh0 = torch.empty_like(initial_state) if initial_state is not None else torch.empty_like(dht)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, cu_seqlens, backend, _ = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale, ctx.backend = scale, backend
    ctx.has_initial_state = initial_state is not None


def _backward(ctx, do, dht):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    T = q.shape[1]
    if do is None:
        do = torch.zeros_like(v)
    if eager_call(q, k, v, g, beta, initial_state, cu_seqlens, do, dht):
        # dht None stays None: the backward allocates no zeros for it (the Hopper walk's dh0 buffer starts as them)
        dq, dk, dv, dg, dbeta, dh0 = run_backward(q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens,
                                                  host_offsets(cu_seqlens, T), do.contiguous(),
                                                  dht.contiguous() if dht is not None else None, ctx.backend)
    else:       # the custom op's schema takes tensors
        if dht is None:
            dht = zero_state_gradient(q, v, cu_seqlens)
        dq, dk, dv, dg, dbeta, dh0 = _bwd_op(q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, do.contiguous(),
                                             dht.contiguous(), ctx.backend)
    return dq, dk, dv, dg, dbeta, None, (dh0 if ctx.has_initial_state else None), None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


_EagerFunction = eager_autograd_function(_fwd_impl, _setup_context, _backward)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    backend: Optional[str] = None,
    *,
    head_first: bool = False,
    chunk_size: Optional[int] = None,
    chunk_indices: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    use_gate_in_kernel: Optional[bool] = None,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    transpose_state_layout: Optional[bool] = None,
    cp_context=None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""Gated delta rule, chunked: a drop-in for fla's ``chunk_gated_delta_rule``.

    Per value head, with S a ``K × V`` state, ``g ≤ 0`` a log decay and ``0 ≤ β ≤ 1``::

        S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        o_t = scale · S_tᵀ q_t

    o_t sees tokens 1..t of its own sequence only (causal; with ``cu_seqlens`` each packed sequence starts from
    its own initial state).

    Args:
        q (torch.Tensor): queries of shape ``[B, T, H, K]``.
        k (torch.Tensor): keys of shape ``[B, T, H, K]``.
        v (torch.Tensor): values of shape ``[B, T, HV, V]``; grouped value heads if ``HV > H`` (``HV % H == 0``):
            value head ``i`` reads query/key head ``i // (HV // H)``.
        g (torch.Tensor): log decays of shape ``[B, T, HV]`` (fp32 recommended); raw gate logits when ``A_log``
            and ``dt_bias`` are given.
        beta (torch.Tensor): write strengths of shape ``[B, T, HV]``; logits if ``use_beta_sigmoid_in_kernel``.
        scale (float): query scale; default ``K ** -0.5``.
        initial_state (torch.Tensor): ``[N, HV, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``).
        output_final_state (bool): also return the final state ``[N, HV, K, V]`` (fp32).
        cu_seqlens (torch.Tensor): ``[N + 1]`` int32/int64 offsets of packed sequences (needs ``B == 1``).
        use_qk_l2norm_in_kernel (bool): L2-normalise q and k as ``x · rsqrt(Σx² + 1e-6)``.
        A_log, dt_bias (torch.Tensor): ``[HV]``; if given, ``g ← −exp(A_log) · softplus(g + dt_bias)``.
        use_beta_sigmoid_in_kernel (bool): ``beta ← sigmoid(beta)``.
        backend (str): ``"triton"`` (default on CUDA), ``"torch"`` (default elsewhere) or ``"reference"``
            (token-by-token float64; for tests).
        head_first, chunk_size, chunk_indices, cu_seqlens_cpu, use_gate_in_kernel, allow_neg_eigval, state_v_first,
            transpose_state_layout, cp_context: fla 0.6's keywords, honoured with fla's meaning where linattn can
            (``fla_keywords.py``; the table is in docs/api.md), else rejected with a message saying what to do.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state fp32 (fp64 for fp64 inputs) or None.
    """
    if fla_keywords_given(A_log, dt_bias, head_first, chunk_size, chunk_indices, cu_seqlens_cpu, use_gate_in_kernel,
                          allow_neg_eigval, state_v_first, transpose_state_layout, cp_context):
        fla_keywords = dict(head_first=head_first, chunk_size=chunk_size, chunk_indices=chunk_indices,
                            cu_seqlens_cpu=cu_seqlens_cpu, use_gate_in_kernel=use_gate_in_kernel,
                            allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                            transpose_state_layout=transpose_state_layout, cp_context=cp_context)
        fla = resolve_fla_keywords("chunk_gated_delta_rule", q, v, g, beta, initial_state, A_log, dt_bias,
                                   use_beta_sigmoid_in_kernel, cu_seqlens=cu_seqlens, **fla_keywords)
        o, ht = chunk_gated_delta_rule(q, k, v, fla.g, fla.beta, scale, fla.initial_state, output_final_state,
                                       cu_seqlens, use_qk_l2norm_in_kernel, fla.A_log, fla.dt_bias,
                                       fla.use_beta_sigmoid_in_kernel, backend)
        return o, fla.final_state(ht)
    return _chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                   use_qk_l2norm_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, backend, "auto")


def chunk_gated_delta_rule_on_path(forward_path: ForwardPath, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   g: torch.Tensor, beta: torch.Tensor, scale: Optional[float] = None,
                                   initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                                   cu_seqlens: Optional[torch.Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
                                   A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                                   use_beta_sigmoid_in_kernel: bool = False, backend: Optional[str] = None
                                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`chunk_gated_delta_rule` with its triton backend's forward forced to ``forward_path`` ("split",
    "walk", "hopper"; "auto" is the public op): for tests, benchmarks and debugging (``dispatch.py``)."""
    return _chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                   use_qk_l2norm_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, backend,
                                   forward_path)


def _chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                            use_qk_l2norm_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, backend,
                            forward_path: ForwardPath):
    """The op's body: a route for a repeated call, else the checks, the pre-processing and the core forward."""
    # a repeated call that ended in a prepared Hopper forward goes straight to it (hopper/route.py)
    routable = cu_seqlens is None and A_log is None and dt_bias is None and \
        not use_qk_l2norm_in_kernel and not use_beta_sigmoid_in_kernel
    if routable:
        arguments = (q, k, v, g, beta, scale, initial_state, backend, forward_path)
        found = route.lookup(*arguments)
        if found is not None:
            out = route.run(found, q, k, v, g, beta, initial_state)
            if out is not None:
                return out[0], (out[1] if output_final_state else None)
        route.start()
    scale, _ = check_gated_delta_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias)
    backend = select_backend(backend, q.device)
    fusable = use_qk_l2norm_in_kernel or A_log is not None or use_beta_sigmoid_in_kernel
    if fusable and backend == "triton" and eager_call(q, k, g, beta, A_log, dt_bias) and _fused_preprocess(q, g, beta):
        # one Triton launch (common/preprocess.py); traced calls keep the PyTorch ops, which torch.compile fuses
        q, k, g, beta = _preprocess_impl().preprocess(q, k, g, beta, A_log, dt_bias, use_qk_l2norm_in_kernel,
                                                      use_beta_sigmoid_in_kernel)
    else:
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)
        if A_log is not None:
            g = gate_from_raw(g, A_log, dt_bias)
        if use_beta_sigmoid_in_kernel:
            beta = beta.sigmoid()
    if backend == "reference":        # outside the custom op: autograd differentiates the token loop itself
        o, ht = gated_delta_rule_reference(q, k, v, g, beta, scale, initial_state, host_offsets(cu_seqlens, q.shape[1]))
        return o.to(v.dtype), (ht.to(compute_dtype(v)) if output_final_state else None)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    o, ht = dispatch_forward(_fwd_op, _fwd_impl, _EagerFunction,
                             (q, k, v, g, beta, scale, initial_state, cu_seqlens, backend, forward_path),
                             (q, k, v, g, beta, initial_state, cu_seqlens))
    if routable:
        route.remember(*arguments)
    return o, (ht if output_final_state else None)
