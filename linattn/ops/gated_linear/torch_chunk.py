"""Chunked gated linear attention in PyTorch (forward and hand-written backward): the CPU backend.

Gated linear attention is the gated delta rule with W = 0 and U = diag(η) V (no delta correction, so no
triangular solve), so it shares the GDN stages of ``linattn.ops.gated_delta.torch_chunk``: the in-chunk cumsum,
the decay matrix, the state pass (forward and reverse) and the output stage. Only the local backward differs
(no W, no T = (I + A)⁻¹ to differentiate). Chunked layout ``[B, HV, NT, C, d]`` as there, and the backend runs
on blocks of a few chunks as there (``block_chunks``; the state and dS carried between blocks):

    O = scale·[diag(Γ) Q S + (Q Kᵀ ⊙ D ⊙ causal) U],     S ← e^{G_C} S + (K ⊙ e^{G_C − G})ᵀ U,     U = diag(η) V
"""
from __future__ import annotations

from typing import Optional

import torch

from ..gated_delta.torch_chunk import (
    CHUNK,
    block_chunks,
    chunk_local_cumsum_bwd_ref,
    chunk_local_cumsum_ref,
    decay_matrix,
    from_chunks,
    output_fwd_ref,
    sequence_spans,
    state_pass_bwd_ref,
    state_pass_fwd_ref,
    to_chunks,
)
from ..utils import MIN_LOG_DECAY, compute_dtype


def gla_forward_blocks(k, v, g, beta, h0: torch.Tensor, block: int):
    """The forward's stages up to the state pass, ``block`` chunks at a time, the state carried. Yields (chunk
    slice, gc, u, h, the state leaving the block) per block."""
    S = h0
    for a in range(0, k.shape[2], block):
        s = slice(a, a + block)
        kb = k[:, :, s]
        gc = chunk_local_cumsum_ref(g[:, :, s])
        u = v[:, :, s] * beta[:, :, s][..., None]
        # W = 0: the shared state pass then leaves V_new = U (the zero matmul is the price of sharing the stage)
        h, _, S = state_pass_fwd_ref(torch.zeros_like(kb), u, kb, gc, S)
        yield s, gc, u, h, S


def gla_chunk_fwd_ref(q, k, v, g, beta, scale: float, h0: torch.Tensor, block: Optional[int] = None):
    """All forward stages; returns (o, final state, (gc, u, h) saved for the backward). ``block``: chunks per
    step (None: all at once, and the saved tensors are returned; with blocks, None is)."""
    o = torch.empty_like(v)
    ht, saved = h0, None
    for s, gc, u, h, S in gla_forward_blocks(k, v, g, beta, h0, block or k.shape[2]):
        o[:, :, s] = output_fwd_ref(q[:, :, s], k[:, :, s], u, h, gc, scale)
        ht, saved = S, ((gc, u, h) if block is None else None)
    return o, ht, saved


def gla_local_bwd_ref(q, k, v, beta, gc, u, h, do, dh, du, scale: float):
    """Gradients that need no sequential pass: dq, dk, dv, dbeta, dG. ``dh`` (dS leaving each chunk) and ``du``
    (dU) come from the shared reverse state pass."""
    gamma = gc.exp()
    e_last = (gc[..., -1:] - gc).exp()
    D = decay_matrix(gc, strict=False)
    # S_out = e^{G_C} S + (K ⊙ e_last)ᵀ U
    dgc = torch.zeros_like(gc)
    dgc[..., -1] += gc[..., -1].exp() * (h * dh).sum((-1, -2))
    dk_decay = u @ dh.transpose(-1, -2)
    dk = e_last[..., None] * dk_decay
    t = e_last * (k * dk_decay).sum(-1)
    dgc[..., -1] += t.sum(-1)
    dgc -= t
    # O = scale·[diag(Γ) Q S + (Q Kᵀ ⊙ D) U]
    dP = scale * (do @ u.transpose(-1, -2)) * D
    dq = dP @ k
    dk += dP.transpose(-1, -2) @ q
    dlogD = dP * (q @ k.transpose(-1, -2))
    dgc += dlogD.sum(-1) - dlogD.sum(-2)
    dq_decay = scale * do @ h.transpose(-1, -2)
    dq += gamma[..., None] * dq_decay
    dgc += gamma * (q * dq_decay).sum(-1)
    # U = diag(η) V
    return dq, dk, beta[..., None] * du, (v * du).sum(-1), dgc


