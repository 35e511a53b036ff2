"""``fused_recurrent_gated_delta_rule``: the recurrent (token-by-token) GDN op for short sequences, forward and
backward, plus the PyTorch twins of its Triton kernels (recurrent_kernels.py).

The recurrent form reads and writes the K×V state once per sequence and walks the tokens in registers: for a few
tokens (decode, speculative verification, short training sequences) that beats the chunked op, whose fixed cost
is per chunk. It takes the arguments, checks and conventions of :func:`linattn.chunk_gated_delta_rule` and gives
the same results within rounding.

Pre-processing (q/k L2 norm, the gate −exp(A_log)·softplus(g + dt_bias), β = sigmoid(β)) is fused into the
kernels; the backward kernels return gradients of the *prepared* inputs and the chain rule through the
pre-processing is :func:`prepare_bwd_ref` (elementwise PyTorch, the same on every backend).

Backward memory: the reverse walk needs every S_t, so the backward materialises them (B·T·HV·K·V fp32, e.g.
64 KiB per token and value head at K = V = 128). Use the chunked op for long sequences.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..utils import (
    MIN_LOG_DECAY,
    check_gated_delta_inputs,
    compute_dtype,
    dispatch_forward,
    eager_autograd_function,
    eager_call,
    host_offsets,
    select_backend,
)
from .fla_keywords import fla_keywords_given, resolve_fla_keywords
from .reference import gated_delta_rule_reference


def load_recurrent_kernels():
    """The Triton kernel module (``recurrent_kernels``), imported on first use."""
    from . import recurrent_kernels  # imported lazily: triton is optional on CPU machines
    return recurrent_kernels


# ----------------------------------------------------------------------------------------------------------------
# PyTorch twins: pre-processing, forward, backward (vectorised over sequences and heads, a loop over tokens)
# ----------------------------------------------------------------------------------------------------------------
def prepare_ref(q, k, g, beta, A_log, dt_bias, use_qk_l2norm: bool, use_beta_sigmoid: bool):
    """The fused pre-processing, in fp32 (fp64 for fp64 input), as the kernels' ``_prepare_token`` does it:
    q, k ← x·rsqrt(Σx² + 1e-6); g ← max(−exp(A_log)·softplus(g + dt_bias), MIN_LOG_DECAY); β ← sigmoid(β). Scale
    is not applied."""
    cd = compute_dtype(q)
    q, k, g, beta = (x.to(cd) for x in (q, k, g, beta))
    if use_qk_l2norm:
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    if A_log is not None:
        g = (-A_log.to(cd).exp() * F.softplus(g + dt_bias.to(cd))).clamp_min(MIN_LOG_DECAY)
    if use_beta_sigmoid:
        beta = beta.sigmoid()
    return q, k, g, beta


def prepare_bwd_ref(q, k, g, beta, A_log, dt_bias, use_qk_l2norm: bool, use_beta_sigmoid: bool,
                    dq, dk, dg, dbeta):
    """Chain rule through :func:`prepare_ref`: gradients of the prepared q, k, g, β (q, k summed over grouped value
    heads already) → gradients of the raw inputs and of A_log, dt_bias (None when not used).

    L2 norm y = x·r, r = (Σx² + ε)^{-1/2}:  dx = r·(dy − y·Σ(dy·y)).
    Gate g = −e^{A}·softplus(x + b):  dx = dg·(−e^{A}·σ(x + b)),  db = Σ dx,  dA = Σ dg·g; all 0 where the gate
    is floored at MIN_LOG_DECAY (selects: e^{A} may be inf).
    Sigmoid β = σ(x):  dx = dβ·β(1 − β)."""
    cd = compute_dtype(q)
    q, k, g_raw, b_raw = (x.to(cd) for x in (q, k, g, beta))
    dA_log = ddt_bias = None
    if use_qk_l2norm:
        def l2_bwd(x, dy):
            r = torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)
            y = x * r
            return r * (dy - y * (dy * y).sum(-1, keepdim=True))
        dq, dk = l2_bwd(q, dq), l2_bwd(k, dk)
    if A_log is not None:
        a = A_log.to(cd).exp()
        x = g_raw + dt_bias.to(cd)
        g_val = -a * F.softplus(x)
        floored = g_val < MIN_LOG_DECAY
        dA_log = torch.where(floored, 0.0, dg * g_val).flatten(0, 1).sum(0).to(A_log.dtype)
        dg = torch.where(floored, 0.0, dg * (-a * x.sigmoid()))
        ddt_bias = dg.flatten(0, 1).sum(0).to(dt_bias.dtype)
    if use_beta_sigmoid:
        s = b_raw.sigmoid()
        dbeta = dbeta * s * (1 - s)
    return dq, dk, dg, dbeta, dA_log, ddt_bias


def _recurrence(q, k, v, g, beta, scale: float, h0: Optional[torch.Tensor], keep_states: bool):
    """o ``[N, T, HV, V]``, the final state and (if ``keep_states``) the list of the states after each token: the
    recurrence is :func:`one_step_ref` token by token, on a copy of h0 updated in place."""
    N, T, HV, K = q.shape
    V = v.shape[-1]
    S = (h0.to(q.dtype, memory_format=torch.contiguous_format, copy=True) if h0 is not None
         else q.new_zeros(N, HV, K, V))
    o = q.new_empty(N, T, HV, V)
    states = []
    for t in range(T):
        o[:, t] = one_step_ref(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale, S)
        if keep_states:
            states.append(S.clone())
    return o, S, states


def fused_recurrent_fwd_ref(q, k, v, g, beta, scale: float, h0: Optional[torch.Tensor],
                            store_intermediate: bool = False):
    """Twin of ``fused_recurrent_fwd_kernel`` on prepared inputs of equal-length sequences.

    q, k ``[N, T, HV, K]`` (grouped heads expanded); v ``[N, T, HV, V]``; g, beta ``[N, T, HV]``, all in the
    compute dtype; h0 ``[N, HV, K, V]`` or None (not modified). Returns o ``[N, T, HV, V]``, the final state and, if
    asked, the state after every token ``[N, T, HV, K, V]``. Per token (:func:`one_step_ref`):

        S' = e^g S,   u = β (v − S'ᵀk),   S ← S' + k uᵀ,   o = scale·Sᵀq"""
    o, S, states = _recurrence(q, k, v, g, beta, scale, h0, store_intermediate)
    return o, S, (torch.stack(states, 1) if store_intermediate else None)


