"""Chunk index tables for packed (varlen) sequences, and the prologue every per-chunk kernel starts with.

With ``cu_seqlens`` (B == 1) chunks never cross a sequence boundary: chunk c of sequence n covers tokens
``[bos + BT·c, min(bos + BT·(c+1), eos))``. The per-chunk kernels run one program per global chunk; two small
tables, built on the host from the offsets the op already holds, map a program to its chunk:

    chunk_indices [NT_total, 2] int32: (sequence id n, chunk id c within sequence n)
    chunk_offsets [N + 1]       int32: first global chunk of each sequence (chunk_offsets[N] = NT_total)

A 0-length sequence owns no chunk (its final state is its initial state).
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

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
