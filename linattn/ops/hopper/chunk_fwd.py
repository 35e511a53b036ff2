"""Hopper forward (TileLang): the state walk and the output fused in one kernel, on wgmma and TMA.

``chunk_gated_delta_rule``'s "auto" path runs it on sm_90 for bf16 inputs it takes (:func:`unsupported_reason`)
where its programs fill the card (``forward.hopper_launch``), ``triton_chunk.FORWARD_PATH = "hopper"`` wherever it
takes them. On the H200 (run 20): B=8 T=4096 H=16 0.387 ms alone, 0.656 with the pre-pass (the split: 1.007);
every case of gpu_check_core within 2× the rounded baseline (o 3.4e-3, final state 2.4e-3 at the anchor case).
benchmarks/hopper_fwd_check.py checks and times its launch variants; ``walk_launch.py`` holds the calls that take
tensors and launch it (``chunk_fwd_hopper_hm``).

Why (issue 4, docs/architecture.md): the Triton split forward writes every chunk's state h (32 KB per chunk and
head in bf16, twice the size of the chunk's queries) and V_new to HBM and reads them back in a second kernel, and
Triton 3.6 cannot warp-specialise the sequential walk that would keep them on chip. This kernel walks the chunks of
one (sequence, value head, V tile) with the state in registers and writes only o and the final state; TileLang
pipelines the next chunk's loads (TMA) under this chunk's dots.

Inputs as the split forward's after its pre-pass (``fused_prepass(write_wy=False)``; ``forward.py`` chains them):
gc (chunk-local cumulative log decays, fp32) and A_inv (each chunk's (I + strictly-lower(β K Kᵀ ⊙ D))⁻¹, bf16 by
default or fp32). Per chunk c, with S the state entering it (K × BV slice, fp32 registers), Γ = e^{gc} per row,
ρ = e^{gc_last − gc} per row and γ = e^{gc of the chunk's last token}:

    S_b   = bf16(S)                                     the state as a dot operand (fla's precision for h)
    X     = β ⊙ V − (β Γ) ⊙ (K S_b)                     [BT, BV]
    V_new = A_inv X                                     bf16 A_inv: X rounded to bf16, one wgmma (FlashQLA's
                                                        choice); fp32 A_inv: tf32 on mma.sync
    O     = scale · [Γ ⊙ (Q S_b) + (Q Kᵀ ⊙ D ⊙ causal) bf16(V_new)]
    S     = γ S + Kᵀ bf16(ρ ⊙ V_new)

Γ and ρ are computed once per row (64 exps each) into shared memory, e^x as ex2.approx (fast math). With
``async_dots`` K S, Q S and Q Kᵀ are issued back to back and K S is waited for first (X needs only it). Reads per
chunk and program, every one by TMA from the producer warpgroup: Q, K (BT × K), V (BT × BV), A_inv
(BT × BT), gc and β (passed head-major, :func:`head_major`, so that a chunk's 64 values are one contiguous
copy); writes O (BT × BV). Shapes are compiled per (H, HV, K, V, BV, scale); B and T are symbolic (a new T costs no
compile).
"""
import functools  # no "from __future__ import annotations": TileLang reads the kernel's annotations as objects
import math
import types
from typing import Optional

import torch

BT = 64


@functools.cache
def tilelang_available() -> bool:
    """Whether TileLang (an optional dependency) imports. Any failure counts as absent: a broken install must send
    the op to its Triton path, not raise from it."""
    try:
        import tilelang  # noqa: F401
    except Exception:
        return False
    return True


