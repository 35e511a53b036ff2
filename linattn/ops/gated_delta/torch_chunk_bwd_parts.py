"""PyTorch twins of the Triton backward kernels, finer-grained than :func:`torch_chunk.local_bwd_ref`.

The Triton backward runs four kernels (linattn/ops/common/):

    local_bwd_dv     dv_local = scale·Pᵀ dO                                  twin: :func:`local_bwd_dv_ref`
    state_pass_bwd   reverse walk over chunks: dh, dv_new, dh0               twin: ``torch_chunk.state_pass_bwd_ref``
    local_bwd_dqk    the terms that read the state (h, dh) and dO            twin: :func:`local_bwd_dqk_ref`
    local_bwd_wy     the WY / UT-transform part, then the dG → dg cumsum     twin: :func:`local_bwd_wy_ref`

``local_bwd_dqk_ref`` followed by ``local_bwd_wy_ref`` is ``local_bwd_ref`` followed by
``chunk_local_cumsum_bwd_ref``, built from the same expressions, merely regrouped so that each part can run in one
kernel; tests/ops/test_triton_bwd.py checks the composition. Layout as in torch_chunk: ``[B, HV, NT, C, d]``.

Two regroupings matter for the kernels:

* Gradients reaching G through a decay D_ij = e^{G_i − G_j} are Σ_j dX_ij X_ij (row) minus Σ_j dX_ji X_ji (column).
  With X = Q Kᵀ this row sum is q_i·(dX K)_i and the column sum k_i·(dXᵀ Q)_i: a sum over the K dimension, so a
  kernel tiled over K adds up its tiles' shares and never forms Q Kᵀ.
* The reverse cumsum dg = revcumsum(dG) is linear, so each part returns its share of dg already summed; the
  "last row" terms (through e^{G_C}) then reach every token of the chunk, and no part needs a padded row.
"""
from __future__ import annotations

import torch

from .torch_chunk import chunk_local_cumsum_bwd_ref, decay_matrix, qk_decay_ref


def local_bwd_dv_ref(q, k, gc, do, scale: float):
    """dv_local = scale·Pᵀ dO with P = Q Kᵀ ⊙ D (inclusive causal): the part of dV_new that needs no state."""
    return scale * qk_decay_ref(q, k, gc).transpose(-1, -2) @ do


def local_bwd_dqk_ref(q, k, beta, gc, A_inv, h, v_new, do, dh, dv_new, scale: float):
    """Everything that reads the state h, its gradient dh, or dO.

    Returns dq (complete), dk (all but the K Kᵀ term), dbeta (the Γ·(k·dkb) term), dg (its share, reverse-summed)
    and dA_inv (the share W contributes: dW (K ⊙ βΓ)ᵀ).
    """
    gamma = gc.exp()
    e_last = (gc[..., -1:] - gc).exp()
    dgc_last = gc[..., -1].exp() * (h * dh).sum((-1, -2))           # through e^{G_C} S

    # t_i reaches G_C as +t_i and G_i as −t_i: after the reverse cumsum, row i keeps Σ_{j<i} t_j
    dk_decay = v_new @ dh.transpose(-1, -2)
    t = e_last * (k * dk_decay).sum(-1)
    dg_t = torch.nn.functional.pad(t.cumsum(-1)[..., :-1], (1, 0))

    # the diagonal of dP ⊙ Q Kᵀ enters rowsum and colsum alike: kept out of the sums (it cancels exactly)
    dP = scale * (do @ v_new.transpose(-1, -2)) * decay_matrix(gc, strict=False)
    dP_diag = dP.diagonal(dim1=-2, dim2=-1)
    dP_strict = dP.tril(-1)
    dq_intra, dk_intra = dP_strict @ k, dP_strict.transpose(-1, -2) @ q
    dgc = (q * dq_intra).sum(-1) - (k * dk_intra).sum(-1)         # = rowsum − colsum of dP ⊙ Q Kᵀ
    dq_intra = dq_intra + dP_diag[..., None] * k
    dk_intra = dk_intra + dP_diag[..., None] * q
    dq_decay = scale * do @ h.transpose(-1, -2)
    dq = dq_intra + gamma[..., None] * dq_decay
    dgc += gamma * (q * dq_decay).sum(-1)
    dk = dk_intra + e_last[..., None] * dk_decay

    dw = -dv_new @ h.transpose(-1, -2)
    dkb = A_inv.transpose(-1, -2) @ dw
    dk += (beta * gamma)[..., None] * dkb
    tk = (k * dkb).sum(-1)
    dbeta = gamma * tk
    dgc += beta * gamma * tk
    dA_inv = dw @ (k * (beta * gamma)[..., None]).transpose(-1, -2)
    dg = chunk_local_cumsum_bwd_ref(dgc) + dg_t + dgc_last[..., None]
    return dq, dk, dbeta, dg, dA_inv


def local_bwd_wy_ref(k, v, beta, gc, A_inv, dv_new, dA_inv, dk, dbeta, dg):
    """The UT-transform part: finishes dA_inv with U's share, differentiates T = (I + A)⁻¹, and adds the K Kᵀ
    terms to the partial dk / dbeta / dg from :func:`local_bwd_dqk_ref`. Returns dk, dv, dbeta, dg (complete)."""
    du = dv_new
    dA_inv = dA_inv + du @ (v * beta[..., None]).transpose(-1, -2)
    dvb = A_inv.transpose(-1, -2) @ du
    dv = beta[..., None] * dvb
    dbeta = dbeta + (v * dvb).sum(-1)

    dA = -(A_inv.transpose(-1, -2) @ dA_inv @ A_inv.transpose(-1, -2)).tril(-1)
    dAD = dA * decay_matrix(gc, strict=True)
    dKKt = dAD * beta[..., :, None]
    r, kdAt = dAD @ k, dKKt.transpose(-1, -2) @ k
    dk = dk + beta[..., None] * r + kdAt
    kr = (k * r).sum(-1)
    dbeta = dbeta + kr                                           # = rowsum of dA ⊙ K Kᵀ ⊙ D
    dgc = beta * kr - (k * kdAt).sum(-1)                         # rowsum − colsum of dKKt ⊙ K Kᵀ
    return dk, dv, dbeta, dg + chunk_local_cumsum_bwd_ref(dgc)

