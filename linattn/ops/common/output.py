"""Stage 5: the output O = scale·[diag(Γ) Q S + (Q Kᵀ ⊙ D ⊙ causal) V_new], parallel over chunks.

Twin: ``torch_chunk.output_fwd_ref``. One program per (BV slice, chunk, value head). Per program:
    K tiles (BK = 64):  read BT×BK queries + BT×BK keys + BK×BV state (fp32, or bf16 from a bf16 split),
                        O_inter += Q S (OUT_PREC),  P += Q Kᵀ (input dtype: exact products)
    then                read BT gates + BT×BV V_new (as the state), O = scale·(Γ ⊙ O_inter + (P ⊙ D) V_new)
                        (OUT_PREC), write BT×BV in the output dtype.
With bf16 inputs, a bf16 state and V_new and OUT_PREC "bf16x3", Q S is one bf16 MMA and P V_new two (common/dot.py
skips the split of a bf16 operand).
BV = 64 keeps the two fp32 accumulators ([BT, BV] and [BT, BT]) at 8192 values; Q Kᵀ is recomputed for every V
slice, which costs 2·BT²·K FLOPs per slice (cheap next to re-reading h). D_ij = e^{G_i − G_j} is formed from the
masked difference (upper triangle and padded rows → −inf → 0). The same kernel serves plain gated linear attention
by passing V as ``v_new``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..utils import cdiv
from . import CHUNK, block_size, dot_precision, launch_options, triton_interpret
from .dot import DOT_PRECISIONS, dot
from .finite import nonfinite
from .launch import launch
from .varlen import chunk_bounds


@triton.jit(do_not_specialize=["T", "NT"])
def output_fwd_kernel(q, k, v_new, h, gc, o, scale, cu_seqlens, chunk_indices, T, NT, H: tl.constexpr,
                      HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, DOT_PREC: tl.constexpr, OUT_PREC: tl.constexpr, USE_DECAY: tl.constexpr,
                      IS_VARLEN: tl.constexpr, INTERPRET: tl.constexpr):
    # grid (cdiv(V, BV), NT, B·HV)
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    _, i_c, bos, eos = chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, IS_VARLEN)
    T_seq = eos - bos
    # global chunk index into h [B, NT, HV, K, V] (varlen: B = 1 and i_t is already global)
    i_tg = i_b.to(tl.int64) * NT + i_t
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T_seq

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_P = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T_seq, K), (H * K, 1), (i_c * BT, i_k * BK), (BT, BK),
                                (1, 0))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (K, T_seq), (1, H * K), (i_k * BK, i_c * BT), (BK, BT),
                                (0, 1))
        p_h = tl.make_block_ptr(h + (i_tg * HV + i_hv) * K * V, (K, V), (V, 1), (i_k * BK, i_v * BV), (BK, BV),
                                (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_kt = tl.load(p_k, boundary_check=(0, 1))
        b_h = tl.load(p_h, boundary_check=(0, 1))
        b_o += dot(b_q, b_h, OUT_PREC, INTERPRET)  # "bf16x3" keeps a bf16 Q whole: two MMAs, not three
        b_P += tl.dot(b_q, b_kt, input_precision=DOT_PREC)

    m_P = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    if USE_DECAY:
        b_gc = tl.load(gc + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
        b_o *= tl.exp(b_gc)[:, None]
        b_P *= tl.exp(tl.where(m_P, b_gc[:, None] - b_gc[None, :], float("-inf")))
    # the mask is a select (after the decay's too): a non-finite key never reaches an earlier row (finite.py)
    b_P = tl.where(m_P, b_P, 0.)

    p_v = tl.make_block_ptr(v_new + (bos * HV + i_hv) * V, (T_seq, V), (HV * V, 1), (i_c * BT, i_v * BV), (BT, BV),
                            (1, 0))
    b_v = tl.load(p_v, boundary_check=(0, 1))  # fp32, or bf16 (kept: dot() skips the split of a bf16 operand)
    # P V_new with V_new's non-finite entries zeroed and o NaN there: V_new's non-finite rows are closed downward
    # (finite.py), so o's rows from the first one on are NaN and the rows before never see it
    m_bad = nonfinite(b_v)
    b_pv = dot(b_P, tl.where(m_bad, 0., b_v).to(b_v.dtype), OUT_PREC, INTERPRET)
    b_o = tl.where(m_bad, float("nan"), (b_o + b_pv) * scale)
    p_o = tl.make_block_ptr(o + (bos * HV + i_hv) * V, (T_seq, V), (HV * V, 1), (i_c * BT, i_v * BV), (BT, BV),
                            (1, 0))
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))


def output_fwd(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, gc: Optional[torch.Tensor],
               scale: float, out_dtype: torch.dtype, cu_seqlens: Optional[torch.Tensor] = None,
               chunk_indices: Optional[torch.Tensor] = None, chunk_size: int = CHUNK,
               dot_prec: Optional[str] = None) -> torch.Tensor:
    """O = scale·[diag(Γ) Q S + (Q Kᵀ ⊙ D ⊙ causal) V_new] per chunk.

    Args:
        q, k: ``[B, T, H, K]``; v_new: ``[B, T, HV, V]`` (from the state pass: fp32, or bf16 with bf16 inputs;
        plain GLA: the values); h: ``[B, NT, HV, K, V]`` states entering each chunk, fp32 (or bf16 as v_new);
        gc: ``[B, T, HV]`` fp32 or None.
        dot_prec: precision of the two dots on fp32 operands (Q S, P V_new), one of ``dot.DOT_PRECISIONS``;
            None: ``dot_precision`` of the inputs. The split forward passes ``split_fwd.output_precision`` (bf16x3
            for bf16: o's error 1.73e-3 at the anchor case as at tf32x3, against 2.0e-3 at tf32).
    Returns:
        o ``[B, T, HV, V]`` in ``out_dtype``.
    """
    if dot_prec is not None and dot_prec not in DOT_PRECISIONS:
        raise ValueError(f"output_fwd dot_prec must be one of {DOT_PRECISIONS}, got {dot_prec!r}")
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    o = torch.empty(B, T, HV, V, dtype=out_dtype, device=q.device)
    NT = chunk_indices.shape[0] if cu_seqlens is not None else cdiv(T, chunk_size)
    BV = block_size(V, 64)
    launch(output_fwd_kernel, (cdiv(V, BV), NT, B * HV),
           q, k, v_new, h, gc, o, scale, cu_seqlens, chunk_indices, T, NT, H=H, HV=HV, K=K, V=V, BT=chunk_size,
           BK=block_size(K, 64), BV=BV, DOT_PREC=dot_precision(q.dtype), OUT_PREC=dot_prec or dot_precision(q.dtype),
           USE_DECAY=gc is not None, IS_VARLEN=cu_seqlens is not None, INTERPRET=triton_interpret(),
           **launch_options("output_fwd"))
    return o