def build_kernel(H: int, HV: int, K: int, V: int, BV: int, scale: float, dtype: str = "bfloat16",
                 threads: int = 128, num_stages: int = 2, use_initial_state: bool = True,
                 beta_dtype: str = "float32", a_dtype: str = "float32", async_dots: bool = False,
                 affine: bool = False, tma_o: bool = False, warm: bool = False, stsm: bool = False,
                 beta_in_a: bool = False, async_o: bool = False, async_ax: bool = False,
                 warm_planned: bool = False, threshold: float = -30.0, min_blocks: int = 1,
                 deferred_decay: bool = False, fold_p_decay: bool = False, lean: bool = False,
                 warm_subset: int = 0, head_split: int = 0, split_cap: float = 0.375,
                 state_only_warmups: bool = False):
    """The TileLang prim_func of the fused forward for these static sizes (B and T symbolic). Without
    ``use_initial_state`` the state starts at zero and h0 is not read. β is read in ``beta_dtype`` (the inputs' own,
    widened on load). ``a_dtype``: A_inv as given, fp32 (A_inv X at tf32 on mma.sync, X kept fp32) or bf16 (X
    rounded to bf16, one wgmma: FlashQLA's choice). ``async_dots``: K S, Q S and Q Kᵀ are issued back to back and
    waited for as needed (else each dot waits for itself). ``affine``: phase A of the segmented forward
    (``forward.py``): each sequence's affine state map [M | N] (S_out = M S_in + N), the walk of the K × (K + V)
    state [I | 0] with values [0 | V], written to ht ``[B, HV, K, K + V]``; the grid covers K + V columns (a
    program's tile lies in M or in N: BV divides K), V's columns are read shifted by K (an M tile reads a valid tile
    and zeroes it), and only the state's three dots run (q not read, o not written); where ``skip_m [B, HV]``
    (int32, read by the affine walk only) is 1 the M tiles walk no chunk and write M = 0
    (``forward.segment_flags``), where it is 2 every tile does ([M | N] = 0: a map the warm walk does without).
    ``tma_o``: o's tile goes to shared memory (stmatrix) and out by TMA, rows past T clipped by it (else each thread
    stores its accumulator pairs). ``async_o`` (with ``tma_o`` or ``warm``): the store is issued and not waited
    for; the wait for its read of the tile comes before the next chunk writes the tile (:data:`ASYNC_O_STORE`).
    ``async_ax`` (with ``async_dots`` and ``stsm``): V's tile read while K S runs, and A_inv X left running while P
    and o's factors are formed (:data:`ASYNC_AX`).

    ``warm``: phase C of the segmented forward with warm-ups (``forward.py``). q, k, v, A_inv and o are the whole
    sequences ``[B, T, ...]``; gc, β ``[B·S, HV, L]``, h0 and ht ``[B·S, HV, K, V]`` are per segment (L = T/S, a
    multiple of 64: the segments' count S = T / L is symbolic too). The program of segment s starts ``ctl [B·S,
    HV]`` = w chunks before it, from h0 (the scan's entering state, or zero for a warm-up), and writes o only from its
    own first chunk on: it walks w + L/64 chunks. With ``warm_planned`` each program finds w itself (no plan, no maps,
    no scan: the segmented forward in two launches; twin ``map_bound.warm_from_bound_ref``): ``ctl`` is then the
    pre-pass's chunk bounds ``[B·S, HV, L/64]`` fp32 (log2 units) and w the fewest chunks before the segment whose
    bounds sum below ``threshold``, else the whole prefix (w = s·L/64, from h0 ``[B, HV, K, V]``, the sequence's
    initial state: exact); a warm-up that ends earlier starts from zero.

    ``stsm`` (bf16 A_inv): the element-wise steps compute in their dots' accumulator registers and go to shared
    memory by ``T.copy`` (stmatrix: four 8 × 8 tiles of bf16 pairs per instruction and one address per lane), and
    the scale sits in P's exponent and Γ's factor instead of a pass over o; else each thread stores its bf16 pairs
    one 4-byte word at a time, each with its swizzled address computed. V is read per thread either way (TileLang
    0.1.15 lowers a copy from a pipelined buffer to a fragment without ldmatrix).

    ``beta_in_a``: A_inv arrives with β folded into its columns (A_inv diag(β), ``prepass.BETA_IN_A_INV``), so X is
    V − Γ ⊙ (K S) and β is not read (its tensor is passed and ignored).

    ``deferred_decay`` (:data:`DEFERRED_DECAY`): the registers hold S' = S / a, the state over its decay since the
    last renormalisation (a = e^la ≤ 1, one scalar per program), so that the chunk's decay γ goes into la instead of
    a multiply per state element: Γ and ρ take a's factor per row (Γ_i a, ρ_i / (a γ)), and the state is multiplied
    only where la + ln γ would fall below −:data:`DEFERRED_DECAY_LIMIT` (then S' ← S' a γ, la ← 0), and once before
    it is written. ``fold_p_decay`` (with it and ``stsm``, :data:`FOLD_P_DECAY`): in a chunk that does not
    renormalise, P's decays e^{gc_i − gc_j} split into Γ_i a (o's row factor) and ρ_j / (a γ) (V_d's), so that P is
    Q Kᵀ under the causal mask alone (no exp per element), P V_d replaces P V_new (no V_new tile) and runs beside
    the state's update, and o = Γ a scale ⊙ (Q S' + P V_d); a chunk that renormalises takes the plain steps.

    ``lean`` (``forward.LEAN_SEGMENTS``): no write that nothing reads. In the affine walk a map whose ``skip_m`` is
    2 is not written at all (the scan reads none of it). In the warm walk (``warm``) ht is ``[B, HV, K, V]``, the
    sequences' final states, written by each sequence's last segment alone; and without ``warm_planned`` a segment
    whose warm-up w is above zero starts from zero instead of reading h0 (the scan leaves those entering states
    unwritten: ``seq_parallel.affine_scan(skip_writes=True)``).

    ``warm_subset`` (the lean warm walk with w given, :data:`WARM_SUBSETS`): 0 every program walks; 1 only those
    whose w is above zero (they read no h0, so they need not wait for the scan), 2 only the others. A program left
    out walks no chunk and writes nothing (``forward.OVERLAP_WARM``: the two halves in two launches).

    ``head_split`` (the lean planned warm walk, :data:`HEAD_SPLITS`; ``forward.SPLIT_HEADS``): the heads routed
    between two launches of this walk at two V tiles, by the same test in both (twin ``map_bound.cold_heads_ref``):
    a head is cold where some segment s ≥ 1 has its ``split_cap`` · L/64 nearest earlier chunks' bounds summing to
    ``threshold`` or more (where they sum below it, its warm-up w is at most that many chunks). 1: only the other
    heads' programs walk, as ``warm_planned`` says (segments; their warm-ups within the cap). 2: only the cold heads
    walk, from the sequence's start and initial state to its end, writing o all the way (the unsegmented walk,
    reading gc and β per segment: a grid of one program per sequence, head and V tile, as its last segment's); a warm
    head's programs walk nothing.

    ``state_only_warmups`` (the warm walks on the default launch: ``async_dots``, ``async_ax``, ``fold_p_decay``;
    :data:`STATE_ONLY_WARMUPS`): a warm-up's chunk, whose o nobody reads, runs the state's three dots alone (K S,
    A_inv X, the update) and skips o's (Q S, Q Kᵀ, P V_d) and P's and o's element-wise steps: each chunk's steps are
    one branch or the other of a test uniform over the program. The state's steps are the same, so o and the final
    state are bitwise the same as without it. The loads are the same too (Q's included: the producer does not
    branch); the consumers then wait for all of a chunk's tiles before the branch."""
    import tilelang
    import tilelang.language as T

    acc = "float32"
    B = T.symbolic("B")
    Tn = T.symbolic("T")
    Tp = T.symbolic("Tp")   # gc and β are passed head-major, [B, HV, Tp], T padded for TMA (see head_major)
    # the programs' sequences and the rows of gc / β: the sequences and Tp, or (warm) the segments and their length
    NB = T.symbolic("BS") if warm else B
    Lg = T.symbolic("L") if warm else Tp
    warm_planned = warm and warm_planned
    # ctl: per (program sequence, value head) the affine walk's skip flag (skip_m) or the warm walk's w; with
    # warm_planned the chunk bounds it finds w from
    ctl_shape, ctl_dtype = ((NB, HV, T.symbolic("LC")), acc) if warm_planned else ((NB, HV), "int32")
    G = HV // H
    x_dtype = acc if a_dtype == acc else dtype      # X, the right operand of A_inv X
    # bf16 X is stored as the tile it is, [BT, BV] (an N-major B operand: each thread writes its accumulator pairs
    # as 4-byte words, and reads V's pairs likewise); tf32 needs Xᵀ, K-major, written element by element (run 22's
    # profile at B=8 T=4096 H=16: the shared-memory pipe 68% busy, the issue slots 25%)
    x_rows = x_dtype != acc
    stsm = stsm and x_rows                          # tf32's Xᵀ is written element by element
    log_scale = math.log(scale)
    store_output = not affine
    W = K + V if affine else V                      # the state's columns: [M | N] in phase A
    if affine and K % BV:
        raise ValueError(f"the affine walk needs BV ({BV}) to divide K ({K})")
    if affine and warm:
        raise ValueError("warm is phase C's walk (affine is phase A's)")
    if warm_subset not in WARM_SUBSETS or (warm_subset and not (warm and lean and not warm_planned)):
        raise ValueError(f"warm_subset must be one of {WARM_SUBSETS}, and above 0 only in the lean warm walk with "
                         f"w given, got {warm_subset}")
    if head_split not in HEAD_SPLITS or (head_split and not (warm_planned and lean)):
        raise ValueError(f"head_split must be one of {HEAD_SPLITS}, and above 0 only in the lean planned warm walk, "
                         f"got {head_split}")
    cap_64ths = round(split_cap * 64)       # the cap in chunks: L/64 · cap_64ths / 64, truncated

    v_early = async_ax and stsm and async_dots
    ax_async = v_early and store_output
    fold_p_decay = fold_p_decay and deferred_decay and stsm and store_output
    # written for the default launch's steps (the fold's P paths, A_inv X left running); a walk without warm-ups (or a
    # head_split 2 walk, whose every chunk writes o) compiles without the branch
    state_only_warmups = state_only_warmups and warm and head_split != 2 and fold_p_decay and ax_async

    @T.macro
    def form_p(QK, Ps, Gsc, gcs, decayed):
        """P into Ps (bf16, stmatrix): Q Kᵀ under the causal mask, times e^{gc_i + ln scale − gc_j} where
        ``decayed`` (else the decays are o's and V_d's: ``fold_p_decay``)."""
        for i, j in T.Parallel(BT, BT):
            if decayed:
                QK[i, j] = T.if_then_else(i >= j, QK[i, j] * T.exp(Gsc[i] - gcs[j]), 0.0)
            else:
                QK[i, j] = T.if_then_else(i >= j, QK[i, j], 0.0)
        T.copy(QK, Ps)

    @T.macro
    def scale_o_tile(Of, Gam):
        """o's accumulator (Q S) times Γ, and the scale with ``stsm`` (else a pass after P V_new)."""
        for i, j in T.Parallel(BT, BV):     # a loop of its own: Of's register layout is not Vn's
            Of[i, j] = Of[i, j] * (Gam[i] * scale if stsm else Gam[i])

    @T.macro
    def store_o(Of, Os, o, ib, c, ihv, iv, write):
        """o's tile of chunk c: by TMA through shared memory (``tma_o`` or ``warm``; with ``async_o`` the previous
        store's wait first, the new one not waited for), else each thread's accumulator pairs."""
        if tma_o or warm:
            if write:
                if async_o:
                    T.tma_store_wait()      # the previous chunk's store has read the tile
                T.copy(Of, Os)
                if async_o:
                    T.tma_copy(Os, o[ib, c * BT:(c + 1) * BT, ihv, iv * BV:(iv + 1) * BV])
                else:
                    T.copy(Os, o[ib, c * BT:(c + 1) * BT, ihv, iv * BV:(iv + 1) * BV])
        else:
            T.copy(Of, o[ib, c * BT:(c + 1) * BT, ihv, iv * BV:(iv + 1) * BV])

    @T.macro
    def chunk_step(t, c, cr, outputs):
        """Chunk c's steps once its tiles are loaded (the consumers' part of the walk's loop; ``t``: the program's
        tiles, indices, loop bounds and the deferred decay's log scale la, :class:`StepTiles`). ``outputs`` (a
        Python bool): o's dots and element-wise steps too; False for a warm-up's chunk under ``state_only_warmups``
        (the state's three dots alone, each waited for inside this step: a dot left running where two branches join
        made ptxas serialise every wgmma of the kernel)."""
        Qs, Ks, Vs, As, gcs, bs, Gam, Rho, Beta, Gsc, Ss, Xs, Ps, Vns, Vds, Os, S, KS, QK, Vn, Of, Vr = (
            t.Qs, t.Ks, t.Vs, t.As, t.gcs, t.bs, t.Gam, t.Rho, t.Beta, t.Gsc, t.Ss, t.Xs, t.Ps, t.Vns, t.Vds, t.Os, t.S,
            t.KS, t.QK, t.Vn, t.Of, t.Vr)
        o, ib, ihv, iv, chunks, Lc, v_on = t.o, t.ib, t.ihv, t.iv, t.chunks, t.Lc, t.v_on
        la = t.la.buffer    # the one-element buffer of T.alloc_var (t.la reads it): assignments below store into it
        T.copy(S, Ss)
        # the dots on this chunk's inputs and the entering state (tensor cores, fp32 accumulators).
        # Async dots and the load pipeline: TileLang releases a staged buffer to the producer right after
        # its last use in program order — for Qs that is the *issue* of Q Kᵀ below, before it completes.
        # That is safe only because the producer loads each chunk's K first and Ks is released last, after
        # the synchronous state update: the producer cannot refill Qs for chunk c + 2 before chunk c is done.
        # Keep it so (K first, the update synchronous) when reordering the dots
        if async_dots:
            T.wgmma_gemm(Ks, Ss, KS, clear_accum=True)
            if store_output and outputs:
                T.wgmma_gemm(Qs, Ss, Of, clear_accum=True)
                T.wgmma_gemm(Qs, Ks, QK, transpose_B=True, clear_accum=True)
        else:
            T.gemm(Ks, Ss, KS, clear_accum=True)
            if store_output:
                T.gemm(Qs, Ss, Of, clear_accum=True)
                T.gemm(Qs, Ks, QK, transpose_B=True, clear_accum=True)
        # per-row decays while the dots run: 2 exps per row instead of per element
        g_last = gcs[T.min(BT, Tn - c * BT) - 1]
        # deferred_decay: whether this chunk renormalises S' (la + ln γ below the limit), and the exponent
        # of ρ's factor 1 / (a γ) after it: 0 where it does (a γ goes into S'), else −(la + ln γ)
        renorm = la + g_last < -DEFERRED_DECAY_LIMIT
        for i in T.Parallel(BT):
            Gam[i] = T.exp(gcs[i] + la) if deferred_decay else T.exp(gcs[i])
            if not beta_in_a:
                Beta[i] = T.cast(bs[i], acc)
        for i in T.Parallel(BT):    # a loop of its own: Rho takes Vn's layout (mma.sync's for tf32)
            if deferred_decay:
                Rho[i] = T.exp(T.if_then_else(renorm, g_last, -la) - gcs[i])
            else:
                Rho[i] = T.exp(g_last - gcs[i])
        if stsm and store_output and outputs:
            for i in T.Parallel(BT):    # and Gsc QK's
                Gsc[i] = gcs[i] + log_scale
        if v_early:
            T.copy(Vs, Vr)      # V's tile into registers while K S runs
        if async_dots:
            T.wait_wgmma(2 if store_output and outputs else 0)     # K S done (X needs only it)
        if stsm:
            # X = β ⊙ (V − Γ ⊙ K S) in K S's registers, then to shared memory by stmatrix
            if not v_early:
                T.copy(Vs, Vr)
            for i, j in T.Parallel(BT, BV):
                vij = Vr[i, j] * v_on if affine else Vr[i, j]
                KS[i, j] = x_value(vij, Gam[i] * KS[i, j], Beta[i], beta_in_a)
            T.copy(KS, Xs)
        else:
            for i, j in T.Parallel(BT, BV):
                vij = Vs[i, j] * v_on if affine else Vs[i, j]
                if x_rows:
                    Xs[i, j] = x_value(vij, Gam[i] * KS[i, j], Beta[i], beta_in_a)
                else:
                    Xs[j, i] = x_value(vij, Gam[i] * KS[i, j], Beta[i], beta_in_a)
        if ax_async:
            # A_inv X left running while P and o's factors are formed (Q S and Q Kᵀ, issued before it, done:
            # wgmma groups complete in order). A_inv's slot is handed back at this issue, safe for the reason
            # Q's is (the producer refills nothing of chunk c + 2 before K's slot, released last)
            T.wgmma_gemm(As, Xs, Vn, clear_accum=True)
            T.wait_wgmma(1)
        else:
            T.gemm(As, Xs, Vn, transpose_B=not x_rows, clear_accum=True)
            if async_dots:
                T.wait_wgmma(0)
        if stsm:
            # P, V_new and ρ ⊙ V_new likewise: in place in their accumulators, then stmatrix
            if not outputs:         # (only under state_only_warmups, which implies the fold)
                T.wait_wgmma(0)     # V_new: a warm-up's chunk forms no P
            elif fold_p_decay:
                if renorm:          # the plain steps below
                    form_p(QK, Ps, Gsc, gcs, True)
                    if ax_async:
                        scale_o_tile(Of, Gam)
                        T.wait_wgmma(0)
                    T.copy(Vn, Vns)
                else:               # P without its decays; no V_new tile
                    form_p(QK, Ps, Gsc, gcs, False)
                    if ax_async:
                        T.wait_wgmma(0)
            elif store_output:
                # the scale inside P's exponent (per row: no operation per element) and Γ's factor below,
                # instead of a pass over o
                form_p(QK, Ps, Gsc, gcs, True)
                if ax_async:
                    scale_o_tile(Of, Gam)
                    T.wait_wgmma(0)                     # V_new
                T.copy(Vn, Vns)
            for i, j in T.Parallel(BT, BV):
                Vn[i, j] = Vn[i, j] * Rho[i]
            T.copy(Vn, Vds)
        else:
            if store_output:
                for i, j in T.Parallel(BT, BT):
                    Ps[i, j] = T.if_then_else(i >= j, QK[i, j] * T.exp(gcs[i] - gcs[j]), 0.0)
                for i, j in T.Parallel(BT, BV):
                    Vns[i, j] = Vn[i, j]
            for i, j in T.Parallel(BT, BV):
                Vds[i, j] = Vn[i, j] * Rho[i]
        # the warm-up's chunks write no o (a Python True elsewhere: no run-time branch)
        write_o = not warm or head_split == 2 or cr >= chunks - Lc
        if not outputs:
            T.sync_threads()        # V_d's tile, stored by every consumer, before the update reads it
        elif fold_p_decay:
            if renorm:
                if not ax_async:
                    scale_o_tile(Of, Gam)
                T.gemm(Ps, Vns, Of)
                store_o(Of, Os, o, ib, c, ihv, iv, write_o)
            else:
                # P V_d issued and left running: the state's update below reads V_d too and waits for both.
                # The consumers' barrier first, as before every dot on a tile they have just stored (TileLang
                # leaves it out on this branch)
                T.sync_threads()
                T.wgmma_gemm(Ps, Vds, Of)
        elif store_output:
            if not ax_async:
                scale_o_tile(Of, Gam)
            T.gemm(Ps, Vns, Of)
            if not stsm:
                for i, j in T.Parallel(BT, BV):
                    Of[i, j] = Of[i, j] * scale
            store_o(Of, Os, o, ib, c, ihv, iv, write_o)
        if deferred_decay:
            # the state's decay in la; S' multiplied only where a γ would leave the limit (a uniform
            # branch: la and γ are the program's)
            if renorm:
                for i, j in T.Parallel(K, BV):
                    S[i, j] = S[i, j] * T.exp(la + g_last)
                la = 0.0
            else:
                la = la + g_last
        else:
            for i, j in T.Parallel(K, BV):
                S[i, j] = S[i, j] * T.exp(g_last)
        # synchronous: TileLang hands Ks back to the producer after its last use in program order, which must
        # come after the dot reading it has completed
        T.gemm(Ks, Vds, S, transpose_A=True)
        if fold_p_decay and outputs:
            if not renorm:
                scale_o_tile(Of, Gam)       # o = Γ a scale ⊙ (Q S' + P V_d)
                store_o(Of, Os, o, ib, c, ihv, iv, write_o)

    @T.prim_func
    def gdn_chunk_fwd(q: T.Tensor((B, Tn, H, K), dtype), k: T.Tensor((B, Tn, H, K), dtype),
                      v: T.Tensor((B, Tn, HV, V), dtype), gc: T.Tensor((NB, HV, Lg), acc),
                      beta: T.Tensor((NB, HV, Lg), beta_dtype), a_inv: T.Tensor((B, Tn, HV, BT), a_dtype),
                      h0: T.Tensor((B if warm_planned else NB, HV, K, V), acc), ctl: T.Tensor(ctl_shape, ctl_dtype),
                      o: T.Tensor((B, Tn, HV, V), dtype),
                      ht: T.Tensor((B if warm and lean else NB, HV, K, W), acc)):
        # head_split 2: one program per (sequence, value head, V tile), its last segment's (the others would walk
        # nothing, and in run 39 a program that walks nothing still held its SM ≈ 25 µs)
        with T.Kernel(T.ceildiv(W, BV), (B if head_split == 2 else NB) * HV, threads=threads) as (iv, bh):
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            if min_blocks > 1 or warm_planned:
                # the warpgroups' register split asked for explicitly (TileLang's own, 24 / 240 at one program per
                # SM, is left out when the producer stores to a local, as warm_planned's does; the consumers then
                # stayed at 168 and spilled): 24 per producer thread and the rest of the program's registers per
                # consumer thread (consumer_registers)
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(consumer_registers(threads, min_blocks))
            ibn = bh // HV                            # the program's sequence: a segment when warm
            ihv = bh % HV
            ih = ihv // G
            ib = ibn                                  # its batch row in q, k, v, A_inv, o
            c0 = 0                                    # the first chunk it walks
            chunks = T.ceildiv(Tn, BT)
            if warm:
                Lc = Lg // BT                         # chunks per segment
                nseg = Tn // Lg
                ib = ibn // nseg
                if warm_planned:
                    nseg = T.truncdiv(Tn, Lg)
                    if head_split == 2:              # no segment axis in the grid: the sequence's last segment
                        ib, ibn = ibn, ibn * nseg + nseg - 1
                    else:
                        ib = T.truncdiv(ibn, nseg)
                    # w: summing the bounds of the chunks before the segment, nearest first, until the sum falls
                    # below the threshold (the entering state's weight < 2^threshold), else up to the sequence's
                    # start. Every thread (producer and consumers) runs the same loads and adds: the same w
                    # (truncating divisions: every index is ≥ 0, and TIR's floor divisions on symbolic sizes expand
                    # to sign tests that stayed live through the chunk loop, 180 bytes of spills)
                    first = T.truncmod(ibn, nseg) * Lc
                    wv = T.alloc_var("int32", init=0)
                    run = T.alloc_var(acc, init=0.0)
                    cold = 0
                    if head_split:
                        # the head's route, the same in both launches: cold where the cap's nearest chunks before
                        # some segment s ≥ 1 sum to the threshold or more. A fixed count of loads whose addresses
                        # do not wait for the sum (the search below waits on each), nearest first in fp32 (twin
                        # map_bound.cold_heads_ref)
                        cold = T.alloc_var("int32", init=0)
                        window = T.alloc_var(acc, init=0.0)
                        capped = T.alloc_var("int32", init=0)  # the window's chunks, once
                        capped = T.truncdiv(Lc * cap_64ths, 64)
                        row = T.alloc_var("int32", init=0)     # the segment's row of ctl, once per segment
                        for s in T.serial(nseg - 1):
                            window = 0.0
                            row = ib * nseg + s
                            # unrolled by ROUTE_UNROLL, the loads issued ahead of the adds (a plain loop waits for
                            # each in turn; run 39's exiting programs took ≈ 25 µs either way). Chunk (s + 1)·Lc − 1 − j
                            # is segment s's chunk Lc − 1 − j (j < capped ≤ Lc): no division by the symbolic Lc per
                            # load (each a 64-bit division in the address, and one more in TileLang's bounds guard:
                            # ≈ 200 per program at row 6, the suspect for those 25 µs)
                            for jb in T.serial(T.ceildiv(capped, ROUTE_UNROLL)):
                                for u in T.unroll(ROUTE_UNROLL):
                                    j = jb * ROUTE_UNROLL + u
                                    if j < capped:
                                        window = window + ctl[row, ihv, Lc - 1 - j]
                            if window >= threshold:
                                cold = 1
                    if head_split == 2:
                        # a cold head's program walks the whole sequence, a warm head's nothing
                        c0 = 0
                        chunks = T.if_then_else(cold == 1, nseg * Lc, 0)
                    else:
                        # (head_split 1: a cold head's programs search nothing and walk nothing)
                        while (cold == 0) and (wv < first) and ((wv == 0) or (run >= threshold)):
                            cw = first - 1 - wv
                            run = run + ctl[ib * nseg + T.truncdiv(cw, Lc), ihv, T.truncmod(cw, Lc)]
                            wv = wv + 1
                        c0 = first - wv
                        chunks = Lc + wv
                        if head_split == 1:
                            chunks = T.if_then_else(cold == 0, chunks, 0)
                else:
                    c0 = (ibn % nseg) * Lc - ctl[ibn, ihv]
                    chunks = Lc + ctl[ibn, ihv]
                    # warm_subset: a program of the other subset walks nothing (no o written)
                    if warm_subset == 1:
                        chunks = T.if_then_else(ctl[ibn, ihv] > 0, chunks, 0)
                    elif warm_subset == 2:
                        chunks = T.if_then_else(ctl[ibn, ihv] == 0, chunks, 0)
            Qs = T.alloc_shared((BT, K), dtype)
            Ks = T.alloc_shared((BT, K), dtype)
            Vs = T.alloc_shared((BT, BV), dtype)
            As = T.alloc_shared((BT, BT), a_dtype)
            gcs = T.alloc_shared((BT,), acc)
            bs = T.alloc_shared((BT,), beta_dtype)     # β as given: a TMA copy, widened where it is read
            # per-row factors in registers (each thread holds its accumulator rows' values: no shared-memory load
            # per element): Γ_i = e^{gc_i}, ρ_i = e^{gc_last − gc_i} (the decay to the chunk's end), β_i
            Gam = T.alloc_fragment((BT,), acc)
            Rho = T.alloc_fragment((BT,), acc)
            Beta = T.alloc_fragment((BT,), acc)
            Gsc = T.alloc_fragment((BT,), acc)      # gc_i + ln(scale), P's rows' exponents (stsm)
            # deferred_decay: ln a, the state's scale (S = a S') at the chunk's start, the same in every thread
            la = T.alloc_var(acc, init=0.0)
            Ss = T.alloc_shared((K, BV), dtype)        # bf16 state, the B operand of K S and Q S
            Xs = T.alloc_shared((BT, BV) if x_rows else (BV, BT), x_dtype)   # X, or Xᵀ for tf32 (x_rows)
            Ps = T.alloc_shared((BT, BT), dtype)
            Vns = T.alloc_shared((BT, BV), dtype)
            Vds = T.alloc_shared((BT, BV), dtype)
            Os = T.alloc_shared((BT, BV), dtype)       # o's tile for its TMA store (tma_o)
            S = T.alloc_fragment((K, BV), acc)
            KS = T.alloc_fragment((BT, BV), acc)
            QK = T.alloc_fragment((BT, BT), acc)
            Vn = T.alloc_fragment((BT, BV), acc)
            Of = T.alloc_fragment((BT, BV), acc)
            Vr = T.alloc_fragment((BT, BV), dtype)     # V's tile in K S's registers (stsm)
            # V's tile is read in the accumulators' layout (each thread its pairs of 8 rows): unswizzled, its
            # 2·BV-byte rows put those 8 rows in the same banks (an 8-way conflict on every read; run 23's ncu: all
            # of the kernel's 7.3 M excess shared wavefronts). Swizzled, as a dot operand's tile is, TMA writes it
            # permuted and the reads spread over the banks
            T.annotate_layout({Vs: tilelang.layout.make_swizzled_layout(Vs)})

            if affine:
                chunks = affine_walk_chunks(iv * BV < K, ctl[ib, ihv], T.ceildiv(Tn, BT))
                for i, j in T.Parallel(K, BV):       # [I | 0]: this tile's columns of the identity, or zeros
                    S[i, j] = T.if_then_else((iv * BV + j == i) & (chunks > 0), 1.0, 0.0)
            elif warm_planned and use_initial_state:
                # the walk starts at the sequence's start: its initial state (head_split 2: every walk does)
                if (chunks > 0) if head_split == 2 else (c0 == 0):
                    T.copy(h0[ib, ihv, 0:K, iv * BV:(iv + 1) * BV], S)
                else:                                # a warm-up: from zero
                    T.clear(S)
            elif warm and lean and use_initial_state and warm_subset == 1:
                # every program that walks starts a warm-up from zero; the others read no h0 (the scan may still be
                # writing it: this half runs beside it)
                T.clear(S)
            elif warm and lean and use_initial_state:
                if ctl[ibn, ihv] > 0:                # a warm-up starts from zero (the scan wrote no h0 for it)
                    T.clear(S)
                else:
                    T.copy(h0[ibn, ihv, 0:K, iv * BV:(iv + 1) * BV], S)
            elif use_initial_state:
                T.copy(h0[ibn, ihv, 0:K, iv * BV:(iv + 1) * BV], S)
            else:
                T.clear(S)
            v0 = iv * BV                              # V's first column for this tile
            if affine:
                # N's tiles read V shifted by K; M's read V's first tile and zero it (v_on)
                v0 = T.max(iv * BV - K, 0)
                v_on = T.if_then_else(iv * BV >= K, 1.0, 0.0)
            t = StepTiles(Qs=Qs, Ks=Ks, Vs=Vs, As=As, gcs=gcs, bs=bs, Gam=Gam, Rho=Rho, Beta=Beta, Gsc=Gsc, Ss=Ss, Xs=Xs,
                          Ps=Ps, Vns=Vns, Vds=Vds, Os=Os, S=S, KS=KS, QK=QK, Vn=Vn, Of=Of, Vr=Vr, o=o, ib=ib, ihv=ihv,
                          iv=iv, chunks=chunks, Lc=Lc if warm else None, v_on=v_on if affine else None, la=la)
            for cr in T.Pipelined(chunks, num_stages=num_stages):
                c = c0 + cr                           # the chunk, in the whole sequence
                # gc and β per program sequence: a warm walk's chunk lies in its segment or an earlier one
                gr = ib * nseg + c // Lc if warm else ib
                gcol = (c % Lc) * BT if warm else c * BT
                T.copy(k[ib, c * BT:(c + 1) * BT, ih, 0:K], Ks)
                if store_output:
                    T.copy(q[ib, c * BT:(c + 1) * BT, ih, 0:K], Qs)
                T.copy(v[ib, c * BT:(c + 1) * BT, ihv, v0:v0 + BV], Vs)
                T.copy(a_inv[ib, c * BT:(c + 1) * BT, ihv, 0:BT], As)
                T.copy(gc[gr, ihv, gcol:gcol + BT], gcs)
                if not beta_in_a:
                    T.copy(beta[gr, ihv, gcol:gcol + BT], bs)
                if state_only_warmups:
                    # a warm-up's chunk (its o written by nobody) runs the state's steps alone: one branch around
                    # the whole step, so that no dot is left running where the two paths join
                    if cr >= chunks - Lc:
                        chunk_step(t, c, cr, True)
                    else:
                        chunk_step(t, c, cr, False)
                else:
                    chunk_step(t, c, cr, True)
            if async_o and store_output and (tma_o or warm):
                T.tma_store_wait()      # the last store read the tile before the program ends
            if deferred_decay:
                for i, j in T.Parallel(K, BV):      # S = a S'
                    S[i, j] = S[i, j] * T.exp(la)
            if affine and lean:
                if ctl[ib, ihv] != 2:                # a map the warm walk does without: not written at all
                    T.copy(S, ht[ibn, ihv, 0:K, iv * BV:(iv + 1) * BV])  # N's tiles at column K + (their V column)
            elif warm and lean:
                # the sequence's last segment writes its final state (truncating divisions, as warm_planned's: every
                # index is ≥ 0, and floor divisions on symbolic sizes expand to sign tests)
                segs = T.truncdiv(Tn, Lg)
                if warm_subset or head_split:
                    # a program of the other subset (or head split) walked nothing: its launch writes this state
                    if (T.truncmod(ibn, segs) == segs - 1) and (chunks > 0):
                        T.copy(S, ht[T.truncdiv(ibn, segs), ihv, 0:K, iv * BV:(iv + 1) * BV])
                elif T.truncmod(ibn, segs) == segs - 1:
                    T.copy(S, ht[T.truncdiv(ibn, segs), ihv, 0:K, iv * BV:(iv + 1) * BV])
            else:
                T.copy(S, ht[ibn, ihv, 0:K, iv * BV:(iv + 1) * BV])  # N's tiles at column K + (their V column)

    return gdn_chunk_fwd


