"""Triton backward of the chunked gated delta rule: recompute the forward intermediates, then four kernels.

    local_bwd_dv     dv_local = scale·Pᵀ dO                              parallel over (chunk, head)
    state_pass_bwd   reverse walk over chunks → dh, dv_new, dh0           parallel over (V tile, sequence, head)
    local_bwd_dqk    dq, most of dk, dA_inv / dβ / dg shares              parallel over (K tile, chunk, head)
    local_bwd_wy     UT-transform part: dk, dv, dβ, dg complete          parallel over (chunk, head)

Each kernel has a PyTorch twin (torch_chunk.state_pass_bwd_ref and torch_chunk_bwd_parts.*) that it is tested
against. Gradients of grouped query/key heads are computed per value head and summed over the group afterwards,
a fixed-order reduction, so the result is deterministic (no atomics anywhere).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from ..common.local_bwd_dqk import local_bwd_dqk
from ..common.local_bwd_dv import local_bwd_dv
from ..common.local_bwd_wy import local_bwd_wy
from ..common.state_pass_bwd import state_pass_bwd
from .torch_chunk_bwd_parts import forward_intermediates_ref

BT = 64


def prepare_chunks(offsets: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """chunk_indices ``[NT, 2]`` (sequence, chunk within it) and chunk_offsets ``[N + 1]`` (first chunk of each
    sequence), int32, from the host cu_seqlens. Private twin of the forward's varlen helper until it lands."""
    counts = [triton.cdiv(e - b, BT) for b, e in zip(offsets[:-1], offsets[1:])]
    indices = [(n, c) for n, nc in enumerate(counts) for c in range(nc)]
    chunk_offsets = [0]
    for nc in counts:
        chunk_offsets.append(chunk_offsets[-1] + nc)
    return (torch.tensor(indices, dtype=torch.int32, device=device).view(-1, 2),
            torch.tensor(chunk_offsets, dtype=torch.int32, device=device))


def _forward_intermediates(q, k, v, g, beta, scale, initial_state, cu_seqlens, offsets):
    """gc, A_inv, w, v_new, h in the layout contract (see forward_intermediates_ref).

    FORWARD CALL SITE: replace with the Triton forward's ``chunk_gated_delta_rule_fwd_stages`` once it lands; the
    torch twin stands in for it until then (same layout, fp32)."""
    return forward_intermediates_ref(q, k, v, g, beta, scale, initial_state, offsets)


def chunk_gated_delta_rule_bwd_from_intermediates(q, k, v, beta, scale: float, gc, A_inv, w, v_new, h, do, dht,
                                                  cu_seqlens: Optional[torch.Tensor] = None,
                                                  chunk_indices: Optional[torch.Tensor] = None,
                                                  chunk_offsets: Optional[torch.Tensor] = None):
    """The four backward kernels, given the forward intermediates. Returns dq, dk ``[B, T, HV, K]`` (per value
    head, fp32), dv ``[B, T, HV, V]`` (v's dtype), dg, dbeta ``[B, T, HV]`` (fp32) and dh0 ``[N, HV, K, V]``
    (fp32)."""
    NT = h.shape[1]
    dv_local = local_bwd_dv(q, k, gc, do, scale, cu_seqlens, chunk_indices)
    dh, dv_new, dh0 = state_pass_bwd(q, k, w, gc, do, dv_local, dht, scale, cu_seqlens, chunk_offsets, NT)
    dq, dk, dbeta_p, dg_p, dA_inv_p = local_bwd_dqk(q, k, beta, gc, A_inv, h, v_new, do, dh, dv_new, scale,
                                                    cu_seqlens, chunk_indices)
    dk, dv, dbeta, dg = local_bwd_wy(k, v, beta, gc, A_inv, dv_new, dA_inv_p, dbeta_p, dg_p, dk,
                                     cu_seqlens, chunk_indices)
    return dq, dk, dv, dg, dbeta, dh0


def chunk_gated_delta_rule_bwd_triton(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                                      cu_seqlens: Optional[torch.Tensor], offsets: Optional[list[int]],
                                      do: torch.Tensor, dht: torch.Tensor):
    """Backward of the chunked gated delta rule on the Triton kernels.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g, beta: ``[B, T, HV]`` (as given to the forward).
        scale: the query scale. initial_state: ``[N, HV, K, V]`` or None.
        cu_seqlens: ``[N + 1]`` device offsets (B == 1) or None; offsets: the same as a host list.
        do: ``[B, T, HV, V]``, the output's gradient. dht: ``[N, HV, K, V]``, the final state's (zeros if none).
    Returns:
        dq, dk ``[B, T, H, K]``, dv ``[B, T, HV, V]``, dg, dbeta ``[B, T, HV]`` in their inputs' dtypes, and dh0
        ``[N, HV, K, V]`` in initial_state's dtype (None without initial_state).
    """
    if q.dtype == torch.float64:
        raise TypeError("the triton backend computes in fp32/fp16/bf16; use backend='torch' for float64 inputs")
    B, T, H, K = q.shape
    HV = v.shape[2]
    q, k, v, g, beta, do, dht = (x.contiguous() for x in (q, k, v, g, beta, do, dht))
    chunk_indices = chunk_offsets = None
    if cu_seqlens is not None:
        chunk_indices, chunk_offsets = prepare_chunks(offsets, q.device)
    gc, A_inv, w, v_new, h = _forward_intermediates(q, k, v, g, beta, scale, initial_state, cu_seqlens, offsets)
    dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd_from_intermediates(
        q, k, v, beta, scale, gc, A_inv, w, v_new, h, do, dht, cu_seqlens, chunk_indices, chunk_offsets)
    if HV != H:
        # value heads i·G .. i·G + G − 1 read query/key head i: sum their shares in a fixed order
        dq, dk = dq.view(B, T, H, HV // H, K).sum(3), dk.view(B, T, H, HV // H, K).sum(3)
    return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype),
            dh0.to(initial_state.dtype) if initial_state is not None else None)
