"""Softmax attention with an optional sliding window, for hybrid models: PyTorch SDPA (or flex_attention) with a
mask, never a hand-written softmax kernel.

Token t (position p_t) sees token s of the same sequence iff ``p_t − window < p_s ≤ p_t`` (``window=None``: full
causal attention). Grouped-query heads, RoPE, and Qwen3's per-head RMSNorm on q and k. The decode state keeps the
last ``window − 1`` keys/values (all of them without a window), so a sliding-window layer decodes in constant memory.

Context parallelism (``cp``, a :class:`~linattn.parallel.ShardPlan`): a rank's queries also see the ``window − 1``
keys/values before its shard (after RoPE and the k norm), fetched from the ranks that hold them
(:func:`~linattn.parallel.with_halo`, whose backward returns their gradients); positions are global within each
sequence. Full attention (no window) fetches every earlier key of the sequence: exact, but its traffic grows with T
(ring attention would bound it; it is not implemented).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cache import AttentionState
from .norm import RMSNorm
from .varlen import check_layer_cu_seqlens, seq_index_and_position

if TYPE_CHECKING:
    from ..parallel import ShardPlan

ATTN_BACKENDS = ("sdpa", "flex")


def rotary(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x [B, T, H, D]`` by positions ``pos [B or 1, T]`` (RoPE, rotate-half convention, fp32 angles)."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    ang = pos.to(torch.float32)[..., None] * inv                                 # [B, T, D/2]
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    xf = x.float()
    x1, x2 = xf[..., : D // 2], xf[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def window_mask(pos_q: torch.Tensor, pos_k: torch.Tensor, window: Optional[int],
                seq_q: Optional[torch.Tensor] = None, seq_k: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Boolean ``[Tq, Tk]`` mask, True where query i may attend to key j (causal, windowed, same sequence)."""
    d = pos_q[:, None] - pos_k[None, :]
    m = d >= 0
    if window is not None:
        m = m & (d < window)
    if seq_q is not None:
        m = m & (seq_q[:, None] == seq_k[None, :])
    return m


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


