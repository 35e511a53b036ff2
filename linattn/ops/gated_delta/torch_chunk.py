"""Chunked gated delta rule in vectorised PyTorch: the CPU backend and the readable twin of the Triton kernels.

Every function ``<stage>_ref`` here is one stage of the chunked algorithm, and the Triton kernel of the same stage
is tested against it. Tensors live in a *chunked layout*: ``[B, HV, NT, C, d]`` (NT chunks of C tokens), with gates
``[B, HV, NT, C]``; grouped value heads are expanded before the stages run. The math (../docs/architecture.md):

    Inside a chunk, G = cumsum(g), Γ_i = e^{G_i}, D_ij = e^{G_i − G_j} (i ≥ j only; never e^{G_i}·e^{−G_j})
    A = strict_lower(diag(β) K Kᵀ ⊙ D),  T = (I + A)⁻¹
    W = T diag(βΓ) K,   U = T diag(β) V                       (the WY / UT representation)
    V_new = U − W S,    O = scale·[diag(Γ) Q S + (Q Kᵀ ⊙ D ⊙ causal) V_new]
    S ← e^{G_C} S + (K ⊙ e^{G_C − G})ᵀ V_new

Causality under NaN and Inf (what the Triton kernels do too): row i of T, W, U, V_new and O reads rows j ≤ i of the
chunk, but a product over the chunk's tokens multiplies the later rows by exact zeros, and NaN · 0 = NaN. So every
such product is a :func:`causal_matmul` (rows of the right operand from its first non-finite row on are zeroed
before the product, the result's rows from there set to NaN), masks are selects (``decay_matrix``, ``masked_fill``),
and the solve runs on A with the rows from the first non-finite β, G or ‖k‖² zeroed, its inverse's rows from there
set to NaN (:func:`kkt_solve_ref`). A non-finite value at token t then reaches the outputs at t and after, and the
state leaving the chunk, exactly as in the token loop (``reference.py``; per row: a NaN in one entry of v poisons the
whole row here).

The backward is written out by hand (not autograd), stage by stage, so it is the twin of the Triton backward:
a reverse pass over chunks carries dS, everything else is parallel over chunks.

The backend runs the stages on blocks of a few chunks at a time (:func:`block_chunks`), carrying the state
between blocks: the same numbers (tested to 1e-6), because every stage is independent per chunk apart from the
carried state. Why: on a CPU, whole-sequence temporaries (32 MB for one [HV=16, T=4096, 128] fp32 tensor) are fresh
mmap'd memory at every allocation, and the page faults cost more than the arithmetic (a bmm into a new tensor
takes more than twice as long as into an existing one). Blocks of ≤ 4 MB are recycled by the allocator and stay in cache, which
halves the CPU forward + backward at long sequences.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..utils import MIN_LOG_DECAY, compute_dtype

CHUNK = 64
# the largest per-block tensor the backend allows itself (h of one block: B·HV·chunks·K·V values): see above
BLOCK_BYTES = 4 << 20


# ----------------------------------------------------------------------------------------------------------------
# layout helpers
# ----------------------------------------------------------------------------------------------------------------
def to_chunks(x: torch.Tensor, C: int = CHUNK) -> torch.Tensor:
    """``[B, T, HV, (d)]`` → ``[B, HV, NT, C, (d)]``, zero-padding T up to a multiple of C.

    Zero padding is exact: a padded token has g = 0 (no decay) and β = 0 (no update), so it leaves the state as it
    was, and its q = 0 gives an output that is dropped anyway.
    """
    B, T = x.shape[:2]
    NT = -(-T // C)
    pad = NT * C - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1)
    x = x.reshape(B, NT, C, *x.shape[2:])
    return x.permute(0, 3, 1, 2, 4) if x.dim() == 5 else x.permute(0, 3, 1, 2)


def from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """Inverse of :func:`to_chunks`: ``[B, HV, NT, C, (d)]`` → ``[B, T, HV, (d)]``."""
    B, HV, NT, C = x.shape[:4]
    x = x.permute(0, 2, 3, 1, 4) if x.dim() == 5 else x.permute(0, 2, 3, 1)
    return x.reshape(B, NT * C, HV, *x.shape[4:])[:, :T]


def dead_rows(bad: torch.Tensor) -> torch.Tensor:
    """``[..., C]`` bool: true from the first true of ``bad`` on (the rows a non-finite row feeds)."""
    return bad.cumsum(-1) > 0


def causal_matmul(L: torch.Tensor, Z: torch.Tensor) -> torch.Tensor:
    """L Z for a lower-triangular L ``[..., C, C]``, computed so that a non-finite row j of Z reaches rows ≥ j only:
    the rows of Z from its first non-finite row on are zeroed before the product and set to NaN after it."""
    # a row sum is non-finite iff an entry is (or the sum overflows); where / an added poison column cost a fraction
    # of masked_fill's two passes on a CPU (no host sync: the backend also runs on CUDA)
    dead = dead_rows(~torch.isfinite(Z.sum(-1)))[..., None]
    return L @ torch.where(dead, 0.0, Z) + torch.where(dead, float("nan"), 0.0)


def _causal(C: int, device, strict: bool) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def decay_matrix(gc: torch.Tensor, strict: bool) -> torch.Tensor:
    """D_ij = e^{G_i − G_j} on the (strict) lower triangle, 0 above: the difference is masked *before* exp, so
    neither an overflow above the diagonal nor e^{G_i}·e^{−G_j} ever appears (G can reach −6400 in one chunk)."""
    C = gc.shape[-1]
    diff = gc[..., :, None] - gc[..., None, :]
    return diff.masked_fill(~_causal(C, gc.device, strict), float("-inf")).exp()


# ----------------------------------------------------------------------------------------------------------------
# forward stages
# ----------------------------------------------------------------------------------------------------------------
def chunk_local_cumsum_ref(g: torch.Tensor) -> torch.Tensor:
    """G = cumulative sum of g inside each chunk, each gate floored at ``utils.MIN_LOG_DECAY`` (so that a −inf gate
    gives finite sums whose decays are exactly 0). g: ``[B, HV, NT, C]``."""
    return g.clamp_min(MIN_LOG_DECAY).cumsum(-1)


def kkt_solve_ref(k: torch.Tensor, beta: torch.Tensor, gc: torch.Tensor) -> torch.Tensor:
    """T = (I + A)⁻¹ with A = strict_lower(diag(β) K Kᵀ ⊙ D). Returns ``[B, HV, NT, C, C]`` (unit lower).
    Rows of T from the first row whose β, G or ‖k‖² is non-finite on are NaN; the rows before are exact (the solve
    runs on A with those rows zeroed, so nothing non-finite enters the substitution)."""
    C = k.shape[-2]
    kkt = k @ k.transpose(-1, -2)
    bad = ~(torch.isfinite(beta) & torch.isfinite(gc) & torch.isfinite(kkt.diagonal(dim1=-2, dim2=-1)))
    dead = dead_rows(bad)[..., None]
    A = torch.where(dead | ~_causal(C, k.device, True), 0.0, beta[..., :, None] * kkt * decay_matrix(gc, strict=True))
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    A_inv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    return A_inv + torch.where(dead, float("nan"), 0.0)


def wy_ref(A_inv, k, v, beta, gc):
    """W = T diag(βΓ) K and U = T diag(β) V (causal products: :func:`causal_matmul`)."""
    w = causal_matmul(A_inv, k * (beta * gc.exp())[..., None])
    u = causal_matmul(A_inv, v * beta[..., None])
    return w, u


def state_pass_fwd_ref(w, u, k, gc, h0: torch.Tensor):
    """Walk the chunks in order. Returns h ``[B, HV, NT, K, V]`` (the state *entering* each chunk), v_new
    ``[B, HV, NT, C, V]`` and the final state ``[B, HV, K, V]``."""
    NT = k.shape[2]
    S = h0
    hs, vns = [], []
    g_last = gc[..., -1]
    for c in range(NT):
        hs.append(S)
        v_new = u[:, :, c] - w[:, :, c] @ S
        vns.append(v_new)
        k_decay = k[:, :, c] * (g_last[:, :, c, None] - gc[:, :, c]).exp()[..., None]
        S = g_last[:, :, c, None, None].exp() * S + k_decay.transpose(-1, -2) @ v_new
    return torch.stack(hs, 2), torch.stack(vns, 2), S


def qk_decay_ref(q, k, gc):
    """P = Q Kᵀ ⊙ D ⊙ causal (inclusive diagonal), ``[B, HV, NT, C, C]``: the state-free part of the output, also
    stored by the pre-pass for the walk (``fused_prepass.py``, q given). The scale is not folded in. The mask is a
    select: a non-finite key never reaches an earlier row."""
    C = q.shape[-2]
    return ((q @ k.transpose(-1, -2)) * decay_matrix(gc, strict=False)).masked_fill(~_causal(C, q.device, False), 0)


def output_fwd_ref(q, k, v_new, h, gc, scale: float):
    """O = scale·[diag(Γ) Q S + (Q Kᵀ ⊙ D ⊙ causal) V_new]."""
    o_inter = (q * gc.exp()[..., None]) @ h
    return scale * (o_inter + causal_matmul(qk_decay_ref(q, k, gc), v_new))


def block_chunks(k: torch.Tensor, v: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> int:
    """Chunks per block for the backend: on a CPU as many as keep one block's h (``B·HV·n·K·V`` values) ≤
    ``block_bytes``; elsewhere all of them (a GPU's caching allocator has no page faults to avoid, and every block is
    another round of kernel launches: the float64 ground truth of the GPU checks runs here)."""
    B, HV, NT, _, K = k.shape
    if k.device.type != "cpu":
        return NT
    return max(1, min(NT, block_bytes // (B * HV * K * v.shape[-1] * k.element_size())))


def forward_blocks(k, v, g, beta, h0: torch.Tensor, block: int):
    """The forward's stages up to the state pass, ``block`` chunks at a time in order, the state carried from block
    to block. Yields (chunk slice, gc, A_inv, w, h, v_new, the state leaving the block) per block."""
    S = h0
    for a in range(0, k.shape[2], block):
        s = slice(a, a + block)
        kb, bb = k[:, :, s], beta[:, :, s]
        gc = chunk_local_cumsum_ref(g[:, :, s])
        A_inv = kkt_solve_ref(kb, bb, gc)
        w, u = wy_ref(A_inv, kb, v[:, :, s], bb, gc)
        h, v_new, S = state_pass_fwd_ref(w, u, kb, gc, S)
        yield s, gc, A_inv, w, h, v_new, S


def chunk_fwd_ref(q, k, v, g, beta, scale: float, h0: torch.Tensor, block: Optional[int] = None):
    """All forward stages in the chunked layout; returns (o, final state, saved tensors for the backward).
    ``block``: chunks per step (None: all at once, and the saved tensors (gc, A_inv, w, h, v_new) are returned;
    with blocks, None is)."""
    o = torch.empty_like(v)
    ht, saved = h0, None
    for s, gc, A_inv, w, h, v_new, S in forward_blocks(k, v, g, beta, h0, block or k.shape[2]):
        o[:, :, s] = output_fwd_ref(q[:, :, s], k[:, :, s], v_new, h, gc, scale)
        ht, saved = S, ((gc, A_inv, w, h, v_new) if block is None else None)
    return o, ht, saved


# ----------------------------------------------------------------------------------------------------------------
# backward stages
# ----------------------------------------------------------------------------------------------------------------
def state_pass_bwd_ref(q, k, w, gc, do, dht: torch.Tensor, scale: float):
    """Walk the chunks in reverse carrying dS, the gradient of the state leaving the chunk.

    Per chunk: dV_new = scale·Pᵀ dO + (K ⊙ e^{G_C − G}) dS  and
               dS_in  = e^{G_C} dS + scale·(diag(Γ) Q)ᵀ dO − Wᵀ dV_new.
    Returns dh ``[B, HV, NT, K, V]`` (dS leaving each chunk), dv_new ``[B, HV, NT, C, V]`` and dh0.
    """
    NT = k.shape[2]
    P = qk_decay_ref(q, k, gc)
    dv_local = scale * P.transpose(-1, -2) @ do          # parallel part of dV_new (independent of dS)
    q_decay = q * gc.exp()[..., None]
    g_last = gc[..., -1]
    dS = dht
    dhs, dvns = [None] * NT, [None] * NT
    for c in reversed(range(NT)):
        dhs[c] = dS
        k_decay = k[:, :, c] * (g_last[:, :, c, None] - gc[:, :, c]).exp()[..., None]
        dv_new = dv_local[:, :, c] + k_decay @ dS
        dvns[c] = dv_new
        dS = (g_last[:, :, c, None, None].exp() * dS + scale * q_decay[:, :, c].transpose(-1, -2) @ do[:, :, c]
              - w[:, :, c].transpose(-1, -2) @ dv_new)
    return torch.stack(dhs, 2), torch.stack(dvns, 2), dS


def _dgc_from_log_decay(dlogD: torch.Tensor) -> torch.Tensor:
    """Gradient reaching G through D_ij = e^{G_i − G_j}, given dlogD_ij = ∂L/∂(G_i − G_j)."""
    return dlogD.sum(-1) - dlogD.sum(-2)


def local_bwd_ref(q, k, v, beta, gc, A_inv, w, h, v_new, do, dh, dv_new, scale: float):
    """Every gradient that needs no sequential pass: dq, dk, dv, dbeta and dG (the gradient of the cumulative
    gate). Inputs as saved by the forward plus dh / dv_new from :func:`state_pass_bwd_ref`."""
    gamma = gc.exp()                                               # Γ_i
    e_last = (gc[..., -1:] - gc).exp()                             # e^{G_C − G_i}
    D_incl = decay_matrix(gc, strict=False)
    D_strict = decay_matrix(gc, strict=True)
    KKt = k @ k.transpose(-1, -2)
    QKt = q @ k.transpose(-1, -2)

    # S_out = e^{G_C} S + (K ⊙ e_last)ᵀ V_new
    dgc = torch.zeros_like(gc)
    dgc[..., -1] += gc[..., -1].exp() * (h * dh).sum((-1, -2))
    dk_decay = v_new @ dh.transpose(-1, -2)                        # [.., C, K]
    dk = e_last[..., None] * dk_decay
    t = e_last * (k * dk_decay).sum(-1)
    dgc[..., -1] += t.sum(-1)
    dgc -= t

    # O = scale·[diag(Γ) Q S + (Q Kᵀ ⊙ D) V_new]
    dP = scale * (do @ v_new.transpose(-1, -2)) * D_incl           # ∂L/∂(QKᵀ) after the decay
    dq = dP @ k
    dk += dP.transpose(-1, -2) @ q
    dgc += _dgc_from_log_decay(dP * QKt)
    dq_decay = scale * do @ h.transpose(-1, -2)
    dq += gamma[..., None] * dq_decay
    dgc += gamma * (q * dq_decay).sum(-1)

    # V_new = U − W S
    du = dv_new
    dw = -dv_new @ h.transpose(-1, -2)

    # W = T diag(βΓ) K,  U = T diag(β) V
    dA_inv = dw @ (k * (beta * gamma)[..., None]).transpose(-1, -2) + du @ (v * beta[..., None]).transpose(-1, -2)
    dkb = A_inv.transpose(-1, -2) @ dw
    dvb = A_inv.transpose(-1, -2) @ du
    dk += (beta * gamma)[..., None] * dkb
    tk = (k * dkb).sum(-1)
    dbeta = gamma * tk + (v * dvb).sum(-1)
    dgc += beta * gamma * tk
    dv = beta[..., None] * dvb

    # T = (I + A)⁻¹  ⇒  dA = −Tᵀ dT Tᵀ on the strict lower triangle; A = diag(β) (K Kᵀ ⊙ D)
    dA = -(A_inv.transpose(-1, -2) @ dA_inv @ A_inv.transpose(-1, -2)).tril(-1)
    dbeta += (dA * KKt * D_strict).sum(-1)
    dKKt = dA * beta[..., :, None] * D_strict
    dk += dKKt @ k + dKKt.transpose(-1, -2) @ k
    dgc += _dgc_from_log_decay(dA * beta[..., :, None] * KKt * D_strict)
    return dq, dk, dv, dbeta, dgc


def chunk_local_cumsum_bwd_ref(dgc: torch.Tensor) -> torch.Tensor:
    """dg_t = Σ_{s ≥ t in the chunk} dG_s (reverse cumulative sum inside each chunk)."""
    return dgc.flip(-1).cumsum(-1).flip(-1)


def chunk_bwd_ref(q, k, v, g, beta, scale, h0, do, dht, block: Optional[int] = None):
    """Recompute the forward stages, then run the backward stages, ``block`` chunks at a time (None: all at once):
    the reverse pass carries dS from block to block. Returns dq, dk, dv, dg, dbeta, dh0."""
    blocks = list(forward_blocks(k, v, g, beta, h0, block or k.shape[2]))
    dq, dk, dv, dg, dbeta = (torch.empty_like(t) for t in (q, k, v, g, beta))
    dS = dht
    for s, gc, A_inv, w, h, v_new, _ in reversed(blocks):
        qb, kb, vb, bb, dob = (t[:, :, s] for t in (q, k, v, beta, do))
        dh, dv_new, dS = state_pass_bwd_ref(qb, kb, w, gc, dob, dS, scale)
        dq[:, :, s], dk[:, :, s], dv[:, :, s], dbeta[:, :, s], dgc = local_bwd_ref(
            qb, kb, vb, bb, gc, A_inv, w, h, v_new, dob, dh, dv_new, scale)
        dg[:, :, s] = chunk_local_cumsum_bwd_ref(dgc)
    return dq, dk, dv, dg, dbeta, dS


# ----------------------------------------------------------------------------------------------------------------
# the backend: [B, T, ...] in, [B, T, ...] out; GVA and varlen handled here
# ----------------------------------------------------------------------------------------------------------------
def sequence_spans(B: int, T: int, offsets: Optional[list[int]]) -> list[tuple[int, int, int]]:
    """(batch index, bos, eos) of every sequence: ``B`` rows of ``[0, T)``, or the packed sequences of row 0."""
    if offsets is None:
        return [(b, 0, T) for b in range(B)]
    return [(0, bos, eos) for bos, eos in zip(offsets[:-1], offsets[1:])]


def chunk_gated_delta_rule_fwd_torch(q, k, v, g, beta, scale, initial_state, offsets, chunk_size=CHUNK,
                                     block_bytes=BLOCK_BYTES):
    """Forward of the torch backend. q, k ``[B, T, H, K]`` ... as the public op; offsets: host list or None;
    block_bytes: the size of one block of chunks' h (:func:`block_chunks`; tests make it small).
    Returns o ``[B, T, HV, V]`` in v's dtype and the final state ``[N, HV, K, V]`` (fp32; fp64 for fp64 input)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cd = compute_dtype(v)
    G = HV // H
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    finals = []
    for n, (b, bos, eos) in enumerate(sequence_spans(B, T, offsets)):
        h0 = (initial_state[n].to(cd) if initial_state is not None
              else torch.zeros(HV, K, V, dtype=cd, device=v.device))
        if eos == bos:
            finals.append(h0)
            continue
        x = [t[b:b + 1, bos:eos].to(cd) for t in (q, k, v, g, beta)]
        x[0], x[1] = x[0].repeat_interleave(G, 2), x[1].repeat_interleave(G, 2)
        qc, kc, vc, gch, bc = (to_chunks(t, chunk_size).contiguous() for t in x)
        oc, ht, _ = chunk_fwd_ref(qc, kc, vc, gch, bc, scale, h0[None], block=block_chunks(kc, vc, block_bytes))
        o[b:b + 1, bos:eos] = from_chunks(oc, eos - bos).to(v.dtype)
        finals.append(ht[0])
    return o, torch.stack(finals)


