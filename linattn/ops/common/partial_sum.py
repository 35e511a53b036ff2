"""The Hopper backward's reductions (``hopper/backward.py``) in one launch: the reverse walk's partials, one per V
slice (and, for dq and dk, per value head), added in a fixed order and stored once in the gradients' dtypes:

    dq[b, t, h, :] = Σ_s Σ_g dq_parts[s, b, t, h·G + g, :]      slices outer, the G value heads inner (dk the same)
    dg[b, t, j]    = Σ_s dg_parts[s, b, j, t], 0 where g[b, t, j] < MIN_LOG_DECAY (such gates do not move the
                     output: ``common/cumsum.py``);   dβ[b, t, j] = Σ_s dβ_parts[s, b, j, t]

The gates' partials come head-major (``[NV, B, HV, Lp]``, the walk's TMA layout) and leave token-major
(``[B, T, HV]``). Programs ``[0, P)`` add dq's rows, ``[P, 2P)`` dk's, the rest the gates' tiles: one launch where
the host chain ran seven or eight (two row sums; sums, compare, masked copy of dg; dβ's sum and cast), which is
what counts where the backward is host-bound (B = 1, T = 4096). Bytes at row 2 (B = 8, T = 4096, H = HV = 16,
K = 128, NV = 2): dq and dk read 1.07 GB of fp32 partials and write 268 MB; the gates move
8 MB. Deterministic (no atomics, the same order every run). Twin: :func:`partial_sums_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import MIN_LOG_DECAY, cdiv
from . import CHUNK
from .launch import launch

ROW_ELEMENTS = 4096     # dq, dk values summed per program (rows × K): 16 KB of fp32 per partial read
# dg, dβ values per program (HV × tokens): a larger tile and its on-chip transpose raise the kernel's registers for
# every program (172 per thread at 4096 against 48, sm_90), and the row sums' occupancy with them
GATE_ELEMENTS = 1024
SUM_DTYPES = (torch.float32, torch.float64)     # the partials summed in their dtype; float64: the CPU tests' exact sums


@triton.jit
def _sum_rows(parts, out, i_p, rows, slice_stride, NV: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
              BK: tl.constexpr, BR: tl.constexpr):
    """BR output rows (b, t, h flattened) × K: each the sum of its NV·G partial rows in their dtype, slices outer,
    heads inner; read NV·G·K partials, write K per row."""
    o_r = i_p * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (o_r < rows)[:, None] & (o_k < K)[None, :]
    acc = tl.zeros([BR, BK], dtype=parts.dtype.element_ty)     # fp32 (float64 for float64 partials)
    for s in tl.static_range(NV):
        for g in tl.static_range(G):
            # row (b·T + t)·HV + h·G + g of slice s: the flattened output row times G, plus g
            off = s * slice_stride + (o_r.to(tl.int64)[:, None] * G + g) * K + o_k[None, :]
            acc += tl.load(parts + off, mask=m, other=0.)
    tl.store(out + o_r.to(tl.int64)[:, None] * K + o_k[None, :], acc.to(out.dtype.element_ty), mask=m)


@triton.jit
def _sum_gates(dg_parts, dbeta_parts, g, dg, dbeta, i_p, T, Lp, tiles_per_sequence, slice_stride,
               NV: tl.constexpr, HV: tl.constexpr, BH: tl.constexpr, BTOK: tl.constexpr, FLOOR: tl.constexpr):
    """HV heads × BTOK tokens of one sequence: dg and dβ added over the slices as read (head-major: each head's
    tokens contiguous), transposed once on chip and written token-major (each token's heads contiguous), dg zeroed
    where the gate is below FLOOR."""
    i_b, i_t = i_p // tiles_per_sequence, i_p % tiles_per_sequence
    o_h = tl.arange(0, BH)
    o_t = i_t * BTOK + tl.arange(0, BTOK)
    m_in = (o_h < HV)[:, None] & (o_t < T)[None, :]
    p_in = (i_b * HV + o_h[:, None]).to(tl.int64) * Lp + o_t[None, :]
    b_dg = tl.zeros([BH, BTOK], dtype=dg_parts.dtype.element_ty)
    b_db = tl.zeros([BH, BTOK], dtype=dbeta_parts.dtype.element_ty)
    for s in tl.static_range(NV):
        b_dg += tl.load(dg_parts + s * slice_stride + p_in, mask=m_in, other=0.)
        b_db += tl.load(dbeta_parts + s * slice_stride + p_in, mask=m_in, other=0.)
    m_out = (o_t < T)[:, None] & (o_h < HV)[None, :]
    p_out = (i_b * T + o_t[:, None]).to(tl.int64) * HV + o_h[None, :]
    b_g = tl.load(g + p_out, mask=m_out, other=0.)
    b_dg = tl.where(b_g < FLOOR, 0., tl.trans(b_dg))     # NaN compares False: a NaN gate keeps its NaN gradient
    tl.store(dg + p_out, b_dg.to(dg.dtype.element_ty), mask=m_out)
    tl.store(dbeta + p_out, tl.trans(b_db).to(dbeta.dtype.element_ty), mask=m_out)


@triton.jit(do_not_specialize=["B", "T", "NT"])
def partial_sums_kernel(dq_parts, dk_parts, dg_parts, dbeta_parts, g, dq, dk, dg, dbeta, B, T, NT,
                        NV: tl.constexpr, G: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr,
                        BK: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, BTOK: tl.constexpr,
                        FLOOR: tl.constexpr):
    """One program: BR rows of dq, or of dk, or BTOK tokens of dg and dβ (module docstring). The sizes come as B, T
    and NT (Lp = NT·BT) and every stride is formed here from them and the constexprs, so that the compiler knows
    each slice's offset a multiple of K or BT (vector loads) while B, T, NT stay unspecialised (one compiled
    kernel per configuration: ``launch.py``)."""
    i_p = tl.program_id(0)
    rows = B * T * (HV // G)
    row_programs = tl.cdiv(rows, BR)
    row_slice_stride = rows.to(tl.int64) * G * K
    if i_p < row_programs:
        _sum_rows(dq_parts, dq, i_p, rows, row_slice_stride, NV, G, K, BK, BR)
    elif i_p < 2 * row_programs:
        _sum_rows(dk_parts, dk, i_p - row_programs, rows, row_slice_stride, NV, G, K, BK, BR)
    else:
        Lp = NT * BT
        _sum_gates(dg_parts, dbeta_parts, g, dg, dbeta, i_p - 2 * row_programs, T, Lp, tl.cdiv(T, BTOK),
                   B.to(tl.int64) * HV * Lp, NV, HV, BH, BTOK, FLOOR)


def _check(dq_parts, dk_parts, dg_parts, dbeta_parts, g, H: int) -> None:
    if dq_parts.dim() != 5 or dk_parts.shape != dq_parts.shape or dk_parts.dtype != dq_parts.dtype:
        raise ValueError(f"dq and dk partials must be [NV, B, T, HV, K] of one shape and dtype, got "
                         f"{tuple(dq_parts.shape)} {dq_parts.dtype}, {tuple(dk_parts.shape)} {dk_parts.dtype}")
    NV, B, T, HV, K = dq_parts.shape
    if dq_parts.dtype not in SUM_DTYPES or HV % H:
        raise ValueError(f"dq, dk partials must be one of {SUM_DTYPES} with HV = {HV} a multiple of H = {H}, "
                         f"got {dq_parts.dtype}")
    if (dg_parts.dim() != 4 or dg_parts.shape[:3] != (NV, B, HV) or dg_parts.shape[3] < T
            or dg_parts.shape[3] % CHUNK or dbeta_parts.shape != dg_parts.shape):
        raise ValueError(f"dg and dbeta partials must be [NV, B, HV, Lp] = [{NV}, {B}, {HV}, Lp], Lp ≥ T = {T} in "
                         f"whole chunks of {CHUNK}, got {tuple(dg_parts.shape)}, {tuple(dbeta_parts.shape)}")
    if dg_parts.dtype not in SUM_DTYPES or dbeta_parts.dtype != dg_parts.dtype:
        raise ValueError(f"dg and dbeta partials must be one of {SUM_DTYPES}, got {dg_parts.dtype}, "
                         f"{dbeta_parts.dtype}")
    if g.shape != (B, T, HV):
        raise ValueError(f"g must be [B, T, HV] = {(B, T, HV)}, got {tuple(g.shape)}")


def partial_sums(dq_parts: torch.Tensor, dk_parts: torch.Tensor, dg_parts: torch.Tensor, dbeta_parts: torch.Tensor,
                 g: torch.Tensor, H: int, qk_dtype: torch.dtype, beta_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The walk's partials added in one launch (module docstring; :func:`partial_sums_ref`'s order).

    Args:
        dq_parts, dk_parts: ``[NV, B, T, HV, K]`` fp32 (or float64: summed in it).
        dg_parts, dbeta_parts: ``[NV, B, HV, Lp]`` head-major, Lp ≥ T in whole chunks of 64, fp32 (or float64).
        g: ``[B, T, HV]`` the log decays (dg is zero where they are below ``MIN_LOG_DECAY``).
        H: the qk heads (HV a multiple of H). qk_dtype, beta_dtype: dq, dk's and dβ's dtypes.
    Returns:
        dq, dk ``[B, T, H, K]`` in ``qk_dtype``; dg ``[B, T, HV]`` in g's dtype; dβ ``[B, T, HV]`` in ``beta_dtype``.
    """
    _check(dq_parts, dk_parts, dg_parts, dbeta_parts, g, H)
    NV, B, T, HV, K = dq_parts.shape
    Lp = dg_parts.shape[3]
    dq_parts, dk_parts, dg_parts, dbeta_parts, g = (x.contiguous() for x in (dq_parts, dk_parts, dg_parts,
                                                                            dbeta_parts, g))
    dq, dk = (torch.empty(B, T, H, K, dtype=qk_dtype, device=g.device) for _ in range(2))
    dg = torch.empty(B, T, HV, dtype=g.dtype, device=g.device)
    dbeta = torch.empty(B, T, HV, dtype=beta_dtype, device=g.device)
    BK, BH = triton.next_power_of_2(K), triton.next_power_of_2(HV)
    BR, BTOK = max(1, ROW_ELEMENTS // BK), max(1, GATE_ELEMENTS // BH)
    grid = (2 * cdiv(B * T * H, BR) + B * cdiv(T, BTOK),)
    launch(partial_sums_kernel, grid, dq_parts, dk_parts, dg_parts, dbeta_parts, g, dq, dk, dg, dbeta, B, T, Lp // CHUNK,
           NV=NV, G=HV // H, K=K, HV=HV, BT=CHUNK, BK=BK, BR=BR, BH=BH, BTOK=BTOK, FLOOR=MIN_LOG_DECAY)
    return dq, dk, dg, dbeta


def partial_sums_ref(dq_parts: torch.Tensor, dk_parts: torch.Tensor, dg_parts: torch.Tensor,
                     dbeta_parts: torch.Tensor, g: torch.Tensor, H: int, qk_dtype: torch.dtype,
                     beta_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """:func:`partial_sums` in PyTorch: the same additions in the same order and in the partials' dtype, the same
    mask and casts."""
    _check(dq_parts, dk_parts, dg_parts, dbeta_parts, g, H)
    NV, B, T, HV, K = dq_parts.shape

    def rows(parts: torch.Tensor) -> torch.Tensor:
        grouped = parts.view(NV, B, T, H, HV // H, K)
        total = torch.zeros(B, T, H, K, dtype=parts.dtype, device=parts.device)
        for s in range(NV):
            for j in range(HV // H):
                total = total + grouped[s, :, :, :, j]
        return total.to(qk_dtype)

    def gates(parts: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(parts[0])
        for s in range(NV):
            total = total + parts[s]
        return total[..., :T].transpose(1, 2)

    dg = gates(dg_parts).masked_fill(g < MIN_LOG_DECAY, 0)
    return rows(dq_parts), rows(dk_parts), dg.to(g.dtype), gates(dbeta_parts).to(beta_dtype)
