"""Chunk index tables for packed (varlen) sequences, and the prologue every per-chunk kernel starts with.

With ``cu_seqlens`` (B == 1) chunks never cross a sequence boundary: chunk c of sequence n covers tokens
``[bos + BT·c, min(bos + BT·(c+1), eos))``. The per-chunk kernels run one program per global chunk; two small
tables, built on the host from the offsets the op already holds, map a program to its chunk:

    chunk_indices [NT_total, 2] int32: (sequence id n, chunk id c within sequence n)
    chunk_offsets [N + 1]       int32: first global chunk of each sequence (chunk_offsets[N] = NT_total)

A 0-length sequence owns no chunk (its final state is its initial state).

And the copy between packed rows and a padded batch (the Hopper forward's varlen, ``hopper/varlen.py``):
:func:`pad_rows` puts sequence n's rows first in row n of an ``[N, Tp, ...]`` batch, zeros after, and
:func:`unpad_rows` takes them back; one launch each, straight from ``cu_seqlens`` (no index tensors).
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from .launch import launch

_TABLES: OrderedDict = OrderedDict()    # (offsets, chunk_size, device) -> tables; the newest last
_TABLES_MAX = 16                        # a training step's forward and backward share one entry


def chunk_tables(offsets: list[int], chunk_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Build ``(chunk_indices [NT_total, 2], chunk_offsets [N + 1])`` as int32 tensors on ``device``.

    ``offsets`` is the host list of the N + 1 values of ``cu_seqlens``. Both tables travel in one host-to-device
    copy, and the last few are cached by their offsets (the backward reuses the forward's; the kernels only read
    them), so a repeated batch layout costs a dict lookup. Callers must not write into the returned tensors.
    """
    key = (tuple(offsets), chunk_size, str(device))
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    flat, firsts = [], [0]
    for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        nt = -(-(eos - bos) // chunk_size)
        for c in range(nt):
            flat += (n, c)
        firsts.append(firsts[-1] + nt)
    both = torch.tensor(flat + firsts, dtype=torch.int32).to(device)
    tables = both[:len(flat)].view(-1, 2), both[len(flat):]
    _TABLES[key] = tables
    if len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return tables


def chunk_tables_ref(offsets: list[int], chunk_size: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Twin of :func:`chunk_tables` written the obvious way (host lists), for the tests."""
    indices = [(n, c) for n in range(len(offsets) - 1)
               for c in range(-(-(offsets[n + 1] - offsets[n]) // chunk_size))]
    firsts = [sum(-(-(offsets[m + 1] - offsets[m]) // chunk_size) for m in range(n)) for n in range(len(offsets))]
    return indices, firsts


@triton.jit
def chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, IS_VARLEN: tl.constexpr):
    """Map program (chunk i_t, batch i_b) to (sequence n, chunk c within it, bos, eos); bos/eos are int64 so
    ``bos * stride`` cannot overflow for packed batches of more than 2^31 elements."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        i_n = i_b
        i_c = i_t
        bos = i_b.to(tl.int64) * T
        eos = bos + T
    return i_n, i_c, bos, eos


@triton.jit(do_not_specialize=["Tp", "row_blocks"])
def pad_rows_kernel(packed, batch, cu_seqlens, Tp, row_blocks, ROW: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr, TO_BATCH: tl.constexpr):
    """One [BLOCK_R rows × BLOCK_C elements] tile between packed rows ``[total, ROW]`` and the batch ``[N·Tp, ROW]``:
    program (n · row_blocks + row block, column block). TO_BATCH: batch row n·Tp + r gets packed row bos_n + r for
    r < len_n, zeros for len_n ≤ r < Tp (every batch row written); else packed row bos_n + r gets batch row n·Tp + r
    for r < len_n. Row offsets in int64 (a batch of 2³¹ elements and more)."""
    i_nr, i_c = tl.program_id(0), tl.program_id(1)
    n = i_nr // row_blocks
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    r = (i_nr % row_blocks).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    in_row = (c < ROW)[None, :]
    valid = (r < eos - bos)[:, None] & in_row
    p_packed = packed + (bos + r)[:, None] * ROW + c[None, :]
    p_batch = batch + (n.to(tl.int64) * Tp + r)[:, None] * ROW + c[None, :]
    if TO_BATCH:
        tl.store(p_batch, tl.load(p_packed, mask=valid, other=0), mask=(r < Tp)[:, None] & in_row)
    else:
        tl.store(p_packed, tl.load(p_batch, mask=valid), mask=valid)


def _copy_rows(packed: torch.Tensor, batch: torch.Tensor, cu_seqlens: torch.Tensor, N: int, Tp: int,
               to_batch: bool) -> None:
    ROW = math.prod(batch.shape[2:])            # elements per row
    BLOCK_C = min(triton.next_power_of_2(ROW), 256)
    BLOCK_R = max(1, min(64, 4096 // BLOCK_C))
    row_blocks = triton.cdiv(Tp, BLOCK_R)
    launch(pad_rows_kernel, (N * row_blocks, triton.cdiv(ROW, BLOCK_C)), packed, batch, cu_seqlens, Tp, row_blocks,
           ROW=ROW, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, TO_BATCH=to_batch, num_warps=4)


def pad_rows(x: torch.Tensor, cu_seqlens: torch.Tensor, Tp: int) -> torch.Tensor:
    """Packed ``[1, total, ...]`` → ``[N, Tp, ...]``: sequence n's rows (``cu_seqlens`` ``[N + 1]``,
    each at most Tp long) first in row n, zeros after. One launch."""
    N = cu_seqlens.shape[0] - 1
    out = x.new_empty(N, Tp, *x.shape[2:])
    if out.numel():
        _copy_rows(x.contiguous(), out, cu_seqlens, N, Tp, True)
    return out


def unpad_rows(y: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The inverse of :func:`pad_rows` on the valid rows: ``[N, Tp, ...]`` → packed ``[1, total,
    ...]``. One launch."""
    N, Tp = y.shape[:2]
    out = y.new_empty(1, total, *y.shape[2:])
    if out.numel():
        _copy_rows(out, y.contiguous(), cu_seqlens, N, Tp, False)
    return out


def pad_rows_ref(x: torch.Tensor, offsets: list[int], Tp: int) -> torch.Tensor:
    """Twin of :func:`pad_rows` (host offsets), one sequence at a time."""
    out = x.new_zeros(len(offsets) - 1, Tp, *x.shape[2:])
    for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        out[n, :eos - bos] = x[0, bos:eos]
    return out


def unpad_rows_ref(y: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """Twin of :func:`unpad_rows` (host offsets)."""
    return torch.cat([y[n, :eos - bos] for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:]))])[None]
