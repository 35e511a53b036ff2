"""Helpers for packed (varlen) batches: ``B == 1`` and ``cu_seqlens = [0, l_0, l_0 + l_1, ..., T]``.

Nothing here reads the offsets to the host while torch.compile traces: a host read (``.tolist()``, ``.item()``)
would break the graph. The values are checked where they are needed on the host anyway: by the ops, inside their
custom ops, on every call (compiled or not).
"""
from __future__ import annotations

import torch


def check_layer_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> int:
    """Check the packed offsets a layer receives; return N, the number of sequences.

    Type, shape and B are checked always; the values (start at 0, never decrease, end at T) in eager mode only,
    which reads them (a device sync). Under torch.compile the op called later checks them at run time."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor of N + 1 >= 2 offsets, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"cu_seqlens (packed sequences) needs batch size 1, got B={B}")
    if not torch.compiler.is_compiling():
        offs = cu_seqlens.tolist()
        if offs[0] != 0 or offs[-1] != T or any(b < a for a, b in zip(offs[:-1], offs[1:])):
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T={T}, got {offs}")
    return cu_seqlens.shape[0] - 1


def seq_index_and_position(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the T packed tokens: the index of its sequence and its position inside it (both int64 [T])."""
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(T, device=cu.device)
    seq = torch.searchsorted(cu[1:], t, right=True)
    return seq, t - cu[seq]
