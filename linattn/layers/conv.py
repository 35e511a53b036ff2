"""ShortConvolution: a causal depthwise 1-D convolution (width W, usually 4) with an optional SiLU.

Gated DeltaNet runs it over the concatenated q, k, v channels before the recurrence (one depthwise conv over the
concatenation is exactly three separate ones). Its decode state is the last ``W − 1`` inputs of each sequence,
``[N, D, W − 1]`` (oldest first), so a prefill followed by token-by-token steps reproduces the full convolution.

Three paths, one result:
* no state, no packing: ``F.conv1d`` with left padding (the training path);
* a state and no packing: the state is prepended to the input and the convolution runs unpadded (decode steps);
* packed sequences (``cu_seqlens``): each output gathers its W inputs explicitly, taking positions before a
  sequence's start from that sequence's state (zeros without one), so nothing leaks across sequence boundaries.

Context parallelism (``cp``, a :class:`~linattn.parallel.ShardPlan`): the W − 1 inputs before the shard come from
the ranks that hold them (:func:`~linattn.parallel.with_halo`, whose backward returns their gradients) and serve as
the state of the sequence that runs into the shard, so the split convolution equals the unsplit one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .varlen import check_layer_cu_seqlens, seq_index_and_position

if TYPE_CHECKING:
    from ..parallel import ShardPlan


class ShortConvolution(nn.Module):
    """Causal depthwise convolution over ``[B, T, D]`` inputs.

    Args:
        hidden_size (int): number of channels D.
        kernel_size (int): width W (≥ 1).
        bias (bool): learn a per-channel bias.
        activation (str or None): ``"silu"`` or None.
    """

    def __init__(self, hidden_size: int, kernel_size: int = 4, bias: bool = False, activation: Optional[str] = "silu"):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        if activation not in (None, "silu"):
            raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
        self.hidden_size, self.kernel_size, self.activation = hidden_size, kernel_size, activation
        # the same [D, 1, W] layout as nn.Conv1d(groups=D), so checkpoints of Conv1d-based layers load as they are
        self.weight = nn.Parameter(torch.empty(hidden_size, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, x: torch.Tensor, state: Optional[torch.Tensor] = None, output_state: bool = False,
                cu_seqlens: Optional[torch.Tensor] = None, cp: Optional[ShardPlan] = None,
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Args:
            x: ``[B, T, D]``.
            state: ``[N, D, W − 1]``, the previous W − 1 inputs of each sequence (N = B, or the number of packed
                sequences), or None for zeros.
            output_state: also return the new state ``[N, D, W − 1]``.
            cu_seqlens: ``[N + 1]`` offsets of packed sequences (B == 1).
            cp: this rank's shard of a sequence split across ranks (x holds its tokens; the plan holds the
                global ``cu_seqlens``); no state, output_state or cu_seqlens with it.
        Returns:
            ``(y, new_state)``: y ``[B, T, D]`` in x's dtype; new_state or None.
        """
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"ShortConvolution({self.hidden_size}) needs x of shape [B, T, {self.hidden_size}], "
                             f"got {tuple(x.shape)}")
        if cp is not None:
            if state is not None or output_state or cu_seqlens is not None:
                raise ValueError("ShortConvolution: with cp (context parallelism) pass no state, output_state or "
                                 "cu_seqlens (the plan holds the global cu_seqlens)")
            return self._context_parallel(x, cp), None
        B, T, D = x.shape
        W = self.kernel_size
        N = B if cu_seqlens is None else check_layer_cu_seqlens(cu_seqlens, B, T)
        if state is not None and tuple(state.shape) != (N, D, W - 1):
            raise ValueError(f"conv state must be [N, D, W - 1] = {(N, D, W - 1)}, got {tuple(state.shape)}")
        w = self.weight.to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        if cu_seqlens is None:
            xt = x.transpose(1, 2)                                        # [B, D, T]
            if state is None:
                xp = F.pad(xt, (W - 1, 0))
            else:
                xp = torch.cat([state.to(x.dtype), xt], dim=-1)
            y = F.conv1d(xp, w, b, groups=D).transpose(1, 2)
            new_state = xp[..., xp.shape[-1] - (W - 1):] if output_state else None
        else:
            y, new_state = self._packed(x[0], state, cu_seqlens, w, b, output_state)
            y = y[None]
        if self.activation == "silu":
            y = F.silu(y)
        if new_state is not None:
            new_state = new_state.contiguous()
        return y, new_state

    def _context_parallel(self, x: torch.Tensor, cp: ShardPlan) -> torch.Tensor:
        from ..parallel import with_halo  # lazy: linattn.parallel imports torch.distributed
        W = self.kernel_size
        ext = with_halo(x, cp, W - 1)
        L = ext.shape[1] - x.shape[1]
        x = ext[:, L:]
        if x.shape[1] == 0:
            return x
        # the halo (up to W − 1 inputs of the sequence running into the shard) is that sequence's state
        halo_state = F.pad(ext[:, :L].transpose(1, 2), (W - 1 - L, 0))                   # [B, D, W − 1]
        if not cp.packed:
            return self(x, state=halo_state)[0]
        state = halo_state.new_zeros(len(cp.segments), x.shape[2], W - 1)
        if cp.continues():
            state = torch.cat([halo_state, state[1:]])
        return self(x, state=state, cu_seqlens=cp.local_cu_seqlens(x.device))[0]

    def _packed(self, x, state, cu_seqlens, w, b, output_state):
        # x [T, D]. Window element j of token t is input position p − (W − 1 − j) of its sequence, p its position.
        T, D = x.shape
        W = self.kernel_size
        seq, pos = seq_index_and_position(cu_seqlens, T)
        rel = pos[:, None] - (W - 1) + torch.arange(W, device=x.device)          # [T, W]
        inside = rel >= 0
        win = x[(torch.arange(T, device=x.device)[:, None] - (W - 1 - torch.arange(W, device=x.device))).clamp(min=0)]
        # torch.where, not a multiply by the mask: a masked slot may hold another sequence's inf
        if state is not None and W > 1:
            # positions before the start: rel in [−(W − 1), −1] reads state column (W − 1) + rel
            from_state = state.to(x.dtype)[seq[:, None], :, (rel + W - 1).clamp(0, W - 2)]         # [T, W, D]
            win = torch.where(inside[..., None], win, from_state)
        else:
            win = torch.where(inside[..., None], win, torch.zeros((), dtype=x.dtype, device=x.device))
        y = torch.einsum("twd,dw->td", win, w[:, 0])
        if b is not None:
            y = y + b
        new_state = None
        if output_state and W > 1:
            # the last W − 1 inputs of each sequence: positions len − (W − 1) .. len − 1, from the state if < 0
            cu = cu_seqlens.to(torch.int64)
            lens = cu[1:] - cu[:-1]
            rel_end = lens[:, None] - (W - 1) + torch.arange(W - 1, device=x.device)            # [N, W − 1]
            idx = (cu[:-1, None] + rel_end).clamp(0, max(T - 1, 0))
            new_state = x[idx].transpose(1, 2)                                                  # [N, D, W − 1]
            if state is not None:
                old = state.to(x.dtype).gather(2, (rel_end + W - 1).clamp(0, W - 2)[:, None, :].expand(-1, D, -1))
            else:
                old = torch.zeros((), dtype=x.dtype, device=x.device)
            new_state = torch.where((rel_end >= 0)[:, None, :], new_state, old)
        elif output_state:
            new_state = x.new_zeros(len(cu_seqlens) - 1, D, 0)
        return y, new_state

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, kernel_size={self.kernel_size}, activation={self.activation}"