def one_step_ref(q, k, v, g, beta, scale: float, S: torch.Tensor) -> torch.Tensor:
    """One token per sequence, ``S`` ``[N, HV, K, V]`` updated in place: twin of the kernel's ONE_STEP path
    (``recurrent_kernels.one_step_path``) and the torch backend's decode step. q, k ``[N, HV, K]``, v
    ``[N, HV, V]``, g, beta ``[N, HV]`` (prepared, grouped heads expanded, S's dtype). Returns o ``[N, HV, V]``.

    Both reductions over K read the entering state S, so it is read once and written once:

        u = β (v − e^g Sᵀk),    o = scale·(e^g Sᵀq + (q·k) u),    S ← e^g S + k uᵀ

    (o = scale·S_newᵀq expanded). On a CPU this is 3 passes over the state (one bmm reading it, the in-place scale
    and rank-1 update) instead of the token loop's ≈ 8 with four fresh state-sized temporaries."""
    N, HV, K, V = S.shape
    S3 = S.view(N * HV, K, V)
    qS, kS = (torch.stack((q, k), 2).view(N * HV, 2, K) @ S3).view(N, HV, 2, V).unbind(2)
    eg = g.exp()[..., None]
    u = beta[..., None] * (v - eg * kS)
    o = scale * (eg * qS + (q * k).sum(-1, keepdim=True) * u)
    S3.mul_(eg.reshape(N * HV, 1, 1)).baddbmm_(k.reshape(N * HV, K, 1), u.reshape(N * HV, 1, V))
    return o


