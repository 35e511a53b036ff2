"""The Hopper forward's pre-pass in TileLang: gc, β and each chunk's A_inv diag(β) in one kernel, the inverse blocked.

Why not the Triton pre-pass: its solve is bound by a 15-step substitution chain on a [4, 16, 16] register tile,
whose every step is two cross-lane reductions. Here each of 64 threads solves one column of one diagonal 16 × 16
block in registers, reading A's row from shared memory (a broadcast): 120 FMAs, no shuffles; the blocks cut the
chain of a whole 64-row column 17-fold, and the merges run on tensor cores. FlashQLA's kkt_solve (read, not copied)
blocks the same way. benchmarks/gpu_check_core.py --forward-path hopper checks the forward on it on the GPU.

One program per (chunk, sequence, value head), 128 threads (:func:`prepass_steps`, in order):

    gc    = cumsum(g) over the chunk                         fp32, shared memory
    K Kᵀ                                                     one bf16 wgmma, fp32 accumulators (exact products)
    A     = strictly_lower(β_i (K Kᵀ)_ij e^{gc_i − gc_j})     fp32; the exponent is masked before the exp
            kept as its four diagonal 16-blocks A_dd, the two blocks below them A_10 and A_32, and the lower-left
            32 × 32 quadrant A_hl (the blocks of ``kkt_solve``'s method, ``common/kkt_solve.py``)
    T_dd  = (I + A_dd)⁻¹                                     thread (d, c) solves column c of block d: fp32 FMAs
    T_10  = −T_11 A_10 T_00, T_32 = −T_33 A_32 T_22          m16n8k8 tf32 mma.sync, one warp per half
    X     = −T_hi A_hl T_lo                                  two 32 × 32 dots on tensor cores, fp32 operands: tf32
                                                             (2⁻¹¹–2⁻¹⁰ per operand, under A_inv's bf16 rounding)
    A_inv diag(β) = [[T_lo, 0], [X, T_hi]] diag(β)           bf16

The kernel is bound by its shared-memory wavefronts (the L1 / shared pipe), so its layouts pad rows to spread each
warp's accesses over the banks, and its steps read each shared value once into registers where nvcc would reload
it (see each step). Reads per chunk: BT × K keys, BT gates and βs. Writes A_inv ``[B, T, HV, 64]`` bf16 (the walk's
operand), the chunk's map bound (``map_bound.py``: the two warps idle in step 3 sum it from β_i (K Kᵀ)_ii = β_i
‖k_i‖², kept on the diagonal blocks' unused diagonals), and gc and β straight into the layout the walk loads
(``chunk_fwd.head_major``'s ``[B·S, HV, Lp]``, per segment when the forward is cut into S segments, which both
kernels take as B·S sequences): no head-major copies.

Causality under NaN and Inf (``common/finite.py``): the chunk's first row whose gc, β or β_i ‖k_i‖² is non-finite
(found in step 2 from K Kᵀ's diagonal, a shared atomic min on the rare bad row) ends A: its rows from there are 0,
so the solve sees finite values only; A_inv diag(β)'s rows from there are NaN (its columns there 0), gc's rows from
there NaN (so the walk finds the rows a bad token feeds from gc alone, and the chunk's last gc, the state's decay,
is NaN), and the chunk's map bound +inf (its map is unbounded: never negligible).
Twin: :func:`prepass_hopper_ref`.
"""
import functools  # no "from __future__ import annotations": TileLang reads the kernel's annotations as objects
import types
from typing import Optional

import torch

from ..utils import MIN_LOG_DECAY
from .chunk_fwd import ACC, BT, DTYPE, padded_length
from .compile import compile_prim_func, launcher, tile_dtype
from .map_bound import LOG2E

D = 16            # the diagonal blocks' size: four per chunk
# Each token's log decay is read as max(g, LOG_DECAY_FLOOR): a full forget (g = −inf, or −3e38 whose cumulative sum
# overflows) would otherwise make gc_i − gc_j = −inf − (−inf) = NaN. e^−104 underflows to 0 in fp32, so any g below
# the floor already contributes exactly the zeros the floor does, and every g at or above it is read unchanged
LOG_DECAY_FLOOR = MIN_LOG_DECAY
THREADS = 2 * BT  # one warpgroup: K Kᵀ's wgmma, 64 solving threads and two warps for the map bound
NAN = float("nan")  # the rows a non-finite input feeds (T.float32(NAN): TileLang takes the constant from here)


