"""LinearAttention: causal (ungated) linear attention with a choice of feature map.

    S_t = S_{t−1} + φ(k_t) v_tᵀ,   o_t = S_tᵀ φ(q_t) · s     (normalize=False, s = F^{−1/2}, then RMSNorm)
    o_t = S_tᵀ φ(q_t) / (φ(q_t)·z_t + ε),  z_t = Σ_{s≤t} φ(k_s)                   (normalize=True)

computed with :func:`linattn.gated_linear_attention` at γ = η = 1. The normaliser z is carried as one extra value
column of ones, so numerator and denominator come out of the same chunked pass (and the same decode state).
The feature map is applied in PyTorch before the op (fusing it into a kernel is a speed matter for later).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..ops.gated_linear import gated_linear_attention
from .cache import GatedDeltaNetState
from .feature_maps import make_feature_map
from .norm import RMSNorm


class LinearAttention(nn.Module):
    """Causal linear attention layer.

    Args:
        hidden_size (int): model width D.
        num_heads (int): heads H.
        head_dim (int): q/k/v head dim; default hidden_size // num_heads.
        feature_map (str): ``identity``, ``elu+1``, ``rff``, ``learnable`` or ``block_orthogonal``.
        num_features (int): F for ``rff`` / ``learnable`` (default head_dim).
        normalize (bool): divide by φ(q)·Σφ(k); default True for positive maps (elu+1), False otherwise (a
            signed denominator can cross zero).
        eps (float): added to the normaliser.
        backend (str): ``"torch"`` or ``"reference"``.
    """

    def __init__(self, hidden_size: int = 1024, num_heads: int = 8, head_dim: Optional[int] = None,
                 feature_map: str = "elu+1", num_features: Optional[int] = None, normalize: Optional[bool] = None,
                 eps: float = 1e-6, backend: Optional[str] = None):
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_dim = hidden_size // num_heads if head_dim is None else head_dim
        self.phi = make_feature_map(feature_map, self.head_dim, num_features)
        self.feature_map, self.num_features = feature_map, self.phi.out_dim
        self.normalize = self.phi.positive if normalize is None else bool(normalize)
        self.eps, self.backend = eps, backend
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.o_norm = None if self.normalize else RMSNorm(self.head_dim)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, state: Optional[GatedDeltaNetState] = None,
                output_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                ) -> tuple[torch.Tensor, Optional[GatedDeltaNetState]]:
        """x ``[B, T, D]`` → ``(out [B, T, D], state)``; the state's recurrent part is ``[N, H, F, V (+1)]``."""
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"LinearAttention(hidden_size={self.hidden_size}) needs [B, T, {self.hidden_size}], "
                             f"got {tuple(hidden_states.shape)}")
        x = hidden_states
        B, T, _ = x.shape
        q = self.phi(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        k = self.phi(self.k_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        if self.normalize:
            v = torch.cat([v, v.new_ones(B, T, self.num_heads, 1)], dim=-1)
        g = torch.zeros(B, T, self.num_heads, dtype=torch.float32 if x.dtype != torch.float64 else x.dtype,
                        device=x.device)
        scale = 1.0 if self.normalize else self.num_features ** -0.5
        o, S = gated_linear_attention(q, k, v, g, None, scale=scale,
                                      initial_state=None if state is None else state.recurrent,
                                      output_final_state=output_state, cu_seqlens=cu_seqlens, backend=self.backend)
        if self.normalize:
            o = o[..., :-1] / (o[..., -1:] + self.eps)
        else:
            o = self.o_norm(o)
        out = self.o_proj(o.flatten(-2).to(x.dtype))
        return out, (GatedDeltaNetState(conv=None, recurrent=S) if output_state else None)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, heads={self.num_heads}x{self.head_dim}, "
                f"feature_map={self.feature_map}({self.num_features}), normalize={self.normalize}")
