"""Hopper forward (TileLang): the state walk and the output fused in one kernel, on wgmma and TMA.

``chunk_gated_delta_rule``'s "auto" path runs it on sm_90 for bf16 inputs it takes (``compile.unsupported_reason``);
``walk_launch.py`` holds the calls that take tensors and launch it (``chunk_fwd_hopper_hm``), ``forward.py`` chains
it after the pre-pass (``prepass.py``), ``compile.py`` compiles it; ``chunk_fwd_ref.py`` is its PyTorch twin.
benchmarks/gpu_check_core.py --forward-path hopper checks it on the GPU; ``tests/ops/hopper_sources.py`` builds the CUDA of
every configuration the forward launches on the CPU.

Why (docs/architecture.md): the Triton split forward writes every chunk's state h (32 KB per chunk and head in
bf16, twice the size of the chunk's queries) and V_new to HBM and reads them back in a second kernel, and Triton 3.6
cannot warp-specialise the sequential walk that would keep them on chip. This kernel walks the chunks of one
(sequence, value head, V tile) with the state in registers and writes only o and the final state; TileLang
pipelines the next chunk's loads (TMA, from a producer warpgroup) under this chunk's dots.

Inputs from the pre-pass (``prepass.prepass_hopper``): gc (chunk-local cumulative log decays, fp32, head-major)
and A_inv diag(β) (each chunk's (I + strictly-lower(β K Kᵀ ⊙ D))⁻¹ with its columns scaled by β, bf16). Per chunk,
with S the state entering it (K × BV slice, fp32 registers, kept as S' = S / a with one log scale ln a per
program: the deferred decay), Γ = e^{gc} a per row, γ = e^{gc of the chunk's last token}, ρ = e^{gc_last − gc} /
(a γ) per row:

    S_b   = bf16(S')                                    the state as a dot operand (fla's precision for h)
    X     = V − Γ ⊙ (K S_b)                             [BT, BV], rounded to bf16: A_inv X is one wgmma
    V_new = (A_inv diag(β)) X
    V_d   = bf16(ρ ⊙ V_new)
    O     = scale · Γ ⊙ (Q S_b + (Q Kᵀ ⊙ causal) V_d)   P's decays e^{gc_i − gc_j} = Γ_i ρ_j γ split between o's
                                                        rows and V_d: no exp per element of P
    S'    = S' + Kᵀ V_d,  ln a += ln γ                  no multiply per state element for the decay

Where ln a + ln γ would fall below −:data:`DEFERRED_DECAY_LIMIT` the chunk renormalises instead (S' ← a γ S',
ln a ← 0, ρ = e^{gc_last − gc}) and takes P with its decays, P = bf16(scale · Q Kᵀ ⊙ e^{gc_i − gc_j} ⊙ causal), and
O = scale · Γ ⊙ Q S_b + P bf16(V_new). e^x is ex2.approx (fast math). Reads per chunk and program, every one by TMA:
Q, K (BT × K), V (BT × BV), A_inv (BT × BT), gc (head-major, :func:`head_major`, so that a chunk's 64 values are one
contiguous copy); writes O (BT × BV) by TMA. Shapes are compiled per (H, HV, K, V, BV, scale); B and T are symbolic
(a new T costs no compile).

Causality under NaN and Inf (``common/finite.py``): the pre-pass sets gc to NaN from a chunk's first row whose gc,
β or key is non-finite, and A_inv diag(β)'s rows from there to NaN. Here a row whose Γ is not finite has X = 0 (A_inv
X would multiply it by the zeros of every earlier row), and one whose ρ is not finite V_d = 0 (the same for P V_d);
those rows' o is NaN through Γ, and the state through ln a += ln γ (the chunk's last gc is NaN). A chunk with such a
row never renormalises (the comparison with NaN is false). A non-finite v is found in the walk: each thread sums
the magnitudes of its elements of V's tile (one add per element; the sum is not finite iff one of them is, or it
overflows), and only where that sum is not finite does it zero X there and send the rows to a shared atomic min,
read after the barrier before A_inv X. From that row on o is NaN (through Γ) and the state dead: ln a NaN (then
every later chunk's Γ and ρ are NaN, and the final state e^{ln a} S' too), or S' NaN where the chunk renormalises.
The walk's V tiles are separate programs: the rows are poisoned in the tiles that hold the non-finite v. The
segmented forward carries it through a NaN map (phase A) or a warm-up that covers it; the pre-pass does not read v,
so a warm-up that starts past it (a head that forgets fast) starts clean: later segments' rows and the final state
stay finite there where the token loop's are NaN (never NaN before it).
The states' walk (``store_states``) keeps the selects on Γ and ρ and does without the search for a non-finite v:
it forms no o, and such a v makes the state's columns it lies in non-finite from its chunk on, as the token loop's.
"""
import functools  # no "from __future__ import annotations": TileLang reads the kernel's annotations as objects
import math
import types
from typing import Optional

import torch

from .compile import (  # noqa: F401  (the Hopper forward's modules import these from here)
    HopperCompileError,
    compile_failed,
    compile_prim_func,
    launcher,
    mark_compile_failed,
    misaligned,
    tilelang_available,
    unsupported_reason,
)

