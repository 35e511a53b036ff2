"""Token-by-token gated delta rule: the obviously-right definition every other path is tested against.

    S_t = e^{g_t} (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ        o_t = scale · S_tᵀ q_t

computed as  S' = e^{g_t} S;  S = S' + k_t (β_t (v_t − S'ᵀ k_t))ᵀ, which is the same expression. Runs in float64
and is differentiable through plain PyTorch autograd, so its gradients are the reference gradients too.
Slow (a Python loop over T): tests and the evaluation suite only.
"""
from __future__ import annotations

from typing import Optional

import torch


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[list[int]] = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent gated delta rule in ``dtype`` (float64 by default).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (HV % H == 0); g (log decay), beta: ``[B, T, HV]``.
        initial_state: ``[N, HV, K, V]`` or None (zeros).
        cu_seqlens: host list of N + 1 packed offsets (B == 1), or None.
    Returns:
        o ``[B, T, HV, V]`` and the final state ``[N, HV, K, V]``, both in ``dtype``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    # grouped value heads: value head i reads query/key head i // (HV // H)
    q = q.repeat_interleave(HV // H, dim=2)
    k = k.repeat_interleave(HV // H, dim=2)
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        seqs = [(0, bos, eos) for bos, eos in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    outs = [[None] * T for _ in range(B)]
    finals = []
    for n, (b, bos, eos) in enumerate(seqs):
        if initial_state is None:
            S = q.new_zeros(HV, K, V)
        else:
            S = initial_state[n].to(dtype)
        for t in range(bos, eos):
            S = S * g[b, t].exp()[:, None, None]
            err = v[b, t] - torch.einsum("hk,hkv->hv", k[b, t], S)
            S = S + torch.einsum("hk,hv->hkv", k[b, t], err * beta[b, t][:, None])
            outs[b][t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, S)
        finals.append(S)
    o = torch.stack([torch.stack(row) for row in outs])
    return o, torch.stack(finals)
