"""Stage 3: the WY (UT) representation W = A_inv diag(βΓ) K and U = A_inv diag(β) V, Γ = e^{G}.

Twin: ``torch_chunk.wy_ref``. One program per (chunk, value head) reads the chunk's fp32 A_inv [BT, BT] once and
streams K and V through it in BK/BV-wide tiles (64: a [64, 64] fp32 operand pair per dot keeps the register
footprint flat for K, V up to 256). Per chunk: read BT² fp32 + BT·(K + V) inputs, write BT·(K + V) fp32.
The β(Γ) row scaling is applied to the K/V tile in fp32 before the dot, so only one rounding (the dot's
operand precision, see ``common/__init__.py``) touches the product.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..utils import cdiv
from . import CHUNK, block_size, dot_precision, launch_options
from .finite import dead_rows, from_first, nan_rows, nonfinite, zero_rows
from .kkt_solve import a_inv_tile
from .varlen import chunk_bounds


@triton.jit(do_not_specialize=["T"])
def wy_kernel(k, v, beta, gc, A_inv, w, u, cu_seqlens, chunk_indices, T, H: tl.constexpr, HV: tl.constexpr,
              K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              DOT_PREC: tl.constexpr, USE_DECAY: tl.constexpr, IS_VARLEN: tl.constexpr):
    # grid (NT, B·HV)
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    _, i_c, bos, eos = chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, IS_VARLEN)
    T_seq = eos - bos
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T_seq

    # read A_inv [BT, BT] fp32 and the row scales β, βΓ (0 on padded rows)
    b_A = tl.load(a_inv_tile(A_inv, bos, i_c, i_hv, T_seq, HV, BT), boundary_check=(0, 1))
    b_beta = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    if USE_DECAY:
        b_gc = tl.load(gc + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
        b_bg = b_beta * tl.exp(b_gc)
        # the rows from the chunk's first non-finite β, G or key on: kkt_solve rewrote gc's rows there as NaN
        m_dead = nonfinite(b_gc)
    else:
        b_bg = b_beta
        m_dead = from_first(nonfinite(b_beta))     # (no gc to read them from: keys are not checked)
    wy_tiles(b_A, m_dead, b_beta, b_bg, k, v, w, u, bos, T_seq, i_c, i_h, i_hv, H, HV, K, V, BT, BK, BV, DOT_PREC)


@triton.jit
def wy_tiles(b_A, m_dead, b_beta, b_bg, k, v, w, u, bos, T_seq, i_c, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
             K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
             DOT_PREC: tl.constexpr):
    """Write W = b_A (βΓ ⊙ K) and U = b_A (β ⊙ V) of chunk i_c, given its inverse b_A [BT, BT] fp32 and the row
    scales b_beta, b_bg [BT] in registers. Shared by :func:`wy_kernel` and the fused pre-pass. Causal under
    non-finite inputs (``finite.py``): ``m_dead`` [BT] marks the rows from the chunk's first non-finite β, G or key
    on (``kkt_inverse``): b_A's rows there are unit rows, and the tiles' rows there are zeroed before the dots (no
    other row of βΓ ⊙ K can be non-finite), W's rows there are 0, U's NaN, and so are U's rows from the V tile's own
    first non-finite row on: U's non-finite rows are closed downward, and V_new = U − W S's with them."""
    # W = A_inv (βΓ ⊙ K): read BT×BK keys, write BT×BK fp32 per tile
    for i_k in range(tl.cdiv(K, BK)):
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T_seq, K), (H * K, 1), (i_c * BT, i_k * BK), (BT, BK),
                                (1, 0))
        p_w = tl.make_block_ptr(w + (bos * HV + i_hv) * K, (T_seq, K), (HV * K, 1), (i_c * BT, i_k * BK),
                                (BT, BK), (1, 0))
        b_kb = tl.load(p_k, boundary_check=(0, 1)).to(tl.float32) * b_bg[:, None]
        b_w = tl.dot(b_A, zero_rows(b_kb, m_dead), input_precision=DOT_PREC)
        tl.store(p_w, b_w.to(p_w.dtype.element_ty), boundary_check=(0, 1))

    # U = A_inv (β ⊙ V): read BT×BV values, write BT×BV fp32 per tile
    for i_v in range(tl.cdiv(V, BV)):
        p_v = tl.make_block_ptr(v + (bos * HV + i_hv) * V, (T_seq, V), (HV * V, 1), (i_c * BT, i_v * BV), (BT, BV),
                                (1, 0))
        p_u = tl.make_block_ptr(u + (bos * HV + i_hv) * V, (T_seq, V), (HV * V, 1), (i_c * BT, i_v * BV),
                                (BT, BV), (1, 0))
        b_vb = tl.load(p_v, boundary_check=(0, 1)).to(tl.float32) * b_beta[:, None]
        m_v = m_dead | dead_rows(b_vb)
        b_u = nan_rows(tl.dot(b_A, zero_rows(b_vb, m_v), input_precision=DOT_PREC), m_v)
        tl.store(p_u, b_u.to(p_u.dtype.element_ty), boundary_check=(0, 1))


def wy_fwd(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, gc: Optional[torch.Tensor], A_inv: torch.Tensor,
           cu_seqlens: Optional[torch.Tensor] = None, chunk_indices: Optional[torch.Tensor] = None,
           chunk_size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """W = A_inv diag(βΓ) K and U = A_inv diag(β) V per chunk.

    Args:
        k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; beta: ``[B, T, HV]``; gc: ``[B, T, HV]`` fp32 or None (Γ = 1);
        A_inv: ``[B, T, HV, BT]`` fp32 from :func:`kkt_solve.kkt_solve`.
    Returns:
        w ``[B, T, HV, K]`` and u ``[B, T, HV, V]``, both fp32.
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    w = torch.empty(B, T, HV, K, dtype=torch.float32, device=k.device)
    u = torch.empty(B, T, HV, V, dtype=torch.float32, device=k.device)
    NT = chunk_indices.shape[0] if cu_seqlens is not None else cdiv(T, chunk_size)
    wy_kernel[(NT, B * HV)](
        k, v, beta, gc, A_inv, w, u, cu_seqlens, chunk_indices, T, H=H, HV=HV, K=K, V=V, BT=chunk_size,
        BK=block_size(K, 64), BV=block_size(V, 64), DOT_PREC=dot_precision(k.dtype), USE_DECAY=gc is not None,
        IS_VARLEN=cu_seqlens is not None, **launch_options("wy"))
    return w, u