BT = 64
DTYPE = "bfloat16"      # q, k, v, A_inv and o; the state and its factors in ACC
ACC = "float32"
# How far (in e-folds) the registers' S' = S / a may run ahead of the state before it is renormalised (the deferred
# decay: the chunk's decay γ goes into ln a, one scalar per program, instead of a multiply per state element):
# |S'| ≤ e^40 |S| ≈ 2.4e17 |S|, far inside fp32's and bf16's range (3.4e38) for any state the op's inputs can build,
# and ρ's factor 1 / (a γ) ≤ e^40
DEFERRED_DECAY_LIMIT = 40.0
# the walk's shared atomic min (x_and_v_new), a plain CUDA call
ATOMIC_MIN_SOURCE = """
__device__ __forceinline__ int linattn_atomic_min(void* slot, int value) { return atomicMin((int*)slot, value); }
"""
NAN = float("nan")  # the rows a non-finite input feeds (T.float32(NAN): TileLang takes the constant from here)


def build_kernel(H: int, HV: int, K: int, V: int, BV: int, scale: float, threads: int = 256, num_stages: int = 2,
                 use_initial_state: bool = True, beta_dtype: str = "float32", affine: bool = False,
                 warm: bool = False, warm_planned: bool = False, threshold: float = -30.0, lean: bool = False,
                 store_states: bool = False, beta_in_a_inv: bool = True, m_only: bool = False):
    """The TileLang prim_func of the fused forward for these static sizes (B and T symbolic). Without
    ``use_initial_state`` the state starts at zero and h0 is not read. A_inv is bf16 with β folded into its columns
    (A_inv diag(β), the pre-pass's), so X = V − Γ ⊙ (K S) and β is not read (its tensor, in ``beta_dtype``, is
    passed and ignored). ``threads``: the consumer threads (TileLang adds a producer warpgroup for the TMA loads);
    ``num_stages``: the depth of the chunk loop's load pipeline.

    ``affine``: phase A of the segmented forward (``forward.py``): each sequence's affine state map [M | N] (S_out =
    M S_in + N), the walk of the K × (K + V) state [I | 0] with values [0 | V], written to ht ``[B, HV, K, K + V]``;
    the grid covers K + V columns (a program's tile lies in M or in N: BV divides K), V's columns are read shifted
    by K (an M tile reads a valid tile and zeroes it), and only the state's three dots run (q not read, o not
    written); where ``skip_m [B, HV]`` (int32, the ``ctl`` argument) is 1 the M tiles walk no chunk and write M = 0
    (``forward.segment_flags``), where it is 2 every tile does ([M | N] = 0: a map the warm walk does without).
    ``m_only`` (affine): M alone, ht ``[B, HV, K, K]`` and the grid over K columns (no N tile: the backward's reverse
    maps, ``reverse_maps.py``, read nothing else).

    ``warm``: phase C of the segmented forward with warm-ups (``forward.py``). q, k, v, A_inv and o are the whole
    sequences ``[B, T, ...]``; gc, β ``[B·S, HV, L]``, h0 and ht ``[B·S, HV, K, V]`` are per segment (L = T/S, a
    multiple of 64: the segments' count S = T / L is symbolic too). The program of segment s starts ``ctl [B·S,
    HV]`` = w chunks before it, from h0 (the scan's entering state, or zero for a warm-up), and writes o only from its
    own first chunk on: it walks w + L/64 chunks. A warm-up's chunk, whose o nobody reads, runs the state's three
    dots alone (:func:`chunk_step_macro`'s ``outputs``). With ``warm_planned`` each program finds w itself (no plan,
    no maps, no scan: the segmented forward in two launches; twin ``map_bound.warm_from_bound_ref``): ``ctl`` is then
    the pre-pass's chunk bounds ``[B·S, HV, L/64]`` fp32 (log2 units) and w the fewest chunks before the segment whose
    bounds sum below ``threshold``, else the whole prefix (w = s·L/64, from h0 ``[B, HV, K, V]``, the sequence's
    initial state: exact); a warm-up that ends earlier starts from zero.

    ``lean`` (``forward.LEAN_SEGMENTS``): no write that nothing reads. In the affine walk a map whose ``skip_m`` is
    2 is not written at all (the scan reads none of it). In the warm walk ht is ``[B, HV, K, V]``, the sequences'
    final states, written by each sequence's last segment alone; and without ``warm_planned`` a segment whose
    warm-up w is above zero starts from zero instead of reading h0 (the scan leaves those entering states
    unwritten: ``seq_parallel.affine_scan(skip_writes=True)``).

    ``store_states``: the Hopper backward's recompute (``backward.py``): the state walk alone (the state's three
    dots: q not read, no o), writing the bf16 state entering each chunk into h ``[B, NT, HV, K, V]`` (the ``o``
    argument; the layout ``chunk_bwd`` reads) by TMA from the tile K S reads, and the final state into ht. A_inv is
    the plain T = (I + A)⁻¹ (the pre-pass's ``beta_in_a_inv=False``) and β is read: X = β ⊙ (V − Γ ⊙ (K S)), the
    backward's own recompute of X (``chunk_bwd``), and no deferred decay (every chunk renormalises, S ← γ S + Kᵀ V_d):
    the stored h is S itself, the state ``chunk_bwd_ref.state_step_ref`` walks. The scale is not used. With ``warm``
    (and ``lean``) it is phase C of the states in segments (``backward.segmented_states``): each segment's program
    starts as the warm walk's and stores h at the global index of its own chunks alone (a warm-up's chunk runs the
    same three dots and stores nothing), ht the sequences' final states; with ``warm_planned`` too, each program
    finds its warm-up from the chunk bounds as the planned forward does (the states in two launches).

    ``beta_in_a_inv`` False (the affine walk; ``store_states`` always reads β so): A_inv is the plain T and
    X = β ⊙ (V − Γ ⊙ K S), β read per chunk, the operator the states walk applies: phase A of the states in
    segments walks the maps of that operator."""
    import tilelang.language as T

    check_build_flags(K, BV, affine, warm, warm_planned, store_states, beta_in_a_inv, m_only)
    B = T.symbolic("B")
    Tn = T.symbolic("T")
    Tp = T.symbolic("Tp")   # gc and β are passed head-major, [B, HV, Tp], T padded for TMA (see head_major)
    # the programs' sequences and the rows of gc / β: the sequences and Tp, or (warm) the segments and their length
    NB = T.symbolic("BS") if warm else B
    Lg = T.symbolic("L") if warm else Tp
    warm_planned = warm and warm_planned
    # ctl: per (program sequence, value head) the affine walk's skip flag (skip_m) or the warm walk's w; with
    # warm_planned the chunk bounds it finds w from
    ctl_shape, ctl_dtype = ((NB, HV, T.symbolic("LC")), ACC) if warm_planned else ((NB, HV), "int32")
    # o: the output, or (store_states) h, the bf16 state entering each of the NT chunks
    o_shape = (B, T.symbolic("NT"), HV, K, V) if store_states else (B, Tn, HV, V)
    kernel = types.SimpleNamespace(H=H, HV=HV, K=K, BV=BV, scale=scale, Tn=Tn, Lg=Lg, affine=affine, warm=warm,
                                   warm_planned=warm_planned, threshold=threshold, lean=lean,
                                   use_initial_state=use_initial_state, store_output=not (affine or store_states),
                                   store_states=store_states, beta_in_x=store_states or not beta_in_a_inv,
                                   beta_dtype=beta_dtype)
    chunk_step = chunk_step_macro(kernel)
    W = K if m_only else K + V if affine else V     # the state's columns: [M | N] in phase A
    walk = walk_macros(kernel)
    dtype = DTYPE

    @T.prim_func
    def gdn_chunk_fwd(q: T.Tensor((B, Tn, H, K), dtype), k: T.Tensor((B, Tn, H, K), dtype),
                      v: T.Tensor((B, Tn, HV, V), dtype), gc: T.Tensor((NB, HV, Lg), ACC),
                      beta: T.Tensor((NB, HV, Lg), beta_dtype), a_inv: T.Tensor((B, Tn, HV, BT), dtype),
                      h0: T.Tensor((B if warm_planned else NB, HV, K, V), ACC), ctl: T.Tensor(ctl_shape, ctl_dtype),
                      o: T.Tensor(o_shape, dtype),
                      ht: T.Tensor((B if warm and lean else NB, HV, K, W), ACC)):
        with T.Kernel(T.ceildiv(W, BV), NB * HV, threads=threads) as (iv, bh):
            T.import_source(ATOMIC_MIN_SOURCE)
            if warm_planned:
                # the warpgroups' register split asked for explicitly (TileLang's own, 24 / 240 at one program per
                # SM, is left out when the producer stores to a local, as warm_planned's does; the consumers then
                # stayed at 168 and spilled): 24 per producer thread and the rest of the program's registers per
                # consumer thread (consumer_registers)
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(consumer_registers(threads))
            ibn = bh // HV                            # the program's sequence: a segment when warm
            ihv = bh % HV
            ih = ihv // (HV // H)
            ib = ibn                                  # its batch row in q, k, v, A_inv, o
            c0 = 0                                    # the first chunk it walks
            chunks = T.ceildiv(Tn, BT)
            if warm:
                Lc = Lg // BT                         # chunks per segment
                nseg = Tn // Lg
                ib = ibn // nseg
                if warm_planned:
                    nseg = T.truncdiv(Tn, Lg)
                    ib = T.truncdiv(ibn, nseg)
                    # w: summing the bounds of the chunks before the segment, nearest first, until the sum falls
                    # below the threshold (the entering state's weight < 2^threshold), else up to the sequence's
                    # start. Every thread (producer and consumers) runs the same loads and adds: the same w
                    # (truncating divisions: every index is ≥ 0, and TIR's floor divisions on symbolic sizes expand
                    # to sign tests that stay live through the chunk loop as spills)
                    first = T.truncmod(ibn, nseg) * Lc
                    wv = T.alloc_var("int32", init=0)
                    run = T.alloc_var(ACC, init=0.0)
                    while (wv < first) and ((wv == 0) or (run >= threshold)):
                        cw = first - 1 - wv
                        run = run + ctl[ib * nseg + T.truncdiv(cw, Lc), ihv, T.truncmod(cw, Lc)]
                        wv = wv + 1
                    c0 = first - wv
                    chunks = Lc + wv
                else:
                    c0 = (ibn % nseg) * Lc - ctl[ibn, ihv]
                    chunks = Lc + ctl[ibn, ihv]
            tiles = walk.alloc_tiles()
            S = tiles.S
            if affine:
                chunks = affine_walk_chunks(iv * BV < K, ctl[ib, ihv], T.ceildiv(Tn, BT))
                for i, j in T.Parallel(K, BV):       # [I | 0]: this tile's columns of the identity, or zeros
                    S[i, j] = T.if_then_else((iv * BV + j == i) & (chunks > 0), 1.0, 0.0)
            else:
                walk.load_initial_state(S, h0, ctl, ib, ibn, ihv, iv, c0)
            if not store_states:              # the walk's search for a non-finite v (chunk_step_macro)
                tiles.vbad[0] = BT
            v0 = iv * BV                              # V's first column for this tile
            if affine:
                # N's tiles read V shifted by K; M's read V's first tile and zero it (v_on)
                v0 = T.max(iv * BV - K, 0)
                v_on = T.if_then_else(iv * BV >= K, 1.0, 0.0)
            t = program_tiles(tiles, o=o, ib=ib, ihv=ihv, iv=iv, chunks=chunks, Lc=Lc if warm else None,
                              v_on=v_on if affine else None)
            for cr in T.Pipelined(chunks, num_stages=num_stages):
                c = c0 + cr                           # the chunk, in the whole sequence
                walk.load_chunk(t, q, k, v, gc, beta, a_inv, ib, ih, ihv, c, v0, nseg if warm else None)
                if warm and not store_states:
                    # a warm-up's chunk (its o written by nobody) runs the state's steps alone: one branch around
                    # the whole step, so that no dot is left running where the two paths join (the states' walk runs
                    # those steps on every chunk: its branch is around h's store alone, in chunk_step)
                    if cr >= chunks - Lc:
                        chunk_step(t, c, cr, True)
                    else:
                        chunk_step(t, c, cr, False)
                else:
                    chunk_step(t, c, cr, not kernel.store_states)      # the states' walk: the state's dots alone
            walk.store_final_state(t, ht, ctl, ib, ibn, ihv, iv)

    return gdn_chunk_fwd