def gla_chunk_bwd_ref(q, k, v, g, beta, scale, h0, do, dht, block: Optional[int] = None):
    """Recompute the forward, run the shared reverse state pass and the local backward, ``block`` chunks at a time
    (None: all at once), dS carried from block to block: dq, dk, dv, dg, dbeta, dh0."""
    blocks = list(gla_forward_blocks(k, v, g, beta, h0, block or k.shape[2]))
    dq, dk, dv, dg, dbeta = (torch.empty_like(t) for t in (q, k, v, g, beta))
    dS = dht
    for s, gc, u, h, _ in reversed(blocks):
        qb, kb, vb, bb, dob = (t[:, :, s] for t in (q, k, v, beta, do))
        dh, du, dS = state_pass_bwd_ref(qb, kb, torch.zeros_like(kb), gc, dob, dS, scale)
        dq[:, :, s], dk[:, :, s], dv[:, :, s], dbeta[:, :, s], dgc = gla_local_bwd_ref(
            qb, kb, vb, bb, gc, u, h, dob, dh, du, scale)
        dg[:, :, s] = chunk_local_cumsum_bwd_ref(dgc)
    return dq, dk, dv, dg, dbeta, dS


def gla_fwd_torch(q, k, v, g, beta, scale, initial_state, offsets, chunk_size=CHUNK):
    """o ``[B, T, HV, V]`` in v's dtype and the final state ``[N, HV, K, V]`` (fp32; fp64 for fp64 inputs)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cd, G = compute_dtype(v), HV // H
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    finals = []
    for n, (b, bos, eos) in enumerate(sequence_spans(B, T, offsets)):
        h0 = initial_state[n].to(cd) if initial_state is not None else v.new_zeros(HV, K, V, dtype=cd)
        if eos == bos:
            finals.append(h0)
            continue
        x = [t[b:b + 1, bos:eos].to(cd) for t in (q, k, v, g, beta)]
        x[0], x[1] = x[0].repeat_interleave(G, 2), x[1].repeat_interleave(G, 2)
        qc, kc, vc, gch, bc = (to_chunks(t, chunk_size).contiguous() for t in x)
        oc, ht, _ = gla_chunk_fwd_ref(qc, kc, vc, gch, bc, scale, h0[None], block=block_chunks(kc, vc))
        o[b:b + 1, bos:eos] = from_chunks(oc, eos - bos).to(v.dtype)
        finals.append(ht[0])
    return o, torch.stack(finals).to(cd)


def gla_bwd_torch(q, k, v, g, beta, scale, initial_state, offsets, do, dht, chunk_size=CHUNK):
    """dq, dk, dv, dg, dbeta, dh0 (None without an initial state); grouped q/k gradients summed over their heads."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cd, G = compute_dtype(v), HV // H
    grads = [torch.zeros(B, T, HV, d, dtype=cd, device=v.device) for d in (K, K, V)]
    grads += [torch.zeros(B, T, HV, dtype=cd, device=v.device) for _ in range(2)]
    dh0s = []
    for n, (b, bos, eos) in enumerate(sequence_spans(B, T, offsets)):
        h0 = initial_state[n].to(cd) if initial_state is not None else v.new_zeros(HV, K, V, dtype=cd)
        dht_n = dht[n].to(cd)
        if eos == bos:
            dh0s.append(dht_n)
            continue
        x = [t[b:b + 1, bos:eos].to(cd) for t in (q, k, v, g, beta, do)]
        x[0], x[1] = x[0].repeat_interleave(G, 2), x[1].repeat_interleave(G, 2)
        qc, kc, vc, gch, bc, doc = (to_chunks(t, chunk_size).contiguous() for t in x)
        res = gla_chunk_bwd_ref(qc, kc, vc, gch, bc, scale, h0[None], doc, dht_n[None], block=block_chunks(kc, vc))
        for dst, src in zip(grads, (res[0], res[1], res[2], res[3], res[4])):
            dst[b:b + 1, bos:eos] = from_chunks(src, eos - bos)
        dh0s.append(res[5][0])
    dq, dk, dv, dg, dbeta = grads
    dq, dk = dq.view(B, T, H, G, K).sum(3), dk.view(B, T, H, G, K).sum(3)
    dh0 = torch.stack(dh0s).to(initial_state.dtype) if initial_state is not None else None
    dg = dg.masked_fill(g < MIN_LOG_DECAY, 0)     # gates below the floor (chunk_local_cumsum_ref) do not move o
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0
