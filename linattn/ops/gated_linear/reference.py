"""Token-by-token gated linear attention (the gated delta rule without the delta term), in float64.

    S_t = γ_t S_{t−1} + η_t k_t v_tᵀ        o_t = scale · S_tᵀ q_t        (γ_t = e^{g_t}, one per value head)

Differentiable through plain autograd: its gradients are the reference gradients. Tests only (a Python loop).
"""
from __future__ import annotations

from typing import Optional

import torch


def gated_linear_attention_reference(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor] = None,
                                     cu_seqlens: Optional[list[int]] = None, dtype: torch.dtype = torch.float64):
    """q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g (log γ), beta (η) ``[B, T, HV]``; initial_state
    ``[N, HV, K, V]``; cu_seqlens a host list. Returns o ``[B, T, HV, V]`` and the final state, in ``dtype``."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    seqs = [(b, 0, T) for b in range(B)] if cu_seqlens is None else [
        (0, bos, eos) for bos, eos in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    outs = [[None] * T for _ in range(B)]
    finals = []
    for n, (b, bos, eos) in enumerate(seqs):
        S = q.new_zeros(HV, K, V) if initial_state is None else initial_state[n].to(dtype)
        for t in range(bos, eos):
            S = S * g[b, t].exp()[:, None, None] + torch.einsum("hk,hv->hkv", k[b, t], v[b, t] * beta[b, t][:, None])
            outs[b][t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, S)
        finals.append(S)
    return torch.stack([torch.stack(row) for row in outs]), torch.stack(finals)