def check_build_flags(K: int, BV: int, affine: bool, warm: bool, warm_planned: bool, store_states: bool,
                      beta_in_a_inv: bool, m_only: bool = False) -> None:
    """ValueError for a combination of :func:`build_kernel`'s flags it does not build."""
    if m_only and not affine:
        raise ValueError("m_only is the affine walk's (its maps' M alone): pass affine=True")
    if affine and K % BV:
        raise ValueError(f"the affine walk needs BV ({BV}) to divide K ({K})")
    if affine and warm:
        raise ValueError("warm is phase C's walk (affine is phase A's)")
    if store_states and affine:
        raise ValueError("store_states is the unsegmented walk or phase C's (warm, warm_planned): not with affine")
    if not (beta_in_a_inv or affine or store_states):
        raise ValueError("β in X (beta_in_a_inv=False) is built for the affine walk and the states walk")


def walk_macros(kernel) -> types.SimpleNamespace:
    """The walk's steps around its chunk loop (TileLang macros over ``kernel``'s static sizes and flags:
    :func:`build_kernel`'s): the program's tiles, its entering state, a chunk's loads, the final state's store."""
    import tilelang
    import tilelang.language as T

    K, BV, warm, lean, affine = kernel.K, kernel.BV, kernel.warm, kernel.lean, kernel.affine
    store_output, store_states, Tn, Lg, dtype = kernel.store_output, kernel.store_states, kernel.Tn, kernel.Lg, DTYPE
    beta_in_x = kernel.beta_in_x

    @T.macro
    def alloc_tiles():
        Qs = T.alloc_shared((BT, K), dtype)
        Ks = T.alloc_shared((BT, K), dtype)
        Vs = T.alloc_shared((BT, BV), dtype)
        As = T.alloc_shared((BT, BT), dtype)
        gcs = T.alloc_shared((BT,), ACC)
        # per-row factors in registers (each thread holds its accumulator rows' values: no shared-memory load
        # per element): Γ_i = e^{gc_i} a, ρ_i = e^{gc_last − gc_i} / a (the decay to the chunk's end)
        Gam = T.alloc_fragment((BT,), ACC)
        Rho = T.alloc_fragment((BT,), ACC)
        Gsc = T.alloc_fragment((BT,), ACC)      # gc_i + ln(scale), P's rows' exponents
        # ln a, the state's scale (S = a S') at the chunk's start, the same in every thread
        la = T.alloc_var(ACC, init=0.0)
        Vsum = None if store_states else T.alloc_local((1,), ACC)  # Σ |v| over the thread's elements of V's tile
        Ss = T.alloc_shared((K, BV), dtype)        # bf16 state, the B operand of K S and Q S
        Xs = T.alloc_shared((BT, BV), dtype)       # X, A_inv X's right operand
        Ps = T.alloc_shared((BT, BT), dtype)
        Vns = T.alloc_shared((BT, BV), dtype)
        Vds = T.alloc_shared((BT, BV), dtype)
        Os = T.alloc_shared((BT, BV), dtype)       # o's tile for its TMA store
        # the first row whose v (this tile's) is not finite, as i − cr·BT (row i of chunk cr): a shared atomic min
        # of the rows that have one (x_and_v_new), never reset: a later chunk's keys are smaller, and an earlier
        # chunk's key (or the initial BT) reads as a row ≥ BT (none) in a later chunk
        vbad = None if store_states else T.alloc_shared((1,), "int32")
        S = T.alloc_fragment((K, BV), ACC)
        KS = T.alloc_fragment((BT, BV), ACC)
        QK = T.alloc_fragment((BT, BT), ACC)
        Vn = T.alloc_fragment((BT, BV), ACC)
        Of = T.alloc_fragment((BT, BV), ACC)
        Vr = T.alloc_fragment((BT, BV), dtype)     # V's tile in K S's registers
        # V's tile is read in the accumulators' layout (each thread its pairs of 8 rows): unswizzled, its 2·BV-byte
        # rows put those 8 rows in the same banks (an 8-way conflict on every read). Swizzled, as a dot operand's
        # tile is, TMA writes it permuted and the reads spread over the banks
        T.annotate_layout({Vs: tilelang.layout.make_swizzled_layout(Vs)})
        # the states' walk and the affine walk of its maps read β per chunk (X = β ⊙ (V − Γ ⊙ K S)), per row beside Γ
        bs = T.alloc_shared((BT,), kernel.beta_dtype) if beta_in_x else None
        Bet = T.alloc_fragment((BT,), ACC) if beta_in_x else None
        return StepTiles(Qs=Qs, Ks=Ks, Vs=Vs, As=As, gcs=gcs, Gam=Gam, Rho=Rho, Gsc=Gsc, Ss=Ss, Xs=Xs, Ps=Ps,
                         Vns=Vns, Vds=Vds, Os=Os, vbad=vbad, S=S, KS=KS, QK=QK, Vn=Vn, Of=Of, Vr=Vr, la=la,
                         Vsum=Vsum, bs=bs, Bet=Bet)

    @T.macro
    def load_initial_state(S, h0, ctl, ib, ibn, ihv, iv, c0):
        if kernel.warm_planned and kernel.use_initial_state:
            # the walk starts at the sequence's start: its initial state
            if c0 == 0:
                T.copy(h0[ib, ihv, 0:K, iv * BV:(iv + 1) * BV], S)
            else:                                # a warm-up: from zero
                T.clear(S)
        elif warm and lean and kernel.use_initial_state:
            if ctl[ibn, ihv] > 0:                # a warm-up starts from zero (the scan wrote no h0 for it)
                T.clear(S)
            else:
                T.copy(h0[ibn, ihv, 0:K, iv * BV:(iv + 1) * BV], S)
        elif kernel.use_initial_state:
            T.copy(h0[ibn, ihv, 0:K, iv * BV:(iv + 1) * BV], S)
        else:
            T.clear(S)

    @T.macro
    def load_chunk(t, q, k, v, gc, beta, a_inv, ib, ih, ihv, c, v0, nseg):
        """Chunk c's tiles, each one TMA copy from the producer: K first (see :func:`chunk_step`); β only where X
        takes it (``beta_in_x``)."""
        # gc per program sequence: a warm walk's chunk lies in its segment or an earlier one
        gr = ib * nseg + c // t.Lc if warm else ib
        gcol = (c % t.Lc) * BT if warm else c * BT
        T.copy(k[ib, c * BT:(c + 1) * BT, ih, 0:K], t.Ks)
        if store_output:
            T.copy(q[ib, c * BT:(c + 1) * BT, ih, 0:K], t.Qs)
        T.copy(v[ib, c * BT:(c + 1) * BT, ihv, v0:v0 + BV], t.Vs)
        T.copy(a_inv[ib, c * BT:(c + 1) * BT, ihv, 0:BT], t.As)
        T.copy(gc[gr, ihv, gcol:gcol + BT], t.gcs)
        if beta_in_x:
            T.copy(beta[gr, ihv, gcol:gcol + BT], t.bs)

    @T.macro
    def store_final_state(t, ht, ctl, ib, ibn, ihv, iv):
        """The final state S = a S' (phase A: the map), after the last store of o (or h) has read its tile."""
        S = t.S
        if store_output or store_states:
            T.tma_store_wait()      # the last store read the tile before the program ends
        for i, j in T.Parallel(K, BV):      # S = a S'
            S[i, j] = S[i, j] * T.exp(t.la)
        if affine and lean:
            if ctl[ib, ihv] != 2:           # not written: a map the warm walk does without
                T.copy(S, ht[ibn, ihv, 0:K, iv * BV:(iv + 1) * BV])  # N's tiles at column K + (their V column)
        elif warm and lean:
            # the sequence's last segment writes its final state (truncating divisions, as warm_planned's: every
            # index is ≥ 0, and floor divisions on symbolic sizes expand to sign tests)
            segs = T.truncdiv(Tn, Lg)
            if T.truncmod(ibn, segs) == segs - 1:
                T.copy(S, ht[T.truncdiv(ibn, segs), ihv, 0:K, iv * BV:(iv + 1) * BV])
        else:
            T.copy(S, ht[ibn, ihv, 0:K, iv * BV:(iv + 1) * BV])  # N's tiles at column K + (their V column)

    return types.SimpleNamespace(alloc_tiles=alloc_tiles, load_initial_state=load_initial_state,
                                 load_chunk=load_chunk, store_final_state=store_final_state)