def build_kernel(H: int, HV: int, K: int, beta_dtype: str = "float32", beta_in_a_inv: bool = True):
    """The TileLang prim_func of the pre-pass for these static sizes (B and T symbolic: with segments, the caller
    passes B·S sequences of T/S tokens as views). ``beta_dtype``: β as given (widened on load, written head-major in
    its own dtype). A_inv is written as A_inv diag(β) (each column scaled by its token's β): the walk's X is then
    V − Γ ⊙ (K S), one multiply per element and β's load per chunk fewer, at the same rounding (β ∈ [0, 1] scales
    before the bf16 rounding). Without ``beta_in_a_inv`` it is the plain T = (I + A)⁻¹, β only inside A: the
    backward's (``backward.py``; it needs Tᵀ dV_new without β, docs/backward.md §1)."""
    import tilelang
    import tilelang.language as T

    B = T.symbolic("B")
    Tn = T.symbolic("T")
    Tp = T.symbolic("Tp")   # T padded to a multiple of 8 (chunk_fwd.padded_length)
    NC = T.symbolic("NC")   # ⌈T/64⌉: the chunks
    steps = prepass_steps(K, Tn, Tp, beta_dtype, beta_in_a_inv)
    # 7 programs per SM (``__launch_bounds__(128, 7)``: 72 registers, 20 bytes of spill): the pre-pass is bound by
    # its shared-memory wavefronts, not by latency, and 7 fit the registers best (docs/decisions.md)
    programs_per_sm = 7
    # words of padding after each 16-word row of A's diagonal blocks and the blocks below them: rows 20 words apart
    # spread the 8 rows a warp touches over 8 bank offsets 4 apart (16 apart put them in two banks)
    a_row_pad = 4
    # T_lo's and Y2's rows 40 words apart: step 5's dots read their B operands one word per lane at k · stride + n,
    # 32 words in 32 banks; T_hi's rows 36 apart: read by ldmatrix, 8 rows of 16 bytes in 8 distinct bank quads
    t_row_pad, t_hi_row_pad = 8, 4

    @T.prim_func
    def gdn_prepass(k: T.Tensor((B, Tn, H, K), DTYPE), g: T.Tensor((B, Tn, HV), ACC),
                    beta: T.Tensor((B, Tn, HV), beta_dtype), a_inv: T.Tensor((B, Tn, HV, BT), DTYPE),
                    gc_hm: T.Tensor((B, HV, Tp), ACC), beta_hm: T.Tensor((B, HV, Tp), beta_dtype),
                    bound: T.Tensor((B, HV, NC), ACC)):
        with T.Kernel(T.ceildiv(Tn, BT), B * HV, threads=THREADS) as (c, bh):
            T.annotate_min_blocks_per_sm(programs_per_sm)
            ib = bh // HV
            ihv = bh % HV
            ih = ihv // (HV // H)
            Ks = T.alloc_shared((BT, K), DTYPE)
            gs = T.alloc_shared((BT,), ACC)
            gcs = T.alloc_shared((BT,), ACC)
            bs = T.alloc_shared((BT,), ACC)
            bl = T.alloc_local((1,), ACC)
            bparts = T.alloc_shared((2,), ACC)    # the map bound's sums over the chunk's two halves
            first_bad = T.alloc_shared((1,), "int32")   # the chunk's first non-finite row (BT: none)
            # A's blocks. A diagonal block's rows are read by 16 threads at once (one per column): the padded block
            # stride (17 rows) puts the two blocks a warp reads in different banks
            Ad = T.alloc_shared((4, D + 1, D + a_row_pad), ACC)
            Ao = T.alloc_shared((2, D, D + a_row_pad), ACC)      # A_10, A_32
            # A_hl, step 5's first A operand, in a linear layout with rows 36 words apart: its stores in step 2 are
            # a base plus a constant (a swizzle's address is recomputed per element), and its ldmatrix reads of 8
            # rows × 16 bytes fall in 8 distinct bank quads
            Ahl = T.alloc_shared((2 * D, 2 * D + 4), ACC)
            Tq = T.alloc_shared((2, 2 * D, 2 * D), ACC)        # T_lo, T_hi: the inverted halves (rows: the layout)
            # A_10 T_00, A_32 T_22: rows 24 words apart, so step 4's 8-byte stores and its B reads are conflict-free
            Y1 = T.alloc_shared((2, D, D + 8), ACC)
            Y2 = T.alloc_shared((2 * D, 2 * D + t_row_pad), ACC)  # A_hl T_lo
            Out = T.alloc_shared((BT, BT), DTYPE)
            KK = T.alloc_fragment((BT, BT), ACC)
            Gr = T.alloc_fragment((BT,), ACC)        # gc and β per row, gc per column of K Kᵀ's registers
            Br = T.alloc_fragment((BT,), ACC)
            Gcol = T.alloc_fragment((BT,), ACC)
            Bl = T.alloc_fragment((2 * D,), ACC)     # β of A_inv's column halves in X's column layout
            Bh = T.alloc_fragment((2 * D,), ACC)
            Z2 = T.alloc_fragment((2 * D, 2 * D), ACC)
            x = T.alloc_local((D,), ACC)
            af = T.alloc_local((4,), ACC)             # step 4: a lane's A, B and C fragments (two C tiles)
            bf = T.alloc_local((2,), ACC)
            cf = T.alloc_local((8,), ACC)
            layouts = {buf: tilelang.layout.make_linear_layout(buf) for buf in [Ad, Ahl, Tq, Y2, Ao, Y1]}
            stride_lo, stride_hi = 2 * D + t_row_pad, 2 * D + t_hi_row_pad
            layouts[Tq] = T.Layout(Tq.shape, lambda h, i, j: h * (2 * D * stride_lo)
                                   + i * (stride_lo + h * (stride_hi - stride_lo)) + j)
            T.annotate_layout(layouts)

            tx = T.get_thread_binding()
            steps.load_chunk(k, g, beta, gc_hm, beta_hm, Ks, gs, gcs, bs, first_bad, tx, ib, ih, ihv, c)
            steps.form_a(Ks, KK, gcs, bs, Gr, Br, Gcol, Ad, Ao, Ahl, Tq, first_bad, gc_hm, ib, ihv, c)
            fb = first_bad[0]
            steps.solve_diagonal_blocks(tx, Ad, Tq, x, bl, bparts)
            T.sync_threads()
            if tx == 4 * D:
                bound[ib, ihv, c] = T.if_then_else(fb < BT, T.infinity(ACC),
                                                   gcs[BT - 1] * LOG2E + bparts[0] + bparts[1])
            # 4. the blocks below the diagonal blocks, both halves at once: Y1 = A_10 T_00, then T_10 = −T_11 Y1
            steps.below_diagonal_blocks(tx, Ao, Tq, Y1, af, bf, cf)
            # 5. the lower-left quadrant X = −T_hi (A_hl T_lo) on tensor cores
            T.gemm(Ahl[:, 0:2 * D], Tq[0, :, 0:2 * D], Z2, clear_accum=True)
            T.copy(Z2, Y2[:, 0:2 * D])
            T.gemm(Tq[1, :, 0:2 * D], Y2[:, 0:2 * D], Z2, clear_accum=True)
            steps.store_a_inv(a_inv, Tq, Z2, bs, Bl, Bh, Out, fb, ib, ihv, c)

    return gdn_prepass