class SlidingWindowAttention(nn.Module):
    """Causal softmax attention with an optional sliding window.

    Args:
        hidden_size (int): model width D.
        num_heads (int): query heads.
        num_kv_heads (int): key/value heads (divides num_heads); default num_heads.
        head_dim (int): head dim; default hidden_size // num_heads.
        window_size (int or None): tokens each query sees, itself included; None for full causal attention.
        rope_theta (float): RoPE base.
        qk_norm (bool): per-head RMSNorm on q and k (Qwen3).
        norm_eps (float): epsilon of the q/k norms.
        attn_backend (str): ``"sdpa"`` (scaled_dot_product_attention with a boolean mask) or ``"flex"``
            (flex_attention with the same rule as a mask_mod; compile the model for speed).
        layer_idx (int): the layer's index in a model (informational).
    """

    def __init__(self, hidden_size: int = 1024, num_heads: int = 8, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, window_size: Optional[int] = 2048, rope_theta: float = 10000.0,
                 qk_norm: bool = True, norm_eps: float = 1e-6, attn_backend: str = "sdpa",
                 layer_idx: Optional[int] = None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
        if window_size is not None and window_size < 1:
            raise ValueError(f"window_size must be >= 1 or None, got {window_size}")
        if attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, got {attn_backend!r}")
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads if head_dim is None else head_dim
        self.window_size, self.rope_theta, self.attn_backend = window_size, rope_theta, attn_backend
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None

    def forward(self, hidden_states: torch.Tensor, state: Optional[AttentionState] = None,
                output_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                cp: Optional[ShardPlan] = None) -> tuple[torch.Tensor, Optional[AttentionState]]:
        """Args:
            hidden_states: ``[B, T, D]``.
            state: keys/values of the previous tokens of the B sequences, or None.
            output_state: also return the state after these tokens.
            cu_seqlens: ``[N + 1]`` offsets of packed sequences (B == 1); positions restart at each sequence.
                Not combined with a state (decode batches are unpacked).
            cp: this rank's shard of a sequence split across ranks (hidden_states holds its tokens; the plan
                holds the global ``cu_seqlens``); no state, output_state or cu_seqlens with it.
        Returns:
            ``(out [B, T, D], new_state or None)``.
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"SlidingWindowAttention(hidden_size={self.hidden_size}) needs [B, T, "
                             f"{self.hidden_size}], got {tuple(hidden_states.shape)}")
        B, T, _ = hidden_states.shape
        dev = hidden_states.device
        if cu_seqlens is not None:
            check_layer_cu_seqlens(cu_seqlens, B, T)
            if state is not None or output_state:
                raise ValueError("SlidingWindowAttention: packed sequences (cu_seqlens) cannot carry a decode state; "
                                 "decode an unpacked batch instead")
        if state is not None and not isinstance(state, AttentionState):
            raise TypeError(f"state must be an AttentionState, got {type(state).__name__}")
        if cp is not None:
            if state is not None or output_state or cu_seqlens is not None:
                raise ValueError("SlidingWindowAttention: with cp (context parallelism) pass no state, output_state "
                                 "or cu_seqlens (the plan holds the global cu_seqlens)")
            return self._context_parallel(hidden_states, cp), None
        offset = 0 if state is None else state.offset
        seq = None
        if cu_seqlens is None:
            pos = torch.arange(offset, offset + T, device=dev)
        else:
            seq, pos = seq_index_and_position(cu_seqlens, T)
        q, k, v = self._project(hidden_states, pos)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))                       # [B, H, T, D]
        pos_k = pos
        if state is not None:
            if state.key.shape[0] != B:
                raise ValueError(f"attention state holds {state.key.shape[0]} sequences, the input {B}")
            L = state.key.shape[2]
            k = torch.cat([state.key.to(k.dtype), k], dim=2)
            v = torch.cat([state.value.to(v.dtype), v], dim=2)
            pos_k = torch.arange(offset - L, offset + T, device=dev)
        o = self._attend(q, k, v, pos, pos_k, seq)
        out = self.o_proj(o.transpose(1, 2).flatten(-2))
        new_state = None
        if output_state:
            keep = k.shape[2] if self.window_size is None else min(k.shape[2], self.window_size - 1)
            new_state = AttentionState(key=k[:, :, k.shape[2] - keep:].contiguous(),
                                       value=v[:, :, v.shape[2] - keep:].contiguous(), offset=offset + T)
        return out, new_state

    def _project(self, hidden_states: torch.Tensor, pos: torch.Tensor):
        """q ``[B, T, H, D]``, k and v ``[B, T, H_kv, D]`` after the q/k norms and RoPE at positions ``pos``."""
        q = self.q_proj(hidden_states).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(hidden_states).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden_states).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotary(q, pos[None], self.rope_theta), rotary(k, pos[None], self.rope_theta), v

    def _context_parallel(self, hidden_states: torch.Tensor, cp: ShardPlan) -> torch.Tensor:
        from ..parallel import with_halo  # lazy: linattn.parallel imports torch.distributed
        from ..parallel.collectives import halo_range
        dev = hidden_states.device
        q, k, v = self._project(hidden_states, cp.positions(dev))
        halo = None if self.window_size is None else self.window_size - 1
        k, v = with_halo(k, cp, halo), with_halo(v, cp, halo)
        if q.shape[1] == 0:
            # an empty shard: no queries; the (empty) keys stay in the graph so every rank's backward matches
            return self.o_proj(q.flatten(-2)) + 0 * (k.sum() + v.sum())
        lo, hi = halo_range(cp, cp.rank, halo)
        pos_k = torch.cat([cp.positions(dev, lo, hi), cp.positions(dev)])
        seq_k = torch.cat([cp.sequence_ids(dev, lo, hi), cp.sequence_ids(dev)])
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        o = self._attend(q, k, v, cp.positions(dev), pos_k, cp.sequence_ids(dev), seq_k)
        return self.o_proj(o.transpose(1, 2).flatten(-2))

    def _attend(self, q, k, v, pos_q, pos_k, seq, seq_k=None):
        rep = self.num_heads // self.num_kv_heads
        if self.attn_backend == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            window = self.window_size
            Lk = k.shape[2]
            pos_q_all = pos_q
            # queries are the last T of the Lk keys; with packing, positions and sequence ids come from cu_seqlens
            seq_ids = seq
            seq_ids_k = seq if seq_k is None else seq_k

            def mask_mod(b, h, qi, kj):
                d = pos_q_all[qi] - pos_k[kj]
                keep = d >= 0
                if window is not None:
                    keep = keep & (d < window)
                if seq_ids is not None:
                    keep = keep & (seq_ids[qi] == seq_ids_k[kj])
                return keep

            bm = create_block_mask(mask_mod, None, None, q.shape[2], Lk, device=q.device)
            # eager flex_attention materialises the scores; compiled it is a fused kernel (GPU only here: the CPU
            # path is for tests, where compiling would cost more than it saves)
            fn = _compiled_flex() if q.is_cuda else flex_attention
            return fn(q, k, v, block_mask=bm, enable_gqa=rep > 1)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        Lq, Lk = q.shape[2], k.shape[2]
        if seq is None and Lq == Lk and (self.window_size is None or self.window_size >= Lq):
            # plain causal: no mask tensor, so SDPA may pick its flash kernel
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        seq_k = seq if seq_k is None else seq_k
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(pos_q, pos_k, self.window_size, seq,
                                                                             seq_k))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, heads={self.num_heads}/{self.num_kv_heads}x{self.head_dim}, "
                f"window={self.window_size}, backend={self.attn_backend}")