def chunk_step_macro(kernel):
    """The consumers' steps for one chunk once its tiles are loaded (a TileLang macro over ``kernel``'s static sizes
    and flags, :func:`build_kernel`'s), in the order they are issued:

        the dots     K S, Q S, Q Kᵀ on the bf16 state, issued back to back; Γ, ρ (and P's row exponents) meanwhile
        X, V_new     X = V − Γ ⊙ K S once K S is done, then A_inv X, left running while P is formed
        P, V_d       P = Q Kᵀ under the causal mask (with its decays where the chunk renormalises), V_d = ρ ⊙ V_new
        o            P V_d beside the state's update (or P V_new before it), o's tile by TMA
        the state    S' ← S' + Kᵀ V_d, its decay kept in la (deferred decay)

    ``outputs`` (a Python bool): o's dots and element-wise steps too; False for a warm-up's chunk (the state's three
    dots alone, each waited for inside this step: a dot left running where two branches join made ptxas serialise
    every wgmma of the kernel) and in the states' walk (``store_states``: the bf16 state out by TMA, β in X, every
    chunk renormalised)."""
    import tilelang.language as T

    K, BV, Tn = kernel.K, kernel.BV, kernel.Tn
    warm, store_output, store_states = kernel.warm, kernel.store_output, kernel.store_states
    beta_in_x = kernel.beta_in_x
    log_scale = math.log(kernel.scale)
    form_p, scale_o_tile, store_o = o_tile_macros(kernel)
    x_and_v_new = x_and_v_new_macro(kernel)

    @T.macro
    def issue_dots(t, outputs):
        """K S, Q S and Q Kᵀ on this chunk's tiles and the entering state (tensor cores, fp32 accumulators), issued
        back to back and waited for as needed.

        Async dots and the load pipeline: TileLang releases a staged buffer to the producer right after its last
        use in program order — for Qs that is the *issue* of Q Kᵀ, before it completes. That is safe only because
        the producer loads each chunk's K first and Ks is released last, after the synchronous state update: the
        producer cannot refill Qs for chunk c + 2 before chunk c is done. Keep it so (K first, the update
        synchronous) when reordering the dots."""
        if store_states:
            T.tma_store_wait()      # the previous chunk's h store has read the tile
        T.copy(t.S, t.Ss)
        T.wgmma_gemm(t.Ks, t.Ss, t.KS, clear_accum=True)
        if store_output and outputs:
            T.wgmma_gemm(t.Qs, t.Ss, t.Of, clear_accum=True)
            T.wgmma_gemm(t.Qs, t.Ks, t.QK, transpose_B=True, clear_accum=True)

    @T.macro
    def store_state(t, c, write):
        """The states' walk: S_b, the bf16 state entering chunk c that K S reads, out to h by TMA where ``write``
        (not in a warm-up's chunk), not waited for (the wait comes before the next chunk writes the tile)."""
        if write:
            T.tma_copy(t.Ss, t.o[t.ib, c, t.ihv, 0:K, t.iv * BV:(t.iv + 1) * BV])

    @T.macro
    def row_factors(t, g_last, renorm, outputs):
        """Γ = e^{gc} a and ρ = e^{gc_last − gc} / (a γ) (or, where the chunk renormalises, e^{gc_last − gc}) per
        row while the dots run: 2 exps per row instead of per element; P's row exponents gc + ln scale; β beside Γ
        where X takes it (every chunk renormalises in the states' walk)."""
        la = t.la.buffer
        for i in T.Parallel(BT):
            t.Gam[i] = T.exp(t.gcs[i] + la)
            if beta_in_x:
                t.Bet[i] = T.cast(t.bs[i], ACC)
        for i in T.Parallel(BT):    # a loop of its own: Rho takes Vn's layout
            t.Rho[i] = T.exp((g_last if store_states else T.if_then_else(renorm, g_last, -la)) - t.gcs[i])
        if store_output and outputs:
            for i in T.Parallel(BT):    # and Gsc QK's
                t.Gsc[i] = t.gcs[i] + log_scale

    @T.macro
    def p_and_v_d(t, renorm, outputs):
        """P, V_new and V_d = ρ ⊙ V_new in place in their accumulators, then to shared memory by stmatrix. A chunk
        that renormalises takes P with its decays and the scale in its exponent, and P V_new; one that does not
        takes P as the masked Q Kᵀ alone (its decays e^{gc_i − gc_j} = (Γ_i a)(ρ_j / (a γ)) go to o's rows and
        V_d), and P V_d."""
        if not outputs:
            T.wait_wgmma(0)     # V_new: a warm-up's chunk forms no P
        elif store_output:
            if renorm:
                form_p(t.QK, t.Ps, t.Gsc, t.gcs, True)
                scale_o_tile(t.Of, t.Gam)
                T.wait_wgmma(0)
                T.copy(t.Vn, t.Vns)
            else:               # P without its decays; no V_new tile
                form_p(t.QK, t.Ps, t.Gsc, t.gcs, False)
                T.wait_wgmma(0)
        for i, j in T.Parallel(BT, BV):      # 0 on a row whose ρ is not finite (the module docstring)
            t.Vn[i, j] = T.if_then_else(T.isfinite(t.Rho[i]), t.Vn[i, j] * t.Rho[i], 0.0)
        T.copy(t.Vn, t.Vds)

    @T.macro
    def chunk_step(t, c, cr, outputs):
        """Chunk c's steps (``t``: the program's tiles, indices, loop bounds and the deferred decay's log scale la,
        :class:`StepTiles`)."""
        la = t.la.buffer    # the one-element buffer of T.alloc_var (t.la reads it): assignments below store into it
        # the warm-up's chunks write no o and no h (a Python True elsewhere: no run-time branch)
        write_o = not warm or cr >= t.chunks - t.Lc
        issue_dots(t, outputs)
        if store_states:
            store_state(t, c, write_o)
        g_last = gcs_last(t.gcs, Tn, c)
        # whether this chunk renormalises S' (la + ln γ below the limit); every chunk in the states' walk, whose h
        # is the state itself
        renorm = True if store_states else la + g_last < -DEFERRED_DECAY_LIMIT
        row_factors(t, g_last, renorm, outputs)
        x_and_v_new(t, cr, outputs)
        p_and_v_d(t, renorm, outputs)
        if not outputs:
            T.sync_threads()        # V_d's tile, stored by every consumer, before the update reads it
        elif store_output:
            if renorm:
                T.gemm(t.Ps, t.Vns, t.Of)
                store_o(t, c, write_o)
            else:
                # P V_d issued and left running: the state's update below reads V_d too and waits for both. The
                # consumers' barrier first, as before every dot on a tile they have just stored (TileLang leaves it
                # out on this branch)
                T.sync_threads()
                T.wgmma_gemm(t.Ps, t.Vds, t.Of)
        # the state's decay in la; S' multiplied only where a γ would leave the limit (a uniform branch: la and γ
        # are the program's)
        if renorm:
            for i, j in T.Parallel(K, BV):
                t.S[i, j] = t.S[i, j] * T.exp(la + g_last)
            la = 0.0
        else:
            la = la + g_last
        # synchronous: TileLang hands Ks back to the producer after its last use in program order, which must come
        # after the dot reading it has completed
        T.gemm(t.Ks, t.Vds, t.S, transpose_A=True)
        if store_output and outputs:
            if not renorm:
                scale_o_tile(t.Of, t.Gam)       # o = Γ a scale ⊙ (Q S' + P V_d)
                store_o(t, c, write_o)

    return chunk_step


