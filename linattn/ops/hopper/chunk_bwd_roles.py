"""Hopper backward (TileLang): the fused reverse walk split by roles (docs/backward.md §11), one program of 512
threads per (sequence, value head) over the whole V, built for K = V in :data:`SIZES`: at 128 in place of
``chunk_bwd.py``'s two V slices per head and their exchange of dq and dk, at 64 in place of its one slice. The
backward (``backward.choose_walk``) takes it where the segment model prices it below the slice walk, and always at
K = V = 64 (the slice walk's width there is V); ``benchmarks/gpu_check_roles_walk.py`` checks and times it beside
that walk at K = V = 128. Twin: the slice walk's, ``chunk_bwd_ref.reverse_walk_ref`` (the same operations and
rounding points, on the whole V).

Four warpgroups, each a role with its own registers (``T.set_max_nreg``, :data:`REGISTERS`):

    S (threads 0-127, 160 registers)      the chain's state: dS (K × V fp32) in its registers; γ Σ h⊙dS; dS·γ +
                                          scale·Qᵀ(Γ⊙dO) (hi + lo operands) as soon as the chunk lands; C3 = Kᵀ
                                          bf16(−βΓY); dS published as bf16 hi + lo for the next chunk's C1
    B (128-255, 168)                      C1 = K [dS_hi; dS_lo] and K S, X = β(V − Γ K S), V_new = T X, t =
                                          rowsum(V_new ⊙ ρ K dS) (both fp32), dV_new = scale Pᵀ dO + ρ K dS, Y =
                                          Tᵀ bf16(dV_new), bf16 Y and bf16(−βΓY); the X terms from fp32 Y and K S
                                          (formed again: its fragment held V_new since); dv = βY; dk = ρ⊙(V_new
                                          dS_hiᵀ) + dKD K + dKDᵀ K + dPᵀ Q − bf16(βΓY) hᵀ; dq = dP K + scale
                                          Γ⊙(dO hᵀ), whose second term gives dG's Γ term scale Γ q·(dO hᵀ)
    A (256-383, 160)                      Q Kᵀ, P; dP and its dlogD; dA = −Y V_newᵀ, K Kᵀ, dKD (the column sums of
                                          dlogD's and dA's products through fp32 tiles in shared memory,
                                          ``SUMS_SLOTS``); then, under the next chunk's loads, dβ and dg (its
                                          reverse and forward cumsums by warp scans)
    producer (384-511, 24)                one warp's TMA copies of each chunk's tiles, the warpgroup's loads of
                                          gc and β

The chunk's step is lock-stepped: the producer loads chunk s + 1 once every consumer has arrived at ``end`` for
chunk s (every input slot is read to the chunk's end, and the formed tiles take the slots of inputs that are dead:
the chunk's vectors share one tile), and the roles hand tiles to each other through mbarriers, one phase per chunk
(parity s mod 2). Shared memory: 226 KB with the mbarriers at K = V = 128, 130 KB at 64. Hand-offs (role → role:
what is ready):

    full      producer → all   the chunk's inputs (TMA transaction count)
    ready_p   A → B            P (bf16, masked, decayed) in ``PdP``
    ready_v   B → A            bf16 V_new in ``XVn``
    read_p    B → A            Pᵀ dO issued and done: ``PdP`` may take dP
    free_g    S → B            Qᵀ(Γ⊙dO) done: ``Gh``, ``Gl`` may take dV_new, Y and Y·(−βΓ); Σ h⊙dS's shares in ``vec``
    ready_y   B → S, A         bf16 Y in ``Gh``, bf16(−βΓY) in ``Gl``
    ready_dp  A → B            dP (bf16) in ``PdP``
    ready_dkd A → B            dKD (bf16) in ``TdKD`` (B's two dots on T done before ready_y)
    ready_xt  B → A            t, the X terms of dG and dβ, and dG's Γ term, in ``vec``
    read_ds   B → S            C1 and dk's first dot done: S may overwrite dS hi + lo
    end       S, A, B → producer   every tile and the rows gc, β read (A: before its dg finish)
    read_vec  A → B            dg's finish has read t, dG's X terms and dβ's: B may write them for the next chunk
    read_sums A → S            dlogD's column sums have read ``sumsD``: S may overwrite dS lo (its slot)
    read_v    B → A            the X terms have read v: A may write ``sumsA`` (v's slot)
"""
import functools  # no "from __future__ import annotations": TileLang reads the kernel's annotations as objects
import math
import types
from typing import Optional

import torch

from . import chunk_bwd
from .chunk_fwd import BT, compile_prim_func, launcher
from .compile import tile_dtype
from .timeline import ROLE_POINTS, ROLE_SLOTS, recorded_steps, role_stamps_shape

NEG = -1.0e30       # an exponent whose exp is 0 (masked decays)
THREADS = 512
# registers a thread per role (S, B, A, producer): 4 × 128 in all, the register file at 512 threads
REGISTERS = (160, 168, 160, 24)
SIZES = (64, 128)   # K = V the walk is built for (its shared memory plan: docs/backward.md §11)
ROLES = "".join(ROLE_POINTS)    # the consumer roles "SBA": the chain, the value side, the key side
# A's column sums read its fp32 products from these tiles (dlogD's, dA's), at K = V = 128 in the slots of tiles dead
# meanwhile: dS lo from B's C1 to S's split (read_sums), v from B's X terms (read_v) to the next chunk's loads
SUMS_SLOTS = dict(sumsD="dSl", sumsA="Vs")
# rows of the chunk's vector tile ``vec`` (alloc_tiles); S's 128 shares of Σ h⊙dS fill rows H_SHARES and H_SHARES + 1
GC, BETA, TS, XG, XB, DG, H_SHARES = range(7)


