"""Triton backward of the chunked gated delta rule: recompute the forward intermediates, then four kernels.

    local_bwd_dv     dv_local = scale·Pᵀ dO                              parallel over (chunk, head)
    state_pass_bwd   reverse walk over chunks → dh, dv_new, dh0           parallel over (V tile, sequence, head),
                     and over segments of long sequences where that leaves SMs idle (seq_parallel_bwd.py)
    local_bwd_dqk    dq, most of dk, dA_inv / dβ / dg shares              parallel over (K tile, chunk, head)
    local_bwd_wy     UT-transform part: dk, dv, dβ, dg complete          parallel over (chunk, head)

Each kernel has a PyTorch twin (torch_chunk.state_pass_bwd_ref and torch_chunk_bwd_parts.*) that it is tested
against. Gradients of grouped query/key heads are computed per value head and summed over the group afterwards,
a fixed-order reduction, so the result is deterministic (no atomics anywhere).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..common import CHUNK, num_sms
from ..common.cumsum import chunk_local_cumsum
from ..common.kkt_solve import kkt_solve
from ..common.local_bwd_dqk import local_bwd_dqk
from ..common.local_bwd_dv import local_bwd_dv
from ..common.local_bwd_wy import local_bwd_wy
from ..common.seq_parallel_bwd import state_pass_bwd_seq_parallel
from ..common.split_fwd import segmented_state_pass, state_pass_plan, store_dtype
from ..common.state_pass import state_pass_fwd
from ..common.varlen import chunk_tables
from ..common.wy import wy_fwd
from ..utils import MIN_LOG_DECAY, cdiv, flat_offsets


def recompute_forward(k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, num_chunks,
                      store: Optional[torch.dtype] = None, offsets: Optional[list[int]] = None,
                      segment_chunks: Optional[int] = None):
    """The forward's stages up to the state pass (the output stage is not needed): gc ``[B, T, HV]``, A_inv
    ``[B, T, HV, 64]``, w ``[B, T, HV, K]`` (fp32), v_new ``[B, T, HV, V]`` and h ``[B, NT, HV, K, V]`` in
    ``store`` (None: the split forward's ``store_dtype``, bf16 for bf16 inputs, else fp32), in the layout contract
    of triton_chunk.py (its ``chunk_gated_delta_rule_fwd_stages`` minus ``output_fwd``).

    The state pass is split into segments exactly where the split forward's is (``split_fwd.state_pass_plan``,
    ``segment_chunks`` forcing it as there; ``offsets``: the host token offsets of the sequences, cu_seqlens' or
    ``b·T``, read from the device when None): phases A, B, C of ``split_fwd.segmented_state_pass``.

    Only local_bwd_dqk reads h and V_new, and both walks carry their state in fp32 registers, so a bf16 store
    rounds what that stage reads (once, ≈ 2^-9), never a carried state; it halves their traffic and memory. dh
    stays fp32: in bf16 it made the backward slower at long sequences."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if offsets is None:
        offsets = cu_seqlens.tolist() if cu_seqlens is not None else flat_offsets(B, T)
    chunks = [-(-(e - b) // CHUNK) for b, e in zip(offsets[:-1], offsets[1:])]
    store = store or store_dtype(k.dtype)
    gc = chunk_local_cumsum(g, cu_seqlens, chunk_indices)
    A_inv = kkt_solve(k, beta, gc, HV, cu_seqlens, chunk_indices)
    w, u = wy_fwd(k, v, beta, gc, A_inv, cu_seqlens, chunk_indices)
    L, BV, num_warps = state_pass_plan(chunks, HV, K, V, num_sms(k.device), segment_chunks)
    if L is None:
        h, v_new, _ = state_pass_fwd(k, w, u, gc, initial_state, cu_seqlens, chunk_offsets, num_chunks,
                                     store_dtype=store)
    else:
        h, v_new, _ = segmented_state_pass(k, w, u, gc, initial_state, cu_seqlens, offsets, L, BV, num_warps, store)
    return gc, A_inv, w, v_new, h


def chunk_gated_delta_rule_bwd_triton(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                                      cu_seqlens: Optional[torch.Tensor], offsets: Optional[list[int]],
                                      do: torch.Tensor, dht: torch.Tensor, dot_prec: Optional[str] = None,
                                      segment_chunks: Optional[int] = None):
    """Backward of the chunked gated delta rule on the Triton kernels.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g, beta: ``[B, T, HV]`` (as given to the forward).
        scale: the query scale. initial_state: ``[N, HV, K, V]`` or None.
        cu_seqlens: ``[N + 1]`` device offsets (B == 1) or None; offsets: the same as a host list.
        do: ``[B, T, HV, V]``, the output's gradient. dht: ``[N, HV, K, V]``, the final state's (zeros if none).
        dot_prec: None (the default policy), or "ieee" / "tf32" / "input" for the dots on fp32 intermediates
            with 16-bit inputs (common/local_bwd_utils.py; benchmarks/gpu_check_bwd.py compares them).
        segment_chunks: None (planned), or force both sequential walks — the recompute's state pass and the
            reverse walk — into segments of this many chunks (≥ 1; a value ≥ the longest sequence's chunk count runs
            them unsegmented): tests and benchmarks (benchmarks/gpu_check_bwd_segments.py).
    Returns:
        dq, dk ``[B, T, H, K]``, dv ``[B, T, HV, V]``, dg, dbeta ``[B, T, HV]`` in their inputs' dtypes, and dh0
        ``[N, HV, K, V]`` in initial_state's dtype (None without initial_state).
    """
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"backend='triton' takes fp16, bf16 or fp32 inputs, got {q.dtype}; use backend='torch' "
                        "for float64")
    B, T, H, K = q.shape
    HV = v.shape[2]
    if segment_chunks is not None and (not isinstance(segment_chunks, int) or segment_chunks < 1):
        raise ValueError(f"segment_chunks must be None or an int >= 1, got {segment_chunks!r}")
    q, k, v, g, beta, do, dht = (x.contiguous() for x in (q, k, v, g, beta, do, dht))
    if cu_seqlens is not None:
        offsets = offsets if offsets is not None else cu_seqlens.tolist()
        chunk_indices, chunk_offsets = chunk_tables(offsets, CHUNK, q.device)
        num_chunks = chunk_indices.shape[0]
    else:
        offsets = flat_offsets(B, T)
        chunk_indices = chunk_offsets = None
        num_chunks = cdiv(T, CHUNK)
    gc, A_inv, w, v_new, h = recompute_forward(k, v, g, beta, initial_state, cu_seqlens, chunk_indices,
                                               chunk_offsets, num_chunks, offsets=offsets,
                                               segment_chunks=segment_chunks)
    # Each intermediate is dropped after its last reader, so that the largest ones are not all alive at the peak
    # (local_bwd_dqk). Bytes at B=8 T=4096 H=16 K=V=128: h, dh 537 MB each (fp32), w, dv_local, v_new, dv_new,
    # dq, dk and the dA_inv shares 268 MB each, A_inv 134 MB; with w and dv_local gone before local_bwd_dqk, its
    # peak is ≈ 2.55 GB instead of ≈ 3.08 (less with h and V_new in bf16).
    dv_local = local_bwd_dv(q, k, gc, do, scale, cu_seqlens, chunk_indices, dot_prec)
    dh, dv_new, dh0 = state_pass_bwd_seq_parallel(q, k, w, gc, do, dv_local, dht, scale, cu_seqlens, chunk_offsets,
                                                  h.shape[1], offsets, dot_prec, segment_chunks)
    del w, dv_local
    # with h stored in bf16, the first chunk reads the initial state as given (a one-chunk sequence stays exact)
    dq, dk, dbeta_p, dg_p, dA_inv_p = local_bwd_dqk(q, k, beta, gc, A_inv, h, v_new, do, dh, dv_new, scale,
                                                    cu_seqlens, chunk_indices, dot_prec,
                                                    h0=initial_state.contiguous() if initial_state is not None
                                                    else None)
    del h, v_new, dh
    dk, dv, dbeta, dg = local_bwd_wy(k, v, beta, gc, A_inv, dv_new, dA_inv_p, dbeta_p, dg_p, dk,
                                     cu_seqlens, chunk_indices, dot_prec)
    if HV != H:
        # value heads i·G .. i·G + G − 1 read query/key head i: sum their shares in a fixed order
        dq, dk = dq.view(B, T, H, HV // H, K).sum(3), dk.view(B, T, H, HV // H, K).sum(3)
    dg = dg.masked_fill(g < MIN_LOG_DECAY, 0)     # gates below the floor (common/cumsum.py) do not move the output
    return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype),
            dh0.to(initial_state.dtype) if initial_state is not None else None)