def x_and_v_new_macro(kernel):
    """The chunk step's X and V_new (:func:`chunk_step_macro`; a TileLang macro over ``kernel``'s static sizes and
    flags)."""
    import tilelang.language as T

    BV, affine, beta_in_x = kernel.BV, kernel.affine, kernel.beta_in_x
    store_output, store_states = kernel.store_output, kernel.store_states
    # the walk's search for a non-finite v. The states' walk does without it: its value columns are independent
    # (no o, no P), so such a v makes the state's columns it lies in non-finite from its chunk on, through A_inv X
    # and Kᵀ V_d, as the token loop's (the twin, chunk_fwd_ref.chunk_states_hopper_ref, the same)
    finds_bad_v = not store_states

    @T.macro
    def x_and_v_new(t, cr, outputs):
        """X = V − Γ ⊙ K S (``beta_in_x``: β ⊙ (V − Γ ⊙ K S)) in K S's registers (V's tile read into registers
        while K S runs), to shared memory by stmatrix, then V_new = A_inv X issued; with o's steps to come it is left
        running while P and o's factors are formed (Q S and Q Kᵀ, issued before it, are done then: wgmma groups
        complete in order). A_inv's slot is handed back at this issue, safe for the reason Q's is (the producer
        refills nothing of chunk c + 2 before K's slot, released last).

        A non-finite v (the module docstring): where a thread's Σ |v| is not finite (rare: a branch around the
        rest), X's element is 0 there and its row goes to ``vbad`` (an atomic min), read after the barrier before
        A_inv X: Γ's rows from the first such row on NaN (o's), and la NaN (the state's). The atomic is a call the
        barrier planner does not see (T.atomic_min adds two barriers per chunk: it takes the atomic for a write
        that may alias every shared tile): the barrier TileLang puts before X's stmatrix orders it before the
        read, and the key needs no reset (``vbad``). The states' walk does without it (``finds_bad_v``)."""
        la = t.la.buffer
        T.copy(t.Vs, t.Vr)
        T.wait_wgmma(2 if store_output and outputs else 0)     # K S done (X needs only it)
        if finds_bad_v:
            t.Vsum[0] = 0.0
        for i, j in T.Parallel(BT, BV):
            vij = t.Vr[i, j] * t.v_on if affine else t.Vr[i, j]
            # 0 on a row whose Γ is not finite: the rows a non-finite gc, β or key feeds (the module docstring)
            if beta_in_x:
                t.KS[i, j] = T.if_then_else(T.isfinite(t.Gam[i]), t.Bet[i] * (vij - t.Gam[i] * t.KS[i, j]), 0.0)
            else:
                t.KS[i, j] = T.if_then_else(T.isfinite(t.Gam[i]), vij - t.Gam[i] * t.KS[i, j], 0.0)
            if finds_bad_v:
                t.Vsum[0] = t.Vsum[0] + T.abs(T.cast(t.Vr[i, j], ACC))   # (|v| · 0 would be folded to 0)
        if finds_bad_v:
            if not T.isfinite(t.Vsum[0]):
                for i, j in T.Parallel(BT, BV):
                    if not T.isfinite(T.cast(t.Vr[i, j], ACC)):
                        t.KS[i, j] = 0.0
                        T.call_extern("int32", "linattn_atomic_min", t.vbad.data, i - cr * BT)
        T.copy(t.KS, t.Xs)
        if store_output:
            T.wgmma_gemm(t.As, t.Xs, t.Vn, clear_accum=True)
            T.wait_wgmma(1)
        else:
            T.gemm(t.As, t.Xs, t.Vn, clear_accum=True)
            T.wait_wgmma(0)
        if finds_bad_v:
            # after the barrier before A_inv X: every atomic of the chunk is in. Γ is read by o's scale alone from
            # here and la by the state's update alone (a chunk that renormalises multiplies S' by e^la: NaN too)
            bad = t.vbad[0] + cr * BT
            for i in T.Parallel(BT):
                t.Gam[i] = T.if_then_else(i < bad, t.Gam[i], T.float32(NAN))
            la = T.if_then_else(bad < BT, T.float32(NAN), la)

    return x_and_v_new

