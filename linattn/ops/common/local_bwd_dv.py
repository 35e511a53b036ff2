"""Backward stage 1: dv_local = scale·Pᵀ dO, the part of dV_new that needs no state (twin:
``torch_chunk_bwd_parts.local_bwd_dv_ref``).

P = Q Kᵀ ⊙ D with D_ij = e^{G_i − G_j} on the inclusive lower triangle, so dv_local_j = scale·Σ_{i ≥ j} P_ij dO_i.
It is parallel over chunks; the sequential reverse pass (state_pass_bwd.py) then adds the state's share.

One program per (chunk, value head). Per chunk it reads q, k (BT×K), the gates (BT) and dO (BT×V), and writes
dv_local (BT×V, fp32). Pᵀ is built once (a K loop of BT×BK×BT dots) and reused for every V tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import cdiv
from . import launch_options
from .local_bwd_utils import bwd_dot_precision, mdot
from .varlen import chunk_bounds

BT = 64


@triton.jit(do_not_specialize=["T"])
def local_bwd_dv_kernel(
    q, k, gc, do, dv, cu_seqlens, chunk_indices, scale,
    T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, eos = chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, IS_VARLEN)
    if IS_VARLEN:
        T = (eos - bos).to(tl.int32)

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_g = tl.load(gc + (bos + o_t) * HV + i_hv, mask=m_t, other=0.)
    # Pᵀ_ji = k_j·q_i e^{G_i − G_j} for i ≥ j; the exponent is masked before exp, so it never overflows
    m_ji = (o_t[None, :] >= o_t[:, None]) & m_t[:, None] & m_t[None, :]
    b_decay = tl.exp(tl.where(m_ji, b_g[None, :] - b_g[:, None], float('-inf')))

    b_Pt = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        # inputs only: one 16-bit MMA (exact products) for 16-bit inputs; fp32 inputs at DOT_PREC like every other
        # dot of theirs (tf32x3: at "ieee" this dot alone compiles to ~2000 FFMA on sm_90)
        b_Pt += mdot(b_k, tl.trans(b_q), k.dtype.element_ty, DOT_PREC)
    b_Pt = b_Pt * b_decay * scale

    for i_v in range(tl.cdiv(V, BV)):
        p_do = tl.make_block_ptr(do + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_dv = tl.make_block_ptr(dv + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        b_do = tl.load(p_do, boundary_check=(0, 1), padding_option="zero")
        b_dv = mdot(b_Pt, b_do, k.dtype.element_ty, DOT_PREC)
        tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), boundary_check=(0, 1))


def local_bwd_dv(q: torch.Tensor, k: torch.Tensor, gc: torch.Tensor, do: torch.Tensor, scale: float,
                 cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                 dot_prec: str | None = None) -> torch.Tensor:
    """dv_local ``[B, T, HV, V]`` fp32 from q, k ``[B, T, H, K]``, gc ``[B, T, HV]`` fp32 (chunk-local cumsum of
    g) and do ``[B, T, HV, V]``. With cu_seqlens (B == 1), chunk_indices ``[NT, 2]`` lists (sequence, chunk).
    dot_prec: see local_bwd_utils.py (None: the default policy)."""
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    NT = chunk_indices.shape[0] if cu_seqlens is not None else cdiv(T, BT)
    dv = torch.empty(B, T, HV, V, dtype=torch.float32, device=q.device)
    BK = min(64, max(16, triton.next_power_of_2(K)))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    local_bwd_dv_kernel[(NT, B * HV)](
        q, k, gc, do, dv, cu_seqlens, chunk_indices, scale, T,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, DOT_PREC=bwd_dot_precision(q.dtype, dot_prec), IS_VARLEN=cu_seqlens is not None, num_warps=4,
        **launch_options("local_bwd_dv"),
    )
    return dv
