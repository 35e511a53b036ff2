"""``gated_linear_attention``: the public op — checks, dispatch, autograd (torch.library custom ops).

Backends: ``torch`` (chunked, hand-written backward; the default on every device for now) and ``reference``
(float64 token loop, tests). There are no Triton kernels for this op yet: ``backend="triton"`` is an error.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..utils import check_gated_delta_inputs, compute_dtype, host_offsets
from .reference import gated_linear_attention_reference
from .torch_chunk import gla_bwd_torch, gla_fwd_torch


@torch.library.custom_op("linattn::gated_linear_attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    return gla_fwd_torch(q, k, v, g, beta, scale, initial_state, host_offsets(cu_seqlens, q.shape[1]))


@_fwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return v.new_empty(v.shape), v.new_empty(N, v.shape[2], q.shape[3], v.shape[3], dtype=compute_dtype(v))


@torch.library.custom_op("linattn::gated_linear_attention_bwd", mutates_args=())
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
            initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], do: torch.Tensor,
            dht: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor]:
    grads = gla_bwd_torch(q, k, v, g, beta, scale, initial_state, host_offsets(cu_seqlens, q.shape[1]), do, dht)
    return (*grads[:5], grads[5] if grads[5] is not None else torch.zeros_like(dht))


@_bwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht):
    dh0 = torch.empty_like(initial_state) if initial_state is not None else torch.empty_like(dht)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, cu_seqlens = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale, ctx.has_initial_state = scale, initial_state is not None


def _backward(ctx, do, dht):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    do = torch.zeros_like(v) if do is None else do
    dht = v.new_zeros(N, v.shape[2], q.shape[3], v.shape[3], dtype=compute_dtype(v)) if dht is None else dht
    dq, dk, dv, dg, dbeta, dh0 = _bwd_op(q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens,
                                         do.contiguous(), dht.contiguous())
    return dq, dk, dv, dg, dbeta, None, (dh0 if ctx.has_initial_state else None), None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""Gated linear attention with scalar gates per head (the gated delta rule without the delta term)::

        S_t = γ_t S_{t−1} + η_t k_t v_tᵀ        o_t = scale · S_tᵀ q_t        γ_t = exp(g_t)

    Args:
        q (torch.Tensor): queries of shape ``[B, T, H, K]``.
        k (torch.Tensor): keys of shape ``[B, T, H, K]``.
        v (torch.Tensor): values of shape ``[B, T, HV, V]``; grouped value heads if ``HV > H`` (``HV % H == 0``).
        g (torch.Tensor): log decays ``log γ`` of shape ``[B, T, HV]`` (≤ 0 for a contraction; fp32 recommended).
        beta (torch.Tensor): write strengths η of shape ``[B, T, HV]``; None for η = 1.
        scale (float): query scale; default ``K ** -0.5``.
        initial_state (torch.Tensor): ``[N, HV, K, V]`` (N = B, or the number of packed sequences).
        output_final_state (bool): also return the final state ``[N, HV, K, V]`` (fp32).
        cu_seqlens (torch.Tensor): ``[N + 1]`` offsets of packed sequences (``B == 1``).
        backend (str): ``"torch"`` (default) or ``"reference"`` (float64 token loop).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state fp32 (fp64 for fp64 inputs) or None.
    """
    if beta is None and isinstance(g, torch.Tensor):
        beta = torch.ones_like(g)
    scale, _ = check_gated_delta_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if backend is None:
        backend = "torch"
    if backend not in ("torch", "reference"):
        raise ValueError(f"gated_linear_attention has backends 'torch' and 'reference' (no Triton kernels yet), "
                         f"got {backend!r}")
    if backend == "reference":
        o, ht = gated_linear_attention_reference(q, k, v, g, beta, scale, initial_state,
                                                 host_offsets(cu_seqlens, q.shape[1]))
        return o.to(v.dtype), (ht.to(compute_dtype(v)) if output_final_state else None)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    o, ht = _fwd_op(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return o, (ht if output_final_state else None)
