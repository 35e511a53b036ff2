"""Stage 2: A = strict_lower(diag(β) K Kᵀ ⊙ D) and A_inv = (I + A)⁻¹, one 64×64 chunk per program.

Twin: ``torch_chunk.kkt_solve_ref``. Output ``A_inv [B, T, HV, BT]`` fp32: row t holds row (t − chunk start) of
its chunk's inverse; columns past the chunk's length are 0 (the inverse is lower triangular).

Method (exact, no iteration to convergence). Split the chunk into four 16-row blocks, A_ij (i ≥ j):
  1. the ten blocks A_ij = β_i (K_i K_jᵀ) ⊙ e^{G_i − G_j}: six 16×16 dots and one 4×16×16 (the diagonal
     blocks) per K tile, in the input dtype (products of inputs are exact in fp32 accumulation); the gate
     difference is masked *before* exp, so padded rows and the upper triangle never overflow, and
     e^{G_i}·e^{−G_j} is never formed (G may reach −6400);
  2. forward substitution on the four diagonal blocks at once: Ainv_ii = (I + A_ii)⁻¹, 15 row steps in
     registers;
  3. block merges, Ainv_ij = −Ainv_ii Σ_{j ≤ m < i} A_im Ainv_mj: six levels of 16×16 fp32 dots at
     :data:`MERGE_PREC_BF16` for bf16 inputs ("ieee" for fp16 and fp32 inputs).
Powers-of-A series ((I − A)(I + A²)(I + A⁴)…) would be cheaper but cancel catastrophically when |A_ij| ≈ 1
(entries of A³² reach C(63, 31) ≈ 1e18 while the inverse stays O(1)); substitution does not.
Per chunk it reads BT·K keys, 2·BT gates/betas and writes BT·BT fp32; the ~2·BT²·K FLOPs are ~5% of the forward.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import CHUNK, block_size, dot_precision, launch_options, product_precision, triton_interpret
from .dot import DOT_PRECISIONS, dot
from .varlen import chunk_bounds

# Precision of the block merges' fp32 products (step 3) for bf16 inputs: "bf16x3" (common/dot.py: each fp32
# factor split into two bf16 parts, three bf16 MMAs, ≈ 2^-16 per product). Run 13 (B=8 T=4096 H=16, bf16): solve
# 0.522 → 0.493 ms, pre-pass 0.902 → 0.842, fwd+bwd 8.65 → 8.54 (the backward recomputes A_inv), every output and
# gradient's error vs float64 unchanged to two digits; "ieee" (FMA units, 552 FFMA of ~3800 SASS instructions) was
# the default before, "tf32x3" is slower than both (0.60 ms: 352 extra shuffles). fp16 and fp32 inputs merge at
# "ieee": at bf16x3 an fp16 case without decay (g = 0) carried a 1.0e-5 final-state error where the fp32-product
# path has 2.5e-7 (tests/ops/test_triton_fwd.py) — invisible under bf16's own rounding, not under fp16's.
MERGE_PREC_BF16 = "bf16x3"


def merge_precision(dtype: torch.dtype, override: Optional[str] = None) -> str:
    """The block merges' precision for inputs of ``dtype``: ``common.FP32_PRODUCT_PRECISION`` for fp32, else
    ``override`` (benchmarks, tests) or :data:`MERGE_PREC_BF16` for bf16 and "ieee" for fp16; checked."""
    setting = MERGE_PREC_BF16 if dtype == torch.bfloat16 else "ieee"
    return product_precision(dtype, setting, override, DOT_PRECISIONS, "kkt_solve merge precision")


@triton.jit
def _gate_block(b_A, gc, beta, bos, T_seq, o_i, o_j, i_hv, HV: tl.constexpr, USE_DECAY: tl.constexpr):
    """b_A ← β_i · b_A ⊙ e^{G_i − G_j} on the rows o_i / columns o_j of the chunk (an off-diagonal block), 0 where
    masked."""
    m_i = o_i < T_seq
    m_j = o_j < T_seq
    m_A = m_i[:, None] & m_j[None, :]
    b_beta = tl.load(beta + (bos + o_i) * HV + i_hv, mask=m_i, other=0).to(tl.float32)
    if USE_DECAY:
        b_gi = tl.load(gc + (bos + o_i) * HV + i_hv, mask=m_i, other=0)
        b_gj = tl.load(gc + (bos + o_j) * HV + i_hv, mask=m_j, other=0)
        b_A = b_A * tl.exp(tl.where(m_A, b_gi[:, None] - b_gj[None, :], float("-inf")))
    return tl.where(m_A, b_A * b_beta[:, None], 0.)


# How steps 1–2 build and invert the four diagonal 16×16 blocks: one 3-D dot over the [4, 16, BK] key stack, whose
# MMA layout on sm_90 puts one block on each warp (warpsPerCTA [4, 1, 1]), then the 15-step forward substitution
# on the [4, 16, 16] stack, each warp for its own block. Four 2-D dots (the way before run 14) give every 16×16
# result a warp-replicated layout, so all four warps ran all four blocks' substitutions (4 × 15 steps of 95 SASS
# instructions, 28 of them shuffles); the stack cuts ≈ 38% of the instructions per warp. Run 14 (B=8 T=4096 H=16,
# bf16): kkt_solve 0.501 → 0.265 ms (predicted ≈ 0.30), pre-pass 0.859 → 0.619, split forward 1.855 → 1.623,
# fwd+bwd 7.98 → 7.50; every error vs float64 unchanged (same arithmetic per block).
@triton.jit
def _gate_diag_blocks(b_A, gc, beta, bos, T_seq, i_c, i_hv, HV: tl.constexpr, USE_DECAY: tl.constexpr):
    """:func:`_gate_block` for the four diagonal blocks stacked as [4, 16, 16] (block b: the chunk's rows and
    columns 16b … 16b + 15): b_A ← β_i · b_A ⊙ e^{G_i − G_j}, 0 on and above the diagonal and where masked."""
    o_r = tl.arange(0, 16)
    o_t = i_c * 64 + tl.arange(0, 4)[:, None] * 16 + o_r[None, :]  # [4, 16]: the token of (block, row)
    m_t = o_t < T_seq
    m_A = m_t[:, :, None] & m_t[:, None, :] & (o_r[:, None] > o_r[None, :])[None, :, :]
    b_beta = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    if USE_DECAY:
        b_g = tl.load(gc + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
        b_A = b_A * tl.exp(tl.where(m_A, b_g[:, :, None] - b_g[:, None, :], float("-inf")))
    return tl.where(m_A, b_A * b_beta[:, :, None], 0.)


@triton.jit
def _invert_diag_blocks(b_A, o_r):
    """(I + A)⁻¹ of the four stacked strictly lower 16×16 diagonal blocks [4, 16, 16] by forward substitution,
    one chain of 15 row steps for all four: with N = (I + A)⁻¹ − I, row r is N_r = −A_r + Σ_{m<r} (−A_rm) N_m;
    rows m < r of b_N already hold N_m, rows ≥ r still hold −A (unused). Returns the four inverses as [16, 16]."""
    b_N = -b_A
    for r in range(1, 16):
        m_r = (o_r == r)[None, :, None]
        b_a = tl.sum(tl.where(m_r, b_N, 0.), 1)  # [4, 16]: row r of each block, N_r (still −A_r)
        b_a = b_a + tl.sum(b_a[:, :, None] * b_N, 1)
        b_N = tl.where(m_r, b_a[:, None, :], b_N)
    b_N = b_N + (o_r[:, None] == o_r[None, :]).to(tl.float32)[None, :, :]
    b_y = tl.permute(tl.reshape(b_N, (2, 2, 16, 16)), (2, 3, 1, 0))  # [16, 16, 2 (within a pair), 2 (pair)]
    b_p0, b_p1 = tl.split(b_y)
    b_T00, b_T11 = tl.split(b_p0)
    b_T22, b_T33 = tl.split(b_p1)
    return b_T00, b_T11, b_T22, b_T33


@triton.jit
def kkt_inverse_blocks(k, beta, gc, bos, T_seq, i_c, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
                       K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
                       USE_DECAY: tl.constexpr, MERGE_PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """Steps 1–3 for chunk i_c of the sequence at bos: the ten lower 16×16 blocks of (I + A)⁻¹, fp32, as
    (T00, T10, T11, T20, T21, T22, T30, T31, T32, T33). Shared by :func:`kkt_solve_kernel` and the fused
    pre-pass (``fused_prepass.py``), which keeps them in registers instead of writing A_inv."""
    tl.static_assert(BT == 64, "the block merge is written for 4 blocks of 16 rows")
    o_r = tl.arange(0, 16)
    o_0 = i_c * BT + o_r
    o_1, o_2, o_3 = o_0 + 16, o_0 + 32, o_0 + 48

    # 1. K Kᵀ in ten 16×16 blocks, accumulated over K tiles (read BT×K keys once)
    b_A10 = tl.zeros([16, 16], dtype=tl.float32)
    b_A20 = tl.zeros([16, 16], dtype=tl.float32)
    b_A21 = tl.zeros([16, 16], dtype=tl.float32)
    b_A30 = tl.zeros([16, 16], dtype=tl.float32)
    b_A31 = tl.zeros([16, 16], dtype=tl.float32)
    b_A32 = tl.zeros([16, 16], dtype=tl.float32)
    b_Ad = tl.zeros([4, 16, 16], dtype=tl.float32)  # the four diagonal blocks, stacked
    p_k0 = k + (bos * H + i_h) * K
    for i_k in range(tl.cdiv(K, BK)):
        p_k = tl.make_block_ptr(p_k0, (T_seq, K), (H * K, 1), (i_c * BT, i_k * BK), (16, BK), (1, 0))
        b_k0 = tl.load(p_k, boundary_check=(0, 1))
        b_k1 = tl.load(tl.advance(p_k, (16, 0)), boundary_check=(0, 1))
        b_k2 = tl.load(tl.advance(p_k, (32, 0)), boundary_check=(0, 1))
        b_k3 = tl.load(tl.advance(p_k, (48, 0)), boundary_check=(0, 1))
        b_A10 += tl.dot(b_k1, tl.trans(b_k0), input_precision=DOT_PREC)
        b_A20 += tl.dot(b_k2, tl.trans(b_k0), input_precision=DOT_PREC)
        b_A21 += tl.dot(b_k2, tl.trans(b_k1), input_precision=DOT_PREC)
        b_A30 += tl.dot(b_k3, tl.trans(b_k0), input_precision=DOT_PREC)
        b_A31 += tl.dot(b_k3, tl.trans(b_k1), input_precision=DOT_PREC)
        b_A32 += tl.dot(b_k3, tl.trans(b_k2), input_precision=DOT_PREC)
        # the four diagonal blocks as one batched dot of the [4, 16, BK] key stack (the keys loaded again as one
        # [BT, BK] tile, from L1: splitting it into the 16-row tiles above would cost layout conversions instead)
        b_k = tl.reshape(tl.load(tl.make_block_ptr(p_k0, (T_seq, K), (H * K, 1), (i_c * BT, i_k * BK), (BT, BK),
                                                   (1, 0)), boundary_check=(0, 1)), (4, 16, BK))
        b_Ad += tl.dot(b_k, tl.permute(b_k, (0, 2, 1)), input_precision=DOT_PREC)
    # β_i and the decay e^{G_i − G_j}, masked before exp
    b_A10 = _gate_block(b_A10, gc, beta, bos, T_seq, o_1, o_0, i_hv, HV, USE_DECAY)
    b_A20 = _gate_block(b_A20, gc, beta, bos, T_seq, o_2, o_0, i_hv, HV, USE_DECAY)
    b_A21 = _gate_block(b_A21, gc, beta, bos, T_seq, o_2, o_1, i_hv, HV, USE_DECAY)
    b_A30 = _gate_block(b_A30, gc, beta, bos, T_seq, o_3, o_0, i_hv, HV, USE_DECAY)
    b_A31 = _gate_block(b_A31, gc, beta, bos, T_seq, o_3, o_1, i_hv, HV, USE_DECAY)
    b_A32 = _gate_block(b_A32, gc, beta, bos, T_seq, o_3, o_2, i_hv, HV, USE_DECAY)

    # 2. diagonal blocks by forward substitution (padded rows have A = 0, so their inverse rows are e_r)
    b_Ad = _gate_diag_blocks(b_Ad, gc, beta, bos, T_seq, i_c, i_hv, HV, USE_DECAY)
    b_T00, b_T11, b_T22, b_T33 = _invert_diag_blocks(b_Ad, o_r)

    # 3. block merges, one sub-diagonal at a time: T_ij = −T_ii Σ_{j ≤ m < i} A_im T_mj (fp32 × fp32,
    #    merge_precision)
    b_T10 = -dot(b_T11, dot(b_A10, b_T00, MERGE_PREC, INTERPRET), MERGE_PREC, INTERPRET)
    b_T21 = -dot(b_T22, dot(b_A21, b_T11, MERGE_PREC, INTERPRET), MERGE_PREC, INTERPRET)
    b_T32 = -dot(b_T33, dot(b_A32, b_T22, MERGE_PREC, INTERPRET), MERGE_PREC, INTERPRET)
    b_T20 = -dot(b_T22, dot(b_A20, b_T00, MERGE_PREC, INTERPRET) + dot(b_A21, b_T10, MERGE_PREC, INTERPRET),
                 MERGE_PREC, INTERPRET)
    b_T31 = -dot(b_T33, dot(b_A31, b_T11, MERGE_PREC, INTERPRET) + dot(b_A32, b_T21, MERGE_PREC, INTERPRET),
                 MERGE_PREC, INTERPRET)
    b_T30 = -dot(b_T33, dot(b_A30, b_T00, MERGE_PREC, INTERPRET) + dot(b_A31, b_T10, MERGE_PREC, INTERPRET)
                 + dot(b_A32, b_T20, MERGE_PREC, INTERPRET), MERGE_PREC, INTERPRET)
    return b_T00, b_T10, b_T11, b_T20, b_T21, b_T22, b_T30, b_T31, b_T32, b_T33


@triton.jit(do_not_specialize=["T"])
def kkt_solve_kernel(k, beta, gc, A_inv, cu_seqlens, chunk_indices, T, H: tl.constexpr, HV: tl.constexpr,
                     K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
                     USE_DECAY: tl.constexpr, IS_VARLEN: tl.constexpr, MERGE_PREC: tl.constexpr,
                     INTERPRET: tl.constexpr):
    # grid (NT, B·HV): one program per (chunk, value head); value head i_hv reads key head i_hv // (HV // H)
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    _, i_c, bos, eos = chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, IS_VARLEN)
    T_seq = eos - bos
    b_T00, b_T10, b_T11, b_T20, b_T21, b_T22, b_T30, b_T31, b_T32, b_T33 = kkt_inverse_blocks(
        k, beta, gc, bos, T_seq, i_c, i_h, i_hv, H, HV, K, BT, BK, DOT_PREC, USE_DECAY, MERGE_PREC, INTERPRET)

    # write all sixteen blocks (the upper ones as zeros) of the chunk's rows; rows past eos are not written
    p_T = tl.make_block_ptr(A_inv + (bos * HV + i_hv) * BT, (T_seq, BT), (HV * BT, 1), (i_c * BT, 0), (16, 16),
                            (1, 0))
    b_zero = tl.zeros([16, 16], dtype=tl.float32)
    tl.store(p_T, b_T00, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (0, 16)), b_zero, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (0, 32)), b_zero, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (0, 48)), b_zero, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (16, 0)), b_T10, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (16, 16)), b_T11, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (16, 32)), b_zero, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (16, 48)), b_zero, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (32, 0)), b_T20, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (32, 16)), b_T21, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (32, 32)), b_T22, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (32, 48)), b_zero, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (48, 0)), b_T30, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (48, 16)), b_T31, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (48, 32)), b_T32, boundary_check=(0, 1))
    tl.store(tl.advance(p_T, (48, 48)), b_T33, boundary_check=(0, 1))


def kkt_solve(k: torch.Tensor, beta: torch.Tensor, gc: Optional[torch.Tensor], HV: int,
              cu_seqlens: Optional[torch.Tensor] = None, chunk_indices: Optional[torch.Tensor] = None,
              chunk_size: int = CHUNK, merge_prec: Optional[str] = None) -> torch.Tensor:
    """A_inv = (I + strict_lower(diag(β) K Kᵀ ⊙ D))⁻¹ per chunk.

    Args:
        k: keys ``[B, T, H, K]``; value head i reads key head ``i // (HV // H)``.
        beta: ``[B, T, HV]``. gc: chunk-local cumulative log decay ``[B, T, HV]`` fp32, or None for no decay.
        cu_seqlens, chunk_indices: varlen offsets ``[N + 1]`` and :func:`varlen.chunk_tables` indices, or None.
        merge_prec: the block merges' precision (None: :func:`merge_precision`; benchmarks and tests).
    Returns:
        A_inv ``[B, T, HV, BT]`` fp32 (row t = row of t's chunk inverse, zero past the chunk's length).
    """
    B, T, H, K = k.shape
    A_inv = torch.empty(B, T, HV, chunk_size, dtype=torch.float32, device=k.device)
    NT = chunk_indices.shape[0] if cu_seqlens is not None else triton.cdiv(T, chunk_size)
    kkt_solve_kernel[(NT, B * HV)](
        k, beta, gc, A_inv, cu_seqlens, chunk_indices, T, H=H, HV=HV, K=K, BT=chunk_size, BK=block_size(K, 64),
        DOT_PREC=dot_precision(k.dtype), USE_DECAY=gc is not None, IS_VARLEN=cu_seqlens is not None,
        MERGE_PREC=merge_precision(k.dtype, merge_prec), INTERPRET=triton_interpret(), **launch_options("kkt_solve"))
    return A_inv
