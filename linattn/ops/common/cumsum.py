"""Stage 1: gc = cumulative sum of the log decay g inside each chunk (fp32).

Twin: ``torch_chunk.chunk_local_cumsum_ref``. Layout ``[B, T, HV]`` in and out (token-major, like the API).
Per chunk the kernel reads BT gates and writes BT fp32 sums: pure bandwidth, negligible next to the other stages.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..utils import cdiv
from . import CHUNK, MIN_LOG_DECAY
from .varlen import chunk_bounds


@triton.jit(do_not_specialize=["T"])
def chunk_local_cumsum_kernel(g, gc, cu_seqlens, chunk_indices, T, HV: tl.constexpr, BT: tl.constexpr,
                              IS_VARLEN: tl.constexpr):
    # grid (NT, B·HV): one program per (chunk, value head)
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    _, i_c, bos, eos = chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, IS_VARLEN)

    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < eos - bos
    o_g = (bos + o_t) * HV + i_hv
    # read BT gates (any float dtype), floor them at MIN_LOG_DECAY (a select: NaN stays NaN), sum in fp32, write BT
    # fp32 values; the tail of the last chunk is masked
    b_g = tl.load(g + o_g, mask=m_t, other=0).to(tl.float32)
    b_g = tl.where(b_g < MIN_LOG_DECAY, MIN_LOG_DECAY, b_g)
    tl.store(gc + o_g, tl.cumsum(b_g, axis=0), mask=m_t)


def chunk_local_cumsum(g: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                       chunk_indices: Optional[torch.Tensor] = None, chunk_size: int = CHUNK) -> torch.Tensor:
    """Chunk-local cumulative sum of ``g [B, T, HV]``, each gate floored at ``utils.MIN_LOG_DECAY``; returns fp32
    ``[B, T, HV]``.

    With ``cu_seqlens`` (B == 1), ``chunk_indices`` from :func:`varlen.chunk_tables` says which chunk each program
    handles, so chunks restart at every sequence boundary.
    """
    B, T, HV = g.shape
    gc = torch.empty(B, T, HV, dtype=torch.float32, device=g.device)
    NT = chunk_indices.shape[0] if cu_seqlens is not None else cdiv(T, chunk_size)
    chunk_local_cumsum_kernel[(NT, B * HV)](g, gc, cu_seqlens, chunk_indices, T, HV=HV, BT=chunk_size,
                                            IS_VARLEN=cu_seqlens is not None)
    return gc
