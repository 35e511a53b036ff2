"""Backward stage 4: the WY / UT-transform part, then dG → dg (twin: ``torch_chunk_bwd_parts.local_bwd_wy_ref``).
Parallel over (chunk, value head).

With T = (I + A)⁻¹, U = T diag(β) V and dU = dV_new:

    dT  = (partials from local_bwd_dqk.py) + dU (V ⊙ β)ᵀ,     dv = β ⊙ Tᵀ dU,     dβ += v·(Tᵀ dU)
    dA  = −strict_lower(Tᵀ dT Tᵀ),   A = diag(β)(K Kᵀ ⊙ D)  ⇒  with R = (dA ⊙ D) K:
    dk += β ⊙ R + (diag(β) dA ⊙ D)ᵀ K,    dβ += k·R,    dG += β ⊙ (k·R) − k·((diag(β) dA ⊙ D)ᵀ K)

and finally dg = (partials) + reverse cumsum of this stage's dG inside the chunk. The T products are BT×BT×BT and
stay in fp32 ("ieee"); the BT×K and BT×V dots follow the precision policy of local_bwd_utils.py. Per program: reads A_inv and the
dA_inv partials (BT×BT, fp32), v and dV_new (BT×V), k and the partial dk (BT×K), the gates and the dβ/dg
partials; writes dv (BT×V, input dtype), dk (BT×K, fp32, in place), dβ and dg (BT, fp32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import cdiv
from . import launch_options, product_precision
from .kkt_solve import a_inv_tile
from .local_bwd_utils import bwd_dot_precision, mdot
from .varlen import chunk_bounds

BT = 64


@triton.jit(do_not_specialize=["T", "NTB"])
def local_bwd_wy_kernel(
    k, v, beta, gc, A_inv, dv_new, dA_inv_p, dbeta_p, dg_p, dk, dv, dbeta, dg, cu_seqlens, chunk_indices,
    T, NTB,
    HV: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NK: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr, INV_PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, eos = chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, IS_VARLEN)
    if IS_VARLEN:
        T = (eos - bos).to(tl.int32)
    DT = k.dtype.element_ty

    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < T
    m_incl = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    m_strict = (o_i[:, None] > o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_g = tl.load(gc + (bos + o_t) * HV + i_hv, mask=m_t, other=0.)
    b_beta = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
    b_A = tl.where(m_incl, tl.load(a_inv_tile(A_inv, bos, i_t, i_hv, T, HV, BT), boundary_check=(0, 1),
                                   padding_option="zero"), 0.)

    # sum the K-tile partials of local_bwd_dqk (a fixed order: deterministic)
    b_dAi = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    b_dg = tl.zeros([BT], dtype=tl.float32)
    o_p = bos                                         # int64 offset of this sequence in partial i_k
    for _ in range(NK):
        p_dAi = tl.make_block_ptr(dA_inv_p + o_p * HV * BT + i_hv * BT, (T, BT), (HV * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
        b_dAi += tl.load(p_dAi, boundary_check=(0, 1), padding_option="zero")
        b_dbeta += tl.load(dbeta_p + (o_p + o_t) * HV + i_hv, mask=m_t, other=0.)
        b_dg += tl.load(dg_p + (o_p + o_t) * HV + i_hv, mask=m_t, other=0.)
        o_p += NTB

    # U = T diag(β) V: dT += dU (V ⊙ β)ᵀ, dv = β ⊙ Tᵀ dU
    for i_v in range(tl.cdiv(V, BV)):
        p_v = tl.make_block_ptr(v + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_du = tl.make_block_ptr(dv_new + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_dv = tl.make_block_ptr(dv + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        b_v = tl.load(p_v, boundary_check=(0, 1), padding_option="zero")
        b_du = tl.load(p_du, boundary_check=(0, 1), padding_option="zero")
        b_dAi += mdot(b_du, tl.trans(b_v.to(tl.float32) * b_beta[:, None]), DT, DOT_PREC)
        b_dvb = mdot(tl.trans(b_A), b_du, DT, DOT_PREC)
        b_dbeta += tl.sum(b_v.to(tl.float32) * b_dvb, 1)
        tl.store(p_dv, (b_beta[:, None] * b_dvb).to(p_dv.dtype.element_ty), boundary_check=(0, 1))

    # T = (I + A)⁻¹ ⇒ dA = −Tᵀ dT Tᵀ on the strict lower triangle (fp32 operands: T's entries carry the whole
    # chunk; INV_PREC: "ieee", or "tf32x3" on tensor cores, the default for 16-bit inputs)
    b_dA = tl.dot(tl.dot(tl.trans(b_A), b_dAi, input_precision=INV_PREC), tl.trans(b_A), input_precision=INV_PREC)
    b_dAD = tl.where(m_strict, -b_dA, 0.) * tl.exp(tl.where(m_strict, b_g[:, None] - b_g[None, :], float('-inf')))
    b_dKKt = b_dAD * b_beta[:, None]

    b_dgc = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        p_dk = tl.make_block_ptr(dk + (bos * HV + i_hv) * K, (T, K), (HV * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        b_dk = tl.load(p_dk, boundary_check=(0, 1), padding_option="zero")
        b_r = mdot(b_dAD, b_k, DT, DOT_PREC)
        b_kdAt = mdot(tl.trans(b_dKKt), b_k, DT, DOT_PREC)
        b_dk += b_beta[:, None] * b_r + b_kdAt
        tl.store(p_dk, b_dk, boundary_check=(0, 1))
        b_kr = tl.sum(b_k.to(tl.float32) * b_r, 1)
        b_dbeta += b_kr
        b_dgc += b_beta * b_kr - tl.sum(b_k.to(tl.float32) * b_kdAt, 1)

    # dg_i = Σ_{j ≥ i} dG_j inside the chunk
    b_dg += tl.sum(tl.where(o_i[:, None] <= o_i[None, :], b_dgc[None, :], 0.), 1)
    tl.store(dbeta + (bos + o_t) * HV + i_hv, b_dbeta, mask=m_t)
    tl.store(dg + (bos + o_t) * HV + i_hv, b_dg, mask=m_t)


def local_bwd_wy(k, v, beta, gc, A_inv, dv_new, dA_inv_p, dbeta_p, dg_p, dk,
                 cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                 dot_prec: str | None = None, inverse_prec: str | None = None):
    """k ``[B, T, H, K]``; v ``[B, T, HV, V]``; beta ``[B, T, HV]``; gc ``[B, T, HV]`` fp32; A_inv
    ``[B, T, HV, 64]`` fp32; dv_new ``[B, T, HV, V]``; the partials of :func:`local_bwd_dqk`: dA_inv_p
    ``[NK, B, T, HV, 64]``, dbeta_p and dg_p ``[NK, B, T, HV]``; dk ``[B, T, HV, K]`` fp32, completed IN PLACE
    (it is local_bwd_dqk's own output, never a user tensor).

    ``inverse_prec``: the two inverse products dA = Tᵀ dT Tᵀ for 16-bit inputs, "tf32x3" (None, the default: three
    tf32 MMAs, about fp32's accuracy; on FMA units these 2 × 64³ products make WY the slowest backward stage) or
    "ieee" (benchmarks); fp32 inputs always "ieee".

    Returns dk (the same tensor), dv ``[B, T, HV, V]`` in v's dtype, dbeta and dg ``[B, T, HV]`` fp32."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    NT = chunk_indices.shape[0] if cu_seqlens is not None else cdiv(T, BT)
    BK = min(64, max(16, triton.next_power_of_2(K)))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    # only precisions with fp32's accuracy: T's entries carry the whole chunk
    inv_prec = product_precision(k.dtype, "tf32x3", inverse_prec, ("ieee", "tf32x3"), "inverse_prec")
    dv = torch.empty_like(v)
    dbeta = torch.empty(B, T, HV, dtype=torch.float32, device=k.device)
    dg = torch.empty(B, T, HV, dtype=torch.float32, device=k.device)
    local_bwd_wy_kernel[(NT, B * HV)](
        k, v, beta, gc, A_inv, dv_new, dA_inv_p, dbeta_p, dg_p, dk, dv, dbeta, dg, cu_seqlens, chunk_indices,
        T, B * T, HV=HV, H=H, K=K, V=V, NK=dA_inv_p.shape[0], BT=BT, BK=BK, BV=BV,
        DOT_PREC=bwd_dot_precision(k.dtype, dot_prec), INV_PREC=inv_prec, IS_VARLEN=cu_seqlens is not None,
        num_warps=8, **launch_options("local_bwd_wy"),
    )
    return dk, dv, dbeta, dg
