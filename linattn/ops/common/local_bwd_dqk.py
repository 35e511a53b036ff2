"""Backward stage 3: the local gradients that read the state h, its gradient dh, or dO (twin:
``torch_chunk_bwd_parts.local_bwd_dqk_ref``). Parallel over (K tile, chunk, value head).

Per chunk, with dP = scale·(dO V_newᵀ) ⊙ D (inclusive causal), dW = −dV_new hᵀ and dkb = Tᵀ dW:

    dq  = dP K + scale·diag(Γ) dO hᵀ
    dk  = dPᵀ Q + diag(e^{G_C − G}) V_new dhᵀ + diag(βΓ) dkb            (the K Kᵀ term comes in local_bwd_wy.py)
    dβ  = Γ ⊙ (k·dkb)                                                  (partial)
    dA_inv = dW (K ⊙ βΓ)ᵀ                                              (partial; U's share comes later)
    dG  = rowsum − colsum of dP ⊙ Q Kᵀ + Γ ⊙ (q·scale dO hᵀ) + βΓ ⊙ (k·dkb) − t,   t = e^{G_C − G} ⊙ (k·V_new dhᵀ)
          plus, on the chunk's last token, e^{G_C} Σ h ⊙ dh + Σ t          (returned reverse-summed as dg)

Terms that cancel exactly in dg (the diagonal of dP ⊙ Q Kᵀ, t_{C−1} against Σ t) are left out rather than added
and subtracted, so dg keeps its relative accuracy where it is tiny (strong decay, or T = 1 without a state).

The row/column sums of dP ⊙ Q Kᵀ are q·(dP K) and k·(dPᵀ Q), sums over K, so each K tile adds its share and Q Kᵀ
is never formed. dP needs all of V and is recomputed by every K tile (a BT×BV×BT dot per V tile, small next to the
BT×BV×BK dots for dq/dk/dW). Per program: reads q, k (BT×BK), h and dh (BK×V), V_new, dO, dV_new (BT×V), A_inv
(BT×BT) and the gates; writes dq, dk (BT×BK, fp32) and its share of dβ, dg (BT) and dA_inv (BT×BT, fp32). dh is
fp32; h and V_new are fp32, or bf16 for bf16 inputs (the recompute stores them as the split forward does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import cdiv
from . import launch_options
from .kkt_solve import a_inv_tile
from .local_bwd_utils import bwd_dot_precision, mdot
from .varlen import chunk_bounds

BT = 64


@triton.jit
def _load_state_tile(s, i_n, i_hv, i_k, i_v, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr):
    """The [BV, BK] tile (i_v, i_k) of sequence i_n's state ``s[i_n, i_hv]`` (``[N, HV, K, V]``), transposed like h's
    tiles here, in fp32."""
    p = tl.make_block_ptr(s + (i_n.to(tl.int64) * HV + i_hv) * K * V, (V, K), (1, V), (i_v * BV, i_k * BK),
                          (BV, BK), (0, 1))
    return tl.load(p, boundary_check=(0, 1), padding_option="zero").to(tl.float32)


@triton.jit(do_not_specialize=["T", "NT", "NTB"])
def local_bwd_dqk_kernel(
    q, k, beta, gc, A_inv, h, v_new, do, dh, dv_new, dq, dk, dbeta, dg, dA_inv, cu_seqlens, chunk_indices, scale,
    h0, T, NT, NTB,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr, IS_VARLEN: tl.constexpr, EXACT_H0: tl.constexpr,
):
    # NTB: tokens of the whole batch (B·T), the stride between the K-tile partials of dβ, dg and dA_inv
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_tg = i_t.to(tl.int64)
    else:
        i_tg = i_b.to(tl.int64) * NT + i_t
    i_n, i_t, bos, eos = chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, IS_VARLEN)
    if IS_VARLEN:
        T = (eos - bos).to(tl.int32)
    DT = k.dtype.element_ty

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_g = tl.load(gc + (bos + o_t) * HV + i_hv, mask=m_t, other=0.)
    b_g_last = tl.load(gc + (bos + tl.minimum(i_t * BT + BT, T) - 1) * HV + i_hv)
    b_beta = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0.).to(tl.float32)
    b_gamma = tl.exp(tl.where(m_t, b_g, float('-inf')))
    b_e_last = tl.exp(tl.where(m_t, b_g_last - b_g, float('-inf')))

    b_dP = tl.zeros([BT, BT], dtype=tl.float32)
    b_dqd = tl.zeros([BT, BK], dtype=tl.float32)      # dO hᵀ
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)      # V_new dhᵀ
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)       # −dV_new hᵀ
    b_hdh = tl.zeros([BK], dtype=tl.float32)          # Σ_v h ⊙ dh, this tile's share
    for i_v in range(tl.cdiv(V, BV)):
        p_h = tl.make_block_ptr(h + (i_tg * HV + i_hv) * K * V, (V, K), (1, V), (i_v * BV, i_k * BK), (BV, BK), (0, 1))
        p_dh = tl.make_block_ptr(dh + (i_tg * HV + i_hv) * K * V, (V, K), (1, V), (i_v * BV, i_k * BK), (BV, BK), (0, 1))
        p_vn = tl.make_block_ptr(v_new + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_do = tl.make_block_ptr(do + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_dvn = tl.make_block_ptr(dv_new + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        # h and V_new arrive as stored: fp32, or bf16 for bf16 inputs; a bf16 tile meets bf16 dO in a bf16 MMA (mdot: both operands in the input dtype, exact products)
        b_h = tl.load(p_h, boundary_check=(0, 1), padding_option="zero")           # hᵀ tile [BV, BK]
        b_dh = tl.load(p_dh, boundary_check=(0, 1), padding_option="zero")
        b_vn = tl.load(p_vn, boundary_check=(0, 1), padding_option="zero")
        b_do = tl.load(p_do, boundary_check=(0, 1), padding_option="zero")
        b_dvn = tl.load(p_dvn, boundary_check=(0, 1), padding_option="zero")
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 0)
        b_dP += mdot(b_do, tl.trans(b_vn), DT, DOT_PREC)
        b_dqd += mdot(b_do, b_h, DT, DOT_PREC)
        b_dkd += mdot(b_vn, b_dh, DT, DOT_PREC)
        b_dw -= mdot(b_dvn, b_h, DT, DOT_PREC)
        # h stored in bf16: the first chunk's h is the initial state, given in fp32 — add back what its rounding
        # took (r = exact − stored, a term ≈ 2^-9 of h's, at DOT_PREC), so that a sequence of one chunk is exact,
        # as with fp32 stores
        if EXACT_H0:
            if i_t == 0:
                b_r = _load_state_tile(h0, i_n, i_hv, i_k, i_v, HV, K, V, BK, BV) - b_h.to(tl.float32)
                b_dqd += mdot(b_do, b_r, DT, DOT_PREC)
                b_dw -= mdot(b_dvn, b_r, DT, DOT_PREC)
                b_hdh += tl.sum(b_r * b_dh.to(tl.float32), 0)

    p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
    b_A = tl.load(a_inv_tile(A_inv, bos, i_t, i_hv, T, HV, BT), boundary_check=(0, 1), padding_option="zero")
    o_i = tl.arange(0, BT)
    m_incl = (o_i[:, None] >= o_i[None, :]) & m_t[:, None] & m_t[None, :]
    b_A = tl.where(m_incl, b_A, 0.)                   # T is unit lower: read only its triangle
    b_qf, b_kf = b_q.to(tl.float32), b_k.to(tl.float32)

    # intra-chunk: dP = scale·(dO V_newᵀ) ⊙ D, exponent masked before exp. The diagonal (D_ii = 1) reaches G as
    # dP_ii q_i·k_i − dP_ii k_i·q_i = 0: it is kept out of the row/column sums so that it cancels exactly, not to
    # rounding (which would leave a spurious ~1e-7·|dP_ii| in dg where the true dg is ~e^{−100} or 0)
    b_dP = b_dP * scale * tl.exp(tl.where(m_incl, b_g[:, None] - b_g[None, :], float('-inf')))
    m_diag = o_i[:, None] == o_i[None, :]
    b_dP_diag = tl.sum(tl.where(m_diag, b_dP, 0.), 1)
    b_dP = tl.where(m_diag, 0., b_dP)
    b_dq = mdot(b_dP, b_k, DT, DOT_PREC)
    b_dk = mdot(tl.trans(b_dP), b_q, DT, DOT_PREC)
    b_dgc = tl.sum(b_qf * b_dq, 1) - tl.sum(b_kf * b_dk, 1)
    b_dq += b_dP_diag[:, None] * b_kf
    b_dk += b_dP_diag[:, None] * b_qf

    # inter-chunk: o gets scale·Γ q h, and S_out gets (K ⊙ e^{G_C − G})ᵀ V_new
    b_dqd = b_dqd * scale
    b_dq += b_gamma[:, None] * b_dqd
    b_dgc += b_gamma * tl.sum(b_qf * b_dqd, 1)
    # t_i = e^{G_C − G_i} k_i·(V_new dhᵀ)_i reaches G_C as +t_i and G_i as −t_i; after the reverse cumsum row i
    # keeps Σ_{j<i} t_j, summed directly (t_{C−1} has e^0 = 1 and would otherwise cancel only to rounding)
    b_t = b_e_last * tl.sum(b_kf * b_dkd, 1)
    b_dk += b_e_last[:, None] * b_dkd
    b_dg_last = tl.exp(b_g_last) * tl.sum(b_hdh, 0)

    # WY: W = T diag(βΓ) K  ⇒  dK += βΓ Tᵀ dW, dβ gets Γ (k·Tᵀ dW), dT = dW (K ⊙ βΓ)ᵀ
    b_dkb = mdot(tl.trans(b_A), b_dw, DT, DOT_PREC)
    b_bg = b_beta * b_gamma
    b_tk = tl.sum(b_kf * b_dkb, 1)
    b_dk += b_bg[:, None] * b_dkb
    b_dgc += b_bg * b_tk
    b_dAi = mdot(b_dw, tl.trans(b_kf * b_bg[:, None]), DT, DOT_PREC)

    # dg_i = Σ_{j ≥ i} dG_j + Σ_{j < i} t_j; the e^{G_C} term (on the last token) reaches every row
    b_dg = tl.sum(tl.where(o_i[:, None] <= o_i[None, :], b_dgc[None, :], b_t[None, :]), 1) + b_dg_last

    p_dq = tl.make_block_ptr(dq + (bos * HV + i_hv) * K, (T, K), (HV * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    p_dk = tl.make_block_ptr(dk + (bos * HV + i_hv) * K, (T, K), (HV * K, 1), (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    p_dAi = tl.make_block_ptr(dA_inv + (i_k.to(tl.int64) * NTB + bos) * HV * BT + i_hv * BT, (T, BT), (HV * BT, 1), (i_t * BT, 0), (BT, BT), (1, 0))
    tl.store(p_dq, b_dq, boundary_check=(0, 1))
    tl.store(p_dk, b_dk, boundary_check=(0, 1))
    tl.store(p_dAi, b_dAi, boundary_check=(0, 1))
    o_p = (i_k.to(tl.int64) * NTB + bos + o_t) * HV + i_hv
    tl.store(dbeta + o_p, b_gamma * b_tk, mask=m_t)
    tl.store(dg + o_p, b_dg, mask=m_t)


def local_bwd_dqk(q, k, beta, gc, A_inv, h, v_new, do, dh, dv_new, scale: float,
                  cu_seqlens: torch.Tensor | None = None, chunk_indices: torch.Tensor | None = None,
                  dot_prec: str | None = None, h0: torch.Tensor | None = None):
    """q, k ``[B, T, H, K]``; beta ``[B, T, HV]``; gc ``[B, T, HV]`` fp32; A_inv ``[B, T, HV, 64]`` fp32; h, dh
    ``[B, NT, HV, K, V]`` (h fp32 or bf16, dh fp32); v_new (fp32 or bf16), do, dv_new ``[B, T, HV, V]``. h0: the
    initial state ``[N, HV, K, V]`` fp32 (or None): given with h stored in bf16, the first chunk of each sequence
    uses h0 as it is, not its stored rounding.

    Returns dq, dk ``[B, T, HV, K]`` fp32 (per value head; dk still lacks the K Kᵀ term), and the per-K-tile
    partials dbeta, dg ``[NK, B, T, HV]`` and dA_inv ``[NK, B, T, HV, 64]`` (fp32), summed in local_bwd_wy.py."""
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    NT = chunk_indices.shape[0] if cu_seqlens is not None else cdiv(T, BT)
    BK = min(64, max(16, triton.next_power_of_2(K)))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    NK = cdiv(K, BK)
    f32 = dict(dtype=torch.float32, device=q.device)
    dq, dk = torch.empty(B, T, HV, K, **f32), torch.empty(B, T, HV, K, **f32)
    dbeta, dg = torch.empty(NK, B, T, HV, **f32), torch.empty(NK, B, T, HV, **f32)
    dA_inv = torch.empty(NK, B, T, HV, BT, **f32)
    local_bwd_dqk_kernel[(NK, NT, B * HV)](
        q, k, beta, gc, A_inv, h, v_new, do, dh, dv_new, dq, dk, dbeta, dg, dA_inv, cu_seqlens, chunk_indices,
        scale, h0, T, cdiv(T, BT), B * T,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, DOT_PREC=bwd_dot_precision(q.dtype, dot_prec), IS_VARLEN=cu_seqlens is not None,
        EXACT_H0=h0 is not None and h.dtype != torch.float32,
        num_warps=8,
        **launch_options("local_bwd_dqk"),
    )
    return dq, dk, dbeta, dg, dA_inv