def prepass_steps(K: int, Tn, Tp, beta_dtype: str, beta_in_a_inv: bool = True) -> types.SimpleNamespace:
    """The pre-pass's steps (TileLang macros over its static sizes and the symbolic T and Tp, and
    :func:`build_kernel`'s ``beta_in_a_inv``), in the order :func:`build_kernel` runs them."""
    import tilelang.cuda.language as TC  # T.copy with CUDA lowering hints
    import tilelang.language as T

    @T.macro
    def load_chunk(k, g, beta, gc_hm, beta_hm, Ks, gs, gcs, bs, first_bad, tx, ib, ih, ihv, c):
        """1. keys, gates (at least :data:`LOG_DECAY_FLOOR`, by a select: a NaN stays NaN) and βs of the chunk (past
        the sequence's end: zero keys, g = 0, β = 0). The key tile by TMA
        (one bulk copy per 64 columns and an mbarrier wait; rows past the end come back as zeros), not through the
        L1 / shared pipe that bounds the pre-pass; gc and β written in the walk's head-major layout."""
        TC.copy(k[ib, c * BT:(c + 1) * BT, ih, 0:K], Ks, prefer_instruction="tma")
        if tx == 0:
            first_bad[0] = BT
        for i in T.Parallel(BT):
            gi = g[ib, c * BT + i, ihv]
            gs[i] = T.if_then_else(c * BT + i < Tn, T.if_then_else(gi < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, gi), 0.0)
            bs[i] = T.if_then_else(c * BT + i < Tn, T.cast(beta[ib, c * BT + i, ihv], ACC), 0.0)
        T.cumsum(gs, gcs, dim=0)
        # rows from T to Tp (the padding of the last chunk) are zero
        for i in T.Parallel(BT):
            if c * BT + i < Tp:
                gc_hm[ib, ihv, c * BT + i] = T.if_then_else(c * BT + i < Tn, gcs[i], 0.0)
                beta_hm[ib, ihv, c * BT + i] = T.if_then_else(c * BT + i < Tn, beta[ib, c * BT + i, ihv],
                                                              T.cast(0.0, beta_dtype))

    @T.macro
    def form_a(Ks, KK, gcs, bs, Gr, Br, Gcol, Ad, Ao, Ahl, Tq, first_bad, gc_hm, ib, ihv, c):
        """2. A = strictly_lower(β_i (K Kᵀ)_ij e^{gc_i − gc_j}), into its blocks. Branch-free: the exponent is −∞
        above the diagonal (where gc_i − gc_j can be large and positive), so e^… = 0 there, and 0 on it, so the
        diagonal blocks' own diagonals, which the solve never reads, keep β_i ‖k_i‖² for the map bound. Each store
        goes to the one block holding (i, j) under its own predicate (no else: an if / elif chain compiles to
        branches around every element). Two loops over K Kᵀ's registers, A's elements first (in place), then their
        stores: in one loop nvcc, unable to tell the blocks' stores from gcs and bs (one shared buffer), reloads β_i,
        gc_i and gc_j after every store. Rows from the chunk's first non-finite gc, β or β_i ‖k_i‖² on are 0 (the
        module docstring): that row, a shared atomic min of the rows that have one (none: no atomic), goes to
        ``first_bad``, and gc's rows from it are rewritten as NaN."""
        T.gemm(Ks, Ks, KK, transpose_B=True, clear_accum=True)
        # β_i and gc_i in K Kᵀ's row layout, gc_j in its column layout (a thread's 2 rows and 16 columns), so the
        # elements read registers only (no load in the exponent's select: nvcc branches around loads)
        for i in T.Parallel(BT):
            Gr[i] = gcs[i]
            Br[i] = bs[i]
        for j in T.Parallel(BT):     # a loop of its own: Gcol takes the columns' layout
            Gcol[j] = gcs[j]
        for i, j in T.Parallel(BT, BT):
            if i == j:
                if (not T.isfinite(Br[i] * KK[i, j])) or (not T.isfinite(Gr[i])):
                    T.atomic_min(first_bad[0], i)
        T.sync_threads()
        fb = first_bad[0]
        for i, j in T.Parallel(BT, BT):
            KK[i, j] = T.if_then_else((i < fb) & (i >= j),
                                      Br[i] * KK[i, j] * T.exp2(T.Select(i >= j, (Gr[i] - Gcol[j]) * LOG2E,
                                                                         -T.infinity(ACC))), 0.0)
        for i, j in T.Parallel(BT, BT):
            a = KK[i, j]
            if i // D == j // D:
                Ad[i // D, i % D, j % D] = a
            if i // D == j // D + 1 and i // (2 * D) == j // (2 * D):
                Ao[i // (2 * D), i % D, j % D] = a
            if i >= 2 * D and j < 2 * D:
                Ahl[i - 2 * D, j] = a
        for h, i, j in T.Parallel(2, 2 * D, 2 * D):
            Tq[h, i, j] = 0.0                    # the quadrants above the blocks stay zero
        for i in T.Parallel(BT):
            if (i >= fb) and (c * BT + i < Tn):
                gc_hm[ib, ihv, c * BT + i] = T.float32(NAN)
        # every thread's A before the column solves, which only 64 threads run
        T.sync_threads()

    @T.macro
    def store_a_inv(a_inv, Tq, Z2, bs, Bl, Bh, Out, fb, ib, ihv, c):
        """6. A_inv diag(β) = [[T_lo, 0], [X, T_hi]] diag(β) in bf16 (without ``beta_in_a_inv``: no diag(β)), rows
        past the sequence's end not written. The columns' β in X's column layout, loaded once (between the stores
        to Out nvcc would reload them from shared memory: one buffer). Rows from ``fb`` (the chunk's first
        non-finite row) on are NaN, columns from it 0 (without β they are already: A's rows and columns from fb are
        0, so the inverse is lower triangular with unit rows there)."""
        if beta_in_a_inv:
            for j in T.Parallel(2 * D):
                Bl[j] = bs[j]
            for j in T.Parallel(2 * D):      # loops of their own: each fragment takes the columns' layout
                Bh[j] = bs[2 * D + j]
            for j in T.Parallel(2 * D):      # in registers: the columns from fb on are 0 (their β may be NaN)
                Bl[j] = T.if_then_else(j < fb, Bl[j], 0.0)
            for j in T.Parallel(2 * D):
                Bh[j] = T.if_then_else(2 * D + j < fb, Bh[j], 0.0)
            for i, j in T.Parallel(2 * D, 2 * D):    # quadrant by quadrant, in X's register layout
                Out[i, j] = T.if_then_else(i < fb, Tq[0, i, j] * Bl[j], T.float32(NAN))
                Out[i, 2 * D + j] = T.if_then_else(i < fb, 0.0, T.float32(NAN))
                Out[2 * D + i, j] = T.if_then_else(2 * D + i < fb, -Z2[i, j] * Bl[j], T.float32(NAN))
                Out[2 * D + i, 2 * D + j] = T.if_then_else(2 * D + i < fb, Tq[1, i, j] * Bh[j], T.float32(NAN))
        else:
            for i, j in T.Parallel(2 * D, 2 * D):
                Out[i, j] = T.if_then_else(i < fb, Tq[0, i, j], T.float32(NAN))
                Out[i, 2 * D + j] = T.if_then_else(i < fb, 0.0, T.float32(NAN))
                Out[2 * D + i, j] = T.if_then_else(2 * D + i < fb, -Z2[i, j], T.float32(NAN))
                Out[2 * D + i, 2 * D + j] = T.if_then_else(2 * D + i < fb, Tq[1, i, j], T.float32(NAN))
        T.copy(Out, a_inv[ib, c * BT:(c + 1) * BT, ihv, 0:BT])

    solve = solve_macros()
    return types.SimpleNamespace(load_chunk=load_chunk, form_a=form_a, solve_diagonal_blocks=solve.diagonal_blocks,
                                 below_diagonal_blocks=solve.below_diagonal_blocks, store_a_inv=store_a_inv)


def solve_macros() -> types.SimpleNamespace:
    """Steps 3–5 of the pre-pass, the blocked solve (TileLang macros; :func:`prepass_steps` hands them on):
    ``diagonal_blocks`` and ``below_diagonal_blocks``, with the 16 × 16 products they share."""
    import tilelang.language as T

    @T.macro
    def solve_diagonal_blocks(tx, Ad, Tq, x, bl, bparts):
        """3. T_dd = (I + A_dd)⁻¹: thread (d, col) solves (I + A_dd) x = e_col by forward substitution, x_i = δ_i,col
        − Σ_{j<i} A_ij x_j (zero above col, so one formula for every row), x in registers. Meanwhile the two warps
        the solve leaves idle sum the chunk's map bound (map_bound.py), Σ_i g_i log2 e + log2 max(1, |1 − β_i
        ‖k_i‖²|) (rows past T: g = β = 0, nothing), one token per thread, summed per warp by shuffles (one thread
        looping over the tokens kept its program waiting at the barrier after this step)."""
        if tx < 4 * D:
            d = tx // D
            col = tx % D
            for i in T.unroll(D):
                x[i] = T.if_then_else(i == col, 1.0, 0.0)
            for i in T.unroll(1, D):
                for j in T.unroll(i):
                    x[i] = x[i] - Ad[d, i, j] * x[j]
            for i in T.unroll(D):
                Tq[d // 2, (d % 2) * D + i, (d % 2) * D + col] = x[i]
        else:
            bl[0] = T.warp_reduce_sum(T.log2(T.max(T.abs(1.0 - Ad[(tx - 4 * D) // D, tx % D, tx % D]), 1.0)))
            if tx % 32 == 0:
                bparts[(tx - 4 * D) // 32] = bl[0]

    @T.macro
    def product_16(A, ar, ac, B, br, bc, h, g, t, af, bf, cf):
        # cf = A[h, ar:ar + 16, ac:ac + 16] B[h, br:br + 16, bc:bc + 16] in lane (g, t)'s C fragments: two k-steps of
        # 8, two n-tiles of 8, one m16n8k8 tf32 mma each, the operands read one word per lane
        for e in T.unroll(8):
            cf[e] = 0.0
        for ki in T.unroll(2):
            for r in T.unroll(2):
                for u in T.unroll(2):
                    af[2 * u + r] = A[h, ar + g + 8 * r, ac + 8 * ki + t + 4 * u]
            for ni in T.unroll(2):
                for u in T.unroll(2):
                    bf[u] = B[h, br + 8 * ki + t + 4 * u, bc + 8 * ni + g]
                T.ptx_mma("float32", "m16n8k8", "row", "col", "tf32", "tf32", "fp32", af.data, 0, bf.data, 0,
                          cf.data, 4 * ni, T.bool(False))

    @T.macro
    def below_diagonal_blocks(tx, Ao, Tq, Y1, af, bf, cf):
        """4. on the tensor cores, one warp per half: threads 0–63, warp h = tx / 32 takes half h (A_10, T_00, T_11
        → T_10 for h = 0; A_32, T_22, T_33 → T_32 for h = 1): Y1 = A_10 T_00, then T_10 = −T_11 Y1, four m16n8k8 tf32
        mma.sync each, the operands read one word per lane straight in the fragments' layouts, Y1 through shared
        memory between the products (its C layout is not the B operand's). Lane (g, t) = (lane / 4, lane % 4)
        holds, per m16n8k8 tile, A at rows g, g + 8 and columns t, t + 4 of the k-step, B at rows t, t + 4 and column
        g, and C at rows g, g + 8 and columns 2t, 2t + 1. The products round their operands to tf32 (2⁻¹¹ each, as
        step 5's do, under A_inv's bf16 2⁻⁹)."""
        h = tx // (2 * D)
        g = (tx % (2 * D)) // 4
        t = tx % 4
        if tx < 4 * D:
            product_16(Ao, 0, 0, Tq, 0, 0, h, g, t, af, bf, cf)       # Y1 = A_h T_hh (the half's first block)
            for ni in T.unroll(2):
                for r in T.unroll(2):
                    for e in T.vectorized(2):
                        Y1[h, g + 8 * r, 8 * ni + 2 * t + e] = cf[4 * ni + 2 * r + e]
        T.sync_threads()
        if tx < 4 * D:
            product_16(Tq, D, D, Y1, 0, 0, h, g, t, af, bf, cf)       # T_h'h' Y1 (the half's second block)
            for ni in T.unroll(2):
                for r in T.unroll(2):
                    for e in T.vectorized(2):
                        Tq[h, D + g + 8 * r, 8 * ni + 2 * t + e] = -cf[4 * ni + 2 * r + e]

    return types.SimpleNamespace(diagonal_blocks=solve_diagonal_blocks, below_diagonal_blocks=below_diagonal_blocks)


@functools.lru_cache(maxsize=64)
def compiled_kernel(H: int, HV: int, K: int, beta_dtype: str = "float32", target: Optional[str] = None,
                    beta_in_a_inv: bool = True):
    """The compiled pre-pass (cached per static configuration); ``target`` as ``compile.compile_prim_func``'s."""
    return compile_prim_func(build_kernel(H, HV, K, beta_dtype, beta_in_a_inv), target)


def prepass_kernel(H: int, HV: int, K: int, beta_dtype: torch.dtype, beta_in_a_inv: bool = True):
    """The compiled pre-pass :func:`prepass_hopper` launches."""
    return compiled_kernel(H, HV, K, tile_dtype(beta_dtype), beta_in_a_inv=beta_in_a_inv)


def _check(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, segments: int) -> None:
    """The shapes and the segment count (the kernel's dtypes are checked by :func:`prepass_hopper`)."""
    B, T = k.shape[:2]
    if g.shape != beta.shape or g.shape[:2] != (B, T):
        raise ValueError(f"g and beta must be [B, T, HV] with B, T = {B}, {T}; got {list(g.shape)} and "
                         f"{list(beta.shape)}")
    if segments < 1 or (segments > 1 and T % (BT * segments)):
        raise ValueError(f"{segments} segments need T a multiple of {BT * segments}, got T={T}")


def prepass_hopper(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, segments: int = 1,
                   beta_in_a_inv: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gc ``[B·S, HV, Lp]`` fp32, β ``[B·S, HV, Lp]`` in β's dtype, A_inv diag(β) ``[B, T, HV, 64]`` bf16) for the
    fused kernel (``walk_launch.chunk_fwd_hopper_hm``) from bf16 keys ``[B, T, H, K]``, log decays g and β ``[B, T, HV]``,
    and the map bound's chunk sums ``[B·S, HV, L/64]`` fp32 (``map_bound.chunk_bounds``'s, for the segmented
    forward's plan: the two warps the solve leaves idle sum them from β_i ‖k_i‖², kept on A's diagonal blocks).
    ``segments`` = S cuts every sequence into S segments of L = T/S tokens (T a multiple of 64·S), which the fused
    kernel takes as B·S sequences: gc and β come per segment (gc is chunk-local, so it holds for them as it is), and
    A_inv viewed as ``[B·S, L, HV, 64]`` is theirs. Lp = ``padded_length(L)``; S = 1: L = T. Without
    ``beta_in_a_inv`` A_inv is the plain T = (I + A)⁻¹ (the backward's, :func:`build_kernel`)."""
    _check(k, g, beta, segments)
    if k.dtype != torch.bfloat16:
        raise TypeError(f"the Hopper pre-pass takes bf16 keys, got {k.dtype}")
    if beta.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"beta must be bf16 or fp32, got {beta.dtype}")
    B, T, H, K = k.shape
    HV = g.shape[2]
    kernel = prepass_kernel(H, HV, K, beta.dtype, beta_in_a_inv)
    BS, L = B * segments, T // segments         # the segments as sequences of their own: views, no copies
    Lp = padded_length(L)
    # every row below Lp is written (the chunks cover each segment, rounded up to 64 rows): no memsets
    a_inv = torch.empty(B, T, HV, BT, dtype=torch.bfloat16, device=k.device)
    gc_hm = torch.empty(BS, HV, Lp, dtype=torch.float32, device=k.device)
    beta_hm = torch.empty(BS, HV, Lp, dtype=beta.dtype, device=k.device)
    bound = torch.empty(BS, HV, -(-L // BT), dtype=torch.float32, device=k.device)
    launcher(kernel)(k.contiguous().view(BS, L, H, K), g.float().contiguous().view(BS, L, HV),
                     beta.contiguous().view(BS, L, HV), a_inv.view(BS, L, HV, BT), gc_hm, beta_hm, bound)
    return gc_hm, beta_hm, a_inv, bound


def prepass_hopper_ref(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, segments: int = 1,
                       a_inv_dtype: torch.dtype = torch.bfloat16, beta_in_a_inv: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin of :func:`prepass_hopper` (same arguments and results) from the PyTorch stages: the chunk-local
    cumsum, ``kkt_solve_ref`` (a dense solve) and ``chunk_fwd.head_major`` on each segment, A_inv rounded to
    ``a_inv_dtype`` once (the kernel's bf16; fp32 for tests of the layout alone; float64, with gc in float64 too, for
    a reference; ``beta_in_a_inv``: A_inv diag(β), as :func:`prepass_hopper`'s, else the plain A_inv). For the
    layout and the segments on a machine without the GPU (any float keys: the kernel's bf16 check is
    :func:`prepass_hopper`'s); :func:`blocked_inverse_ref` is the twin of the kernel's solve."""
    from ..gated_delta import torch_chunk as tc
    from .chunk_fwd import head_major
    from .map_bound import chunk_bounds_ref
    _check(k, g, beta, segments)
    B, T, H, K = k.shape
    HV = g.shape[2]
    work = torch.float64 if a_inv_dtype == torch.float64 else torch.float32   # float64: a reference A_inv
    kc = tc.to_chunks(k.to(work).repeat_interleave(HV // H, 2), BT)
    g = torch.where(g < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, g)                      # as the kernel reads it (NaN stays)
    gcc = tc.chunk_local_cumsum_ref(tc.to_chunks(g.to(work), BT))
    bc = tc.to_chunks(beta.to(work), BT)
    # the kernel's rows from each chunk's first non-finite gc, β or β ‖k‖² on (the module docstring): the solve
    # on finite values (those rows of A 0), then gc and A_inv's rows NaN there and A_inv diag(β)'s columns 0
    dead = (~torch.isfinite(gcc) | ~torch.isfinite(bc) | ~torch.isfinite(bc * kc.square().sum(-1))).cummax(-1).values
    a_inv = tc.kkt_solve_ref(torch.where(dead[..., None], 0.0, kc), torch.where(dead, 0.0, bc),
                             torch.where(dead, 0.0, gcc))                          # [B, HV, NT, BT, BT]
    if beta_in_a_inv:
        a_inv = a_inv * torch.where(dead, 0.0, bc)[..., None, :]                  # A_inv diag(β)
    a_inv = torch.where(dead[..., None], float("nan"), a_inv)
    gcc = torch.where(dead, float("nan"), gcc)
    a_inv = tc.from_chunks(a_inv, T).to(a_inv_dtype)                            # [B, T, HV, BT]
    gc = tc.from_chunks(gcc, T)                                                  # [B, T, HV]

    def per_segment(x: torch.Tensor) -> torch.Tensor:
        return head_major(x.reshape(B * segments, T // segments, HV))

    # a chunk with such a row: its map bound +inf (never negligible), as the kernel's
    unbounded = dead.any(-1).view(B, HV, segments, -1).transpose(1, 2).reshape(B * segments, HV, -1)
    bound = torch.where(unbounded, float("inf"), chunk_bounds_ref(k, g, beta, segments).float())
    return per_segment(gc), per_segment(beta), a_inv, bound


def blocked_inverse_ref(a: torch.Tensor) -> torch.Tensor:
    """(I + A)⁻¹ of strictly lower ``a [..., 64, 64]`` by the kernel's steps 3–5, in a's dtype: the four diagonal
    16-blocks by column forward substitution, the blocks below them, then the lower-left quadrant. The twin of
    :func:`build_kernel`'s solve (without its tf32 rounding), tested against a dense solve."""
    eye = torch.eye(D, dtype=a.dtype, device=a.device)
    blk = [a[..., i * D:(i + 1) * D, i * D:(i + 1) * D] for i in range(4)]
    tdd = []
    for ad in blk:                              # step 3: x_i = δ_i,col − Σ_{j<i} A_ij x_j, all columns at once
        x = eye.expand_as(ad).clone()
        for i in range(1, D):
            x[..., i, :] = eye[i] - (ad[..., i, :i, None] * x[..., :i, :]).sum(-2)
        tdd.append(x)
    halves = []
    for h in range(2):                          # step 4: T_10 = −T_11 (A_10 T_00), per half
        r = 2 * h * D
        a_off = a[..., r + D:r + 2 * D, r:r + D]
        t_off = -(tdd[2 * h + 1] @ (a_off @ tdd[2 * h]))
        zero = torch.zeros_like(t_off)
        halves.append(torch.cat([torch.cat([tdd[2 * h], zero], -1), torch.cat([t_off, tdd[2 * h + 1]], -1)], -2))
    t_lo, t_hi = halves
    x = -(t_hi @ (a[..., 2 * D:, :2 * D] @ t_lo))  # step 5
    return torch.cat([torch.cat([t_lo, torch.zeros_like(t_lo)], -1), torch.cat([x, t_hi], -1)], -2)