def fused_recurrent_bwd_ref(q, k, v, g, beta, scale: float, h0: Optional[torch.Tensor], do, dht):
    """Twin of ``fused_recurrent_bwd_kernel``: the reverse walk, on the inputs of :func:`fused_recurrent_fwd_ref`.
    Returns dq, dk ``[N, T, HV, K]``, dv ``[N, T, HV, V]``, dg, dbeta ``[N, T, HV]`` and dh0 (see the kernel's
    docstring for the per-token formulas). The (sequence, head) pairs are one batch of NH = N·HV matrices, and dS is
    updated in place (rank-1 ``baddbmm_``, in-place scale): no state-sized temporary per token but S'."""
    N, T, HV, K = q.shape
    V = v.shape[-1]
    NH = N * HV
    _, _, states = _recurrence(q, k, v, g, beta, scale, h0, keep_states=True)
    h_first = h0.to(q.dtype) if h0 is not None else q.new_zeros(N, HV, K, V)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dv = torch.empty_like(v)
    dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
    dS = (dht.to(q.dtype, memory_format=torch.contiguous_format, copy=True).view(NH, K, V) if dht is not None
          else q.new_zeros(NH, K, V))
    Sp = q.new_empty(NH, K, V)                                                   # S' = e^g S_{t-1}, reused
    do = do.to(q.dtype)
    for t in reversed(range(T)):
        kt, qt, dot = k[:, t].reshape(NH, K), q[:, t].reshape(NH, K) * scale, do[:, t].reshape(NH, V)
        bt, eg = beta[:, t].reshape(NH, 1), g[:, t].exp().reshape(NH, 1)
        torch.mul((states[t - 1] if t > 0 else h_first).reshape(NH, K, V), eg[..., None], out=Sp)
        u = v[:, t].reshape(NH, V) - (kt[:, None] @ Sp)[:, 0]
        bu = bt * u
        dq[:, t] = scale * (states[t].view(NH, K, V) @ dot[..., None]).view(N, HV, K)     # S_t dO
        dS.baddbmm_(qt[..., None], dot[:, None])                                  # + scale·q dOᵀ
        dbu = (kt[:, None] @ dS)[:, 0]
        du = bt * dbu
        dk[:, t] = (dS @ bu[..., None] - Sp @ du[..., None]).view(N, HV, K)
        dbeta[:, t] = (u * dbu).sum(-1).view(N, HV)
        dv[:, t] = du.view(N, HV, V)
        dS.baddbmm_(kt[..., None], du[:, None], alpha=-1)                         # dS' = dS − k duᵀ
        # ⟨dS', S'⟩ by vecdot, 9× faster on a CPU than a [1, K·V] @ [K·V, 1] bmm
        dg[:, t] = torch.linalg.vecdot(dS.view(NH, K * V), Sp.view(NH, K * V)).view(N, HV)
        dS.mul_(eg[..., None])
    return dq, dk, dv, dg, dbeta, dS.view(N, HV, K, V)


# ----------------------------------------------------------------------------------------------------------------
# the torch backend: [B, T, ...] in and out; grouped heads, varlen and pre-processing handled here
# ----------------------------------------------------------------------------------------------------------------
def _sequences(B: int, T: int, offsets: Optional[list[int]]):
    """(rows, bos, eos) of every group of equal-length sequences processed together: the whole batch at once
    without varlen, one packed sequence at a time with it."""
    if offsets is None:
        return [(slice(0, B), 0, T, slice(0, B))]
    return [(slice(0, 1), bos, eos, slice(n, n + 1)) for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:]))]


