"""GatedDeltaNet: the Gated DeltaNet token mixer, as Qwen3-Next and fla build it.

    x ─┬─ q_proj ─┐
       ├─ k_proj ─┼─ ShortConvolution + SiLU (depthwise, causal, over [q | k | v]) ─ q, k, v (per head)
       ├─ v_proj ─┘
       ├─ a_proj ── g = −exp(A_log) · softplus(a + dt_bias)      (log decay, ≤ 0; computed inside the op)
       ├─ b_proj ── β = sigmoid(b)   (× 2, β ∈ (0, 2), with allow_neg_eigval: eigenvalues of I − βkkᵀ in (−1, 1])
       └─ g_proj ── z (output gate)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, β)   →   o_proj(GatedRMSNorm(o, z))

Grouped value heads: ``num_v_heads`` may be a multiple of ``num_heads`` (query/key heads), as in Qwen3-Next
(16 key heads, 32 value heads); value head i reads query/key head ``i // (num_v_heads // num_heads)``.

Modes: ``"chunk"`` runs :func:`linattn.chunk_gated_delta_rule` (training, prefill); ``"recurrent"`` steps the
state token by token (decode) with :func:`linattn.fused_recurrent_gated_delta_rule`.
``mode="auto"`` (the default) picks recurrent for inputs of at most
``recurrent_max_len`` tokens in eval mode, chunked otherwise.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.gated_delta.chunk import chunk_gated_delta_rule
from ..ops.gated_delta.recurrent import fused_recurrent_gated_delta_rule
from .cache import GatedDeltaNetState
from .conv import ShortConvolution
from .norm import GatedRMSNorm, RMSNorm
from .varlen import check_layer_cu_seqlens

MODES = ("auto", "chunk", "recurrent")


def gated_delta_rule(q, k, v, a, beta, A_log, dt_bias, *, mode: str, initial_state=None, output_final_state=False,
                     cu_seqlens=None, backend=None):
    """Run the gated delta rule on the layer's tensors: ``mode="chunk"`` with the chunked op, ``"recurrent"`` with
    the token-by-token op. The gate is raw (``g = −exp(A_log)·softplus(a + dt_bias)`` inside the op) and q, k are
    L2-normalised inside the op. Shapes as in :func:`linattn.chunk_gated_delta_rule`."""
    op = fused_recurrent_gated_delta_rule if mode == "recurrent" else chunk_gated_delta_rule
    return op(q, k, v, a, beta, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias, backend=backend)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer layer.

    Args:
        hidden_size (int): model width D.
        num_heads (int): query/key heads H.
        head_dim (int): query/key head dim K.
        num_v_heads (int): value heads HV (a multiple of H); default H.
        expand_v (float): value head dim V = head_dim · expand_v (must be an integer).
        use_gate (bool): output gate z with a gated RMSNorm (else a plain RMSNorm).
        use_short_conv (bool): short causal convolution + SiLU on q, k, v (else SiLU alone, as fla does).
        conv_size (int): convolution width W.
        conv_bias (bool): learn a bias in the convolution.
        allow_neg_eigval (bool): β = 2·sigmoid(b) ∈ (0, 2) instead of sigmoid(b).
        norm_eps (float): epsilon of the output norm.
        mode (str): ``"auto"``, ``"chunk"`` or ``"recurrent"`` (see the module docstring).
        recurrent_max_len (int): longest input run in recurrent mode under ``mode="auto"``.
        backend (str): backend of the chunked op (None: triton on CUDA, torch elsewhere).
        layer_idx (int): the layer's index in a model (informational).
    """

    def __init__(self, hidden_size: int = 1024, num_heads: int = 4, head_dim: int = 128,
                 num_v_heads: Optional[int] = None, expand_v: float = 1.0, use_gate: bool = True,
                 use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False,
                 allow_neg_eigval: bool = False, norm_eps: float = 1e-6, mode: str = "auto",
                 recurrent_max_len: int = 64, backend: Optional[str] = None, layer_idx: Optional[int] = None):
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        if num_heads < 1 or num_v_heads % num_heads != 0:
            raise ValueError(f"num_v_heads={num_v_heads} must be a positive multiple of num_heads={num_heads}")
        head_v_dim = head_dim * expand_v
        if head_v_dim != int(head_v_dim) or head_v_dim < 1:
            raise ValueError(f"head_dim * expand_v must be a positive integer, got {head_dim} * {expand_v}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.hidden_size, self.num_heads, self.num_v_heads = hidden_size, num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_dim, int(head_v_dim)
        self.key_dim, self.value_dim = num_heads * head_dim, num_v_heads * self.head_v_dim
        self.use_gate, self.use_short_conv, self.allow_neg_eigval = use_gate, use_short_conv, allow_neg_eigval
        self.mode, self.recurrent_max_len, self.backend, self.layer_idx = mode, recurrent_max_len, backend, layer_idx

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = (ShortConvolution(2 * self.key_dim + self.value_dim, conv_size, bias=conv_bias,
                                        activation="silu") if use_short_conv else None)
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        # excluded from weight decay by the trainer (fla and mamba do the same)
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        else:
            self.g_proj = None
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
        """A = uniform(1, 16) (A_log = log A); dt log-uniform in [dt_min, dt_max], dt_bias = softplus⁻¹(dt)."""
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.rand_like(self.dt_bias) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def _rule(self, q, k, v, a, beta, *, mode, initial_state, output_final_state, cu_seqlens):
        """The recurrence itself (subclasses swap it: :class:`GatedLinearAttention` drops the delta term)."""
        return gated_delta_rule(q, k, v, a, beta, self.A_log, self.dt_bias, mode=mode, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=self.backend)

    def _rule_cp(self, q, k, v, a, beta, cp):
        """The recurrence over a sequence split across ranks (:mod:`linattn.parallel`); returns o."""
        from ..parallel import context_parallel_gated_delta_rule  # lazy: it imports torch.distributed
        return context_parallel_gated_delta_rule(q, k, v, a, beta, plan=cp, use_qk_l2norm_in_kernel=True,
                                                 A_log=self.A_log, dt_bias=self.dt_bias, backend=self.backend)[0]

    def _mode(self, T: int) -> str:
        if self.mode != "auto":
            return self.mode
        return "recurrent" if (not self.training and T <= self.recurrent_max_len) else "chunk"

    def forward(self, hidden_states: torch.Tensor, state: Optional[GatedDeltaNetState] = None,
                output_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                cp=None) -> tuple[torch.Tensor, Optional[GatedDeltaNetState]]:
        """Args:
            hidden_states: ``[B, T, D]``.
            state: the layer's state after the previous tokens (N = B sequences, or N packed ones), or None.
            output_state: also return the state after these tokens (for decoding).
            cu_seqlens: ``[N + 1]`` offsets of packed sequences (B == 1); each starts from its own state.
            cp: a :class:`~linattn.parallel.ShardPlan`: hidden_states is this rank's shard of a sequence split
                across ranks (context parallelism); no state, output_state or cu_seqlens with it.
        Returns:
            ``(out [B, T, D], new_state or None)``.
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"GatedDeltaNet(hidden_size={self.hidden_size}) needs [B, T, {self.hidden_size}], "
                             f"got {tuple(hidden_states.shape)}")
        B, T, _ = hidden_states.shape
        if cu_seqlens is not None:
            check_layer_cu_seqlens(cu_seqlens, B, T)
        if state is not None and not isinstance(state, GatedDeltaNetState):
            raise TypeError(f"state must be a GatedDeltaNetState, got {type(state).__name__}")
        if cp is not None and (state is not None or output_state or cu_seqlens is not None):
            raise ValueError(f"{type(self).__name__}: with cp (context parallelism) pass no state, output_state or "
                             "cu_seqlens (the plan holds the global cu_seqlens)")
        x = hidden_states
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        conv_state = None
        if self.conv1d is not None:
            qkv, conv_state = self.conv1d(qkv, None if state is None else state.conv, output_state, cu_seqlens,
                                          cp=cp)
        else:
            qkv = F.silu(qkv)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_k_dim))
        k = k.unflatten(-1, (self.num_heads, self.head_k_dim))
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        a = self.a_proj(x)
        beta = self.b_proj(x).float().sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2
        if cp is not None:
            o, recurrent = self._rule_cp(q, k, v, a, beta, cp), None
        else:
            o, recurrent = self._rule(q, k, v, a, beta, mode=self._mode(T),
                                      initial_state=None if state is None else state.recurrent,
                                      output_final_state=output_state, cu_seqlens=cu_seqlens)
        if self.g_proj is not None:
            o = self.o_norm(o, self.g_proj(x).unflatten(-1, (self.num_v_heads, self.head_v_dim)))
        else:
            o = self.o_norm(o)
        out = self.o_proj(o.flatten(-2).to(x.dtype))
        new_state = GatedDeltaNetState(conv=conv_state, recurrent=recurrent) if output_state else None
        return out, new_state

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, heads={self.num_heads}x{self.head_k_dim}, "
                f"v_heads={self.num_v_heads}x{self.head_v_dim}, mode={self.mode}, neg_eigval={self.allow_neg_eigval}")
