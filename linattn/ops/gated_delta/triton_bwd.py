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

from ..common import CHUNK
from ..common.cumsum import chunk_local_cumsum
from ..common.kkt_solve import kkt_solve
from ..common.local_bwd_dqk import local_bwd_dqk
from ..common.local_bwd_dv import local_bwd_dv
from ..common.local_bwd_wy import local_bwd_wy
from ..common.split_fwd import stored_dtype
from ..common.state_pass import state_pass_fwd
from ..common.state_pass_bwd import state_pass_bwd
from ..common.varlen import chunk_tables
from ..common.wy import wy_fwd
from ..utils import cdiv

# The dtypes the backward stores its largest intermediates in for bf16 inputs, "fp32" or "bf16" (what
# split_fwd.STORE_BF16 does for the forward): RECOMPUTE_STORE_BF16 for h and V_new from the recompute's state pass,
# DH_STORE_BF16 for dh from the reverse walk. Both walks carry their state in fp32 registers and only local_bwd_dqk
# reads these, so the store rounds what that stage reads (once, ≈ 2^-9), never a carried state: dv and dh0 are
# unchanged (dv comes from dV_new, which the reverse walk computes from its fp32 dS). In local_bwd_dqk a bf16 h,
# dh or V_new meets bf16 dO or V_new in a bf16 MMA (local_bwd_utils.mdot: exact products) where the fp32 ones run
# at tf32. Count at B=8 T=4096 H=16 K=V=128: h 537 MB + V_new 268 MB (recompute writes, dq/dk reads) and dh 537
# MB (reverse walk writes, dq/dk reads), 2.7 GB of traffic in fp32, half in bf16.
# Prediction (written before run 16): the recompute's state pass 0.615 → ≈ 0.50 ms, the reverse walk −0.05, dq/dk
# 1.69 → ≈ 1.3, fwd+bwd 7.29 → ≈ 6.8 at B=8; dq, dk, dg, dβ errors up ≈ 30%, dv and dh0 unchanged. Measured (run
# 16, bench_bwd_precision.py; B=8 T=4096 H=16, fp32/fp32 → bf16/fp32 → bf16/bf16): recompute 1.211 → 1.103 → 1.104
# ms (the state pass's −0.11 as predicted), reverse walk 1.222 → 1.224 → 1.129, dq/dk 1.682 → 1.712 → 1.586 (not
# 1.3: halved reads and two programs per SM were not what bounds it), fwd+bwd 7.258 → 7.209 → 7.000; B=1 T=32768
# 10.741 → 10.697 → 10.592; B=1 T=4096 a tie (1.41–1.52 ms for all three). Errors / rounded-PyTorch baseline at
# the anchor, K=V=64 and T=32768: ≤ 1.21. But gpu_check_core's T=1 case (B=1, HV=2, an initial state) then had dg
# 3.1e-3 against a baseline of 8.7e-5 (2.6e-5 with fp32 stores, run 15): with one token, h is the initial state
# itself, and its bf16 rounding (≈ 2^-9) is all of dg's error, which the baseline (the initial state unrounded)
# does not make. The rule (every gradient within 2× the baseline) fails there, for 1–3% of fwd+bwd: both stay
# "fp32". Run 17 (the T=1 case and dh alone in bf16 added): T=1's dg over the baseline 0.30 (fp32 / fp32), 35.8
# (bf16 / fp32), 8.4 (fp32 / bf16), 44.0 (bf16 / bf16) — dh alone fails too (at T=1, dh of the only chunk is dht's
# own rounding). Prepared after run 17 (CPU-tested, not timed): local_bwd_dqk reads the first chunk's h from the
# initial state and the last chunk's dh from dh_T in fp32 when they are stored in bf16 (adds back the rounding, in
# branches those chunks alone take), so one-chunk sequences are as exact as with fp32 stores. Prediction: T=1's dg
# within 2× of its baseline with both stores bf16, fwd+bwd B=8 6.97 ms against 7.32. Rule: a store goes "bf16" if
# every gradient is within 2× at all four cases and fwd+bwd is faster at all three shapes. Run 18
# (bench_bwd_precision.py, 2026-11-30; fp32/fp32 → bf16/fp32 → fp32/bf16 → bf16/bf16): every ratio ≤ 1.47 at all
# four cases for all three (T=1's dg 0.30 / 0.18 / 0.30 / 0.18: the exact ends work); fwd+bwd B=8 7.281 → 7.182 →
# 7.458 → 7.183 ms, B=1 T=32768 10.665 → 10.645 → 10.993 → 10.740, B=1 T=4096 1.933 → 1.596 → 1.493 → 1.649
# (host-bound, noisy); peak extra at B=8 2586 → 2202 → 2330 → 1946 MB. h / V_new in bf16 passes the rule (faster
# at all three shapes, by 1.4% and 0.2% where the GPU bounds it, −384 MB at B=8): "bf16". dh in bf16 does not
# (slower at T=32768 alone and with h; its reverse walk is 8% faster but dq/dk not): stays "fp32" (the prediction
# of 6.97 ms missed: dq/dk did not speed up with halved reads, as in run 16).
RECOMPUTE_STORE_BF16 = "bf16"
DH_STORE_BF16 = "fp32"