def alloc_tiles(K: int, V: int, **program) -> types.SimpleNamespace:
    """The program's shared tiles (inputs, and the formed tiles in the slots they share: module docstring), register
    fragments of each role, and mbarriers, with ``program``'s indices and tensors beside them (call inside the
    kernel; a TileLang macro sees only its arguments)."""
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"
    shared = dict(
        Qs=((BT, K), bf), Ks=((BT, K), bf), Vs=((BT, V), bf), dOs=((BT, V), bf), Hs=((K, V), bf),
        TdKD=((BT, BT), bf),        # T, then dKD
        dSh=((K, V), bf), dSl=((K, V), bf),
        PdP=((BT, BT), bf),         # P, then dP
        XVn=((BT, V), bf),          # X, then bf16 V_new
        Gh=((BT, V), bf),           # Γ⊙dO hi, then bf16 dV_new, then bf16 Y
        Gl=((BT, V), bf),           # Γ⊙dO lo, then bf16(−βΓY)
        # the chunk's vectors in one tile (each tile starts on a 1 KB boundary): gc and β, B's t and X terms of dG and
        # dβ, A's dG, and S's 128 shares of Σ h⊙dS in the last two rows
        vec=((8, BT), acc))
    if K == max(SIZES):         # shared memory is full: the sums' tiles take the slots of tiles dead meanwhile,
        # each bf16 slot seen whole as fp32 BT × BT tiles
        views = {n: (of, (math.prod(shared[of][0]) // (2 * BT * BT), BT, BT)) for n, of in SUMS_SLOTS.items()}
    else:
        shared.update({n: ((1, BT, BT), acc) for n in SUMS_SLOTS})
        views = {}
    fragments = dict(
        dS=(K, V),                              # S
        F=(BT, V), N=(BT, K), rowsF=(BT,),      # B
        QK=(BT, BT), dP=(BT, BT), rowsA=(BT,), dbA=(BT,))     # A
    arrivals = dict(full=128, init=128, ready_p=128, ready_v=128, read_p=128, free_g=128, ready_y=128,
                    ready_dp=128, ready_dkd=128, read_ds=128, ready_xt=128, read_vec=128, read_sums=128,
                    read_v=128, end=3 * 128)
    tiles = {n: T.alloc_shared(shape, dtype) for n, (shape, dtype) in shared.items()}
    tiles.update({n: T.view(tiles[of], shape, acc) for n, (of, shape) in views.items()})
    tiles.update({n: T.alloc_fragment(shape, acc) for n, shape in fragments.items()})
    tiles.update({n: T.alloc_barrier(arrive_count=count) for n, count in arrivals.items()})
    return types.SimpleNamespace(**tiles, **program)


def _mark_macro(role: str, timed: bool):
    """A TileLang macro ``mark(t, step, point)``: with ``timed`` the timeline build's stamp of ``role``'s point
    (a name in ``timeline.ROLE_POINTS[role]``) at chunk step ``step``; without it nothing."""
    import tilelang.language as T

    if not timed:
        @T.macro
        def mark(t, step, point):
            pass

        return mark
    points = ROLE_POINTS[role]
    stamp = chunk_bwd.timeline_macros(len(ROLE_POINTS), ROLE_SLOTS, first_warpgroup=0).stamp

    @T.macro
    def mark(t, step, point):
        stamp(t, step, points.index(point))

    return mark


def _chain_macro(K: int, V: int, scale: float, state_grads: bool, timed: bool):
    """Role S as a TileLang macro over :func:`alloc_tiles`' namespace (``timed``: with its timeline stamps)."""
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"
    split = chunk_bwd.hi_lo_split_macro(K, V)
    mark = _mark_macro("S", timed)

    @T.macro
    def chain(t):
        """Role S: the state's gradient over the walk."""
        if state_grads:
            T.copy(t.dht[t.ib, t.ihv, 0:K, 0:V], t.dS)
        else:
            T.clear(t.dS)
        split(t)
        T.fence_proxy_async()
        T.mbarrier_arrive(t.init)
        for s in T.serial(t.chunks):
            c = t.chunks - 1 - s
            rows = T.min(BT, t.Tn - c * BT)
            mark(t, s, "top")
            T.mbarrier_wait_parity(t.full, s % 2)
            mark(t, s, "loads")
            g_last = t.vec[GC, rows - 1]
            # γ Σ h⊙dS with the dS leaving the chunk: each thread's share, added by A in its finish
            part = T.alloc_var(acc, init=0.0)
            for i, j in T.Parallel(K, V):
                part += T.cast(t.Hs[i, j], acc) * t.dS[i, j]
            t.vec[H_SHARES + t.tx // BT, t.tx % BT] = part
            for i, j in T.Parallel(K, V):
                t.dS[i, j] = t.dS[i, j] * T.exp(g_last)
            for i, j in T.Parallel(BT, V):       # the lo half from the hi half's rounding, not from Gh (no re-read)
                x = scale * T.exp(t.vec[GC, i]) * T.cast(t.dOs[i, j], acc)
                hi = T.cast(x, bf)
                t.Gh[i, j] = hi
                t.Gl[i, j] = T.cast(x - T.cast(hi, acc), bf)
            T.fence_proxy_async()
            mark(t, s, "gamma_do")
            T.wgmma_gemm(t.Qs, t.Gh, t.dS, transpose_A=True)
            T.wgmma_gemm(t.Qs, t.Gl, t.dS, transpose_A=True)
            T.wait_wgmma(0)
            T.mbarrier_arrive(t.free_g)
            mark(t, s, "q_dots")
            T.mbarrier_wait_parity(t.ready_y, s % 2)
            mark(t, s, "wait_y")
            T.wgmma_gemm(t.Ks, t.Gl, t.dS, transpose_A=True)        # C3: Gl holds bf16(−βΓY) now
            T.wait_wgmma(0)
            mark(t, s, "c3")
            T.mbarrier_wait_parity(t.read_ds, s % 2)
            T.mbarrier_wait_parity(t.read_sums, s % 2)
            mark(t, s, "wait_ds")
            split(t)
            T.fence_proxy_async()
            T.mbarrier_arrive(t.end)
            mark(t, s, "finish")
        if state_grads:
            T.copy(t.dS, t.dh0[t.ib, t.ihv, 0:K, 0:V])

    return chain


def _value_macro(K: int, V: int, scale: float, timed: bool):
    """Role B as a TileLang macro."""
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"
    mark = _mark_macro("B", timed)

    @T.macro
    def value_side(t):
        """Role B: F holds K dS, then dV_new, then Y; N holds V_new, then dk."""
        for s in T.serial(t.chunks):
            c = t.chunks - 1 - s
            rows = T.min(BT, t.Tn - c * BT)
            mark(t, s, "top")
            T.mbarrier_wait_parity(t.full, s % 2)
            if s > 0:                       # A's finish of the chunk before has read the rows B writes (t, X terms)
                T.mbarrier_wait_parity(t.read_vec, (s - 1) % 2)
            mark(t, s, "loads")
            g_last = t.vec[GC, rows - 1]
            T.wgmma_gemm(t.Ks, t.Hs, t.N, clear_accum=True)        # K S
            T.wgmma_gemm(t.Ks, t.dSh, t.F, clear_accum=True)       # C1, left running under the X pass
            T.wgmma_gemm(t.Ks, t.dSl, t.F)
            T.wait_wgmma(2)
            # X formed in N, then stored: a pass that reads shared memory and writes it gets a barrier per
            # element from TileLang's sync pass
            for i, j in T.Parallel(BT, V):
                t.N[i, j] = t.vec[BETA, i] * (T.cast(t.Vs[i, j], acc) - T.exp(t.vec[GC, i]) * t.N[i, j])
            for i, j in T.Parallel(BT, V):
                t.XVn[i, j] = T.cast(t.N[i, j], bf)
            T.fence_proxy_async()
            mark(t, s, "x")
            T.wgmma_gemm(t.TdKD, t.XVn, t.N, clear_accum=True)     # V_new = T X
            T.wait_wgmma(0)
            for i, j in T.Parallel(BT, V):
                t.XVn[i, j] = T.cast(t.N[i, j], bf)
            T.fence_proxy_async()
            T.mbarrier_arrive(t.ready_v)
            # t_i = V_new_i · (ρ ⊙ K dS)_i, both fp32 (docs/decisions.md: either in bf16 breaks dg's bound); A reads
            # it after ready_xt
            for i, j in T.Parallel(BT, V):
                t.N[i, j] = t.N[i, j] * t.F[i, j] * T.exp(g_last - t.vec[GC, i])
            T.reduce_sum(t.N, t.rowsF, dim=1)
            for i in T.Parallel(BT):
                t.vec[TS, i] = t.rowsF[i]
            mark(t, s, "v_new")
            # dV_new = scale Pᵀ dO + ρ K dS: ρ K dS / scale in the accumulator, Pᵀ dO added, then × scale
            for i, j in T.Parallel(BT, V):
                t.F[i, j] = t.F[i, j] * (T.exp(g_last - t.vec[GC, i]) / scale)
            T.mbarrier_wait_parity(t.ready_p, s % 2)
            mark(t, s, "wait_p")
            T.wgmma_gemm(t.PdP, t.dOs, t.F, transpose_A=True)
            T.wait_wgmma(0)
            T.mbarrier_arrive(t.read_p)
            mark(t, s, "p_do")
            T.mbarrier_wait_parity(t.free_g, s % 2)
            mark(t, s, "wait_g")
            for i, j in T.Parallel(BT, V):
                t.Gh[i, j] = T.cast(t.F[i, j] * scale, bf)
            T.fence_proxy_async()
            T.wgmma_gemm(t.TdKD, t.Gh, t.F, transpose_A=True, clear_accum=True)     # Y = Tᵀ bf16(dV_new)
            T.wait_wgmma(0)
            for i in T.Parallel(BT):            # −βΓ by rows: the stores below read no shared memory
                t.rowsF[i] = -t.vec[BETA, i] * T.exp(t.vec[GC, i])
            for i, j in T.Parallel(BT, V):
                t.Gh[i, j] = T.cast(t.F[i, j], bf)
                t.Gl[i, j] = T.cast(t.rowsF[i] * t.F[i, j], bf)
            T.fence_proxy_async()
            T.mbarrier_arrive(t.ready_y)
            mark(t, s, "y")
            # the X terms, dβ's Y·W and dG's −βΓ Y·K S, from fp32 Y and K S (formed again: N held V_new since)
            T.wgmma_gemm(t.Ks, t.Hs, t.N, clear_accum=True)
            T.wait_wgmma(0)
            for i, j in T.Parallel(BT, V):
                t.N[i, j] = t.F[i, j] * t.N[i, j]
            T.reduce_sum(t.N, t.rowsF, dim=1)
            for i in T.Parallel(BT):
                t.vec[XG, i] = -t.vec[BETA, i] * T.exp(t.vec[GC, i]) * t.rowsF[i]
                t.vec[XB, i] = -T.exp(t.vec[GC, i]) * t.rowsF[i]
            for i, j in T.Parallel(BT, V):
                t.N[i, j] = t.F[i, j] * T.cast(t.Vs[i, j], acc)
            T.reduce_sum(t.N, t.rowsF, dim=1)
            for i in T.Parallel(BT):
                t.vec[XB, i] = t.vec[XB, i] + t.rowsF[i]
            T.mbarrier_arrive(t.read_v)
            mark(t, s, "x_terms")
            for i, j in T.Parallel(BT, V):
                t.F[i, j] = t.F[i, j] * t.vec[BETA, i]
            T.copy(t.F, t.dv[t.ib, c * BT:(c + 1) * BT, t.ihv, 0:V])
            mark(t, s, "dv")
            # dk = ρ ⊙ (V_new dS_hiᵀ), its rows scaled in the accumulator, then the other four terms added
            T.wgmma_gemm(t.XVn, t.dSh, t.N, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            T.mbarrier_arrive(t.read_ds)
            mark(t, s, "dk_first")
            for i, j in T.Parallel(BT, K):
                t.N[i, j] = t.N[i, j] * T.exp(g_last - t.vec[GC, i])
            T.mbarrier_wait_parity(t.ready_dkd, s % 2)
            mark(t, s, "wait_dkd")
            T.wgmma_gemm(t.TdKD, t.Ks, t.N)
            T.wgmma_gemm(t.TdKD, t.Ks, t.N, transpose_A=True)
            T.wgmma_gemm(t.PdP, t.Qs, t.N, transpose_A=True)
            T.wgmma_gemm(t.Gl, t.Hs, t.N, transpose_B=True)
            T.wait_wgmma(0)
            T.copy(t.N, t.dk[t.ib, c * BT:(c + 1) * BT, t.ihv, 0:K])
            mark(t, s, "dk")
            # dq = dP K + scale Γ ⊙ (dO hᵀ); its first part gives Γ's term of dG, scale Γ q·(dO hᵀ), added to dG's
            # X term (F, dv's fragment, is free once dv is stored)
            T.wgmma_gemm(t.dOs, t.Hs, t.N, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            for i, j in T.Parallel(BT, K):
                t.N[i, j] = t.N[i, j] * scale * T.exp(t.vec[GC, i])
            for i, j in T.Parallel(BT, K):
                t.F[i, j] = T.cast(t.Qs[i, j], acc) * t.N[i, j]
            T.reduce_sum(t.F, t.rowsF, dim=1)
            for i in T.Parallel(BT):
                t.vec[XG, i] = t.vec[XG, i] + t.rowsF[i]
            T.mbarrier_arrive(t.ready_xt)
            T.wgmma_gemm(t.PdP, t.Ks, t.N)
            T.wait_wgmma(0)
            T.copy(t.N, t.dq[t.ib, c * BT:(c + 1) * BT, t.ihv, 0:K])
            T.mbarrier_arrive(t.end)
            mark(t, s, "finish")

    return value_side


def _key_macro(K: int, V: int, scale: float, timed: bool):
    """Role A as a TileLang macro."""
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"
    mark = _mark_macro("A", timed)

    @T.macro
    def dg_scan(t, c, tail):
        """dg_i = Σ_{j ≥ i} (dG_j + X_G,j) + Σ_{j < i} t_j + tail on one warp: lane l holds rows 2l and 2l + 1, the
        pairs' suffix sums by shfl_down and prefix sums by shfl_up, five steps each, then the neighbours' sums one
        more shuffle away (adds only, no sum taken back out, in a fixed order), in place of 64 dependent adds per
        row."""
        lane = t.tx - 2 * 128
        d0 = t.vec[DG, 2 * lane] + t.vec[XG, 2 * lane]
        d1 = t.vec[DG, 2 * lane + 1] + t.vec[XG, 2 * lane + 1]
        t0 = t.vec[TS, 2 * lane]
        t1 = t.vec[TS, 2 * lane + 1]
        suffix = T.alloc_var(acc, init=0.0)
        prefix = T.alloc_var(acc, init=0.0)
        down = T.alloc_var(acc, init=0.0)       # the shuffles' values: vars, so no expression reads one stale
        up = T.alloc_var(acc, init=0.0)
        suffix = d0 + d1
        prefix = t0 + t1
        for u in T.unroll(5):
            # every lane shuffles (a full-warp mask), then keeps what lies within the warp
            down = T.shfl_down(suffix, 1 << u)
            up = T.shfl_up(prefix, 1 << u)
            suffix = suffix + T.if_then_else(lane + (1 << u) < 32, down, 0.0)
            prefix = prefix + T.if_then_else(lane >= (1 << u), up, 0.0)
        # the pairs after this lane's and before it: the neighbours' inclusive sums
        down = T.shfl_down(suffix, 1)
        up = T.shfl_up(prefix, 1)
        t.dg[t.ib, t.ihv, c * BT + 2 * lane] = suffix + T.if_then_else(lane > 0, up, 0.0) + tail
        t.dg[t.ib, t.ihv, c * BT + 2 * lane + 1] = ((d1 + T.if_then_else(lane < 31, down, 0.0))
                                                   + (T.if_then_else(lane > 0, up, 0.0) + t0) + tail)

    @T.macro
    def column_sums(t, products):
        """dG_j −= Σ_i products[0, i, j] (fp32, i in order) on A's first BT threads, a column each, once every
        thread of A has stored its products."""
        if t.tx < 2 * 128 + BT:
            col = t.tx - 2 * 128
            column = T.alloc_var(acc, init=0.0)
            for i0 in T.serial(BT // 8):
                for i1 in T.unroll(8):      # eight loads issued ahead of their adds
                    column = column + products[0, i0 * 8 + i1, col]
            t.vec[DG, col] = t.vec[DG, col] - column

    @T.macro
    def key_side(t):
        """Role A: P, dP, dA, dKD, and dg and dβ from every role's terms."""
        for s in T.serial(t.chunks):
            c = t.chunks - 1 - s
            rows = T.min(BT, t.Tn - c * BT)
            mark(t, s, "top")
            T.mbarrier_wait_parity(t.full, s % 2)
            mark(t, s, "loads")
            g_last = t.vec[GC, rows - 1]
            T.wgmma_gemm(t.Qs, t.Ks, t.QK, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            for i, j in T.Parallel(BT, BT):
                t.PdP[i, j] = T.cast(t.QK[i, j] * T.exp(T.if_then_else((i >= j) & (i < rows),
                                                                       t.vec[GC, i] - t.vec[GC, j], NEG)), bf)
            T.fence_proxy_async()
            T.mbarrier_arrive(t.ready_p)
            mark(t, s, "p")
            # dP = scale (dO V_newᵀ) ⊙ D; its dlogD (diagonal left out) by rows here, by columns below
            T.mbarrier_wait_parity(t.ready_v, s % 2)
            mark(t, s, "wait_v")
            T.wgmma_gemm(t.dOs, t.XVn, t.dP, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            for i, j in T.Parallel(BT, BT):
                t.dP[i, j] = t.dP[i, j] * scale * T.exp(T.if_then_else((i >= j) & (i < rows),
                                                                       t.vec[GC, i] - t.vec[GC, j], NEG))
            T.mbarrier_wait_parity(t.read_p, s % 2)
            for i, j in T.Parallel(BT, BT):
                t.PdP[i, j] = T.cast(t.dP[i, j], bf)
            T.fence_proxy_async()
            T.mbarrier_arrive(t.ready_dp)
            mark(t, s, "dp")
            for i, j in T.Parallel(BT, BT):
                t.dP[i, j] = T.if_then_else(i > j, t.dP[i, j] * t.QK[i, j], 0.0)
            T.reduce_sum(t.dP, t.rowsA, dim=1)
            for i in T.Parallel(BT):
                t.vec[DG, i] = t.rowsA[i]
            # the column sums of the same products: dG_j −= Σ_i, through shared memory (a fragment's columns span
            # the warpgroup's threads)
            for i, j in T.Parallel(BT, BT):
                t.sumsD[0, i, j] = t.dP[i, j]
            column_sums(t, t.sumsD)
            T.fence_proxy_async()           # dS lo, this slot, is B's next wgmma operand
            T.mbarrier_arrive(t.read_sums)
            mark(t, s, "dlogd")
            T.mbarrier_wait_parity(t.ready_y, s % 2)
            mark(t, s, "wait_y")
            # dA = −Y V_newᵀ (bf16 operands), dKD = β dA ⊙ D into T's slot (B's dots on T are done: ready_y)
            T.wgmma_gemm(t.Gh, t.XVn, t.dP, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(t.Ks, t.Ks, t.QK, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            for i, j in T.Parallel(BT, BT):
                t.dP[i, j] = T.if_then_else((i > j) & (i < rows), -t.dP[i, j] * T.exp(t.vec[GC, i] - t.vec[GC, j]), 0.0)
                t.TdKD[i, j] = T.cast(t.vec[BETA, i] * t.dP[i, j], bf)
            T.fence_proxy_async()
            T.mbarrier_arrive(t.ready_dkd)
            mark(t, s, "dkd")
            for i, j in T.Parallel(BT, BT):
                t.dP[i, j] = t.dP[i, j] * t.QK[i, j]
            T.reduce_sum(t.dP, t.rowsA, dim=1)
            for i in T.Parallel(BT):
                t.dbA[i] = t.rowsA[i]
                t.vec[DG, i] = t.vec[DG, i] + t.vec[BETA, i] * t.rowsA[i]
            T.mbarrier_wait_parity(t.read_v, s % 2)
            for i, j in T.Parallel(BT, BT):
                t.sumsA[0, i, j] = t.vec[BETA, i] * t.dP[i, j]
            column_sums(t, t.sumsA)
            T.fence_proxy_async()           # the next chunk's v lands by TMA where these generic writes were
            mark(t, s, "da_sums")
            # dg_i = Σ_{j ≥ i} dG_j + Σ_{j < i} t_j + γ Σ h⊙dS (one select per term in a fixed order)
            total = T.alloc_var(acc, init=0.0)
            for p in T.serial(128):
                total = total + t.vec[H_SHARES + p // BT, p % BT]
            # the tiles and the producer's rows are read: the next chunk loads under the finish, which reads only
            # the rows B writes again after read_vec
            T.mbarrier_arrive(t.end)
            T.mbarrier_wait_parity(t.ready_xt, s % 2)
            mark(t, s, "wait_xt")
            for i in T.Parallel(BT):
                t.dbeta[t.ib, t.ihv, c * BT + i] = t.vec[XB, i] + t.dbA[i]
            if t.tx < 2 * 128 + 32:         # A's first warp
                dg_scan(t, c, T.exp(g_last) * total)
            T.mbarrier_arrive(t.read_vec)
            mark(t, s, "finish")

    return key_side


def _producer_macro(K: int, V: int):
    """The producer as a TileLang macro."""
    import tilelang.language as T

    @T.macro
    def producer(t):
        """Chunk s's inputs, once every consumer has left chunk s − 1: one warp's TMA copies, the warpgroup's
        plain loads of gc and β."""
        T.mbarrier_wait_parity(t.init, 0)
        for s in T.serial(t.chunks):
            c = t.chunks - 1 - s
            if s > 0:
                T.mbarrier_wait_parity(t.end, (s - 1) % 2)
            for i in T.Parallel(BT):        # gc and β by plain loads: TMA takes no row of the vector tile
                t.vec[GC, i] = t.gc[t.ib, t.ihv, c * BT + i]
                t.vec[BETA, i] = t.beta[t.ib, t.ihv, c * BT + i]
            if t.tx < 3 * 128 + 32:         # one warp: the copies' elect.sync picks one lane of it
                T.tma_copy(t.q[t.ib, c * BT:(c + 1) * BT, t.ih, 0:K], t.Qs, barrier=t.full)
                T.tma_copy(t.k[t.ib, c * BT:(c + 1) * BT, t.ih, 0:K], t.Ks, barrier=t.full)
                T.tma_copy(t.v[t.ib, c * BT:(c + 1) * BT, t.ihv, 0:V], t.Vs, barrier=t.full)
                T.tma_copy(t.do[t.ib, c * BT:(c + 1) * BT, t.ihv, 0:V], t.dOs, barrier=t.full)
                T.tma_copy(t.a_inv[t.ib, c * BT:(c + 1) * BT, t.ihv, 0:BT], t.TdKD, barrier=t.full)
                T.tma_copy(t.h[t.ib, c, t.ihv, 0:K, 0:V], t.Hs, barrier=t.full)
            T.mbarrier_arrive(t.full)

    return producer


def _idle_macros():
    """Each consumer role's hand-offs alone, in its order, with no work and no stamps: the roles a timeline build
    leaves idle (:func:`build_kernel`'s ``busy``)."""
    import tilelang.language as T

    @T.macro
    def idle_chain(t):
        T.mbarrier_arrive(t.init)
        for s in T.serial(t.chunks):
            T.mbarrier_wait_parity(t.full, s % 2)
            T.mbarrier_arrive(t.free_g)
            T.mbarrier_wait_parity(t.ready_y, s % 2)
            T.mbarrier_wait_parity(t.read_ds, s % 2)
            T.mbarrier_wait_parity(t.read_sums, s % 2)
            T.mbarrier_arrive(t.end)

    @T.macro
    def idle_value_side(t):
        for s in T.serial(t.chunks):
            T.mbarrier_wait_parity(t.full, s % 2)
            if s > 0:
                T.mbarrier_wait_parity(t.read_vec, (s - 1) % 2)
            T.mbarrier_arrive(t.ready_v)
            T.mbarrier_wait_parity(t.ready_p, s % 2)
            T.mbarrier_arrive(t.read_p)
            T.mbarrier_wait_parity(t.free_g, s % 2)
            T.mbarrier_arrive(t.ready_y)
            T.mbarrier_arrive(t.read_v)
            T.mbarrier_arrive(t.read_ds)
            T.mbarrier_wait_parity(t.ready_dkd, s % 2)
            T.mbarrier_arrive(t.ready_xt)
            T.mbarrier_arrive(t.end)

    @T.macro
    def idle_key_side(t):
        for s in T.serial(t.chunks):
            T.mbarrier_wait_parity(t.full, s % 2)
            T.mbarrier_arrive(t.ready_p)
            T.mbarrier_wait_parity(t.ready_v, s % 2)
            T.mbarrier_wait_parity(t.read_p, s % 2)
            T.mbarrier_arrive(t.ready_dp)
            T.mbarrier_arrive(t.read_sums)
            T.mbarrier_wait_parity(t.ready_y, s % 2)
            T.mbarrier_arrive(t.ready_dkd)
            T.mbarrier_wait_parity(t.read_v, s % 2)
            T.mbarrier_arrive(t.end)
            T.mbarrier_wait_parity(t.ready_xt, s % 2)
            T.mbarrier_arrive(t.read_vec)

    return types.SimpleNamespace(chain=idle_chain, value_side=idle_value_side, key_side=idle_key_side)


def role_macros(K: int, V: int, scale: float, state_grads: bool, timed: bool = False,
                busy: str = ROLES) -> types.SimpleNamespace:
    """The four roles (module docstring) as TileLang macros over :func:`alloc_tiles`' namespace; ``timed``: S, B
    and A stamp their points (timeline.ROLE_POINTS); the consumer roles not in ``busy`` only hand off (idle)."""
    idle = _idle_macros() if busy != ROLES else None
    pick = lambda role, name, macro: macro if role in busy else getattr(idle, name)
    return types.SimpleNamespace(chain=pick("S", "chain", _chain_macro(K, V, scale, state_grads, timed)),
                                 value_side=pick("B", "value_side", _value_macro(K, V, scale, timed)),
                                 key_side=pick("A", "key_side", _key_macro(K, V, scale, timed)),
                                 producer=_producer_macro(K, V))


def build_kernel(H: int, HV: int, K: int, V: int, scale: float, state_grads: bool = True, timeline: bool = False,
                 busy: str = ROLES):
    """The TileLang prim_func of the role-split walk for these static sizes (B and T symbolic): the inputs of
    ``chunk_bwd.build_kernel``'s walk; dg, dβ complete ``[B, HV, Lp]`` (no partials); ``state_grads`` False: from a
    zero dS, no dh0 (dht and dh0 one-element placeholders). ``timeline``: the benchmark's instrument, the same walk
    with one more parameter, ``stamps`` int64 ``timeline.role_stamps_shape(B · HV, steps)`` (the first ``steps``
    chunk steps of each program are stamped: :func:`walk_timeline`). ``busy`` (the timeline build only): the
    consumer roles that work, a non-empty part of "SBA"; the others keep their hand-offs alone, so each busy role's
    phases take their time without the idle roles' work beside them on the SM (the outputs are then garbage)."""
    if K != V or K not in SIZES:
        raise ValueError(f"the role-split walk is built for K = V in {SIZES}, got K={K}, V={V}")
    if not busy or set(busy) - set(ROLES) or (busy != ROLES and not timeline):
        raise ValueError(f"busy must be a non-empty part of {ROLES!r}, other than all only in the timeline build, "
                         f"got {busy!r} (timeline={timeline})")
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"
    B, Tn, Lp, NT = T.symbolic("B"), T.symbolic("T"), T.symbolic("Lp"), T.symbolic("NT")
    G = HV // H
    dq_out, dk_out = map(tile_dtype, chunk_bwd.qk_heads_dtypes(G))
    state_shape = (B, HV, K, V) if state_grads else (1,)
    m = role_macros(K, V, scale, state_grads, timeline, busy)
    s_regs, b_regs, a_regs, p_regs = REGISTERS

    @T.macro
    def walk(q, k, v, do, gc, beta, a_inv, h, dht, dq, dk, dv, dg, dbeta, dh0, stamps):
        """The kernel (``stamps`` None: no timeline)."""
        with T.Kernel(B * HV, threads=THREADS) as (bh,):
            if timeline:
                T.import_source(chunk_bwd.TIMELINE_SOURCE)
            ib, ihv = bh // HV, bh % HV
            tx = T.get_thread_binding()
            timed = dict(stamps=stamps) if timeline else {}
            t = alloc_tiles(K, V, ib=ib, ihv=ihv, ih=ihv // G, tx=tx, Tn=Tn, chunks=T.ceildiv(Tn, BT), q=q, k=k, v=v,
                            do=do, gc=gc, beta=beta, a_inv=a_inv, h=h, dht=dht, dq=dq, dk=dk, dv=dv, dg=dg,
                            dbeta=dbeta, dh0=dh0, **timed)
            if tx < 128:
                T.set_max_nreg(s_regs, 1)
                m.chain(t)
            elif tx < 256:
                T.set_max_nreg(b_regs, 1)
                m.value_side(t)
            elif tx < 384:
                T.set_max_nreg(a_regs, 1)
                m.key_side(t)
            else:
                T.set_max_nreg(p_regs, 0)
                m.producer(t)

    if timeline:
        @T.prim_func
        def gdn_chunk_bwd_roles_timeline(
                q: T.Tensor((B, Tn, H, K), bf), k: T.Tensor((B, Tn, H, K), bf), v: T.Tensor((B, Tn, HV, V), bf),
                do: T.Tensor((B, Tn, HV, V), bf), gc: T.Tensor((B, HV, Lp), acc), beta: T.Tensor((B, HV, Lp), acc),
                a_inv: T.Tensor((B, Tn, HV, BT), bf), h: T.Tensor((B, NT, HV, K, V), bf),
                dht: T.Tensor(state_shape, acc), dq: T.Tensor((B, Tn, HV, K), dq_out),
                dk: T.Tensor((B, Tn, HV, K), dk_out), dv: T.Tensor((B, Tn, HV, V), bf),
                dg: T.Tensor((B, HV, Lp), acc), dbeta: T.Tensor((B, HV, Lp), acc), dh0: T.Tensor(state_shape, acc),
                stamps: T.Tensor(role_stamps_shape(B * HV, T.symbolic("steps")), "int64")):
            walk(q, k, v, do, gc, beta, a_inv, h, dht, dq, dk, dv, dg, dbeta, dh0, stamps)

        return gdn_chunk_bwd_roles_timeline

    @T.prim_func
    def gdn_chunk_bwd_roles(q: T.Tensor((B, Tn, H, K), bf), k: T.Tensor((B, Tn, H, K), bf),
                            v: T.Tensor((B, Tn, HV, V), bf), do: T.Tensor((B, Tn, HV, V), bf),
                            gc: T.Tensor((B, HV, Lp), acc), beta: T.Tensor((B, HV, Lp), acc),
                            a_inv: T.Tensor((B, Tn, HV, BT), bf), h: T.Tensor((B, NT, HV, K, V), bf),
                            dht: T.Tensor(state_shape, acc),
                            dq: T.Tensor((B, Tn, HV, K), dq_out), dk: T.Tensor((B, Tn, HV, K), dk_out),
                            dv: T.Tensor((B, Tn, HV, V), bf), dg: T.Tensor((B, HV, Lp), acc),
                            dbeta: T.Tensor((B, HV, Lp), acc), dh0: T.Tensor(state_shape, acc)):
        walk(q, k, v, do, gc, beta, a_inv, h, dht, dq, dk, dv, dg, dbeta, dh0, None)

    return gdn_chunk_bwd_roles


@functools.lru_cache(maxsize=16)
def compiled_kernel(H: int, HV: int, K: int, V: int, scale: float, target: Optional[str] = None,
                    state_grads: bool = True, timeline: bool = False, busy: str = ROLES):
    """:func:`build_kernel` compiled by TileLang for ``target`` (None: this GPU; "sm_90a" without one)."""
    return compile_prim_func(build_kernel(H, HV, K, V, scale, state_grads, timeline, busy), target)


def chunk_bwd_roles_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, gc: torch.Tensor,
                           beta: torch.Tensor, a_inv: torch.Tensor, h: torch.Tensor, dht: Optional[torch.Tensor],
                           scale: float, want_dh0: bool = True, **out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Launch the role-split walk on an sm_90 GPU: ``chunk_bwd.chunk_bwd_hopper``'s inputs, ``out`` and outputs as
    that walk's with one slice of the whole V (its arguments from ``chunk_bwd.walk_arguments``): dg, dβ
    ``[1, B, HV, Lp]``, complete."""
    arguments, outputs, state_grads = _walk_arguments(q, k, v, do, gc, beta, a_inv, h, dht, want_dh0, out)
    H, HV, K, V = q.shape[2], v.shape[2], q.shape[3], v.shape[3]
    launcher(compiled_kernel(H, HV, K, V, scale, state_grads=state_grads))(*arguments)
    return outputs


def _walk_arguments(q, k, v, do, gc, beta, a_inv, h, dht, want_dh0: bool, out: dict):
    """The walk's launch arguments up to dh0, its outputs and whether it has state gradients:
    ``chunk_bwd.walk_arguments``' with BV = V, dg and dβ the one slice's rows ``[B, HV, Lp]``."""
    state_grads = want_dh0 or dht is not None
    arguments, outputs = chunk_bwd.walk_arguments(q, k, v, do, gc, beta, a_inv, h, dht, v.shape[3], out, state_grads)
    arguments[12:14] = outputs[3][0], outputs[4][0]
    return arguments, outputs, state_grads


def walk_timeline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, gc: torch.Tensor,
                  beta: torch.Tensor, a_inv: torch.Tensor, h: torch.Tensor, dht: Optional[torch.Tensor],
                  scale: float, want_dh0: bool = True,
                  steps: Optional[int] = None, busy: str = ROLES) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The role-split walk's timeline build (a benchmark's instrument): launched as :func:`chunk_bwd_roles_hopper`
    launches the walk, on the same inputs. Returns its outputs (the same bits where every role is ``busy``) and the
    stamps int64 ``timeline.role_stamps_shape(B · HV, steps)`` of the first ``steps`` chunk steps of every program
    (None: every step; unwritten entries −1, an idle role's all), which ``timeline.role_timeline`` reduces to µs
    per phase and role."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    recorded = recorded_steps(steps, -(-T // BT))
    arguments, outputs, state_grads = _walk_arguments(q, k, v, do, gc, beta, a_inv, h, dht, want_dh0, {})
    stamps = torch.full(role_stamps_shape(B * HV, recorded), -1, dtype=torch.int64, device=q.device)
    launcher(compiled_kernel(H, HV, K, V, scale, state_grads=state_grads, timeline=True, busy=busy))(*arguments,
                                                                                                     stamps)
    return outputs, stamps
