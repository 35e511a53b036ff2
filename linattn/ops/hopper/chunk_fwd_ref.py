"""The Hopper forward's PyTorch twins: the fused kernel's arithmetic chunk by chunk (``chunk_fwd.py``), rounding to
bf16 exactly where the kernel does, for tests of what runs around the kernel (the segmented forward, the warm-ups)
on a machine without the GPU and as the reference its GPU checks compare against. With the working dtype as the
operand dtype nothing is rounded: the algebra alone, equal to the token-by-token recurrence
(tests/ops/test_hopper_fwd.py)."""
from __future__ import annotations

from typing import Optional

import torch

from . import chunk_fwd
from .chunk_fwd import BT
from .prepass import LOG_DECAY_FLOOR


def chunk_fwd_hopper_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float, initial_state: Optional[torch.Tensor],
                         operand_dtype: torch.dtype = torch.bfloat16,
                         round_a_inv: bool = False, deferred_decay: bool = True, fold_p_decay: bool = True,
                         decay_limit: float = chunk_fwd.DEFERRED_DECAY_LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's PyTorch twin, chunk by chunk in fp32 (float64 for float64 inputs), rounding to
    ``operand_dtype`` exactly where the kernel does: the state as the operand of K S and Q S, P, V_new as P V_new's
    operand, and the decayed V_new of the state update (A_inv X stays in the working precision; with
    ``round_a_inv``, the kernel's bf16 A_inv, A_inv and X are rounded too). With ``operand_dtype`` the working dtype
    nothing is rounded: the algebra alone, equal to the token-by-token reference. ``deferred_decay``,
    ``fold_p_decay``: the state kept over its decay and P's decays folded into o's rows and V_d, as the kernel does
    (:func:`_walk_ref`; off: the plain algebra, for tests that the two agree), renormalising where the state's
    scale would pass ``decay_limit`` e-folds (the kernel's :data:`chunk_fwd.DEFERRED_DECAY_LIMIT`). g: the log
    decays (not their cumulative sums); A_inv comes from ``kkt_solve_ref``. Returns o ``[B, T, HV, V]`` in v's dtype
    and the final state ``[B, HV, K, V]`` in the working dtype."""
    from ..gated_delta import torch_chunk as tc
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    rnd = (lambda t: t) if operand_dtype == work else (lambda t: t.to(operand_dtype).to(work))
    HV = v.shape[2]
    kc = tc.to_chunks(k.to(work).repeat_interleave(HV // q.shape[2], 2), BT)
    g = g.clamp_min(LOG_DECAY_FLOOR)        # as the pre-pass reads it
    gc = tc.chunk_local_cumsum_ref(tc.to_chunks(g.to(work), BT))
    a_inv = tc.kkt_solve_ref(kc, tc.to_chunks(beta.to(work), BT), gc)
    return _walk_ref(q, k, v, gc, beta, a_inv if not round_a_inv else rnd(a_inv), scale, initial_state, work, rnd,
                     rnd if round_a_inv else (lambda t: t), scale_in_p=fold_p_decay and deferred_decay,
                     deferred_decay=deferred_decay, fold_p_decay=fold_p_decay, decay_limit=decay_limit)


def chunk_fwd_hopper_hm_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gc_hm: torch.Tensor,
                            beta_hm: torch.Tensor, a_inv: torch.Tensor, scale: float,
                            initial_state: Optional[torch.Tensor], affine: bool = False,
                            skip_m: Optional[torch.Tensor] = None, warm_chunks: Optional[torch.Tensor] = None,
                            beta_in_a_inv: bool = True, warm_bound: Optional[torch.Tensor] = None,
                            warm_threshold: Optional[float] = None, lean: bool = False,
                            deferred_decay: bool = True, fold_p_decay: bool = True, m_only: bool = False,
                            **launch) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """The twin of :func:`chunk_fwd_hopper_hm` (same arguments and results; ``launch``, the kernel's tile and
    pipeline keywords BV, threads, num_stages, changes no value), from the pre-pass's gc, β (head-major) and A_inv
    instead of its own: for tests of what runs around the kernel (the segmented forward) on a machine without the
    GPU. Rounds where the kernel does for bf16 inputs (X too when A_inv is bf16; P with the scale in it), nowhere for
    fp32 and float64 ones. ``beta_in_a_inv``: A_inv is A_inv diag(β), as the kernel's (the pre-pass's), and X has no
    β; False: the plain A_inv, X = β ⊙ (V − Γ ⊙ K S), for references built from it. ``deferred_decay``,
    ``fold_p_decay``: as the kernel (:func:`_walk_ref`; off: the plain algebra).
    ``affine``: the walk of [I | 0] with values [0 | V], o None; ``skip_m`` ``[B, HV]``: 1 or 2, those maps' M
    written as zeros (the affine walk's negligible maps); ``m_only``: M alone; ``warm_chunks``: the warm walk (one
    walk per segment and value head, from warm_chunks chunks before the segment); ``warm_bound``,
    ``warm_threshold``: the warm walk that plans its warm-ups (``map_bound.warm_from_bound_ref``; initial_state the
    sequences'). ``lean`` (the kernel's): the affine walk's maps flagged 2 come back NaN (the
    kernel leaves them unwritten: whatever the buffer held), and the warm walks return the sequences' final states
    ``[B, HV, K, V]``, with warm_chunks starting every segment whose warm-up is above zero from zero."""
    from ..gated_delta import torch_chunk as tc
    if warm_bound is not None:
        from .map_bound import warm_from_bound_ref
        warm_chunks, from_start = warm_from_bound_ref(warm_bound, q.shape[1] // gc_hm.shape[2], warm_threshold)
        NB, HV = warm_chunks.shape
        K, V = q.shape[-1], v.shape[-1]
        # a warm-up that reaches the sequence's start begins from its initial state, any other from zero
        h0 = torch.zeros(NB, HV, K, V, dtype=torch.float32, device=q.device)
        if initial_state is not None:
            seq = initial_state.float().repeat_interleave(NB // q.shape[0], 0)
            h0 = torch.where(from_start[..., None, None], seq, h0)
        initial_state = h0
    elif warm_chunks is not None and lean:       # the lean kernel starts a warm-up from zero, whatever h0 holds
        initial_state = torch.where(warm_chunks[..., None, None] > 0, 0.0, initial_state)
    if warm_chunks is not None:
        o, ht = _warm_walk_ref(q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state, warm_chunks, beta_in_a_inv,
                               deferred_decay, fold_p_decay)
        return o, (ht.view(q.shape[0], -1, *ht.shape[1:])[:, -1] if lean else ht)
    B, T, H, K = q.shape
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    rnd = (lambda t: t.to(q.dtype).to(work)) if q.dtype in (torch.bfloat16, torch.float16) else (lambda t: t)
    gc = gc_hm[..., :T].transpose(1, 2).to(work)
    gcc = _chunk_cumsums(gc_hm, T, work)
    S0 = initial_state
    if affine:
        v = torch.cat([torch.zeros(*v.shape[:3], K, dtype=v.dtype, device=v.device), v], -1)
        S0 = torch.cat([torch.eye(K, dtype=work, device=q.device).expand(B, v.shape[2], K, K),
                        torch.zeros(B, v.shape[2], K, v.shape[3] - K, dtype=work, device=q.device)], -1)
    rnd_x = rnd if a_inv.dtype == torch.bfloat16 else (lambda t: t)
    beta = torch.ones_like(gc) if beta_in_a_inv else beta_hm[..., :T].transpose(1, 2)
    o, S = _walk_ref(q, k, v, gcc, beta, tc.to_chunks(a_inv.to(work), BT), scale, S0, work, rnd, rnd_x, True,
                     deferred_decay, fold_p_decay)
    if affine and skip_m is not None:
        S, flags = S.clone(), skip_m.int()
        S[(flags == 1) | (flags == 2), :, :K] = 0
        S[flags == 2] = float("nan") if lean else 0
    return (None if affine else o), (S[..., :K] if m_only else S)


def chunk_states_hopper_ref(k: torch.Tensor, v: torch.Tensor, gc_hm: torch.Tensor, beta_hm: torch.Tensor,
                            t_inv: torch.Tensor, initial_state: Optional[torch.Tensor],
                            warm_chunks: Optional[torch.Tensor] = None, warm_bound: Optional[torch.Tensor] = None,
                            warm_threshold: Optional[float] = None, **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of ``walk_launch.chunk_states_hopper``, the walk's ``store_states`` build (same arguments and
    results; ``launch`` changes no value): per chunk ``chunk_bwd_ref.state_step_ref`` — h = S_b = bf16(S),
    X = β ⊙ (V − Γ ⊙ K S_b) rounded, V_new = T X, S ← γ S + Kᵀ bf16(ρ ⊙ V_new) —, rounding where the kernel does for
    bf16 k, nowhere for fp32 and float64 ones. Returns h ``[B, NT, HV, K, V]`` (bf16 for bf16 k, else the working
    dtype) and the final state ``[B, HV, K, V]`` in the working dtype. ``warm_chunks``: phase C of the states in
    segments (:func:`_warm_states_ref`); ``warm_bound`` with ``warm_threshold``: the planned states walk, each
    segment's warm-up found from the chunk bounds (``map_bound.warm_from_bound_ref``), the whole prefix from the
    sequence's initial state where no shorter one is."""
    from ..gated_delta import torch_chunk as tc
    if warm_bound is not None:
        from .map_bound import warm_from_bound_ref
        B, S = k.shape[0], gc_hm.shape[0] // k.shape[0]
        warm, from_start = warm_from_bound_ref(warm_bound, S, warm_threshold)
        entering = (initial_state.repeat_interleave(S, 0) if initial_state is not None else
                    torch.zeros(B * S, v.shape[2], k.shape[3], v.shape[3], dtype=torch.float32, device=k.device))
        return _warm_states_ref(k, v, gc_hm, beta_hm, t_inv, entering, warm, from_start)
    if warm_chunks is not None:
        return _warm_states_ref(k, v, gc_hm, beta_hm, t_inv, initial_state, warm_chunks)
    from .chunk_bwd_ref import state_step_ref
    B, T, H, K = k.shape
    HV = v.shape[2]
    work = torch.float64 if k.dtype == torch.float64 else torch.float32
    rounds = k.dtype in (torch.bfloat16, torch.float16)
    rnd = (lambda t: t.to(k.dtype).to(work)) if rounds else (lambda t: t)
    kc = tc.to_chunks(k.to(work).repeat_interleave(HV // H, 2), BT)
    vc, tc_inv = tc.to_chunks(v.to(work), BT), tc.to_chunks(t_inv.to(work), BT)
    bc = tc.to_chunks(beta_hm[..., :T].transpose(1, 2).to(work), BT)
    gcc = _chunk_cumsums(gc_hm, T, work)
    S = (initial_state.to(work) if initial_state is not None
         else torch.zeros(B, HV, K, v.shape[3], dtype=work, device=k.device))
    hs = []
    for c in range(kc.shape[2]):
        Sb, _, S = state_step_ref(S, kc[:, :, c], vc[:, :, c], gcc[:, :, c], bc[:, :, c], tc_inv[:, :, c], rnd)
        hs.append(Sb)
    return torch.stack(hs, 1).to(k.dtype if rounds else work), S


def _warm_states_ref(k, v, gc_hm, beta_hm, t_inv, initial_state, warm_chunks,
                     from_initial: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of the states walk's phase C (``chunk_states_hopper(warm_chunks=)``): for each segment s and value
    head, the unsegmented twin over the chunks from warm_chunks chunks before the segment to its end, from zero
    where that is above 0 (the lean kernel reads no entering state there), else from initial_state, keeping h of
    the segment's own chunks; the final state is each sequence's last segment's. ``from_initial`` ``[B·S, HV]``
    bool: where to start from initial_state (else zero) instead (the planned walk's: at the sequence's start)."""
    B, T, H, _ = k.shape
    NB, HV, L = gc_hm.shape
    S, G, Lc = NB // B, HV // H, L // BT
    gc_all, beta_all = (x.view(B, S, HV, L).transpose(1, 2).reshape(B, HV, T) for x in (gc_hm, beta_hm))
    hs, finals = [[None] * S for _ in range(B)], []
    for ibs in range(NB):
        b, s = divmod(ibs, S)
        row, last = [], []
        for hv in range(HV):
            w = int(warm_chunks[ibs, hv])
            start = w == 0 if from_initial is None else bool(from_initial[ibs, hv])
            r0, r1, ih = (s * Lc - w) * BT, (s + 1) * L, hv // G
            h0 = initial_state[ibs:ibs + 1, hv:hv + 1]
            h, ht = chunk_states_hopper_ref(k[b:b + 1, r0:r1, ih:ih + 1], v[b:b + 1, r0:r1, hv:hv + 1],
                                            gc_all[b:b + 1, hv:hv + 1, r0:r1], beta_all[b:b + 1, hv:hv + 1, r0:r1],
                                            t_inv[b:b + 1, r0:r1, hv:hv + 1], h0 if start else torch.zeros_like(h0))
            row.append(h[0, w:, 0])
            last.append(ht[0, 0])
        hs[b][s] = torch.stack(row, 1)                      # [Lc, HV, K, V]
        if s == S - 1:
            finals.append(torch.stack(last))
    return torch.stack([torch.cat(seq, 0) for seq in hs]), torch.stack(finals)


def _chunk_cumsums(gc_hm: torch.Tensor, T: int, work: torch.dtype) -> torch.Tensor:
    """Head-major chunk-local cumulative decays ``[B, HV, Tp]`` → ``[B, HV, NT, 64]`` in ``work``, the last chunk
    padded with its last value (its rows past T decay nothing): back to per-token decays, chunked, summed again."""
    from ..gated_delta import torch_chunk as tc
    gc = gc_hm[..., :T].transpose(1, 2).to(work)
    g = gc.clone()
    g[:, 1:] -= gc[:, :-1]
    g[:, ::BT] = gc[:, ::BT]
    return tc.chunk_local_cumsum_ref(tc.to_chunks(g, BT))


def _warm_walk_ref(q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state, warm_chunks, beta_in_a_inv,
                   deferred_decay, fold_p_decay):
    """The warm kernel's twin: for each segment s and value head, the plain walk over the rows from warm_chunks
    chunks before the segment to its end, from initial_state, keeping o of the segment's own rows."""
    B, T, H, _ = q.shape
    NB, HV, L = gc_hm.shape
    S, G = NB // B, HV // H
    # gc and β per segment back to whole sequences [B, HV, T] (L is a multiple of 64: no padding)
    gc_all, beta_all = (x.view(B, S, HV, L).transpose(1, 2).reshape(B, HV, T) for x in (gc_hm, beta_hm))
    o = torch.empty_like(v)
    hts = []
    for ibs in range(NB):
        b, s = divmod(ibs, S)
        row = []
        for hv in range(HV):
            r0, r1 = s * L - int(warm_chunks[ibs, hv]) * BT, (s + 1) * L
            ih = hv // G
            sl = (slice(b, b + 1), slice(r0, r1))
            oo, ht = chunk_fwd_hopper_hm_ref(q[sl][:, :, ih:ih + 1], k[sl][:, :, ih:ih + 1], v[sl][:, :, hv:hv + 1],
                                             gc_all[b:b + 1, hv:hv + 1, r0:r1], beta_all[b:b + 1, hv:hv + 1, r0:r1],
                                             a_inv[sl][:, :, hv:hv + 1], scale, initial_state[ibs:ibs + 1, hv:hv + 1],
                                             beta_in_a_inv=beta_in_a_inv,
                                             deferred_decay=deferred_decay, fold_p_decay=fold_p_decay)
            o[b, s * L:r1, hv] = oo[0, r1 - r0 - L:, 0]
            row.append(ht[0, 0])
        hts.append(torch.stack(row))
    return o, torch.stack(hts)


def _walk_ref(q, k, v, gc, beta, a_inv, scale, initial_state, work, rnd, rnd_x, scale_in_p=False,
              deferred_decay=False, fold_p_decay=False, decay_limit=chunk_fwd.DEFERRED_DECAY_LIMIT):
    """The kernel's chunk loop in PyTorch: gc ``[B, HV, NT, BT]`` chunk-local cumulative decays, a_inv
    ``[B, HV, NT, BT, BT]``; rnd rounds the kernel's bf16 dot operands, rnd_x the right operand X of A_inv X;
    ``scale_in_p``: the scale multiplies P before its rounding and Γ (as the kernel), else o at the end.
    ``deferred_decay``: S holds the state over a = e^la (per sequence and head), Γ and ρ carry a's factor, and S is
    multiplied only where la + ln γ falls below −``decay_limit`` (the kernel's deferred decay; without rounding the
    same algebra). ``fold_p_decay`` (with both): in the chunks that do
    not renormalise, o = Γ a scale ⊙ (Q S + P V_d) with P the masked Q Kᵀ alone, rounded, and V_d = ρ / (a γ) ⊙
    V_new, rounded, the update's operand. Non-finite inputs as the kernel takes them (its module docstring): X 0
    where Γ or v is not finite, V_d 0 where ρ is; a non-finite v makes o NaN from its row on and the state NaN
    (la, or S without ``deferred_decay``). The kernel does so per V tile, the twin per row (every column)."""
    from ..gated_delta import torch_chunk as tc
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    fold_p_decay = fold_p_decay and deferred_decay and scale_in_p      # the kernel's condition
    qc, kc = (tc.to_chunks(x.to(work).repeat_interleave(HV // H, 2), BT) for x in (q, k))
    vc, bc = tc.to_chunks(v.to(work), BT), tc.to_chunks(beta.to(work), BT)
    S = (initial_state.to(work) if initial_state is not None
         else torch.zeros(B, HV, K, V, dtype=work, device=q.device))
    la = torch.zeros(B, HV, dtype=work, device=q.device)    # ln a: S is the state over a (deferred_decay), else 0
    outs = []
    for c in range(qc.shape[2]):
        Qc, Kc, Vc, bt, Gc = qc[:, :, c], kc[:, :, c], vc[:, :, c], bc[:, :, c], gc[:, :, c]
        g_last = Gc[..., -1]
        Sb = rnd(S)
        gam = (Gc + la[..., None]).exp()
        # the kernel's selects (its module docstring): X = 0 where Γ or v is not finite; o's rows from the chunk's
        # first non-finite v on NaN, and the state dead from there (la NaN)
        v_ok = torch.isfinite(Vc)
        v_dead = (~v_ok).any(-1).cummax(-1).values                  # [B, HV, BT]: rows from the first on
        X = torch.where(torch.isfinite(gam)[..., None] & v_ok, bt[..., None] * (Vc - gam[..., None] * (Kc @ Sb)), 0.0)
        Vn = a_inv[:, :, c] @ rnd_x(X)
        if scale_in_p:
            P = rnd(scale * tc.qk_decay_ref(Qc, Kc, Gc))
            out = (scale * gam)[..., None] * (Qc @ Sb) + P @ rnd(Vn)
        else:
            P = rnd(tc.qk_decay_ref(Qc, Kc, Gc))
            out = scale * (gam[..., None] * (Qc @ Sb) + P @ rnd(Vn))
        if deferred_decay:
            # S over a γ where that stays within the limit (ρ then carries 1 / (a γ)); else S renormalised
            renorm = la + g_last < -decay_limit
            rho = (torch.where(renorm, g_last, -la)[..., None] - Gc).exp()
            la = torch.where(v_dead[..., -1], float("nan"), la)
            S = torch.where(renorm[..., None, None], (la + g_last).exp()[..., None, None] * S, S)
            la = torch.where(renorm, torch.zeros_like(la), la + g_last)
        else:
            rho = (g_last[..., None] - Gc).exp()
            S = torch.where(v_dead[..., -1, None, None], float("nan"), g_last.exp()[..., None, None] * S)
        Vd = torch.where(torch.isfinite(rho)[..., None], rnd(rho[..., None] * Vn), 0.0)
        if fold_p_decay:
            masked = rnd((Qc @ Kc.transpose(-1, -2)).tril())
            folded = (scale * gam)[..., None] * (Qc @ Sb + masked @ Vd)
            out = torch.where(renorm[..., None, None], out, folded)
        outs.append(torch.where(v_dead[..., None], float("nan"), out))
        S = S + Kc.transpose(-1, -2) @ Vd
    return tc.from_chunks(torch.stack(outs, 2), T).to(v.dtype), la.exp()[..., None, None] * S
