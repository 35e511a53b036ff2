"""The Hopper backward's PyTorch twin: the fused reverse walk (one program per segment and value head, dS in fp32
registers) chunk by chunk, with the kernel's bf16 rounding points as options, and its sequence-parallel variant.
The design, with FLOPs, bytes and budgets: docs/backward.md (to move into docs/architecture.md).

What the training forward saves (:class:`SavedForward`, from :func:`forward_for_backward_ref`): gc and β head-major,
each chunk's T = (I + A)⁻¹ *without* β (the backward needs Tᵀ dV_new unscaled: dβ would otherwise divide by β), and
fp32 states every ``checkpoint_every`` chunks. The backward then runs

    recompute  :func:`recompute_states_ref`  bf16 h of every chunk from the checkpoints, parallel over checkpoints
    maps       :func:`reverse_maps_ref`      per segment [Mᵀ | D]: the reverse walk of [I | 0] with [0 | dO]
    scan       :func:`reverse_scan_ref`      dS leaving every segment, from dht, in segment order
      or warm  :func:`reverse_warm_ref`      instead of both: each segment's dS from a chain walk started from zero
                                             w chunks after it, w from the chunks' norm bounds (no maps, no scan)
    walk       :func:`reverse_walk_ref`      per chunk in reverse (:func:`reverse_chunk_ref`): dq, dk, dv, dg, dβ
      or per V slice  :func:`chunk_bwd_v_slices_ref` the kernel's programs (unsegmented): the walk on each slice
                      of V alone; dq, dk added over the slices in the kernel's order (:func:`slice_sum_ref`),
                      partials of dg, dβ, all of which :func:`sum_partials_ref` adds

with one segment the maps and the scan drop out. Per chunk (G chunk-local cumsum of g, Γ = e^G, ρ = e^{G_C − G},
γ = e^{G_C}, S_b the bf16 state entering the chunk, dS the gradient of the state leaving it):

    recompute   KS = K S_b,  W = V − Γ⊙KS,  X = β⊙W,  V_new = T bf16(X),  P = Q Kᵀ ⊙ D (inclusive)
    chain       dV_new = scale·Pᵀ dO + ρ⊙(K dS) (dS as bf16 hi + lo);  Y = Tᵀ bf16(dV_new)
                dS_in = γ dS + scale·Qᵀ(Γ⊙dO) − Kᵀ bf16(βΓ⊙Y)           (three dependent GEMMs; Γ⊙dO as
                                                                         bf16 hi + lo, two products)
    local       dv = β⊙Y,  dA = −Y V_newᵀ (strict; = −Tᵀ dT Tᵀ since T X = V_new),  dKD = β⊙dA⊙D
                dP = scale·(dO V_newᵀ)⊙D,  dq = dP K + scale·Γ⊙(dO S_bᵀ)
                dk = dPᵀ Q + dKD K + dKDᵀ K + ρ⊙(bf16(V_new) bf16(dS)ᵀ) − bf16(βΓ⊙Y) S_bᵀ
                dβ = rowsum(Y⊙W) + rowsum(dA⊙KKᵀ⊙D)
                dg = reverse cumsum of the Γ and D terms of dG, plus the ρ and γ terms (:func:`_decay_gradient`)

Rounding: ``operand_dtype`` (bf16 for the kernel, None for none) rounds each dot operand the kernel forms in bf16;
``da_operands`` the two operands of dA = −Y V_newᵀ ("bf16" — the kernel's choice: no shared memory for fp32 copies at
K = 128 —, "tf32" or "exact").
Layout inside: ``[B, HV, NT, BT, d]`` chunks (``torch_chunk.to_chunks``); q, k expanded to the value heads.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch

from ..gated_delta import torch_chunk as tc

BT = 64
CHECKPOINT_EVERY = 8        # fp32 states kept by the forward: 8 KB per chunk·head at K = V = 128, a quarter of bf16 h
DA_OPERANDS = ("exact", "tf32", "bf16")
# A reverse warm-up ends where the skipped chunks' map has norm below 2^this (``map_bound.py``'s bound; ‖Mᵀ‖ = ‖M‖)
NEGLIGIBLE_LOG2 = -30.0


class SavedForward(NamedTuple):
    """What the training forward keeps for the backward (kernel layouts): gc ``[B, HV, NT·64]`` chunk-local
    cumulative log decays and β ``[B, HV, NT·64]`` (head-major; zero-padded β, gc padded with each chunk's last
    value), T ``[B, T, HV, 64]`` each chunk's (I + A)⁻¹ without β, rounded to the operand dtype, and checkpoints
    ``[B, HV, NC, K, V]`` fp32: the state entering chunks 0, R, 2R, … (R = ``checkpoint_every``)."""
    gc: torch.Tensor
    beta: torch.Tensor
    a_inv: torch.Tensor
    checkpoints: torch.Tensor
    checkpoint_every: int


def rounder(work: torch.dtype, operand_dtype: Optional[torch.dtype]) -> Callable[[torch.Tensor], torch.Tensor]:
    """x ↦ x rounded to ``operand_dtype`` and back to ``work``; the identity for None or the working dtype."""
    if operand_dtype is None or operand_dtype == work:
        return lambda t: t
    return lambda t: t.to(operand_dtype).to(work)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 → tf32 (10 mantissa bits), to nearest with ties away from zero (cvt.rna.tf32.f32); float64 passes
    through fp32 first."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(x.dtype)


def _da_rounder(da_operands: str, rnd: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    if da_operands not in DA_OPERANDS:
        raise ValueError(f"da_operands must be one of {DA_OPERANDS}, got {da_operands!r}")
    return {"exact": lambda t: t, "tf32": round_tf32, "bf16": rnd}[da_operands]


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, checkpoint_every: int) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, HV, V], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if v.shape[2] % q.shape[2]:
        raise ValueError(f"HV = {v.shape[2]} must be a multiple of H = {q.shape[2]}")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be at least 1, got {checkpoint_every}")


def _expand_heads(x: torch.Tensor, HV: int, work: torch.dtype) -> torch.Tensor:
    """``[B, T, H, d]`` → chunks ``[B, HV, NT, BT, d]`` of the value heads' own copies (GVA)."""
    return tc.to_chunks(x.to(work).repeat_interleave(HV // x.shape[2], 2), BT)


def _head_major_chunks(x: torch.Tensor) -> torch.Tensor:
    """``[B, HV, NT·64]`` → ``[B, HV, NT, 64]``."""
    return x.view(*x.shape[:2], -1, BT)


# ----------------------------------------------------------------------------------------------------------------
# forward (what it saves) and the recompute of h
# ----------------------------------------------------------------------------------------------------------------
def state_step_ref(S, Kc, Vc, Gc, bt, Tc, rnd):
    """The forward's state step on one chunk (the walk's arithmetic, ``chunk_fwd_ref._walk_ref``'s with T and β
    apart): S_b = bf16(S), X = β⊙(V − Γ⊙K S_b), V_new = T bf16(X), S ← γ S + Kᵀ bf16(ρ⊙V_new). Returns (S_b,
    V_new, the state leaving the chunk). Non-finite decays as the walk takes them (``chunk_fwd``'s module docstring):
    X 0 on a row whose Γ is not finite, V_d 0 on one whose ρ is (the state is NaN then through γ)."""
    Sb = rnd(S)
    gam = Gc.exp()
    X = torch.where(torch.isfinite(gam)[..., None], bt[..., None] * (Vc - gam[..., None] * (Kc @ Sb)), 0.0)
    Vn = Tc @ rnd(X)
    rho = (Gc[..., -1:] - Gc).exp()
    Vd = torch.where(torch.isfinite(rho)[..., None], rnd(rho[..., None] * Vn), 0.0)
    return Sb, Vn, Gc[..., -1].exp()[..., None, None] * S + Kc.transpose(-1, -2) @ Vd


def forward_for_backward_ref(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                             checkpoint_every: int = CHECKPOINT_EVERY,
                             operand_dtype: Optional[torch.dtype] = torch.bfloat16
                             ) -> tuple[torch.Tensor, torch.Tensor, SavedForward]:
    """The training forward's twin: o ``[B, T, HV, V]`` (v's dtype), the final state ``[B, HV, K, V]`` (working
    dtype: fp32, float64 for float64 q) and :class:`SavedForward`. q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``;
    g (log decays), β ``[B, T, HV]``; initial_state ``[B, HV, K, V]`` or None."""
    _check(q, k, v, checkpoint_every)
    work = _work_dtype(q)
    rnd = rounder(work, operand_dtype)
    HV = v.shape[2]
    qc, kc = _expand_heads(q, HV, work), _expand_heads(k, HV, work)
    vc, bc = tc.to_chunks(v.to(work), BT), tc.to_chunks(beta.to(work), BT)
    gc = tc.chunk_local_cumsum_ref(tc.to_chunks(g.to(work), BT))
    a_inv = rnd(tc.kkt_solve_ref(kc, bc, gc))
    B, NT = kc.shape[0], kc.shape[2]
    S = (initial_state.to(work) if initial_state is not None
         else torch.zeros(B, HV, k.shape[-1], v.shape[-1], dtype=work, device=q.device))
    outs, checkpoints = [], []
    for c in range(NT):
        if c % checkpoint_every == 0:
            checkpoints.append(S.float() if work == torch.float32 else S)
        Gc = gc[:, :, c]
        Sb, Vn, S = state_step_ref(S, kc[:, :, c], vc[:, :, c], Gc, bc[:, :, c], a_inv[:, :, c], rnd)
        Qc = qc[:, :, c]
        outs.append(scale * (Gc.exp()[..., None] * (Qc @ Sb) + rnd(tc.qk_decay_ref(Qc, kc[:, :, c], Gc)) @ rnd(Vn)))
    saved = SavedForward(gc.flatten(2), bc.flatten(2), tc.from_chunks(a_inv, q.shape[1]), torch.stack(checkpoints, 2),
                         checkpoint_every)
    return tc.from_chunks(torch.stack(outs, 2), q.shape[1]).to(v.dtype), S, saved


def recompute_states_ref(k, v, saved: SavedForward, rnd) -> torch.Tensor:
    """The backward's first launch: bf16 S_b ``[B, HV, NT, K, V]`` (in the working dtype) of every chunk, walked
    from the fp32 checkpoints, all checkpoint intervals at once (the kernel's programs: one per checkpoint and head)."""
    work = _work_dtype(saved.gc)
    HV, R = v.shape[2], saved.checkpoint_every
    kc, vc = _expand_heads(k, HV, work), tc.to_chunks(v.to(work), BT)
    gc, bc = _head_major_chunks(saved.gc), _head_major_chunks(saved.beta)
    a_inv = tc.to_chunks(saved.a_inv.to(work), BT)
    B, _, NT = gc.shape[:3]
    NC = saved.checkpoints.shape[2]

    def intervals(x: torch.Tensor) -> torch.Tensor:        # [B, HV, NT, ...] → [B, HV, NC, R, ...], zero chunks after
        pad = x.new_zeros(B, HV, NC * R - NT, *x.shape[3:])    # the end: g = β = 0, k = 0 leave the state as it is
        return torch.cat([x, pad], 2).view(B, HV, NC, R, *x.shape[3:])

    kc, vc, gc, bc, a_inv = (intervals(x) for x in (kc, vc, gc, bc, a_inv))
    S = saved.checkpoints.to(work)
    hs = []
    for r in range(R):
        Sb, _, S = state_step_ref(S, kc[:, :, :, r], vc[:, :, :, r], gc[:, :, :, r], bc[:, :, :, r],
                                  a_inv[:, :, :, r], rnd)
        hs.append(Sb)
    return torch.stack(hs, 3).flatten(2, 3)[:, :, :NT]


# ----------------------------------------------------------------------------------------------------------------
# the reverse walk
# ----------------------------------------------------------------------------------------------------------------
class ChunkGrads(NamedTuple):
    dq: torch.Tensor        # [.., BT, K]
    dk: torch.Tensor        # [.., BT, K]
    dv: torch.Tensor        # [.., BT, V]
    dbeta: torch.Tensor     # [.., BT]
    dg: torch.Tensor        # [.., BT] (after the chunk's reverse cumsum)
    dS_in: torch.Tensor     # [.., K, V] the gradient of the state entering the chunk


def reverse_chain_ref(Qc, Kc, Gc, bt, Tc, dOc, dS, scale: float, rnd):
    """The dS chain of one chunk, the part that needs no state: (dV_new, Y = Tᵀ bf16(dV_new), dS_in, ρ⊙(K dS)).
    Linear in (dO, dS) column by column, so the affine walk of :func:`reverse_maps_ref` runs it on [I | 0]."""
    gam, rho = Gc.exp(), (Gc[..., -1:] - Gc).exp()
    P = rnd(tc.qk_decay_ref(Qc, Kc, Gc))
    # C1: ρ scales the product's rows (K stays the exact input), and dS is two bf16 operands, hi + lo, back to
    # back into one accumulator: dS as one bf16 operand puts dg's and dh0's errors at 2.3× and 2.0× the rounded
    # baseline's at slow decay (docs/backward.md §7)
    dS_hi = rnd(dS)
    dVn_state = rho[..., None] * (Kc @ dS_hi + Kc @ rnd(dS - dS_hi))
    dVn = scale * P.transpose(-1, -2) @ dOc + dVn_state
    Y = Tc.transpose(-1, -2) @ rnd(dVn)                                       # C2
    # Γ⊙dO as two bf16 operands (hi + lo): dO is an input, exact in bf16, and one rounding of Γ⊙dO alone puts
    # dh0's error at 6-20× the rounded baseline's (docs/backward.md §7); off the chain, +2.1 MFLOP per chunk
    gdo = gam[..., None] * dOc
    gdo_hi = rnd(gdo)
    qdo = Qc.transpose(-1, -2) @ gdo_hi + Qc.transpose(-1, -2) @ rnd(gdo - gdo_hi)
    dS_in = (Gc[..., -1].exp()[..., None, None] * dS + scale * qdo
             - Kc.transpose(-1, -2) @ rnd((bt * gam)[..., None] * Y))         # C3
    return dVn, Y, dS_in, dVn_state


def _rowsum_minus_colsum(x: torch.Tensor) -> torch.Tensor:
    """Σ_j x_ij − Σ_j x_ji: the gradient reaching G through D_ij = e^{G_i − G_j} from dlogD = x."""
    return x.sum(-1) - x.sum(-2)


def reverse_chunk_ref(Qc, Kc, Vc, dOc, Gc, bt, Tc, Sb, dS, scale: float, rnd, rnd_da) -> ChunkGrads:
    """One step of the fused reverse walk (module docstring): the chain, then the local gradients from the
    recomputed V_new, P and K Kᵀ. Sb: the bf16 state entering the chunk; dS: the gradient of the state leaving it."""
    gam, rho = Gc.exp(), (Gc[..., -1:] - Gc).exp()
    KS = Kc @ Sb
    W = Vc - gam[..., None] * KS
    Vn = Tc @ rnd(bt[..., None] * W)
    Vn_b = rnd(Vn)
    dVn, Y, dS_in, dVn_state = reverse_chain_ref(Qc, Kc, Gc, bt, Tc, dOc, dS, scale, rnd)
    dS_b = rnd(dS)
    bgY = rnd((bt * gam)[..., None] * Y)                 # C3's operand, also the k side's
    QKt, KKt = Qc @ Kc.transpose(-1, -2), Kc @ Kc.transpose(-1, -2)
    D_strict = tc.decay_matrix(Gc, strict=True)

    dP = scale * (dOc @ Vn_b.transpose(-1, -2)) * tc.decay_matrix(Gc, strict=False)
    dq_state = dOc @ Sb.transpose(-1, -2)
    dq = rnd(dP) @ Kc + (scale * gam)[..., None] * dq_state
    dA = -(rnd_da(Y) @ rnd_da(Vn).transpose(-1, -2)).tril(-1)
    dKD = bt[..., :, None] * dA * D_strict
    dk = (rnd(dP).transpose(-1, -2) @ Qc + rnd(dKD) @ Kc + rnd(dKD).transpose(-1, -2) @ Kc
          + rho[..., None] * (Vn_b @ dS_b.transpose(-1, -2)) - bgY @ Sb.transpose(-1, -2))
    dbeta = (Y * W).sum(-1) + (dA * KKt * D_strict).sum(-1)
    dg = _decay_gradient(Qc, Gc, bt, Y, KS, Vn, dq_state, dVn_state, dP.tril(-1) * QKt, dKD * KKt, Sb, dS, scale)
    return ChunkGrads(dq, dk, bt[..., None] * Y, dbeta, dg, dS_in)


def _decay_gradient(Qc, Gc, bt, Y, KS, Vn, dq_state, dVn_state, dlogD_p, dlogD_a, Sb, dS, scale: float):
    """dg of one chunk (after its reverse cumsum) from dG: Γ in o (scale Γ q·(dO S_bᵀ)) and in X (−βΓ Y·KS), D in
    P and in A (rowsum − colsum of dlogD, the diagonal left out: it cancels exactly), then the update's ρ and γ,
    added after the cumsum so that nothing cancels: t_i = V_new_i·(ρ⊙K dS)_i reaches G_C as +t_i and G_i as −t_i,
    so row i keeps Σ_{j<i} t_j (an exclusive cumsum; summed before the reverse cumsum, the last token's t_C and
    −t_C would cancel at O(1) where the true dg is e^{−100} small), and γ Σ S_b⊙dS reaches every row."""
    gam = Gc.exp()
    dG = scale * gam * (Qc * dq_state).sum(-1) - bt * gam * (Y * KS).sum(-1)
    dG = dG + _rowsum_minus_colsum(dlogD_p) + _rowsum_minus_colsum(dlogD_a)
    t = (Vn * dVn_state).sum(-1)
    before = torch.nn.functional.pad(t.cumsum(-1)[..., :-1], (1, 0))
    d_gamma = Gc[..., -1].exp() * (Sb * dS).sum((-1, -2))
    return tc.chunk_local_cumsum_bwd_ref(dG) + before + d_gamma[..., None]


def warp_scan_dg_ref(dG: torch.Tensor, t: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The role-split walk's dg finish (``chunk_bwd_roles``' ``dg_scan``), transcribed: dg_i = Σ_{j ≥ i} dG_j +
    Σ_{j < i} t_j + tail over a chunk's 64 rows ``[..., 64]`` (tail ``[...]``), on 32 lanes that hold rows 2l and
    2l + 1: the pairs' suffix sums by shuffles down and prefix sums by shuffles up (five steps each, a lane keeping a
    shuffled value only from within the warp), then the neighbours' inclusive sums one more shuffle away. The same
    adds in the same order as the kernel's; :func:`_decay_gradient` forms the same sums directly."""
    lanes = dG.shape[-1] // 2
    d0, d1, t0, t1 = dG[..., 0::2], dG[..., 1::2], t[..., 0::2], t[..., 1::2]
    lane = torch.arange(lanes, device=dG.device)
    zero = torch.zeros((), dtype=dG.dtype, device=dG.device)

    def down(x, n):       # lane l reads lane l + n (zero past the warp's end)
        return torch.where(lane + n < lanes, torch.roll(x, -n, -1), zero)

    def up(x, n):         # lane l reads lane l − n (zero before its start)
        return torch.where(lane >= n, torch.roll(x, n, -1), zero)

    suffix, prefix = d0 + d1, t0 + t1
    for u in range(5):
        suffix, prefix = suffix + down(suffix, 1 << u), prefix + up(prefix, 1 << u)
    after, before = down(suffix, 1), up(prefix, 1)
    tail = tail[..., None]
    even = suffix + before + tail
    odd = (d1 + after) + (before + t0) + tail
    return torch.stack((even, odd), -1).flatten(-2)


class _Chunks(NamedTuple):
    """The walk's inputs in chunks ``[B, HV, NT, BT, (d)]``, working dtype."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    gc: torch.Tensor
    beta: torch.Tensor
    a_inv: torch.Tensor


def reverse_walk_ref(x: _Chunks, h: torch.Tensor, dS: torch.Tensor, first: int, end: int, scale: float, rnd,
                     rnd_da) -> tuple[list[ChunkGrads], torch.Tensor]:
    """The fused walk over chunks [first, end) in reverse from dS (the gradient of the state leaving chunk end − 1):
    each chunk's gradients (in chunk order) and the gradient of the state entering chunk ``first``."""
    grads = [None] * (end - first)
    for c in reversed(range(first, end)):
        grads[c - first] = reverse_chunk_ref(x.q[:, :, c], x.k[:, :, c], x.v[:, :, c], x.do[:, :, c], x.gc[:, :, c],
                                             x.beta[:, :, c], x.a_inv[:, :, c], h[:, :, c], dS, scale, rnd, rnd_da)
        dS = grads[c - first].dS_in
    return grads, dS


def reverse_maps_ref(x: _Chunks, cuts: list[tuple[int, int]], scale: float, rnd) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase A of the segmented backward: per segment [first, end) the reverse walk of the K × (K + V) gradient
    [I | 0] with dO widened to [0 | dO] (the chain alone, which reads no state). Returns (Mᵀ ``[S, B, HV, K, K]``,
    D ``[S, B, HV, K, V]``): dS_in = Mᵀ dS_out + D over the segment, M the forward's own segment map."""
    B, HV, _, _, K = x.k.shape
    wide_do = torch.cat([x.do.new_zeros(*x.do.shape[:-1], K), x.do], -1)
    eye = torch.eye(K, dtype=x.k.dtype, device=x.k.device).expand(B, HV, K, K)
    start = torch.cat([eye, x.do.new_zeros(B, HV, K, x.do.shape[-1])], -1)
    maps = []
    for first, end in cuts:
        dS = start
        for c in reversed(range(first, end)):
            dS = reverse_chain_ref(x.q[:, :, c], x.k[:, :, c], x.gc[:, :, c], x.beta[:, :, c], x.a_inv[:, :, c],
                                   wide_do[:, :, c], dS, scale, rnd)[2]
        maps.append(dS)
    maps = torch.stack(maps)
    return maps[..., :K], maps[..., K:]


def reverse_scan_ref(Mt: torch.Tensor, D: torch.Tensor, dht: torch.Tensor) -> torch.Tensor:
    """The gradients of the states leaving each segment ``[S, B, HV, K, V]``, from the last segment's (dht) back,
    in segment order (deterministic): dS_out(s − 1) = Mᵀ_s dS_out(s) + D_s."""
    outs = [dht]
    for s in reversed(range(1, Mt.shape[0])):
        outs.append(Mt[s] @ outs[-1] + D[s])
    return torch.stack(outs[::-1])


def reverse_warm_ups_ref(bound: torch.Tensor, cuts: list[tuple[int, int]], threshold: float = NEGLIGIBLE_LOG2,
                         cap: Optional[int] = None) -> torch.Tensor:
    """``[S, B, HV]`` int64: per segment the fewest w ≥ 1 chunks after it whose bounds (``bound [B, HV, NT]``, the
    forward's chunk sums in log2 units: ``map_bound.chunk_bounds``) sum, nearest first in fp32, below
    ``threshold``; where none do, every chunk to the sequence's end (the walk then starts from dht: exact), or
    ``cap`` chunks where that is fewer. The last segment's is 0."""
    return _warm_search(bound, cuts, threshold, cap)[0]


def _warm_search(bound: torch.Tensor, cuts: list[tuple[int, int]], threshold: float, cap: Optional[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reverse_warm_ups_ref`'s w and whether each sum fell below the threshold (both ``[S, B, HV]``)."""
    NT = bound.shape[-1]
    warm, founds = [], []
    for _, end in cuts:
        most = NT - end if cap is None else min(NT - end, cap)
        w = torch.full(bound.shape[:2], most, dtype=torch.int64, device=bound.device)
        run = torch.zeros(bound.shape[:2], dtype=torch.float32, device=bound.device)
        found = torch.zeros(bound.shape[:2], dtype=torch.bool, device=bound.device)
        for j in range(1, most + 1):
            run = run + bound[..., end + j - 1].float()
            hit = ~found & (run < threshold)
            w = w.masked_fill(hit, j)
            found |= hit
        warm.append(w)
        founds.append(found)
    return torch.stack(warm), torch.stack(founds)


def reverse_warm_map_flags_ref(bound: torch.Tensor, segments: int, threshold: float = NEGLIGIBLE_LOG2
                               ) -> torch.Tensor:
    """The capped warm-ups' ``map_flags`` ``[B·S, HV]`` int32 (``chunk_bwd.reverse_warm_ups_hopper``'s; read by
    ``reverse_maps.py``): segment s + 1's flag is 3 (its map M walked, the scan applies it) where segment s's
    warm-up, capped at one segment, neither fell below the threshold nor reached the sequence's end; every other
    flag 2 (the first segment's always)."""
    NT = bound.shape[-1]
    cuts = segment_cuts(NT, segments)
    warm, found = _warm_search(bound, cuts, threshold, NT // segments)
    ends = torch.tensor([end for _, end in cuts], device=bound.device)[:, None, None]
    capped = ~found & (ends + warm < NT)                                   # [S, B, HV]
    flags = torch.full(warm.shape, 2, dtype=torch.int32, device=bound.device)
    flags[1:] = torch.where(capped[:-1], 3, 2).int()
    return flags.transpose(0, 1).reshape(-1, bound.shape[1])


def reverse_warm_ref(x: _Chunks, cuts: list[tuple[int, int]], warm: torch.Tensor, dht: torch.Tensor, scale: float,
                     rnd) -> torch.Tensor:
    """The gradients of the states leaving each segment ``[S, B, HV, K, V]`` from reverse warm-ups: for segment s
    and each head, the chain alone (no state needed) from zero at w chunks after the segment's end, or from dht where
    w reaches the sequence's end. Its error is the skipped chunks' map applied to the true gradient there: below
    2^threshold of its norm."""
    NT = x.k.shape[2]
    outs = []
    for (_, end), w in zip(cuts, warm):
        top = end + int(w.max())
        dS = dht if top == NT else torch.zeros_like(dht)
        for c in reversed(range(end, top)):
            dS = torch.where((c >= end + w)[..., None, None], torch.zeros_like(dS), dS)   # not yet started: zero
            dS = reverse_chain_ref(x.q[:, :, c], x.k[:, :, c], x.gc[:, :, c], x.beta[:, :, c], x.a_inv[:, :, c],
                                   x.do[:, :, c], dS, scale, rnd)[2]
        outs.append(dS)
    return torch.stack(outs)


def reverse_warm_ups_hopper_ref(q, k, do, gc, beta, a_inv, bound, dht: Optional[torch.Tensor], scale: float,
                                segments: int, operand_dtype: Optional[torch.dtype] = torch.bfloat16,
                                capped: bool = False) -> torch.Tensor:
    """The twin of ``chunk_bwd.reverse_warm_ups_hopper`` (its layouts and contract): dS_out ``[B·S, HV, K, V]``
    (the working dtype), segment s of sequence b at b·S + s, from the whole sequences' q, k ``[B, T, H, K]``, do
    ``[B, T, HV, V]``, gc, β ``[B, HV, NT·64]`` head-major, T ``[B, T, HV, 64]`` (without β), the chunk bounds
    ``bound [B, HV, NT]`` and dht; ``segments`` = S divides NT. w as the kernel finds it
    (:func:`reverse_warm_ups_ref`: fp32 sums, nearest first; ``capped``: one segment at most, the kernel's flags
    :func:`reverse_warm_map_flags_ref`), then :func:`reverse_warm_ref`."""
    work = _work_dtype(q)
    rnd = rounder(work, operand_dtype)
    B, T, H, K = q.shape
    HV, V = do.shape[2:]
    NT = bound.shape[-1]
    if NT % segments:
        raise ValueError(f"segments ({segments}) must divide the {NT} chunks")
    x = _Chunks(_expand_heads(q, HV, work), _expand_heads(k, HV, work), None, tc.to_chunks(do.to(work), BT),
                _head_major_chunks(gc.to(work)), _head_major_chunks(beta.to(work)),
                tc.to_chunks(a_inv.to(work), BT))
    cuts = segment_cuts(NT, segments)
    dS_last = dht.to(work) if dht is not None else x.do.new_zeros(B, HV, K, V)
    warm = reverse_warm_ups_ref(bound, cuts, cap=NT // segments if capped else None)
    dS_out = reverse_warm_ref(x, cuts, warm, dS_last, scale, rnd)                             # [S, B, HV, K, V]
    return dS_out.transpose(0, 1).reshape(B * segments, HV, K, V)


def segment_cuts(NT: int, segments: int) -> list[tuple[int, int]]:
    """[first, end) chunks of each of ``segments`` segments: ⌈NT / segments⌉ chunks each, the last one shorter."""
    if segments < 1:
        raise ValueError(f"segments must be at least 1, got {segments}")
    L = -(-NT // segments)
    return [(a, min(a + L, NT)) for a in range(0, NT, L)]


def chunk_bwd_hopper_ref(q, k, v, do, dht: Optional[torch.Tensor], saved: SavedForward, scale: float,
                         segments: int = 1, operand_dtype: Optional[torch.dtype] = torch.bfloat16,
                         da_operands: str = "bf16", warm_bound: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, ...]:
    """The Hopper backward's twin: recompute h from the checkpoints, then (``segments`` > 1) the reverse maps and
    their scan (with ``warm_bound``, the chunks' norm bounds ``[B, HV, NT]``: the reverse warm-ups instead), then the
    fused reverse walk per segment. q, k ``[B, T, H, K]``; v, do ``[B, T, HV, V]``; dht
    ``[B, HV, K, V]`` or None; saved: :func:`forward_for_backward_ref`'s. Returns dq, dk ``[B, T, H, K]`` (the G
    value heads of a group added in head order), dv ``[B, T, HV, V]``, dg, dβ ``[B, T, HV]`` and dh0
    ``[B, HV, K, V]``, all in the working dtype (fp32; float64 for float64 q)."""
    _check(q, k, v, saved.checkpoint_every)
    if do.shape != v.shape:
        raise ValueError(f"do must have v's shape {tuple(v.shape)}, got {tuple(do.shape)}")
    work = _work_dtype(q)
    rnd = rounder(work, operand_dtype)
    B, T, H, K = q.shape
    rnd_da = _da_rounder(da_operands, rnd)
    HV, V = v.shape[2:]
    x = _Chunks(_expand_heads(q, HV, work), _expand_heads(k, HV, work), tc.to_chunks(v.to(work), BT),
                tc.to_chunks(do.to(work), BT), _head_major_chunks(saved.gc.to(work)),
                _head_major_chunks(saved.beta.to(work)), tc.to_chunks(saved.a_inv.to(work), BT))
    NT = x.k.shape[2]
    h = recompute_states_ref(k, v, saved, rnd)
    dS_last = dht.to(work) if dht is not None else x.v.new_zeros(B, HV, K, V)
    cuts = segment_cuts(NT, segments)
    if len(cuts) == 1:
        dS_out = dS_last[None]
    elif warm_bound is not None:
        dS_out = reverse_warm_ref(x, cuts, reverse_warm_ups_ref(warm_bound, cuts), dS_last, scale, rnd)
    else:
        dS_out = reverse_scan_ref(*reverse_maps_ref(x, cuts, scale, rnd), dS_last)
    grads, dh0 = [], None
    for (first, end), dS in reversed(list(zip(cuts, dS_out))):
        seg_grads, dh0 = reverse_walk_ref(x, h, dS, first, end, scale, rnd, rnd_da)
        grads = seg_grads + grads
    dq, dk, dv, dbeta, dg = (tc.from_chunks(torch.stack([getattr(c, n) for c in grads], 2), T)
                             for n in ("dq", "dk", "dv", "dbeta", "dg"))
    heads = rnd if HV > H else (lambda t: t)    # the walk stores dq per value head in bf16 (GVA), dk in fp32
    return group_sum(heads(dq), H), group_sum(dk, H), dv, dg, dbeta, dh0


class SlicePartials(NamedTuple):
    """The V-sliced walk's outputs (:func:`chunk_bwd_v_slices_ref`), NV = V / BV slices. dv and dh0 are complete
    (each slice writes its own columns); dq, dk are per value head, the slices added (:func:`slice_sum_ref`); dg, dβ
    are per-slice partials. :func:`sum_partials_ref` adds the rest."""
    dq: torch.Tensor        # [B, T, HV, K] per value head
    dk: torch.Tensor        # [B, T, HV, K]
    dv: torch.Tensor        # [B, T, HV, V]
    dg: torch.Tensor        # [NV, B, T, HV]
    dbeta: torch.Tensor     # [NV, B, T, HV]
    dh0: torch.Tensor       # [B, HV, K, V]


def chunk_bwd_v_slices_ref(q, k, v, do, dht: Optional[torch.Tensor], saved: SavedForward, scale: float, BV: int,
                           operand_dtype: Optional[torch.dtype] = torch.bfloat16, da_operands: str = "bf16"
                           ) -> SlicePartials:
    """The unsegmented walk run once per V slice of width ``BV`` (the kernel's programs: one per sequence, value
    head and slice), each slice's walk reading only its columns of v, dO, h and dht. The reverse step is
    column-separable in V: KS, X, V_new, dV_new, Y and the dS chain (left products) live in one slice, and every
    other gradient is a sum over V of the slices' contributions (dP = scale (dO V_newᵀ) ⊙ D and dA = −Y V_newᵀ
    are, and dq, dk, dβ, dg are linear in them and in the slices' own row sums, t and γ Σ h⊙dS included), so the
    slices' chains need no exchange: their dq, dk tiles added per chunk (the kernel does so in its cluster,
    :func:`slice_sum_ref`'s order) and :func:`sum_partials_ref` of the rest is the whole-V walk (float64: to
    rounding). Arguments as :func:`chunk_bwd_hopper_ref`'s."""
    _check(q, k, v, saved.checkpoint_every)
    V = v.shape[-1]
    if BV < 1 or V % BV:
        raise ValueError(f"BV must divide V = {V}, got {BV}")
    work = _work_dtype(q)
    rnd = rounder(work, operand_dtype)
    rnd_da = _da_rounder(da_operands, rnd)
    B, T, H, K = q.shape
    HV = v.shape[2]
    x = _Chunks(_expand_heads(q, HV, work), _expand_heads(k, HV, work), tc.to_chunks(v.to(work), BT),
                tc.to_chunks(do.to(work), BT), _head_major_chunks(saved.gc.to(work)),
                _head_major_chunks(saved.beta.to(work)), tc.to_chunks(saved.a_inv.to(work), BT))
    h = recompute_states_ref(k, v, saved, rnd)
    dS_last = dht.to(work) if dht is not None else x.v.new_zeros(B, HV, K, V)
    slices = []
    for v0 in range(0, V, BV):
        cols = slice(v0, v0 + BV)
        xs = x._replace(v=x.v[..., cols], do=x.do[..., cols])
        grads, dh0 = reverse_walk_ref(xs, h[..., cols], dS_last[..., cols], 0, x.k.shape[2], scale, rnd, rnd_da)
        slices.append(([tc.from_chunks(torch.stack([getattr(c, n) for c in grads], 2), T)
                        for n in ("dq", "dk", "dv", "dg", "dbeta")], dh0))
    part = lambda i: torch.stack([s[0][i] for s in slices])
    heads = rnd if HV > H else (lambda t: t)    # the slices' dq stored per value head in bf16 (GVA), dk in fp32
    return SlicePartials(heads(slice_sum_ref(part(0))), slice_sum_ref(part(1)),
                         torch.cat([s[0][2] for s in slices], -1),
                         part(3), part(4), torch.cat([s[1] for s in slices], -1))


def slice_sum_ref(parts: torch.Tensor) -> torch.Tensor:
    """``[NV, B, T, HV, K]`` → ``[B, T, HV, K]``: the slices' dq (or dk) added as the walk adds them, chunk by chunk:
    at its step s (chunks counted from the sequence's last, s = NT − 1 − c) slice o = s mod NV owns the chunk and
    adds the others to its tile in the cyclic order o + 1, o + 2, ... (mod NV): ((p_o + p_{o+1}) + p_{o+2}) + ..."""
    NV, T = parts.shape[0], parts.shape[2]
    NT = -(-T // BT)
    out = torch.empty_like(parts[0])
    for c in range(NT):
        rows, owner = slice(c * BT, (c + 1) * BT), (NT - 1 - c) % NV
        total = parts[owner, :, rows]
        for i in range(1, NV):
            total = total + parts[(owner + i) % NV, :, rows]
        out[:, rows] = total
    return out


def sum_partials_ref(p: SlicePartials, H: int) -> tuple[torch.Tensor, ...]:
    """dq, dk ``[B, T, H, K]``, dv, dg, dβ ``[B, T, HV]``, dh0 from :class:`SlicePartials`: dq, dk's value heads of
    each group added in head order, dg, dβ's slices in slice order (the host's fixed-order reductions)."""
    total = lambda x: functools.reduce(torch.add, x.unbind(0))
    return group_sum(p.dq, H), group_sum(p.dk, H), p.dv, total(p.dg), total(p.dbeta), p.dh0


def group_sum(x: torch.Tensor, H: int) -> torch.Tensor:
    """``[B, T, HV, d]`` → ``[B, T, H, d]``: the G = HV / H value heads of each group added in head order (the
    kernel's fixed order: no atomics, the same bits every run)."""
    parts = x.view(*x.shape[:2], H, x.shape[2] // H, x.shape[3]).unbind(3)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total
