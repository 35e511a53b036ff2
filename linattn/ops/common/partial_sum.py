"""The Hopper backward's last reduction (``hopper/backward.py``): the reverse walk's fp32 partials of dq or dk, one
per V slice and value head, added over the slices and over the G value heads of each qk head, in that fixed order,
and stored once in the output dtype:

    out[b, t, h, :] = Σ_s Σ_g parts[s, b, t, h·G + g, :]          read NV·G·K fp32, write K per row

One pass instead of torch's sum (fp32 written) and cast (read back): at row 2 (B=8, T=4096, H=16, K=128, NV=2)
1.07 GB read and 134 MB written instead of ≈ 1.74 GB moved. Deterministic (no atomics; the same order every run).
Twin: :func:`partial_sum_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import cdiv

ROW_ELEMENTS = 4096     # values summed per program (rows × K): 16 KB of fp32 per partial read, a few per SM


@triton.jit
def partial_sum_kernel(parts, out, rows, slice_stride, NV: tl.constexpr, G: tl.constexpr, K: tl.constexpr,
                       BK: tl.constexpr, BR: tl.constexpr):
    """BR output rows (b, t, h flattened) × K: each the sum of its NV·G partial rows, slices outer, heads inner."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m = (o_r < rows)[:, None] & (o_k < K)[None, :]
    acc = tl.zeros([BR, BK], dtype=parts.dtype.element_ty)         # fp32 (float64 for float64 partials)
    for s in tl.static_range(NV):
        for g in tl.static_range(G):
            # row (b·T + t)·HV + h·G + g of slice s: the flattened output row times G, plus g
            off = s * slice_stride + (o_r.to(tl.int64)[:, None] * G + g) * K + o_k[None, :]
            acc += tl.load(parts + off, mask=m, other=0.)
    tl.store(out + o_r.to(tl.int64)[:, None] * K + o_k[None, :], acc.to(out.dtype.element_ty), mask=m)


def partial_sum(parts: torch.Tensor, H: int, dtype: torch.dtype) -> torch.Tensor:
    """``parts [NV, B, T, HV, K]`` fp32 (or float64: summed in it) → ``[B, T, H, K]`` in ``dtype``: the slices
    added, then the HV / H value heads of each qk head (:func:`partial_sum_ref`'s order)."""
    NV, B, T, HV, K = parts.shape
    if parts.dtype not in (torch.float32, torch.float64) or HV % H:
        raise ValueError(f"parts must be fp32 [NV, B, T, HV, K] with HV a multiple of H = {H}, got {parts.dtype} "
                         f"{tuple(parts.shape)}")
    parts = parts.contiguous()
    out = torch.empty(B, T, H, K, dtype=dtype, device=parts.device)
    BK = triton.next_power_of_2(K)
    BR = max(1, ROW_ELEMENTS // BK)
    rows = B * T * H
    partial_sum_kernel[(cdiv(rows, BR),)](parts, out, rows, parts[0].numel(), NV, HV // H, K, BK, BR)
    return out


def partial_sum_ref(parts: torch.Tensor, H: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`partial_sum` in PyTorch, the same order of additions, in the partials' dtype."""
    NV, B, T, HV, K = parts.shape
    grouped = parts.view(NV, B, T, H, HV // H, K)
    total = None
    for s in range(NV):
        for g in range(HV // H):
            total = grouped[s, :, :, :, g] if total is None else total + grouped[s, :, :, :, g]
    return total.to(dtype)