def o_tile_macros(kernel) -> tuple:
    """(form_p, scale_o_tile, store_o): the chunk step's macros on P and o's tile, over ``kernel``'s sizes."""
    import tilelang.language as T

    BV, scale = kernel.BV, kernel.scale

    @T.macro
    def form_p(QK, Ps, Gsc, gcs, decayed):
        """P into Ps (bf16, stmatrix): Q Kᵀ under the causal mask, times e^{gc_i + ln scale − gc_j} where
        ``decayed`` (else the decays are o's and V_d's)."""
        for i, j in T.Parallel(BT, BT):
            if decayed:
                QK[i, j] = T.if_then_else(i >= j, QK[i, j] * T.exp(Gsc[i] - gcs[j]), 0.0)
            else:
                QK[i, j] = T.if_then_else(i >= j, QK[i, j], 0.0)
        T.copy(QK, Ps)

    @T.macro
    def scale_o_tile(Of, Gam):
        """o's accumulator (Q S) times Γ and the scale."""
        for i, j in T.Parallel(BT, BV):     # a loop of its own: Of's register layout is not Vn's
            Of[i, j] = Of[i, j] * (Gam[i] * scale)

    @T.macro
    def store_o(t, c, write):
        """o's tile of chunk c through shared memory (stmatrix) and out by TMA, rows past T clipped by it. The store
        is issued and not waited for: the wait for its read of the tile comes before the next chunk writes the tile
        (T.copy would wait right after issuing it, in the elected thread, so the warpgroup's next wgmma would wait
        on the store's read of 16 KB)."""
        if write:
            T.tma_store_wait()      # the previous chunk's store has read the tile
            T.copy(t.Of, t.Os)
            T.tma_copy(t.Os, t.o[t.ib, c * BT:(c + 1) * BT, t.ihv, t.iv * BV:(t.iv + 1) * BV])

    return form_p, scale_o_tile, store_o


