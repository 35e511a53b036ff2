"""Stage 2: A = strict_lower(diag(β) K Kᵀ ⊙ D) and A_inv = (I + A)⁻¹, one 64×64 chunk per program.

Twin: ``torch_chunk.kkt_solve_ref``. Output ``A_inv [B, T, HV, BT]`` fp32: row t holds row (t − chunk start) of
its chunk's inverse; columns past the chunk's length are 0 (the inverse is lower triangular).

Method (exact, no iteration to convergence). Split the chunk into four 16-row blocks, A_ij (i ≥ j), and two
32-row halves (lo, hi):
  1. A's blocks = β_i (K_i K_jᵀ) ⊙ e^{G_i − G_j}, per K tile one [4, 16, 16] dot (the diagonal blocks), one
     [2, 16, 16] dot (A10, A32) and one 32×32 dot (the lower-left quadrant A_hl), in the input dtype (products of
     inputs are exact in fp32 accumulation); the gate difference is masked *before* exp, so padded rows and the
     upper triangle never overflow, and e^{G_i}·e^{−G_j} is never formed (G may reach −6400);
  2. forward substitution on the four diagonal blocks at once: T_ii = (I + A_ii)⁻¹, 15 row steps in registers;
  3. merges, by halves: (T10, T32) = −(T11, T33) (A10, A32) (T00, T22) in one
     [2, 16, 16] pair of dots, then the quadrant X = −T_hi A_hl T_lo in two 32×32 dots, fp32 × fp32 at
     :func:`merge_precision` ("bf16x3" for bf16 inputs, "ieee" for fp16 and fp32).
Powers-of-A series ((I − A)(I + A²)(I + A⁴)…) would be cheaper but cancel catastrophically when |A_ij| ≈ 1
(entries of A³² reach C(63, 31) ≈ 1e18 while the inverse stays O(1)); substitution does not.
Per chunk it reads BT·K keys, 2·BT gates/betas and writes BT·BT fp32; the ~2·BT²·K FLOPs are ~5% of the forward.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..utils import cdiv
from . import CHUNK, block_size, dot_precision, launch_options, product_precision, triton_interpret
from .dot import DOT_PRECISIONS, dot
from .finite import nonfinite
from .varlen import chunk_bounds


def merge_precision(dtype: torch.dtype, override: Optional[str] = None) -> str:
    """The block merges' precision for inputs of ``dtype``, else ``override`` (benchmarks, tests); checked.

    bf16: "bf16x3" (``dot.py``: each fp32 factor split into two bf16 parts, three bf16 MMAs, ≈ 2^-16 per product),
    faster than "ieee" on FMA units and than "tf32x3" (its shuffles), every error unchanged under bf16's rounding.
    fp16 and fp32: "ieee" (``common.product_precision``): at "bf16x3" an fp16 case without decay carries a 1e-5
    final-state error where the fp32-product path has 2.5e-7 — invisible under bf16's rounding, not under fp16's."""
    setting = "bf16x3" if dtype == torch.bfloat16 else "ieee"
    return product_precision(dtype, setting, override, DOT_PRECISIONS, "kkt_solve merge precision")


@triton.jit
def _gate(b_A, gc, beta, bos, T_seq, o_end, o_i, o_j, i_hv, HV: tl.constexpr, USE_DECAY: tl.constexpr):
    """b_A ← β_i · b_A ⊙ e^{G_i − G_j} where row > column, 0 elsewhere and where masked, for one block [R, C] of the
    chunk on rows o_i [R] and columns o_j [C], or a stack of them [S, R, C] (o_i [S, R], o_j [S, C]): a diagonal
    block keeps its strict lower triangle, a block below the diagonal all of itself. The gate difference is masked
    before exp, so no overflow. Rows from o_end on (the chunk's first non-finite row, ``finite.py``) are 0 too."""
    o_r, o_c = tl.expand_dims(o_i, -1), tl.expand_dims(o_j, -2)
    m_i = (o_i < T_seq) & (o_i < o_end)
    m_A = tl.expand_dims(m_i, -1) & (o_c < T_seq) & (o_r > o_c)
    b_beta = tl.load(beta + (bos + o_i) * HV + i_hv, mask=m_i, other=0).to(tl.float32)
    if USE_DECAY:
        b_gi = tl.load(gc + (bos + o_i) * HV + i_hv, mask=m_i, other=0)
        b_gj = tl.load(gc + (bos + o_j) * HV + i_hv, mask=o_j < T_seq, other=0)
        b_A = b_A * tl.exp(tl.where(m_A, tl.expand_dims(b_gi, -1) - tl.expand_dims(b_gj, -2), float("-inf")))
    return tl.where(m_A, b_A * tl.expand_dims(b_beta, -1), 0.)


@triton.jit
def cat_cols(a, b):
    """[M, N] ++ [M, N] → [M, 2N] along columns (register shuffle only)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def cat_rows(a, b):
    """[M, N] ++ [M, N] → [2M, N] along rows (register shuffle only)."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * a.shape[0], a.shape[1]))


@triton.jit
def _unstack2(x):
    """[2, M, N] → its two [M, N] slices."""
    return tl.split(tl.permute(x, (1, 2, 0)))


@triton.jit
def _invert_diag_blocks(b_A, o_r):
    """(I + A)⁻¹ of the four stacked strictly lower 16×16 diagonal blocks [4, 16, 16] by forward substitution,
    one chain of 15 row steps for all four: with N = (I + A)⁻¹ − I, row r is N_r = −A_r + Σ_{m<r} (−A_rm) N_m;
    rows m < r of b_N already hold N_m, rows ≥ r still hold −A (unused). Returns the inverses as two stacks
    [2, 16, 16]: (T00, T22) and (T11, T33), the first and the second block of each half of the chunk."""
    b_N = -b_A
    for r in range(1, 16):
        m_r = (o_r == r)[None, :, None]
        b_a = tl.sum(tl.where(m_r, b_N, 0.), 1)  # [4, 16]: row r of each block, N_r (still −A_r)
        b_a = b_a + tl.sum(b_a[:, :, None] * b_N, 1)
        b_N = tl.where(m_r, b_a[:, None, :], b_N)
    b_N = b_N + (o_r[:, None] == o_r[None, :]).to(tl.float32)[None, :, :]
    # block 2p + i is the i-th block of half p: [2 (p), 2 (i), 16, 16] → [2 (p), 16, 16, 2 (i)] → split on i
    return tl.split(tl.permute(tl.reshape(b_N, (2, 2, 16, 16)), (0, 2, 3, 1)))


# How step 3 merges the inverted diagonal blocks, by halves: first both halves of the chunk at once,
# T_{2p+1,2p} = −T_{2p+1,2p+1} A_{2p+1,2p} T_{2p,2p} for p = 0, 1 as two dots of [2, 16, 16] stacks, then the
# lower-left 32×32 quadrant X = −T_hi A_hl T_lo as two 32×32 dots (T_lo, T_hi: the inverted halves), with A's
# quadrant A_hl and the two blocks A10, A32 built in step 1 as one 32×32 and one [2, 16, 16] dot. On 4 warps each of
# these dots spreads its result over the warps, where sixteen 16×16 merge dots would give every warp the whole
# 16×16 result (about half the HMMAs and a third of the shuffles on sm_90). Same products as the block-by-block
# merge, associated differently (T30 = −(T32 Y + T33 Z) instead of −T33 (Z + A32 T20), Y and Z the sums inside
# T20 and T30).
@triton.jit
def _inverse_by_halves(k, beta, gc, bos, T_seq, i_c, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
                       K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
                       USE_DECAY: tl.constexpr, MERGE_PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """Steps 1–3 (the module docstring): (T_lo, X, T_hi), the 32×32 quadrants of (I + A)⁻¹ below the diagonal, and
    the chunk's first row (sequence-local) whose β, G or key is non-finite (the chunk's end when none is)."""
    o_r = tl.arange(0, 16)
    o_32 = tl.arange(0, 32)
    o_h = tl.arange(0, 2)[:, None] * 32 + o_r[None, :]  # [2, 16]: rows of block 0 of each half (chunk-local)
    o_k = tl.arange(0, BK)

    # 1. per K tile: the four diagonal blocks ([4, 16, BK] stack of the chunk's keys), (A10, A32) ([2, 16, BK]
    #    stacks of blocks 1, 3 and 0, 2) and the lower-left quadrant (keys 32..63 by keys 0..31); read BT×K keys
    #    once from HBM, the slices again from L1
    b_Ad = tl.zeros([4, 16, 16], dtype=tl.float32)
    b_As = tl.zeros([2, 16, 16], dtype=tl.float32)
    b_Ahl = tl.zeros([32, 32], dtype=tl.float32)
    p_k0 = k + (bos * H + i_h) * K
    p_kc = p_k0 + (i_c * BT).to(tl.int64) * (H * K)  # the chunk's first key row
    m_lo = (i_c * BT + o_h < T_seq)[:, :, None]
    m_hi = (i_c * BT + o_h + 16 < T_seq)[:, :, None]
    for i_k in range(tl.cdiv(K, BK)):
        b_k = tl.load(tl.make_block_ptr(p_k0, (T_seq, K), (H * K, 1), (i_c * BT, i_k * BK), (BT, BK), (1, 0)),
                      boundary_check=(0, 1))
        b_k = tl.reshape(b_k, (4, 16, BK))
        b_Ad += tl.dot(b_k, tl.permute(b_k, (0, 2, 1)), input_precision=DOT_PREC)
        m_k = (i_k * BK + o_k < K)[None, None, :]
        p_s = p_kc + o_h[:, :, None] * (H * K) + i_k * BK + o_k[None, None, :]
        b_ks0 = tl.load(p_s, mask=m_lo & m_k, other=0)  # blocks 0, 2
        b_ks1 = tl.load(p_s + 16 * H * K, mask=m_hi & m_k, other=0)  # blocks 1, 3
        b_As += tl.dot(b_ks1, tl.permute(b_ks0, (0, 2, 1)), input_precision=DOT_PREC)
        p_q = tl.make_block_ptr(p_k0, (T_seq, K), (H * K, 1), (i_c * BT, i_k * BK), (32, BK), (1, 0))
        b_klo = tl.load(p_q, boundary_check=(0, 1))
        b_khi = tl.load(tl.advance(p_q, (32, 0)), boundary_check=(0, 1))
        b_Ahl += tl.dot(b_khi, tl.trans(b_klo), input_precision=DOT_PREC)
    # the chunk's first row whose β, G or ‖k‖² (the diagonal of K Kᵀ) is non-finite: A's rows from there are 0, so
    # the substitution and the merges see finite values only (the inverse's rows there are unit rows), and gc's rows
    # from there are rewritten as NaN: what the later stages find the rows a bad token feeds by (finite.py). Padded
    # rows load as 0; a finite chunk stores nothing (the mask is empty)
    # (in the diagonal blocks' [4, 16] row layout: no layout change)
    o_d = i_c * BT + tl.arange(0, 4)[:, None] * 16 + o_r[None, :]
    m_d = o_d < T_seq
    b_kk = tl.sum(tl.where((o_r[:, None] == o_r[None, :])[None, :, :], b_Ad, 0.), 2)
    b_bad = nonfinite(b_kk) | nonfinite(tl.load(beta + (bos + o_d) * HV + i_hv, mask=m_d, other=0).to(tl.float32))
    if USE_DECAY:
        b_bad = b_bad | nonfinite(tl.load(gc + (bos + o_d) * HV + i_hv, mask=m_d, other=0))
    o_end = tl.min(tl.min(tl.where(b_bad, o_d, i_c * BT + BT), axis=1), axis=0)
    if USE_DECAY:
        # rows ≥ o_end of gc are read below only under masks that drop them: no barrier needed
        tl.store(gc + (bos + o_d) * HV + i_hv, tl.full([4, 16], float("nan"), tl.float32), mask=m_d & (o_d >= o_end))
    # β_i and the decay e^{G_i − G_j}, masked before exp
    b_Ad = _gate(b_Ad, gc, beta, bos, T_seq, o_end, o_d, o_d, i_hv, HV, USE_DECAY)
    b_As = _gate(b_As, gc, beta, bos, T_seq, o_end, i_c * BT + o_h + 16, i_c * BT + o_h, i_hv, HV, USE_DECAY)
    b_Ahl = _gate(b_Ahl, gc, beta, bos, T_seq, o_end, i_c * BT + 32 + o_32, i_c * BT + o_32, i_hv, HV, USE_DECAY)

    # 2. the diagonal blocks by forward substitution (padded rows have A = 0, so their inverse rows are e_r)
    b_Tf, b_Ts = _invert_diag_blocks(b_Ad, o_r)  # (T00, T22), (T11, T33)

    # 3. both halves' off-diagonal blocks at once, (T10, T32) = −(T11, T33) (A10, A32) (T00, T22), then the
    #    quadrant X = −T_hi A_hl T_lo (fp32 × fp32, merge_precision)
    b_Tm = -dot(b_Ts, dot(b_As, b_Tf, MERGE_PREC, INTERPRET), MERGE_PREC, INTERPRET)
    b_T00, b_T22 = _unstack2(b_Tf)
    b_T11, b_T33 = _unstack2(b_Ts)
    b_T10, b_T32 = _unstack2(b_Tm)
    b_0 = tl.zeros([16, 16], dtype=tl.float32)
    b_Tlo = cat_rows(cat_cols(b_T00, b_0), cat_cols(b_T10, b_T11))
    b_Thi = cat_rows(cat_cols(b_T22, b_0), cat_cols(b_T32, b_T33))
    b_X = -dot(b_Thi, dot(b_Ahl, b_Tlo, MERGE_PREC, INTERPRET), MERGE_PREC, INTERPRET)
    return b_Tlo, b_X, b_Thi, o_end


@triton.jit
def a_inv_tile(a_inv, bos, i_c, i_hv, T_seq, HV: tl.constexpr, BT: tl.constexpr):
    """Block pointer to chunk i_c's [BT, BT] rows of A_inv ``[B, T, HV, BT]`` (row t: the row of t's chunk
    inverse) for the sequence starting at token bos: the one place that layout is spelled out, for every kernel that
    writes or reads A_inv. Rows past T_seq lie outside the block (boundary_check=(0, 1): stores skip them, loads give
    0)."""
    return tl.make_block_ptr(a_inv + (bos * HV + i_hv) * BT, (T_seq, BT), (HV * BT, 1), (i_c * BT, 0), (BT, BT),
                             (1, 0))


@triton.jit
def kkt_inverse(k, beta, gc, bos, T_seq, i_c, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr, USE_DECAY: tl.constexpr,
                MERGE_PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """Steps 1–3 for chunk i_c of the sequence at bos: (I + A)⁻¹ as one [BT, BT] fp32 register tile (zero above
    the diagonal). Shared by :func:`kkt_solve_kernel` and the fused pre-pass (``fused_prepass.py``), which keeps it
    in registers instead of writing A_inv; and the [BT] mask of the rows from the chunk's first non-finite β, G or
    key on, where the inverse's rows are unit rows and gc is rewritten as NaN (the rows before are exact:
    ``finite.py``)."""
    tl.static_assert(BT == 64, "the block merge is written for 4 blocks of 16 rows")
    b_Tlo, b_X, b_Thi, o_end = _inverse_by_halves(k, beta, gc, bos, T_seq, i_c, i_h, i_hv, H, HV, K, BT, BK,
                                                  DOT_PREC, USE_DECAY, MERGE_PREC, INTERPRET)
    b_T = cat_rows(cat_cols(b_Tlo, tl.zeros([32, 32], dtype=tl.float32)), cat_cols(b_X, b_Thi))
    return b_T, i_c * BT + tl.arange(0, BT) >= o_end


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
    b_A, _ = kkt_inverse(k, beta, gc, bos, T_seq, i_c, i_h, i_hv, H, HV, K, BT, BK, DOT_PREC, USE_DECAY, MERGE_PREC,
                         INTERPRET)
    # the chunk's rows (rows past eos are not written), zeros above the diagonal included
    tl.store(a_inv_tile(A_inv, bos, i_c, i_hv, T_seq, HV, BT), b_A, boundary_check=(0, 1))


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
    NT = chunk_indices.shape[0] if cu_seqlens is not None else cdiv(T, chunk_size)
    kkt_solve_kernel[(NT, B * HV)](
        k, beta, gc, A_inv, cu_seqlens, chunk_indices, T, H=H, HV=HV, K=K, BT=chunk_size, BK=block_size(K, 64),
        DOT_PREC=dot_precision(k.dtype), USE_DECAY=gc is not None, IS_VARLEN=cu_seqlens is not None,
        MERGE_PREC=merge_precision(k.dtype, merge_prec), INTERPRET=triton_interpret(), **launch_options("kkt_solve"))
    return A_inv