def fused_recurrent_fwd_torch(q, k, v, g, beta, scale, initial_state, offsets, A_log, dt_bias, use_qk_l2norm,
                              use_beta_sigmoid):
    """Forward of the torch backend: o ``[B, T, HV, V]`` in v's dtype, final state ``[N, HV, K, V]`` fp32
    (fp64 for fp64 input)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    qp, kp, gp, bp = prepare_ref(q, k, g, beta, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid)
    qp, kp = qp.repeat_interleave(G, 2), kp.repeat_interleave(G, 2)
    vp = v.to(qp.dtype)
    o = torch.empty_like(v)
    N = B if offsets is None else len(offsets) - 1
    ht = torch.empty(N, HV, K, V, dtype=qp.dtype, device=q.device)
    for rows, bos, eos, seqs in _sequences(B, T, offsets):
        h0 = initial_state[seqs] if initial_state is not None else None
        if eos == bos:
            ht[seqs] = h0.to(qp.dtype) if h0 is not None else 0.
            continue
        on, htn, _ = fused_recurrent_fwd_ref(qp[rows, bos:eos], kp[rows, bos:eos], vp[rows, bos:eos],
                                             gp[rows, bos:eos], bp[rows, bos:eos], scale, h0)
        o[rows, bos:eos] = on.to(v.dtype)
        ht[seqs] = htn
    return o, ht


def fused_recurrent_bwd_torch(q, k, v, g, beta, scale, initial_state, offsets, A_log, dt_bias, use_qk_l2norm,
                              use_beta_sigmoid, do, dht):
    """Gradients of the prepared inputs, as :func:`fused_recurrent_bwd` in recurrent_kernels.py returns them."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    qp, kp, gp, bp = prepare_ref(q, k, g, beta, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid)
    qp, kp = qp.repeat_interleave(G, 2), kp.repeat_interleave(G, 2)
    vp, dop = v.to(qp.dtype), do.to(qp.dtype)
    N = B if offsets is None else len(offsets) - 1
    dq, dk = torch.zeros_like(qp), torch.zeros_like(kp)
    dv = torch.zeros_like(vp)
    dg, dbeta = torch.zeros_like(gp), torch.zeros_like(bp)
    dh0 = torch.empty(N, HV, K, V, dtype=qp.dtype, device=q.device)
    for rows, bos, eos, seqs in _sequences(B, T, offsets):
        h0 = initial_state[seqs] if initial_state is not None else None
        dhtn = dht[seqs] if dht is not None else None
        if eos == bos:
            dh0[seqs] = dhtn.to(qp.dtype) if dhtn is not None else 0.
            continue
        sl = (rows, slice(bos, eos))
        grads = fused_recurrent_bwd_ref(qp[sl], kp[sl], vp[sl], gp[sl], bp[sl], scale, h0, dop[sl], dhtn)
        for dst, src in zip((dq, dk, dv, dg, dbeta), grads[:5]):
            dst[sl] = src
        dh0[seqs] = grads[5]
    return dq, dk, dv.to(v.dtype), dg, dbeta, dh0


# ----------------------------------------------------------------------------------------------------------------
# custom ops and autograd
# ----------------------------------------------------------------------------------------------------------------
def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], A_log: Optional[torch.Tensor],
            dt_bias: Optional[torch.Tensor], use_qk_l2norm: bool, use_beta_sigmoid: bool,
            backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = host_offsets(cu_seqlens, q.shape[1])
    if backend == "triton":
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        ht = v.new_empty(N, v.shape[2], q.shape[3], v.shape[3], dtype=compute_dtype(v))
        o = load_recurrent_kernels().fused_recurrent_fwd(
            q, k, v, g, beta, scale, initial_state, ht, None, cu_seqlens, None, A_log, dt_bias, use_qk_l2norm,
            use_beta_sigmoid)
        return o, ht
    return fused_recurrent_fwd_torch(q, k, v, g, beta, scale, initial_state, offsets, A_log, dt_bias,
                                     use_qk_l2norm, use_beta_sigmoid)


_fwd_op = torch.library.custom_op("linattn::fused_recurrent_gated_delta_rule_fwd", _fwd_impl, mutates_args=())