def gcs_last(gcs, Tn, c):
    """The chunk's last cumulative log decay, ln γ (a TileLang expression): its last row, or row T − 1 in the
    sequence's last chunk."""
    import tilelang.language as T
    return gcs[T.min(BT, Tn - c * BT) - 1]


class StepTiles(types.SimpleNamespace):
    """What the chunk step reads and writes besides its chunk: the program's shared tiles and register fragments, its
    sequence, value head and V tile, its loop bound and segment length (a TileLang macro sees only its arguments and
    the constants of the function that defines it)."""


def program_tiles(tiles: StepTiles, **program) -> StepTiles:
    """``tiles`` with the program's indices and loop bounds beside them (o, ib, ihv, iv, chunks, Lc, v_on)."""
    return StepTiles(**vars(tiles), **program)


def consumer_registers(threads: int) -> int:
    """Registers per consumer thread once the producer warpgroup (128 threads) has given all but 24 of its own back:
    the program's registers at launch, which ptxas allots under ``__launch_bounds__(threads + 128, 1)`` (64K per SM,
    in steps of 8 per thread), less the producer's 24, over ``threads``. setmaxnreg.inc takes registers from the
    program's own pool only and waits until it holds enough (PTX ISA), so asking for more hangs. 240 at 256 consumer
    threads, TileLang's own split; at most 256 (setmaxnreg's and a thread's ceiling)."""
    at_launch = min(256, 65536 // (threads + 128) // 8 * 8)
    return min(256, (at_launch * (threads + 128) - 128 * 24) // threads // 8 * 8)


def affine_walk_chunks(tile_in_m, skip, chunks):
    """The affine walk's loop count for one program (a TileLang expression): 0 where the map's ``skip_m`` flag
    ``skip`` drops the tile — 1: the M tiles (a negligible map, M = 0), 2: every tile (a map the warm walk does
    without, [M | N] = 0) —, else ``chunks``. A tile that walks no chunk starts from zeros instead of [I | 0] and
    writes them (with ``lean``, flag 2, a tile that nothing reads, is not written)."""
    import tilelang.language as T
    dropped = T.if_then_else(tile_in_m, (skip == 1) | (skip == 2), skip == 2)
    return T.if_then_else(dropped, 0, chunks)


@functools.lru_cache(maxsize=64)
def compiled_kernel(H: int, HV: int, K: int, V: int, BV: int, scale: float, threads: int = 256, num_stages: int = 2,
                    target: Optional[str] = None, use_initial_state: bool = True, beta_dtype: str = "float32",
                    affine: bool = False, warm: bool = False, warm_planned: bool = False, threshold: float = -30.0,
                    lean: bool = False, store_states: bool = False, beta_in_a_inv: bool = True,
                    m_only: bool = False):
    """The compiled kernel (cached per static configuration; the arguments :func:`build_kernel`'s, ``target`` as
    :func:`compile_prim_func`'s), its CUDA rewritten so that ptxas sees the warpgroup index as warp-uniform
    (``uniform_warpgroup.py``: the wgmma descriptors then live in uniform registers; no value changes)."""
    from . import uniform_warpgroup as uniform
    func = build_kernel(H, HV, K, V, BV, scale, threads, num_stages, use_initial_state, beta_dtype, affine, warm,
                        warm_planned, threshold, lean, store_states, beta_in_a_inv, m_only)
    with uniform.rewriting():
        return compile_prim_func(uniform.marked(func), target)


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