def chunk_gated_delta_rule_bwd_torch(q, k, v, g, beta, scale, initial_state, offsets, do, dht,
                                     chunk_size=CHUNK, block_bytes=BLOCK_BYTES):
    """Backward of the torch backend: returns dq, dk, dv, dg, dbeta, dh0 (dh0 None without initial_state).
    chunk_size, block_bytes: as the forward's.
    Gradients of grouped query/key heads are summed over the value heads that read them."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cd = compute_dtype(v)
    G = HV // H
    dq, dk = torch.zeros(B, T, HV, K, dtype=cd, device=q.device), torch.zeros(B, T, HV, K, dtype=cd,
                                                                              device=q.device)
    dv = torch.zeros(B, T, HV, V, dtype=cd, device=q.device)
    dg, dbeta = torch.zeros(B, T, HV, dtype=cd, device=q.device), torch.zeros(B, T, HV, dtype=cd, device=q.device)
    dh0s = []
    for n, (b, bos, eos) in enumerate(sequence_spans(B, T, offsets)):
        h0 = (initial_state[n].to(cd) if initial_state is not None
              else torch.zeros(HV, K, V, dtype=cd, device=v.device))
        dht_n = dht[n].to(cd) if dht is not None else torch.zeros(HV, K, V, dtype=cd, device=v.device)
        if eos == bos:
            dh0s.append(dht_n)
            continue
        L = eos - bos
        x = [t[b:b + 1, bos:eos].to(cd) for t in (q, k, v, g, beta, do)]
        x[0], x[1] = x[0].repeat_interleave(G, 2), x[1].repeat_interleave(G, 2)
        qc, kc, vc, gch, bc, doc = (to_chunks(t, chunk_size).contiguous() for t in x)
        grads = chunk_bwd_ref(qc, kc, vc, gch, bc, scale, h0[None], doc, dht_n[None],
                              block=block_chunks(kc, vc, block_bytes))
        for dst, src in zip((dq, dk, dv, dg, dbeta), grads[:5]):
            dst[b:b + 1, bos:eos] = from_chunks(src, L)
        dh0s.append(grads[5][0])
    dq = dq.view(B, T, H, G, K).sum(3)
    dk = dk.view(B, T, H, G, K).sum(3)
    dh0 = torch.stack(dh0s).to(initial_state.dtype) if initial_state is not None else None
    dg = dg.masked_fill(g < MIN_LOG_DECAY, 0)     # the floor's derivative: gates below it do not move the output
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0)