def recompute_forward(k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, num_chunks,
                      store: Optional[str] = None):
    """The forward's stages up to the state pass (the output stage is not needed): gc ``[B, T, HV]``, A_inv
    ``[B, T, HV, 64]``, w ``[B, T, HV, K]`` (fp32), v_new ``[B, T, HV, V]`` and h ``[B, NT, HV, K, V]`` (fp32,
    or bf16 for bf16 inputs: ``store``, None for :data:`RECOMPUTE_STORE_BF16`), in the layout contract of
    triton_chunk.py (its ``chunk_gated_delta_rule_fwd_stages`` minus ``output_fwd``)."""
    gc = chunk_local_cumsum(g, cu_seqlens, chunk_indices)
    A_inv = kkt_solve(k, beta, gc, v.shape[2], cu_seqlens, chunk_indices)
    w, u = wy_fwd(k, v, beta, gc, A_inv, cu_seqlens, chunk_indices)
    h, v_new, _ = state_pass_fwd(k, w, u, gc, initial_state, cu_seqlens, chunk_offsets, num_chunks,
                                 store_dtype=stored_dtype(k.dtype, store or RECOMPUTE_STORE_BF16,
                                                          "triton_bwd.RECOMPUTE_STORE_BF16"))
    return gc, A_inv, w, v_new, h


def chunk_gated_delta_rule_bwd_triton(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                                      cu_seqlens: Optional[torch.Tensor], offsets: Optional[list[int]],
                                      do: torch.Tensor, dht: torch.Tensor, dot_prec: Optional[str] = None):
    """Backward of the chunked gated delta rule on the Triton kernels.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g, beta: ``[B, T, HV]`` (as given to the forward).
        scale: the query scale. initial_state: ``[N, HV, K, V]`` or None.
        cu_seqlens: ``[N + 1]`` device offsets (B == 1) or None; offsets: the same as a host list.
        do: ``[B, T, HV, V]``, the output's gradient. dht: ``[N, HV, K, V]``, the final state's (zeros if none).
        dot_prec: None (the default policy), or "ieee" / "tf32" / "input" for the dots on fp32 intermediates
            with 16-bit inputs (common/local_bwd_utils.py; benchmarks/gpu_check_bwd.py compares them).
    Returns:
        dq, dk ``[B, T, H, K]``, dv ``[B, T, HV, V]``, dg, dbeta ``[B, T, HV]`` in their inputs' dtypes, and dh0
        ``[N, HV, K, V]`` in initial_state's dtype (None without initial_state).
    """
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"backend='triton' takes fp16, bf16 or fp32 inputs, got {q.dtype}; use backend='torch' "
                        "for float64")
    B, T, H, K = q.shape
    HV = v.shape[2]
    q, k, v, g, beta, do, dht = (x.contiguous() for x in (q, k, v, g, beta, do, dht))
    if cu_seqlens is not None:
        chunk_indices, chunk_offsets = chunk_tables(offsets if offsets is not None else cu_seqlens.tolist(), CHUNK,
                                                    q.device)
        num_chunks = chunk_indices.shape[0]
    else:
        chunk_indices = chunk_offsets = None
        num_chunks = cdiv(T, CHUNK)
    gc, A_inv, w, v_new, h = recompute_forward(k, v, g, beta, initial_state, cu_seqlens, chunk_indices,
                                               chunk_offsets, num_chunks)
    # Each intermediate is dropped after its last reader, so that the largest ones are not all alive at the peak
    # (local_bwd_dqk). Bytes at B=8 T=4096 H=16 K=V=128: h, dh 537 MB each (fp32), w, dv_local, v_new, dv_new,
    # dq, dk and the dA_inv shares 268 MB each, A_inv 134 MB; with w and dv_local gone before local_bwd_dqk, its
    # peak is ≈ 2.55 GB instead of ≈ 3.08. Run 18 (bench_bwd_precision.py, the op's peak above its inputs over one
    # forward + backward, as bench_anchors measures it): 2586 MB with fp32 stores (run 17, before the deletions:
    # 3230), 2202 with h / V_new in bf16 (the default since).
    dv_local = local_bwd_dv(q, k, gc, do, scale, cu_seqlens, chunk_indices, dot_prec)
    dh, dv_new, dh0 = state_pass_bwd(q, k, w, gc, do, dv_local, dht, scale, cu_seqlens, chunk_offsets,
                                     h.shape[1], dot_prec, dh_dtype=stored_dtype(q.dtype, DH_STORE_BF16,
                                                                                 "triton_bwd.DH_STORE_BF16"))
    del w, dv_local
    # with h / dh stored in bf16, the first chunk reads the initial state and the last one dh_T as given (T = 1 is
    # then exact, run 16's failure of the bf16 stores)
    dq, dk, dbeta_p, dg_p, dA_inv_p = local_bwd_dqk(q, k, beta, gc, A_inv, h, v_new, do, dh, dv_new, scale,
                                                    cu_seqlens, chunk_indices, dot_prec,
                                                    h0=initial_state.contiguous() if initial_state is not None
                                                    else None, dht=dht)
    del h, v_new, dh
    dk, dv, dbeta, dg = local_bwd_wy(k, v, beta, gc, A_inv, dv_new, dA_inv_p, dbeta_p, dg_p, dk,
                                     cu_seqlens, chunk_indices, dot_prec)
    if HV != H:
        # value heads i·G .. i·G + G − 1 read query/key head i: sum their shares in a fixed order
        dq, dk = dq.view(B, T, H, HV // H, K).sum(3), dk.view(B, T, H, HV // H, K).sum(3)
    return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype),
            dh0.to(initial_state.dtype) if initial_state is not None else None)