@_fwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid, backend):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return v.new_empty(B, T, HV, V), v.new_empty(N, HV, K, V, dtype=compute_dtype(v))


def _bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], A_log: Optional[torch.Tensor],
            dt_bias: Optional[torch.Tensor], use_qk_l2norm: bool, use_beta_sigmoid: bool, do: torch.Tensor,
            dht: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias; the last two are empty when A_log is None (custom
    ops cannot return None)."""
    H, HV = q.shape[2], v.shape[2]
    if backend == "triton":
        grads = load_recurrent_kernels().fused_recurrent_bwd(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid,
            do, dht)
    else:
        grads = fused_recurrent_bwd_torch(q, k, v, g, beta, scale, initial_state, host_offsets(cu_seqlens, q.shape[1]),
                                          A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid, do, dht)
    dq, dk, dv, dg, dbeta, dh0 = grads
    B, T = q.shape[:2]
    dq = dq.view(B, T, H, HV // H, -1).sum(3)      # grouped value heads: sum over the heads that read q/k
    dk = dk.view(B, T, H, HV // H, -1).sum(3)
    dq, dk, dg, dbeta, dA_log, ddt_bias = prepare_bwd_ref(q, k, g, beta, A_log, dt_bias, use_qk_l2norm,
                                                          use_beta_sigmoid, dq, dk, dg, dbeta)
    dh0 = dh0.to(initial_state.dtype) if initial_state is not None else dh0
    if dA_log is None:
        dA_log, ddt_bias = q.new_zeros(0), q.new_zeros(0)
    return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype), dh0, dA_log, ddt_bias)


_bwd_op = torch.library.custom_op("linattn::fused_recurrent_gated_delta_rule_bwd", _bwd_impl, mutates_args=())


@_bwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid, do,
      dht, backend):
    dh0 = torch.empty_like(initial_state) if initial_state is not None else torch.empty_like(dht)
    dA = torch.empty_like(A_log) if A_log is not None else q.new_empty(0)
    ddt = torch.empty_like(dt_bias) if dt_bias is not None else q.new_empty(0)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0, dA, ddt)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid, backend = \
        inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    ctx.scale, ctx.backend = scale, backend
    ctx.use_qk_l2norm, ctx.use_beta_sigmoid = use_qk_l2norm, use_beta_sigmoid
    ctx.has_initial_state, ctx.has_gate = initial_state is not None, A_log is not None


def _backward(ctx, do, dht):
    q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias = ctx.saved_tensors
    B, _, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if do is None:
        do = torch.zeros_like(v)
    if dht is None:
        dht = v.new_zeros(N, HV, K, V, dtype=compute_dtype(v))
    do, dht = do.contiguous(), dht.contiguous()
    bwd = _bwd_impl if eager_call(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, do, dht) else _bwd_op
    dq, dk, dv, dg, dbeta, dh0, dA, ddt = bwd(
        q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, A_log, dt_bias, ctx.use_qk_l2norm,
        ctx.use_beta_sigmoid, do, dht, ctx.backend)
    gate = (dA, ddt) if ctx.has_gate else (None, None)
    return (dq, dk, dv, dg, dbeta, None, (dh0 if ctx.has_initial_state else None), None, *gate, None, None, None)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


_EagerFunction = eager_autograd_function(_fwd_impl, _setup_context, _backward)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
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
    gk: Optional[torch.Tensor] = None,
    gv: Optional[torch.Tensor] = None,
    use_gate_in_kernel: Optional[bool] = None,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    transpose_state_layout: Optional[bool] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""Gated delta rule, recurrent form: a drop-in for fla's ``fused_recurrent_gated_delta_rule``, with a backward.

    Same math, arguments and results as :func:`linattn.chunk_gated_delta_rule`::

        S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        o_t = scale · S_tᵀ q_t

    computed token by token with the state in registers. Best for short sequences (a few to a few hundred
    tokens); its backward stores every S_t (B·T·HV·K·V fp32), so train long sequences with the chunked op.

    Args:
        q (torch.Tensor): queries of shape ``[B, T, H, K]``.
        k (torch.Tensor): keys of shape ``[B, T, H, K]``.
        v (torch.Tensor): values of shape ``[B, T, HV, V]``; grouped value heads if ``HV > H`` (``HV % H == 0``).
        g (torch.Tensor): log decays of shape ``[B, T, HV]``; raw gate logits when ``A_log``/``dt_bias`` are given;
            None: no decay (g = 0, as fla).
        beta (torch.Tensor): write strengths of shape ``[B, T, HV]``; logits if ``use_beta_sigmoid_in_kernel``;
            None: ones (as fla).
        scale (float): query scale; default ``K ** -0.5``.
        initial_state (torch.Tensor): ``[N, HV, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``).
        output_final_state (bool): also return the final state ``[N, HV, K, V]`` (fp32).
        cu_seqlens (torch.Tensor): ``[N + 1]`` int32/int64 offsets of packed sequences (needs ``B == 1``).
        use_qk_l2norm_in_kernel (bool): L2-normalise q and k as ``x · rsqrt(Σx² + 1e-6)`` (fused, in fp32).
        A_log, dt_bias (torch.Tensor): ``[HV]``; if given, ``g ← −exp(A_log) · softplus(g + dt_bias)`` (fused).
        use_beta_sigmoid_in_kernel (bool): ``beta ← sigmoid(beta)`` (fused).
        backend (str): ``"triton"`` (default on CUDA), ``"torch"`` (default elsewhere) or ``"reference"``.
        gk, gv, use_gate_in_kernel, allow_neg_eigval, state_v_first, transpose_state_layout: fla 0.6's keywords,
            honoured with fla's meaning where linattn can (``fla_keywords.py``; the table is in docs/api.md), else
            rejected with a message saying what to do (gk / gv: per-channel decays are not supported).

        gk, gv, use_gate_in_kernel, allow_neg_eigval, state_v_first, transpose_state_layout: fla 0.6's keywords,
            honoured with fla's meaning where linattn can (``fla_keywords.py``; g and beta may then be omitted as
            fla allows), else rejected with a message saying what to do.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state fp32 (fp64 for fp64 inputs) or None.
    """
    if g is None or beta is None or fla_keywords_given(A_log, dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                                                       allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                                                       transpose_state_layout=transpose_state_layout, gk=gk, gv=gv):
        fla = resolve_fla_keywords("fused_recurrent_gated_delta_rule", q, v, g, beta, initial_state, A_log, dt_bias,
                                   use_beta_sigmoid_in_kernel, cu_seqlens=cu_seqlens, gk=gk, gv=gv,
                                   use_gate_in_kernel=use_gate_in_kernel, allow_neg_eigval=allow_neg_eigval,
                                   state_v_first=state_v_first, transpose_state_layout=transpose_state_layout)
        o, ht = fused_recurrent_gated_delta_rule(q, k, v, fla.g, fla.beta, scale, fla.initial_state,
                                                 output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, fla.A_log,
                                                 fla.dt_bias, fla.use_beta_sigmoid_in_kernel, backend)
        return o, fla.final_state(ht)
    scale, _ = check_gated_delta_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias)
    backend = select_backend(backend, q.device)
    use_qk_l2norm, use_beta_sigmoid = bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel)
    if backend == "reference":
        qp, kp, gp, bp = prepare_ref(q, k, g, beta, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid)
        o, ht = gated_delta_rule_reference(qp, kp, v, gp, bp, scale, initial_state,
                                           host_offsets(cu_seqlens, q.shape[1]))
        return o.to(v.dtype), (ht.to(compute_dtype(v)) if output_final_state else None)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    o, ht = dispatch_forward(_fwd_op, _fwd_impl, _EagerFunction,
                             (q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, use_qk_l2norm,
                              use_beta_sigmoid, backend),
                             (q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias))
    return o, (ht if output_final_state else None)
