"""The Hopper backward's reductions (``hopper/backward.py``) in one launch: what the reverse walk leaves per V slice
(dg, dβ) and per value head (dq, dk: the walk adds its slices itself), added in a fixed order and stored once in the
gradients' dtypes:

    dq[b, t, h, :] = Σ_g dq_heads[b, t, h·G + g, :]      the G value heads of a qk head in head order, from head 0
                                                          (dk the same; G = 1: the walk's own dq, dk, no launch part)
    dg[b, t, j]    = Σ_s dg_parts[s, b, j, t], 0 where g[b, t, j] < MIN_LOG_DECAY (such gates do not move the
                     output: ``common/cumsum.py``);   dβ[b, t, j] = Σ_s dβ_parts[s, b, j, t]

The gates' partials come head-major (``[NV, B, HV, Lp]``, the walk's TMA layout) and leave token-major
(``[B, T, HV]``). Programs ``[0, P)`` add dq's rows, ``[P, 2P)`` dk's (none where G = 1), the rest the gates'
tiles: one launch where the host chain ran seven or eight (two row sums; sums, compare, masked copy of dg; dβ's sum
and cast), which is what counts where the backward is host-bound (B = 1, T = 4096). Bytes at row 5 (B = 4,
T = 8192, H = 16, HV = 32, K = 128): dq and dk read 0.8 GB per value head (dq bf16, dk fp32: the walk's
``chunk_bwd.qk_heads_dtypes``), summed in fp32, and write 268 MB; at row 2 (G = 1) the gates alone, 8 MB.
Deterministic (no atomics, the same order every run). Twin: :func:`partial_sums_ref`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from ..utils import MIN_LOG_DECAY, cdiv, output_tensor
from . import CHUNK
from .launch import BoundLaunch, launch

ROW_ELEMENTS = 4096     # dq, dk values summed per program (rows × K): 16 KB of fp32 per partial read
# dg, dβ values per program (HV × tokens): a larger tile and its on-chip transpose raise the kernel's registers for
# every program (172 per thread at 4096 against 48, sm_90), and the row sums' occupancy with them
GATE_ELEMENTS = 1024
SUM_DTYPES = (torch.float32, torch.float64)     # the partials summed in their dtype; float64: the CPU tests' exact sums
HEAD_DTYPES = (torch.bfloat16, *SUM_DTYPES)     # dq, dk per value head: bf16 summed in fp32


@triton.jit
def _sum_rows(heads, out, i_p, rows, G: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """BR output rows (b, t, h flattened) × K: each the sum of its G value heads' rows in fp32 (float64 for float64
    heads), in head order from head 0; read G·K values, write K per row."""
    ACC: tl.constexpr = tl.float64 if heads.dtype.element_ty == tl.float64 else tl.float32
    o_r = i_p * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (o_r < rows)[:, None] & (o_k < K)[None, :]
    # row (b·T + t)·HV + h·G + g: the flattened output row times G, plus g
    first = o_r.to(tl.int64)[:, None] * G * K + o_k[None, :]
    acc = tl.load(heads + first, mask=m, other=0.).to(ACC)
    for g in tl.static_range(1, G):
        acc += tl.load(heads + first + g * K, mask=m, other=0.).to(ACC)
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
def partial_sums_kernel(dq_heads, dk_heads, dg_parts, dbeta_parts, g, dq, dk, dg, dbeta, B, T, NT,
                        NV: tl.constexpr, G: tl.constexpr, K: tl.constexpr, HV: tl.constexpr, BT: tl.constexpr,
                        BK: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, BTOK: tl.constexpr,
                        FLOOR: tl.constexpr):
    """One program: BR rows of dq, or of dk (G > 1), or BTOK tokens of dg and dβ (module docstring). The sizes come
    as B, T and NT (Lp = NT·BT) and every stride is formed here from them and the constexprs, so that the compiler
    knows each slice's offset a multiple of BT (vector loads) while B, T, NT stay unspecialised (one compiled kernel
    per configuration: ``launch.py``)."""
    i_p = tl.program_id(0)
    Lp = NT * BT
    gate_programs_from = 0      # the first program of dg and dβ: after dq's and dk's rows where G > 1
    if G > 1:
        rows = B * T * (HV // G)
        row_programs = tl.cdiv(rows, BR)
        gate_programs_from = 2 * row_programs
        if i_p < row_programs:
            _sum_rows(dq_heads, dq, i_p, rows, G, K, BK, BR)
        elif i_p < gate_programs_from:
            _sum_rows(dk_heads, dk, i_p - row_programs, rows, G, K, BK, BR)
    if i_p >= gate_programs_from:
        _sum_gates(dg_parts, dbeta_parts, g, dg, dbeta, i_p - gate_programs_from, T, Lp, tl.cdiv(T, BTOK),
                   B.to(tl.int64) * HV * Lp, NV, HV, BH, BTOK, FLOOR)


def _check(dq_heads, dk_heads, dg_parts, dbeta_parts, g, H: int) -> None:
    if dq_heads.dim() != 4 or dk_heads.shape != dq_heads.shape:
        raise ValueError(f"dq and dk must be [B, T, HV, K] of one shape, got {tuple(dq_heads.shape)}, "
                         f"{tuple(dk_heads.shape)}")
    B, T, HV, K = dq_heads.shape
    if HV % H or (HV != H and not {dq_heads.dtype, dk_heads.dtype} <= set(HEAD_DTYPES)):
        raise ValueError(f"dq, dk per value head must be of {HEAD_DTYPES} with HV = {HV} a multiple of H = {H}, "
                         f"got {dq_heads.dtype}, {dk_heads.dtype}")
    if dg_parts.dim() != 4 or dg_parts.shape[1:3] != (B, HV) or dg_parts.shape[3] < T \
            or dg_parts.shape[3] % CHUNK or dbeta_parts.shape != dg_parts.shape:
        raise ValueError(f"dg and dbeta partials must be [NV, B, HV, Lp] = [NV, {B}, {HV}, Lp], Lp ≥ T = {T} in "
                         f"whole chunks of {CHUNK}, got {tuple(dg_parts.shape)}, {tuple(dbeta_parts.shape)}")
    if dg_parts.dtype not in SUM_DTYPES or dbeta_parts.dtype != dg_parts.dtype:
        raise ValueError(f"dg and dbeta partials must be one of {SUM_DTYPES}, got {dg_parts.dtype}, "
                         f"{dbeta_parts.dtype}")
    if g.shape != (B, T, HV):
        raise ValueError(f"g must be [B, T, HV] = {(B, T, HV)}, got {tuple(g.shape)}")


def partial_sums(dq_heads: torch.Tensor, dk_heads: torch.Tensor, dg_parts: torch.Tensor, dbeta_parts: torch.Tensor,
                 g: torch.Tensor, H: int, qk_dtype: torch.dtype, beta_dtype: torch.dtype,
                 out: Optional[tuple] = None) -> tuple[torch.Tensor, ...]:
    """The walk's per-head dq, dk and per-slice dg, dβ added in one launch (module docstring; :func:`partial_sums_ref`'s
    order).

    Args:
        dq_heads, dk_heads: ``[B, T, HV, K]``, per value head where HV > H: bf16 or fp32 (summed in fp32), or
            float64 (summed in it); where HV = H the gradients themselves (returned in ``qk_dtype``, cast only if they
            are not in it).
        dg_parts, dbeta_parts: ``[NV, B, HV, Lp]`` head-major, Lp ≥ T in whole chunks of 64, fp32 (or float64).
        g: ``[B, T, HV]`` the log decays (dg is zero where they are below ``MIN_LOG_DECAY``).
        H: the qk heads (HV a multiple of H). qk_dtype, beta_dtype: dq, dk's and dβ's dtypes.
        out: (dq, dk, dg, dβ) contiguous tensors of the returned shapes and dtypes to write (where HV = H, dq and dk
            copied into unless they are dq_heads and dk_heads themselves), or None: new ones.
    Returns:
        dq, dk ``[B, T, H, K]`` in ``qk_dtype``; dg ``[B, T, HV]`` in g's dtype; dβ ``[B, T, HV]`` in ``beta_dtype``.
    """
    _check(dq_heads, dk_heads, dg_parts, dbeta_parts, g, H)
    B, T, HV, K = dq_heads.shape
    NV, Lp = dg_parts.shape[0], dg_parts.shape[3]
    dq_heads, dk_heads, dg_parts, dbeta_parts, g = (x.contiguous() for x in (dq_heads, dk_heads, dg_parts,
                                                                            dbeta_parts, g))
    G = HV // H
    if out is not None and len(out) != 4:
        raise ValueError(f"out must be (dq, dk, dg, dbeta), got {len(out)} tensors")
    given = dict(zip(("dq", "dk", "dg", "dbeta"), out or (None,) * 4))
    if G == 1 and out is None:      # the walk's dq, dk are the gradients: no launch part, no copy in their dtype
        dq, dk = dq_heads.to(qk_dtype), dk_heads.to(qk_dtype)
    else:
        dq, dk = (output_tensor(given[n], n, (B, T, H, K), qk_dtype, g.device) for n in ("dq", "dk"))
        for heads, grad in ((dq_heads, dq), (dk_heads, dk)) if G == 1 else ():
            if grad.data_ptr() != heads.data_ptr():
                grad.copy_(heads)
    dg = output_tensor(given["dg"], "dg", (B, T, HV), g.dtype, g.device)
    dbeta = output_tensor(given["dbeta"], "dbeta", (B, T, HV), beta_dtype, g.device)
    grid, constexprs = _sums_launch(B, T, H, HV, K, NV)
    launch(partial_sums_kernel, grid, dq_heads, dk_heads, dg_parts, dbeta_parts, g, dq, dk, dg, dbeta, B, T,
           Lp // CHUNK, **constexprs)
    return dq, dk, dg, dbeta


def _sums_launch(B: int, T: int, H: int, HV: int, K: int, NV: int) -> tuple[tuple, dict]:
    """partial_sums_kernel's grid and constexprs for B rows of T tokens, H qk heads, HV value heads of K, NV
    slices."""
    G = HV // H
    BK, BH = triton.next_power_of_2(K), triton.next_power_of_2(HV)
    BR, BTOK = max(1, ROW_ELEMENTS // BK), max(1, GATE_ELEMENTS // BH)
    grid = ((2 * cdiv(B * T * H, BR) if G > 1 else 0) + B * cdiv(T, BTOK),)
    return grid, dict(NV=NV, G=G, K=K, HV=HV, BT=CHUNK, BK=BK, BR=BR, BH=BH, BTOK=BTOK, FLOOR=MIN_LOG_DECAY)


def partial_sums_launcher(B: int, T: int, H: int, HV: int, K: int, NV: int, Lp: int) -> Callable:
    """:func:`partial_sums` for a prepared call (``hopper/backward_prepared.py``): its launch configuration once;
    then ``sums(dq_heads, dk_heads, dg_parts, dbeta_parts, g, dq, dk, dg, dbeta)`` on contiguous tensors of those
    sizes (the partials ``[NV, B, HV, Lp]``), the outputs the caller's (where HV = H, dq and dk the walk's own),
    through ``common.launch.BoundLaunch`` (the same kernel and arguments, none of the per-call checks)."""
    grid, constexprs = _sums_launch(B, T, H, HV, K, NV)
    run = BoundLaunch(partial_sums_kernel, grid, **constexprs)
    return lambda *tensors: run(*tensors, B, T, Lp // CHUNK)


def partial_sums_ref(dq_heads: torch.Tensor, dk_heads: torch.Tensor, dg_parts: torch.Tensor,
                     dbeta_parts: torch.Tensor, g: torch.Tensor, H: int, qk_dtype: torch.dtype,
                     beta_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """:func:`partial_sums` in PyTorch: the same additions in the same order and in the inputs' dtype, the same
    mask and casts."""
    _check(dq_heads, dk_heads, dg_parts, dbeta_parts, g, H)
    NV, B, HV, _ = dg_parts.shape
    T, K = dq_heads.shape[1], dq_heads.shape[3]

    def rows(heads: torch.Tensor) -> torch.Tensor:
        grouped = heads.view(B, T, H, HV // H, K).to(torch.float64 if heads.dtype == torch.float64 else torch.float32)
        total = grouped[:, :, :, 0]
        for j in range(1, HV // H):
            total = total + grouped[:, :, :, j]
        return total.to(qk_dtype)

    def gates(parts: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(parts[0])
        for s in range(NV):
            total = total + parts[s]
        return total[..., :T].transpose(1, 2)

    dg = gates(dg_parts).masked_fill(g < MIN_LOG_DECAY, 0)
    return rows(dq_heads), rows(dk_heads), dg.to(g.dtype), gates(dbeta_parts).to(beta_dtype)