class StepTiles(types.SimpleNamespace):
    """What ``build_kernel``'s chunk step reads and writes besides its chunk: the program's shared tiles and register
    fragments, its sequence, value head and V tile, its loop bound and segment length (a TileLang macro sees only
    its arguments and ``build_kernel``'s constants)."""


def consumer_registers(threads: int, min_blocks: int) -> int:
    """Registers per consumer thread once the producer warpgroup (128 threads) has given all but 24 of its own back:
    the program's registers at launch, which ptxas allots under ``__launch_bounds__(threads + 128, min_blocks)`` (64K
    per SM shared by ``min_blocks`` programs, in steps of 8 per thread), less the producer's 24, over ``threads``.
    setmaxnreg.inc takes registers from the program's own pool only and waits until it holds enough (PTX ISA), so
    asking for more hangs: run 28's two programs per SM asked for 112 (the SM's half, 32K registers, less the
    producer's, over 256) where ptxas had allotted 80 per thread at launch (30,720 for the program, 7,168 freed by
    the producer, 8,192 asked) and never finished. One program per SM: 240, TileLang's own split; at most 256
    (setmaxnreg's and a thread's ceiling)."""
    at_launch = min(256, 65536 // (min_blocks * (threads + 128)) // 8 * 8)
    return min(256, (at_launch * (threads + 128) - 128 * 24) // threads // 8 * 8)


def x_value(v, gamma_ks, beta, beta_in_a: bool):
    """X's element (a TileLang expression): β (v − Γ K S), or v − Γ K S where β is folded into A_inv."""
    return v - gamma_ks if beta_in_a else beta * (v - gamma_ks)


def affine_walk_chunks(tile_in_m, skip, chunks):
    """The affine walk's loop count for one program (a TileLang expression, this kernel's and
    ``chunk_fwd_roles``'): 0 where the map's ``skip_m`` flag ``skip`` drops the tile — 1: the M tiles (a negligible
    map, M = 0), 2: every tile (a map the warm walk does without, [M | N] = 0) —, else ``chunks``. A tile that walks
    no chunk starts from zeros instead of [I | 0] and writes them."""
    import tilelang.language as T
    return T.if_then_else((tile_in_m & (skip != 0)) | (skip == 2), 0, chunks)


class HopperCompileError(RuntimeError):
    """TileLang could not build the kernel on this machine (a CUDA toolkit it needs missing, an incompatible
    TileLang, ...): the op then runs its Triton forward (``triton_chunk``), see :data:`COMPILE_FAILED`."""


# build_kernel's warm_subset: every program of the warm walk, those whose warm-up is above zero, the others
WARM_SUBSETS = (0, 1, 2)
# build_kernel's head_split: every head of the planned warm walk, the heads that warm up within the cap, the others
HEAD_SPLITS = (0, 1, 2)
# the head-split route's bound loads in flight at once (the cold test's window, 48 chunks at row 6)
ROUTE_UNROLL = 8


# Set to the first compile error of this process: from then on :func:`unsupported_reason` turns every input away,
# so the op warns once and keeps to its Triton paths instead of failing (or trying again) on every call
COMPILE_FAILED: Optional[str] = None


@functools.lru_cache(maxsize=64)
def compiled_kernel(H: int, HV: int, K: int, V: int, BV: int, scale: float, dtype: str = "bfloat16",
                    threads: int = 128, num_stages: int = 2, target: Optional[str] = None,
                    use_initial_state: bool = True, beta_dtype: str = "float32", a_dtype: str = "float32",
                    async_dots: bool = False, affine: bool = False, tma_o: bool = False, warm: bool = False,
                    stsm: bool = False, beta_in_a: bool = False, async_o: bool = False,
                    async_ax: bool = False, warm_planned: bool = False, threshold: float = -30.0,
                    min_blocks: int = 1, deferred_decay: bool = False, fold_p_decay: bool = False,
                    uniform_warpgroup: bool = False, lean: bool = False, warm_subset: int = 0,
                    head_split: int = 0, split_cap: float = 0.375, state_only_warmups: bool = False):
    """The compiled kernel (cached per static configuration); ``target`` as :func:`compile_prim_func`'s;
    ``uniform_warpgroup``: its CUDA rewritten so that ptxas sees the warpgroup index as warp-uniform
    (:data:`UNIFORM_WARPGROUP`, ``uniform_warpgroup.py``)."""
    func = build_kernel(H, HV, K, V, BV, scale, dtype, threads, num_stages, use_initial_state, beta_dtype, a_dtype,
                        async_dots, affine, tma_o, warm, stsm, beta_in_a, async_o, async_ax, warm_planned, threshold,
                        min_blocks, deferred_decay, fold_p_decay, lean, warm_subset, head_split, split_cap,
                        state_only_warmups)
    if not uniform_warpgroup:
        return compile_prim_func(func, target)
    from . import uniform_warpgroup as uniform
    with uniform.rewriting():
        return compile_prim_func(uniform.marked(func), target)


# TileLang's launcher for the compiled kernels: None takes its default (tvm_ffi in 0.1.15, ≈ 25 µs of host time per
# launch with its Python argument handling, run 23); "cython" is its other C launcher (it links against libcuda, so
# it builds only on a GPU machine): run 24 measured it slower, 110–205 µs of host time per pre-pass launch and
# 112–134 per walk, the segmented forward 584–660 µs per call. Set before the first call: compiled kernels are
# cached per configuration, not per launcher
EXECUTION_BACKEND: Optional[str] = None


# Launch the compiled kernels through TileLang's tvm_ffi executable itself (``launcher``), not its Python wrapper,
# which loops over the parameters to allocate outputs that these kernels do not have (out_idx None: every output is
# passed in). The executable checks each tensor's shape, dtype and strides and takes Torch's current stream, as the
# wrapper's call does. False: the wrapper. Set before the first call, like EXECUTION_BACKEND: ``launcher`` caches
# its answer per compiled kernel (``launcher.cache_clear()`` after a change)
DIRECT_LAUNCH = True
# o's TMA store per chunk issued without waiting for it (``build_kernel``'s ``async_o``): TileLang's T.copy waits for
# the store to have read the tile (``cp.async.bulk.wait_group.read 0``) right after issuing it, in the elected
# thread, so its warp — and the warpgroup's next wgmma, which needs every warp — waits on the store's read of 16 KB.
# With the flag the wait comes before the next chunk writes the tile, one chunk later. Predicted up to −7% (≈ 0.3 µs
# of a chunk's ≈ 4.1); run 26 (H200, benchmarks/op_time_check.py --async-o-ab, the public op, o and the final state
# bitwise equal): B=8 T=4096 H=16 0.3247 → 0.3083 ms (−5%), B=1 T=32768 H=16 (segmented: the warm walk) 0.519
# (host-bound that time) → 0.365, against 0.384 GPU-bound in call 7
ASYNC_O_STORE = True
# The X step's neighbours off the chain (``build_kernel``'s ``async_ax``, with ``async_dots`` and ``stsm``): V's tile
# read into registers while K S runs (16 shared loads per thread and their addresses, in phase A too), and A_inv X
# (V_new) left running while P's mask and decays and o's factor Γ are applied in their accumulators and P is stored,
# instead of waited for first (≈ 100 instructions per thread and chunk). Predicted −3 to −5% of the walk; run 27
# (H200, benchmarks/op_time_check.py --async-ax-ab --repeat 2, the public op, o and the final state bitwise equal):
# B=8 T=4096 H=16 0.310 → 0.307 ms, B=1 T=32768 H=16 0.369 → 0.364, B=1 T=32768 H=2 HV=8 0.223 → 0.220 (−1 to −2%
# of the op, ≈ −2 to −3% of the walk). Session 20's companion, P V_new and the state's update under one wait with the
# state's decay in the first dots' shadow, measured nothing beside it (0.306 / 0.365 / 0.222 ms with both) and was
# removed
ASYNC_AX = True
# Session 23's three cuts of the walk's instructions per chunk (docs/architecture.md, "Fewer instructions per chunk";
# benchmarks/walk_sass_count.py: 1027 → 722 SASS instructions per lazy chunk and consumer thread at B=8 T=4096 H=16's
# launch, −30%). Run 30 (H200, op_time_check.py --repeat 2, the public op, all three against none): B=8 T=4096 H=16
# 0.295 → 0.282 and 0.303 → 0.290 ms, B=4 T=8192 16/32 heads 0.568 → 0.551 and 0.582 → 0.560 (−3 to −4% of the op,
# ≈ −7% of the walk: the low end of the prediction, −10 to −20%); their GPU tests pass and every gpu_check_core case
# is as before: on. Each alone not timed.
# DEFERRED_DECAY (``build_kernel``'s ``deferred_decay``): the state kept as S' = S / a with one log scale per program,
# so the chunk's decay goes into la instead of 64 FMUL per thread; S' is multiplied only where la + ln γ would pass
# −DEFERRED_DECAY_LIMIT (every ≈ 12 chunks at bench_anchors' gates; every chunk for a head that forgets within one)
# and once before it is written. The same bf16 rounding points on rescaled values
DEFERRED_DECAY = True
# How far (in e-folds) S' may run ahead of the state before it is renormalised: |S'| ≤ e^40 |S| ≈ 2.4e17 |S|, far
# inside fp32's and bf16's range (3.4e38) for any state the op's inputs can build, and ρ's factor 1 / (a γ) ≤ e^40
DEFERRED_DECAY_LIMIT = 40.0
# FOLD_P_DECAY (with DEFERRED_DECAY and stsm; ``fold_p_decay``): in a chunk that does not renormalise, P's decays
# e^{gc_i − gc_j} = (Γ_i a)(ρ_j / (a γ)) split into o's row factor and V_d's, so P is the masked Q Kᵀ alone (no exp
# per element), P V_d replaces P V_new and runs beside the state's update, and o = Γ a scale ⊙ (Q S' + P V_d)
FOLD_P_DECAY = True
# UNIFORM_WARPGROUP (``compiled_kernel``'s ``uniform_warpgroup``, ``uniform_warpgroup.py``): the warpgroup index made
# warp-uniform in the generated CUDA, so ptxas builds the 40 wgmma descriptors per chunk in uniform registers
# instead of per thread (no value changes: outputs bitwise equal, run 30's GPU test)
UNIFORM_WARPGROUP = True
# STATE_ONLY_WARMUPS (``build_kernel``'s ``state_only_warmups``): a warm-up's chunk runs the state's dots alone (no
# Q S, Q Kᵀ, P V_d: ≈ 44% of its tensor work); bitwise the same outputs; the consumers wait for all of a chunk's tiles
# before the branch. On since run 42 (H200, graph replay, off → on): row 4 −5.5% / −2.3% / −1.0% at mixed / anchors' /
# slow gates, row 1 −18% / −3% / −18%, row 3 0% / −1% / −0.6%; bitwise the plain walk (GPU test and every A/B)
STATE_ONLY_WARMUPS = True


def schedule_switches(async_dots: bool, stsm: bool, tma_store: bool) -> tuple[bool, bool]:
    """``build_kernel``'s ``async_o`` and ``async_ax`` from :data:`ASYNC_O_STORE` and :data:`ASYNC_AX`, each False
    where the launch cannot use it (o not stored by TMA, dots not async, no stmatrix steps), so that a switch with no
    effect compiles no second copy of a kernel."""
    return ASYNC_O_STORE and tma_store, ASYNC_AX and async_dots and stsm


def warmup_switch(async_dots: bool, stsm: bool, head_split: int) -> bool:
    """``compiled_kernel``'s ``state_only_warmups`` for a warm walk from :data:`STATE_ONLY_WARMUPS`: False where the
    launch could not use it (the branch is written for A_inv X left running and the fold, as
    :func:`schedule_switches` and :func:`instruction_switches` resolve them; a head_split 2 walk has no warm-up), so
    that no second copy of a kernel compiles."""
    async_ax = schedule_switches(async_dots, stsm, True)[1]
    return (STATE_ONLY_WARMUPS and async_ax and instruction_switches(stsm, True)["fold_p_decay"]
            and head_split != 2)


def instruction_switches(stsm: bool, store_output: bool) -> dict:
    """``compiled_kernel``'s ``deferred_decay``, ``fold_p_decay`` and ``uniform_warpgroup`` from
    :data:`DEFERRED_DECAY`, :data:`FOLD_P_DECAY` and :data:`UNIFORM_WARPGROUP`, the fold False where the launch
    cannot use it (no deferred decay, no stmatrix steps, no o: phase A), as :func:`schedule_switches` does."""
    return dict(deferred_decay=DEFERRED_DECAY, fold_p_decay=FOLD_P_DECAY and DEFERRED_DECAY and stsm and store_output,
                uniform_warpgroup=UNIFORM_WARPGROUP)


@functools.lru_cache(maxsize=256)
def launcher(kernel):
    """What to call to launch a compiled kernel: its tvm_ffi executable with :data:`DIRECT_LAUNCH` where TileLang
    exposes one (0.1.15's tvm_ffi adapter), else the kernel itself."""
    adapter = getattr(kernel, "adapter", None)
    get = getattr(adapter, "_get_executable", None)
    if DIRECT_LAUNCH and EXECUTION_BACKEND is None and callable(get) and not getattr(adapter, "result_idx", None):
        return get()
    return kernel


def compile_prim_func(func, target: Optional[str] = None):
    """Compile a TileLang prim_func of the Hopper forward (this kernel, ``chunk_fwd_roles``, ``prepass``).
    ``target``: None for the current GPU, or an arch such as "sm_90a" to compile without one (the CPU compile
    checks). Fast math: e^x as ex2.approx (relative error ≈ 2⁻²², far below the bf16 rounding of every operand it
    scales). Any failure is a :class:`HopperCompileError` (the op then keeps to its Triton paths)."""
    import tilelang
    tgt = {"kind": "cuda", "arch": target} if target else "auto"
    try:
        return tilelang.compile(func, target=tgt, execution_backend=EXECUTION_BACKEND,
                                pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})
    except Exception as e:
        raise HopperCompileError(f"{type(e).__name__}: {e}"[:500]) from e


@functools.cache
def _cuda_major(index: Optional[int]) -> int:
    """The compute capability's major version of CUDA device ``index`` (None: the current one), cached: the op asks
    on every call, and the property lookup is host time."""
    return torch.cuda.get_device_capability(index)[0]


def unsupported_reason(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> Optional[str]:
    """Why the Hopper forward cannot take these inputs (None: it can): bf16 on an sm_90 GPU with TileLang
    installed, K and V multiples of 64 up to 256 and 128 (the TMA boxes), equal-length sequences (packed ones go
    through ``varlen.py``'s padding, which asks with ``cu_seqlens`` None)."""
    if q.dtype != torch.bfloat16:
        return f"takes bf16 inputs, got {q.dtype}"
    if q.device.type != "cuda" or _cuda_major(q.device.index) != 9:
        return "needs an sm_90 (Hopper) GPU"
    if cu_seqlens is not None:
        return "packed sequences (cu_seqlens) only by padding: hopper.varlen.VARLEN_BY_PADDING is off"
    K, V = q.shape[-1], v.shape[-1]
    if K % 64 or V % 64 or K > 128 or V > 256:
        return f"K and V must be multiples of 64 (K <= 128, V <= 256), got K={K}, V={V}"
    if not tilelang_available():
        return "TileLang is not installed"
    if COMPILE_FAILED is not None:
        return f"its compile failed earlier in this process ({COMPILE_FAILED})"
    return None


def misaligned(*tensors: Optional[torch.Tensor]) -> Optional[int]:
    """The position of the first of ``tensors`` (None skipped) whose data does not start on a 16-byte boundary, or
    None. The kernels read their inputs by TMA, whose descriptors need a 16-byte aligned start, and by 16-byte
    vector loads. A contiguous view can still start off that boundary: a flat buffer cut at an odd element, as a
    memory planner may. Such inputs take the Triton paths, which specialise on alignment instead of assuming it."""
    for i, x in enumerate(tensors):
        if x is not None and x.data_ptr() % 16:
            return i
    return None


def padded_length(T: int) -> int:
    """Tp: T rounded up to a multiple of 8, so that a head-major row of fp32 or bf16 values is a multiple of 16 bytes
    (TMA's stride rule); one Tp for gc and β, which the kernel binds to one symbol."""
    return -(-T // 8) * 8


def head_major(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, HV]`` → ``[B, HV, Tp]`` contiguous (:func:`padded_length`), zero-padded: the kernel loads a chunk's 64
    gates (or β) with one TMA copy, which needs contiguous rows and 16-byte strides. One copy of B·T·HV values (a
    few MB), against a global load on every chunk's critical path otherwise."""
    B, T, HV = x.shape
    Tp = padded_length(T)
    xt = x.transpose(1, 2)
    return xt.contiguous() if Tp == T else torch.nn.functional.pad(xt, (0, Tp - T))
