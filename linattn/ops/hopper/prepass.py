"""The Hopper forward's pre-pass in TileLang: gc, β and each chunk's A_inv in one kernel, the inverse blocked.

The default (``forward.PREPASS``) since run 22: 0.131 ms at B=8 T=4096 H=16 on the H200, against 0.268 for the
Triton pre-pass (``fused_prepass(write_wy=False)``), A_inv's error against float64 equal (2.38e-4 vs 2.33e-4);
benchmarks/hopper_fwd_check.py --prepass checks and times both.

Why a second pre-pass: the Triton solve is bound by its 15-step substitution chain on a [4, 16, 16] register tile,
whose every step is two cross-lane reductions (95 SASS instructions per step, 24 of them shuffles; 40% of the
kernel's ≈ 3700 executed instructions per thread, benchmarks' sm90 SASS). Here each of 64 threads solves one column
of one diagonal 16 × 16 block in registers, reading A's row from shared memory (a broadcast): 120 FMAs, no
shuffles. A TileLang pre-pass that solved whole 64-row columns that way (2016 dependent FMAs per column) took 0.76
ms in run 20; the blocks cut the chain 17-fold and the merges run on tensor cores. FlashQLA's kkt_solve (read, not
copied) blocks the same way.

One program per (chunk, sequence, value head), 128 threads:

    gc    = cumsum(g) over the chunk                         fp32, shared memory
    K Kᵀ                                                     one bf16 wgmma, fp32 accumulators (exact products)
    A     = strictly_lower(β_i (K Kᵀ)_ij e^{gc_i − gc_j})     fp32; the exponent is masked before the exp
            kept as its four diagonal 16-blocks A_dd, the two blocks below them A_10 and A_32, and the lower-left
            32 × 32 quadrant A_hl (the blocks of ``kkt_solve``'s method, ``common/kkt_solve.py``)
    T_dd  = (I + A_dd)⁻¹                                     thread (d, c) solves column c of block d: fp32 FMAs
    T_10  = −T_11 A_10 T_00, T_32 = −T_33 A_32 T_22          fp32 FMAs (both halves at once)
    X     = −T_hi A_hl T_lo                                  two 32 × 32 dots on tensor cores, fp32 operands: tf32
                                                             (2⁻¹¹–2⁻¹⁰ per operand, under A_inv's bf16 rounding)

Step 4 on tensor cores too (two 32 × 32 tf32 dots on block-diagonal operands, diag(A_10, A_32) diag(T_00, T_22)
and so on) measured slower in session 18 (0.150 against 0.135 ms at B=8 T=4096 H=16, error below the diagonal
blocks 1.8e-3 against 1.7e-3): its FMAs already read one broadcast word and one 16-byte vector per four FMAs, and the
dots add their operands' zero blocks, stores and barriers.

Reads per chunk: BT × K keys, BT gates and βs. Writes A_inv ``[B, T, HV, 64]`` bf16 (the Hopper kernel's operand),
the chunk's map bound (``map_bound.py``: the two warps idle in step 3 sum it from β_i (K Kᵀ)_ii = β_i ‖k_i‖², kept
on the diagonal blocks' unused diagonals), and gc and β straight into the layout the fused kernel loads
(``chunk_fwd.head_major``'s ``[B·S, HV, Lp]``, per segment when the forward is cut into S segments, which both
kernels take as B·S sequences): no head-major copies.
Twin: :func:`prepass_hopper_ref`.
"""
import functools  # no "from __future__ import annotations": TileLang reads the kernel's annotations as objects
from typing import Optional

import torch

from .chunk_fwd import BT, compile_prim_func, launcher, padded_length
from .map_bound import LOG2E

D = 16            # the diagonal blocks' size: four per chunk
# A_inv written as A_inv diag(β) (each column scaled by its token's β): the fused kernel's X is then V − Γ ⊙ (K S),
# one multiply per element and β's load per chunk fewer (``chunk_fwd.build_kernel``'s ``beta_in_a``). The same
# rounding error (β ∈ [0, 1] scales before the bf16 rounding). Run 25 (H200, benchmarks/beta_fold_check.py,
# forward_hopper ms off / on): B=8 T=4096 H=16 0.357 / 0.355 (o 3.370e-3 / 3.378e-3 against float64); B=1
# T=32768 H=16, 8 segments: 0.413 / 0.411 at the anchors' gates, 0.698 / 0.686 at 1/4096 of them (o 4.03e-3 /
# 4.04e-3).
# Predicted −3% of the walk; measured −0.6 to −1.7% of the forward
BETA_IN_A_INV = True
# The programs resident per SM that ptxas compiles for (``__launch_bounds__(128, n)``; 1: no bound). Its 25 KB of
# shared memory would allow 8 per SM; left to itself ptxas takes 92 registers per thread, which allows 5 (31%
# occupancy); at 8, 64 registers and 8 bytes of spill (ptxas 13.0, sm_90a). Run 25 (H200,
# benchmarks/prepass_occupancy_check.py, pre-pass ms at n = 1 / 5 / 6 / 7 / 8, outputs bitwise equal): B=8 T=4096
# H=16 0.139 / 0.148 / 0.139 / 0.131 / 0.128; B=4 T=8192 H=16 HV=32 0.263 / 0.277 / 0.257 / 0.244 / 0.240. I
# predicted 0.095 (latency hidden by 1.6× the programs); the miss says latency is not what bounds it. Shared memory
# does: A kept whole (one 64 × 64 array, no per-element block selection: 20% fewer SASS instructions) took 0.172
# with rows 64 words apart (step 4's reads 8-way bank conflicts) and 0.128 with 68 (but 34 KB: 6 programs per SM). Run 35
# (prepass_ab.py, with A_BEFORE_STORES, against the pre-pass before it at 8): 7 per SM (72 registers, 20 bytes of
# spill against 44 at 64) −11.8 / −12.4 / −12.7% at B=8 T=4096 H=16 / B=1 T=32768 H=16 / B=4 T=8192 HV=32, 8 per SM
# −9.2 / −10.1 / −8.7% (0.1064 → 0.0966 ms at the first)
MIN_BLOCKS_PER_SM = 7
# The key tile loaded by TMA (``prefer_instruction="tma"``: one bulk copy per 64 columns and an mbarrier wait; rows
# past the sequence's end come back as zeros from the tensor's bounds) instead of per-thread 16-byte loads and
# stores, which go through the L1 / shared pipe that bounds the pre-pass (16 KB loaded through the L1 and 16 KB
# stored per chunk, more than A's blocks take: 10 KB). Predicted −10 to −20% of the pre-pass; run 26 (H200,
# benchmarks/prepass_occupancy_check.py 8 8+tma, outputs bitwise equal) measured −4 to −6%: 0.127 → 0.122 ms at
# B=8 T=4096 H=16, 0.240 → 0.226 at B=4 T=8192 H=16 HV=32, 0.067 → 0.063 at B=1 T=32768 H=2 HV=8
TMA_KEYS = True
# Words of padding after each 16-word row of A's diagonal blocks and the blocks below them (0: rows 16 words apart,
# the committed kernel). Rows 16 apart put the 8 rows a warp touches in two banks: step 2's stores of the blocks are
# 4-way bank conflicts and step 4's reads of A_10 / A_32 (one column, 8 rows per warp) too. Rows 20 apart spread
# them over 8 bank offsets 4 apart: step 4's reads conflict-free, step 2's stores 2-way, step 3's two blocks per
# warp still 20 banks apart and its 16-byte loads aligned. The same values everywhere (a layout only). Predicted
# −15 to −25% of the pre-pass (run 25 measured step 4's reads going from 4-way to 8-way at +35%); run 26 measured
# 0 alone (0.127 → 0.127 ms at B=8 T=4096 H=16) and −1.3 to −1.7% with TMA_KEYS (0.122 → 0.120; every row of the
# A/B the same way; outputs bitwise equal). The miss says 4-way conflicts on these reads are not what bounds it
A_ROW_PAD = 4
# Words of padding after each 32-word row of T_lo, T_hi (Tq) and Y2 = A_hl T_lo, in linear layouts (0: TileLang's
# swizzled layouts for them). Step 5's two tf32 dots read their B operands (T_lo, Y2) one word per thread, k = lane
# % 4 and n = lane / 4: rows 40 words apart put those 32 words in 32 banks; TileLang's swizzle left them 2-way
# conflicts (run 26's source profile: step 5's loads 8.3% of the kernel's shared wavefronts against 5.5% ideal, Y2's
# stores 2.8% against 1.4%). Step 4's column reads of T_11 (8 rows per warp) land 8 banks apart (2-way). +2 KB of
# shared memory (8 programs per SM still fit). Predicted −5 to −7% of the pre-pass; run 27 (H200,
# benchmarks/prepass_ab.py against the file with 0, A_inv and o bitwise equal on six shapes): 0.1164 → 0.1131 ms at
# B=8 T=4096 H=16, 0.2237 → 0.2125 at B=4 T=8192 H=16 HV=32, 0.0604 → 0.0581 at B=1 T=32768 H=2 HV=8 (−3 to −5%);
# 9.4 → 9.6 µs at the small shapes (timed first there)
T_ROW_PAD = 8
# Step 4 (the two 16-blocks below the diagonal blocks) register-blocked on 64 threads: each thread two rows and four
# columns of a block (8 accumulators), reading per step m one 8-byte vector of A's column (A_10 / A_32 stored
# transposed in step 2, and T_11 / T_33 transposed by their solving threads after step 3, into the diagonal blocks'
# storage, dead by then) and one 16-byte vector of T's row: per m and warp 2 shared wavefronts for 8 FMAs a thread,
# 2 warps: 4 per m against the Parallel form's 8 (4 warps, a word of A and a 16-byte vector of T for 4 FMAs a
# thread). The two idle warps wait. The same products in the same order: outputs bitwise equal. Run 26's source
# profile put step 4's loops at ≈ 26% of the kernel's shared wavefronts (and the pre-pass is bound by them: 93% of
# its L1 / shared pipe busy): predicted −8 to −12% of the pre-pass. Run 28 (H200, benchmarks/prepass_ab.py against
# the file with False; A_inv and o bitwise equal on six shapes): 0.1129 → 0.1070 ms at B=8 T=4096 H=16, 0.1128 →
# 0.1062 at B=1 T=32768 H=16, 0.2126 → 0.1973 at B=4 T=8192 H=16 HV=32, 0.0581 → 0.0539 at B=1 T=32768 H=2 HV=8
# (−5 to −7%: short of the prediction, the two idle warps' share of the step not refilled); at the small shapes,
# timed first, 0.018 → 0.025 (B=2 T=300 H=4) and 0.0345 → 0.0364 (B=1 T=1000 H=2 HV=8)
STEP4_BLOCKED = True
# Step 2 as two loops over K Kᵀ's registers: A's elements first (in place), then their stores to the blocks. In one
# loop each element read β_i, gc_i and gc_j from shared memory again (3 loads per element, 96 per thread): the
# stores to A's blocks go to the same shared buffer, which nvcc cannot tell apart from gcs and bs, so it reloads them
# after every store. Run 35's ncu source view (H200, B=1 T=32768 H=16): those loads were 384 of the pre-pass's 800
# shared loads per program and 384 of its 1874 shared wavefronts, and step 2 30% of its stall samples, where its
# L1 / shared pipe is 88% busy. With no store in the first loop a thread loads its 2 rows' and 16 columns' values
# once each. The same products in the same order: outputs bitwise equal. Predicted −8 to −12% of the pre-pass; run 35
# (H200, benchmarks/prepass_ab.py against the file without it; A_inv and o bitwise equal on six shapes): 0.1064 →
# 0.0966 ms at B=8 T=4096 H=16, 0.1062 → 0.0955 at B=1 T=32768 H=16, 0.1957 → 0.1786 at B=4 T=8192 H=16 HV=32,
# 0.0544 → 0.0489 at B=1 T=32768 H=2 HV=8 (−9 to −10%), 0.0094 → 0.0082 at B=2 T=300 H=4
A_BEFORE_STORES = True
# Step 4 on the tensor cores, one warp per half (threads 0–63, as STEP4_BLOCKED): Y1 = A_10 T_00 and then T_10 =
# −T_11 Y1 as four m16n8k8 tf32 mma.sync each (two k-steps of 8, two n-tiles of 8), the operands read one word per
# lane straight in the fragments' layouts (A_10 and A_32 stored untransposed, rows 20 words apart: conflict-free),
# Y1 through shared memory between the products (its C layout is not the B operand's; rows 24 words apart, so its
# 8-byte stores and its B reads are conflict-free). Run 35's ncu source view put step 4's loops at 386 of the
# pre-pass's 1874 shared wavefronts per chunk, where the blocked FMAs read a 16-byte vector of T's row per 8 FMAs
# (four wavefronts a warp, whatever its broadcast); this reads ≈ 112. The products round their operands to tf32
# (2⁻¹¹ each, as step 5's do, under A_inv's bf16 2⁻⁹): not bitwise the FMA steps. Session 18 put step 4 on 32 × 32
# block-diagonal dots (zero blocks, stores, barriers) and measured it slower, when the kernel was not bound by its
# shared wavefronts as it is now. Predicted −8 to −15% of the pre-pass; run 36 (H200, benchmarks/prepass_ab.py
# against today's file with it off; A_inv against its fp32 twin 2.43e-4 where the FMAs give 2.37e-4, o against
# float64 unchanged to 4 digits): 0.0936 → 0.0892 ms at B=8 T=4096 H=16, 0.0948 → 0.0894 at B=1 T=32768 H=16,
# 0.1723 → 0.1478 at B=4 T=8192 H=16 HV=32 (−5 to −14%)
STEP4_MMA = True
# T_hi's rows this many words after its 32 (None: T_lo's T_ROW_PAD, one stride for both halves). Step 5 reads T_lo
# as its first dot's B operand, one word per lane at k · stride + n (stride 40 puts those 32 words in 32 banks), and
# T_hi as its second dot's A operand by ldmatrix, 8 rows of 16 bytes per matrix: at stride 40 rows r and r + 4 share
# their banks, a 2-way conflict, which run 35's ncu source view counted as 64 of the pre-pass's 146 excess shared
# wavefronts per chunk (of 1874). Stride 36 puts the 8 rows in 8 distinct bank quads (and STEP4_MMA's reads of T_33
# too). A layout only: outputs bitwise equal. Predicted −2 to −4% of the pre-pass; run 36 (bitwise on six shapes):
# 0.0935 → 0.0909 ms at B=8 T=4096 H=16, 0.0932 → 0.0904 at B=1 T=32768 H=16, 0.1747 → 0.1675 at B=4 T=8192 H=16
# HV=32 (−3 to −4%)
T_HI_ROW_PAD = 4
# Step 6's β per column (A_inv diag(β), BETA_IN_A_INV) from registers: each thread's 8 elements of a quadrant take 4
# columns' β, loaded once before the stores to the staging tile instead of 12 reloads after them (nvcc cannot tell
# bs from Out: one shared buffer; run 35's source view: 64 of the pre-pass's shared wavefronts per chunk). The same
# products: outputs bitwise equal. Predicted −1 to −3% of the pre-pass; run 36 (bitwise on six shapes): 0.0942 →
# 0.0919 ms at B=8 T=4096 H=16, 0.0942 → 0.0919 at B=1 T=32768 H=16, 0.1745 → 0.1694 at B=4 T=8192 H=16 HV=32 (−2
# to −3%). The three together (run 36): 0.0936 → 0.0869, 0.0943 → 0.0870, 0.1741 → 0.1425 (−7, −8, −18%)
STEP6_BETA = True


def build_kernel(H: int, HV: int, K: int, beta_dtype: str = "float32", threads: int = 128,
                 beta_in_a: bool = False, min_blocks: int = 1, tma_keys: bool = False, a_row_pad: int = 0,
                 t_row_pad: int = 0, step4_blocked: bool = False, a_before_stores: bool = False,
                 step4_mma: bool = False, t_hi_row_pad: Optional[int] = None, step6_beta: bool = False):
    """The TileLang prim_func of the pre-pass for these static sizes (B and T symbolic: with segments, the caller
    passes B·S sequences of T/S tokens as views). ``beta_dtype``: β as given (widened on load, written head-major
    in its own dtype). ``beta_in_a``: A_inv diag(β) instead of A_inv (:data:`BETA_IN_A_INV`). ``min_blocks``: the
    programs per SM the registers are fitted for (:data:`MIN_BLOCKS_PER_SM`); ``tma_keys``: the key tile by TMA
    (:data:`TMA_KEYS`); ``a_row_pad``: words after each row of A's 16-blocks (:data:`A_ROW_PAD`); ``t_row_pad``:
    T_lo, T_hi and Y2 in linear layouts with that many words after each 32-word row (:data:`T_ROW_PAD`; 0: TileLang's
    own swizzled layouts); ``step4_blocked``: step 4 register-blocked on 64 threads (:data:`STEP4_BLOCKED`);
    ``a_before_stores``: step 2's elements, then its stores (:data:`A_BEFORE_STORES`); ``step4_mma``: step 4 on
    mma.sync, one warp per half (:data:`STEP4_MMA`; instead of ``step4_blocked``); ``t_hi_row_pad``: T_hi's rows
    that many words after 32 (:data:`T_HI_ROW_PAD`; None: ``t_row_pad``'s); ``step6_beta``: step 6's β per
    column from registers (:data:`STEP6_BETA`).
    ``threads``: 128 only (one warpgroup: K Kᵀ's wgmma, 64 solving threads and two warps for
    the map bound)."""
    if threads != 2 * BT:
        raise ValueError(f"the pre-pass runs 128 threads per program, got threads={threads}")
    if t_hi_row_pad is not None and not t_row_pad:
        raise ValueError("t_hi_row_pad needs t_row_pad (T_lo's rows padded too)")
    import tilelang
    import tilelang.cuda.language as TC  # T.copy with CUDA lowering hints
    import tilelang.language as T

    acc, dtype = "float32", "bfloat16"
    B = T.symbolic("B")
    Tn = T.symbolic("T")
    Tp = T.symbolic("Tp")   # T padded to a multiple of 8 (chunk_fwd.padded_length)
    NC = T.symbolic("NC")   # ⌈T/64⌉: the chunks
    G = HV // H

    @T.macro
    def step4_blocked_products(tx, Ao, Ad, Tq, Y1, x, z, zt, av):
        # threads 0–63: half h = tx / 32 (A_10 T_00 and T_11 for h = 0, A_32 T_22 and T_33 for h = 1), rows 2a, 2a + 1
        # and columns 4b … 4b + 3 of the half's 16 × 16 block; per step m an 8-byte read of A's column (Ao holds
        # A_10 / A_32 transposed) and a 16-byte read of T's row
        h = tx // (2 * D)
        a = (tx % (2 * D)) // 4
        b = tx % 4
        if tx < 4 * D:
            # T_11 / T_33 transposed into their diagonal blocks' storage (Ad[1], Ad[3]: read by nobody after step 3's
            # barrier) by the threads that solved them, from their registers: row col ← their column
            if (tx // D) % 2 == 1:
                for i in T.vectorized(D):
                    Ad[tx // D, tx % D, i] = x[i]
            for r in T.unroll(2):
                for cc in T.vectorized(4):
                    z[r, cc] = 0.0
            for m in T.serial(D):
                for r in T.vectorized(2):
                    av[r] = Ao[h, m, 2 * a + r]           # one 8-byte read: A's rows 2a, 2a + 1 at column m
                for r in T.unroll(2):
                    for cc in T.vectorized(4):
                        z[r, cc] += av[r] * Tq[h, m, 4 * b + cc]
            for r in T.unroll(2):
                for cc in T.vectorized(4):
                    Y1[h, 2 * a + r, 4 * b + cc] = z[r, cc]
        T.sync_threads()
        if tx < 4 * D:
            for r in T.unroll(2):
                for cc in T.vectorized(4):
                    zt[r, cc] = 0.0
            for m in T.serial(D):
                for r in T.vectorized(2):
                    av[r] = Ad[2 * h + 1, m, 2 * a + r]   # T_11's rows 2a, 2a + 1 at column m
                for r in T.unroll(2):
                    for cc in T.vectorized(4):
                        zt[r, cc] -= av[r] * Y1[h, m, 4 * b + cc]
            for r in T.unroll(2):
                for cc in T.vectorized(4):
                    Tq[h, D + 2 * a + r, 4 * b + cc] = zt[r, cc]

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
    def step4_mma_products(tx, Ao, Tq, Y1, af, bf, cf):
        # threads 0–63: warp h = tx / 32 takes half h (A_10, T_00, T_11 → T_10 for h = 0; A_32, T_22, T_33 → T_32 for
        # h = 1); lane (g, t) = (lane / 4, lane % 4) holds, per m16n8k8 tile, A at rows g, g + 8 and columns t,
        # t + 4 of the k-step, B at rows t, t + 4 and column g, and C at rows g, g + 8 and columns 2t, 2t + 1
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

    @T.prim_func
    def gdn_prepass(k: T.Tensor((B, Tn, H, K), dtype), g: T.Tensor((B, Tn, HV), acc),
                    beta: T.Tensor((B, Tn, HV), beta_dtype), a_inv: T.Tensor((B, Tn, HV, BT), dtype),
                    gc_hm: T.Tensor((B, HV, Tp), acc), beta_hm: T.Tensor((B, HV, Tp), beta_dtype),
                    bound: T.Tensor((B, HV, NC), acc)):
        with T.Kernel(T.ceildiv(Tn, BT), B * HV, threads=threads) as (c, bh):
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            ib = bh // HV
            ihv = bh % HV
            ih = ihv // G
            Ks = T.alloc_shared((BT, K), dtype)
            gs = T.alloc_shared((BT,), acc)
            gcs = T.alloc_shared((BT,), acc)
            bs = T.alloc_shared((BT,), acc)
            bl = T.alloc_local((1,), acc)
            bparts = T.alloc_shared((2,), acc)    # the map bound's sums over the chunk's two halves
            # A's blocks. A diagonal block's rows are read by 16 threads at once (one per column): the padded block
            # stride (17 rows) puts the two blocks a warp reads in different banks
            Ad = T.alloc_shared((4, D + 1, D + a_row_pad), acc)
            Ao = T.alloc_shared((2, D, D + a_row_pad), acc)      # A_10, A_32 (step4_blocked: transposed)
            step4_transposed = step4_blocked and not step4_mma
            # A_hl, step 5's first A operand, in a linear layout with rows 36 words apart (run 26): its stores in step
            # 2 are a base plus a constant (a swizzle's address was recomputed per element), and its ldmatrix reads
            # of 8 rows × 16 bytes fall in 8 distinct bank quads
            Ahl = T.alloc_shared((2 * D, 2 * D + 4), acc)
            # T_lo, T_hi: the inverted halves (t_hi_row_pad: unpadded logically, the rows spaced by the layout)
            Tq = T.alloc_shared((2, 2 * D, 2 * D + (0 if t_hi_row_pad is not None else t_row_pad)), acc)
            Y1 = T.alloc_shared((2, D, D + (8 if step4_mma else 0)), acc)      # A_10 T_00, A_32 T_22
            Y2 = T.alloc_shared((2 * D, 2 * D + t_row_pad), acc)  # A_hl T_lo
            Out = T.alloc_shared((BT, BT), dtype)
            KK = T.alloc_fragment((BT, BT), acc)
            Gr = T.alloc_fragment((BT,), acc)        # a_before_stores: gc and β per row, gc per column
            Br = T.alloc_fragment((BT,), acc)
            Gcol = T.alloc_fragment((BT,), acc)
            Bl = T.alloc_fragment((2 * D,), acc)     # step6_beta: β of A_inv's column halves
            Bh = T.alloc_fragment((2 * D,), acc)
            Z1 = T.alloc_fragment((2, D, D), acc)
            Z2 = T.alloc_fragment((2 * D, 2 * D), acc)
            x = T.alloc_local((D,), acc)
            z = T.alloc_local((2, 4), acc)            # step4_blocked: a thread's 2 × 4 accumulators
            zt = T.alloc_local((2, 4), acc)
            av = T.alloc_local((2,), acc)             # step4_blocked: A's two values at column m
            af = T.alloc_local((4,), acc)             # step4_mma: a lane's A, B and C fragments (two C tiles)
            bf = T.alloc_local((2,), acc)
            cf = T.alloc_local((8,), acc)
            linear = [Ad, Ahl] + ([Tq, Y2] if t_row_pad else []) + ([Ao, Y1] if step4_blocked or step4_mma else [])
            layouts = {buf: tilelang.layout.make_linear_layout(buf) for buf in linear}
            if t_hi_row_pad is not None:
                # T_hi's rows t_hi_row_pad words after 32 (T_lo's t_row_pad): T_lo is step 5's first B operand, read
                # one word per lane at k · stride + n; T_hi its second A operand, read by ldmatrix (8 rows × 16 bytes)
                stride_lo, stride_hi = 2 * D + t_row_pad, 2 * D + t_hi_row_pad
                layouts[Tq] = T.Layout(Tq.shape, lambda h, i, j: h * (2 * D * stride_lo)
                                       + i * (stride_lo + h * (stride_hi - stride_lo)) + j)
            T.annotate_layout(layouts)

            # 1. keys, gates and βs of the chunk (past the sequence's end: zero keys, g = 0, β = 0)
            TC.copy(k[ib, c * BT:(c + 1) * BT, ih, 0:K], Ks, prefer_instruction="tma" if tma_keys else None)
            for i in T.Parallel(BT):
                gs[i] = T.if_then_else(c * BT + i < Tn, g[ib, c * BT + i, ihv], 0.0)
                bs[i] = T.if_then_else(c * BT + i < Tn, T.cast(beta[ib, c * BT + i, ihv], acc), 0.0)
            T.cumsum(gs, gcs, dim=0)
            # gc and β in the fused kernel's layout; rows from T to Tp (the padding of the last chunk) are zero
            for i in T.Parallel(BT):
                if c * BT + i < Tp:
                    gc_hm[ib, ihv, c * BT + i] = T.if_then_else(c * BT + i < Tn, gcs[i], 0.0)
                    beta_hm[ib, ihv, c * BT + i] = T.if_then_else(c * BT + i < Tn, beta[ib, c * BT + i, ihv],
                                                                  T.cast(0.0, beta_dtype))

            # 2. A = strictly_lower(β_i (K Kᵀ)_ij e^{gc_i − gc_j}), into its blocks. Branch-free: the exponent is
            #    −∞ above the diagonal (where gc_i − gc_j can be large and positive), so e^… = 0 there, and 0 on it,
            #    so the diagonal blocks' own diagonals, which the solve never reads, keep β_i ‖k_i‖² for the map
            #    bound. Each store goes to the one block holding (i, j) under its own predicate (no else: an
            #    if / elif chain compiled to branches around every element, 2264 → 1992 static SASS instructions)
            T.gemm(Ks, Ks, KK, transpose_B=True, clear_accum=True)
            if a_before_stores:
                # β_i and gc_i in K Kᵀ's row layout, gc_j in its column layout (a thread's 2 rows and 16 columns), so
                # the elements read registers only (no load in the exponent's select: nvcc branched around loads)
                for i in T.Parallel(BT):
                    Gr[i] = gcs[i]
                    Br[i] = bs[i]
                for j in T.Parallel(BT):     # a loop of its own: Gcol takes the columns' layout
                    Gcol[j] = gcs[j]
                for i, j in T.Parallel(BT, BT):
                    KK[i, j] = Br[i] * KK[i, j] * T.exp2(T.Select(i >= j, (Gr[i] - Gcol[j]) * LOG2E, -T.infinity(acc)))
            for i, j in T.Parallel(BT, BT):
                if a_before_stores:
                    a = KK[i, j]
                else:
                    a = bs[i] * KK[i, j] * T.exp2(T.Select(i >= j, (gcs[i] - gcs[j]) * LOG2E, -T.infinity(acc)))
                if i // D == j // D:
                    Ad[i // D, i % D, j % D] = a
                if i // D == j // D + 1 and i // (2 * D) == j // (2 * D):
                    if step4_transposed:
                        Ao[i // (2 * D), j % D, i % D] = a           # column j % D of the block as a row
                    else:
                        Ao[i // (2 * D), i % D, j % D] = a
                if i >= 2 * D and j < 2 * D:
                    Ahl[i - 2 * D, j] = a
            for h, i, j in T.Parallel(2, 2 * D, 2 * D):
                Tq[h, i, j] = 0.0                    # the quadrants above the blocks stay zero
            # every thread's A before the column solves, which only 64 threads run
            T.sync_threads()

            # 3. T_dd = (I + A_dd)⁻¹: thread (d, col) solves (I + A_dd) x = e_col by forward substitution,
            #    x_i = δ_i,col − Σ_{j<i} A_ij x_j (zero above col, so one formula for every row), x in registers
            tx = T.get_thread_binding()
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
                # meanwhile the two warps the solve leaves idle: the chunk's map bound (map_bound.py), Σ_i g_i log2 e
                # + log2 max(1, |1 − β_i ‖k_i‖²|) (rows past T: g = β = 0, nothing), one token per thread, summed
                # per warp by shuffles. One thread looping over the 64 tokens (session 19's kernel) kept its warps
                # and their program waiting at the barrier below: ncu's stall samples of run 26, 12% on its loop
                bl[0] = T.warp_reduce_sum(T.log2(T.max(T.abs(1.0 - Ad[(tx - 4 * D) // D, tx % D, tx % D]), 1.0)))
                if tx % 32 == 0:
                    bparts[(tx - 4 * D) // 32] = bl[0]
            T.sync_threads()
            if tx == 4 * D:
                bound[ib, ihv, c] = gcs[BT - 1] * LOG2E + bparts[0] + bparts[1]

            # 4. the blocks below the diagonal blocks, both halves at once: Y1 = A_10 T_00, then T_10 = −T_11 Y1
            if step4_mma:
                step4_mma_products(tx, Ao, Tq, Y1, af, bf, cf)
            elif step4_blocked:
                step4_blocked_products(tx, Ao, Ad, Tq, Y1, x, z, zt, av)
            else:
                T.clear(Z1)
                for m in T.serial(D):
                    for h, i, j in T.Parallel(2, D, D):
                        Z1[h, i, j] += Ao[h, i, m] * Tq[h, m, j]
                T.copy(Z1, Y1)
                T.clear(Z1)
                for m in T.serial(D):
                    for h, i, j in T.Parallel(2, D, D):
                        Z1[h, i, j] -= Tq[h, D + i, D + m] * Y1[h, m, j]
                for h, i, j in T.Parallel(2, D, D):
                    Tq[h, D + i, j] = Z1[h, i, j]

            # 5. the lower-left quadrant X = −T_hi (A_hl T_lo) on tensor cores
            T.gemm(Ahl[:, 0:2 * D], Tq[0, :, 0:2 * D], Z2, clear_accum=True)
            T.copy(Z2, Y2[:, 0:2 * D])
            T.gemm(Tq[1, :, 0:2 * D], Y2[:, 0:2 * D], Z2, clear_accum=True)

            # 6. A_inv = [[T_lo, 0], [X, T_hi]] in bf16 (beta_in_a: column j times β_j), rows past the sequence's
            #    end not written
            if beta_in_a and step6_beta:
                # the columns' β in X's column layout, loaded once (between the stores to Out below nvcc reloads
                # them from shared memory: one buffer)
                for j in T.Parallel(2 * D):
                    Bl[j] = bs[j]
                for j in T.Parallel(2 * D):      # loops of their own: each fragment takes the columns' layout
                    Bh[j] = bs[2 * D + j]
            for i, j in T.Parallel(2 * D, 2 * D):    # quadrant by quadrant, in X's register layout
                Out[i, j] = Tq[0, i, j] * (Bl[j] if step6_beta else bs[j]) if beta_in_a else Tq[0, i, j]
                Out[i, 2 * D + j] = 0.0
                Out[2 * D + i, j] = -Z2[i, j] * (Bl[j] if step6_beta else bs[j]) if beta_in_a else -Z2[i, j]
                Out[2 * D + i, 2 * D + j] = (Tq[1, i, j] * (Bh[j] if step6_beta else bs[2 * D + j]) if beta_in_a
                                             else Tq[1, i, j])
            T.copy(Out, a_inv[ib, c * BT:(c + 1) * BT, ihv, 0:BT])

    return gdn_prepass


@functools.lru_cache(maxsize=64)
def compiled_kernel(H: int, HV: int, K: int, beta_dtype: str = "float32", threads: int = 128,
                    target: Optional[str] = None, beta_in_a: bool = False, min_blocks: int = 1,
                    tma_keys: bool = False, a_row_pad: int = 0, t_row_pad: int = 0, step4_blocked: bool = False,
                    a_before_stores: bool = False, step4_mma: bool = False, t_hi_row_pad: Optional[int] = None,
                    step6_beta: bool = False):
    """The compiled pre-pass (cached per static configuration); ``target`` as ``chunk_fwd.compile_prim_func``'s."""
    return compile_prim_func(build_kernel(H, HV, K, beta_dtype, threads, beta_in_a, min_blocks, tma_keys,
                                          a_row_pad, t_row_pad, step4_blocked, a_before_stores, step4_mma,
                                          t_hi_row_pad, step6_beta), target)


def prepass_kernel(H: int, HV: int, K: int, beta_dtype: torch.dtype, beta_in_a: bool):
    """The compiled pre-pass :func:`prepass_hopper` launches, with the module's switches applied."""
    return compiled_kernel(H, HV, K, str(beta_dtype).removeprefix("torch."), beta_in_a=beta_in_a,
                           min_blocks=MIN_BLOCKS_PER_SM, tma_keys=TMA_KEYS, a_row_pad=A_ROW_PAD,
                           t_row_pad=T_ROW_PAD, step4_blocked=STEP4_BLOCKED, a_before_stores=A_BEFORE_STORES,
                           step4_mma=STEP4_MMA, t_hi_row_pad=T_HI_ROW_PAD, step6_beta=STEP6_BETA)


def _check(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, segments: int) -> None:
    """The shapes and the segment count (the kernel's dtypes are checked by :func:`prepass_hopper`)."""
    B, T = k.shape[:2]
    if g.shape != beta.shape or g.shape[:2] != (B, T):
        raise ValueError(f"g and beta must be [B, T, HV] with B, T = {B}, {T}; got {list(g.shape)} and "
                         f"{list(beta.shape)}")
    if segments < 1 or (segments > 1 and T % (BT * segments)):
        raise ValueError(f"{segments} segments need T a multiple of {BT * segments}, got T={T}")


def prepass_hopper(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, segments: int = 1,
                   beta_in_a_inv: Optional[bool] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gc ``[B·S, HV, Lp]`` fp32, β ``[B·S, HV, Lp]`` in β's dtype, A_inv ``[B, T, HV, 64]`` bf16) for the fused
    kernel (``walk_launch.chunk_fwd_hopper_hm``) from bf16 keys ``[B, T, H, K]``, log decays g and β ``[B, T, HV]``,
    and the map bound's chunk sums ``[B·S, HV, L/64]`` fp32 (``map_bound.chunk_bounds``'s, for the segmented
    forward's plan: the two warps the solve leaves idle sum them from β_i ‖k_i‖², kept on A's diagonal blocks).
    ``segments`` = S cuts every sequence into S segments of L = T/S tokens (T a multiple of 64·S), which the fused
    kernel takes as B·S sequences: gc and β come per segment (gc is chunk-local, so it holds for them as it is), and
    A_inv viewed as ``[B·S, L, HV, 64]`` is theirs. Lp = ``padded_length(L)``; S = 1: L = T. ``beta_in_a_inv``
    (None: :data:`BETA_IN_A_INV`): A_inv diag(β) instead of A_inv."""
    _check(k, g, beta, segments)
    if k.dtype != torch.bfloat16:
        raise TypeError(f"the Hopper pre-pass takes bf16 keys, got {k.dtype}")
    if beta.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"beta must be bf16 or fp32, got {beta.dtype}")
    B, T, H, K = k.shape
    HV = g.shape[2]
    kernel = prepass_kernel(H, HV, K, beta.dtype, BETA_IN_A_INV if beta_in_a_inv is None else beta_in_a_inv)
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
                       a_inv_dtype: torch.dtype = torch.bfloat16, beta_in_a_inv: Optional[bool] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin of :func:`prepass_hopper` (same arguments and results) from the PyTorch stages: the chunk-local
    cumsum, ``kkt_solve_ref`` (a dense solve) and ``chunk_fwd.head_major`` on each segment, A_inv rounded to
    ``a_inv_dtype`` once (the kernel's bf16; fp32 for tests of the layout alone; float64, with gc in float64 too, for
    a reference; ``beta_in_a_inv`` as :func:`prepass_hopper`'s). For the layout and the segments on
    a machine without the GPU (any float keys: the kernel's bf16 check is :func:`prepass_hopper`'s);
    :func:`blocked_inverse_ref` is the twin of the kernel's solve."""
    from ..gated_delta import torch_chunk as tc
    from .chunk_fwd import head_major
    from .map_bound import chunk_bounds_ref
    _check(k, g, beta, segments)
    B, T, H, K = k.shape
    HV = g.shape[2]
    work = torch.float64 if a_inv_dtype == torch.float64 else torch.float32   # float64: a reference A_inv
    kc = tc.to_chunks(k.to(work).repeat_interleave(HV // H, 2), BT)
    gcc = tc.chunk_local_cumsum_ref(tc.to_chunks(g.to(work), BT))
    bc = tc.to_chunks(beta.to(work), BT)
    a_inv = tc.kkt_solve_ref(kc, bc, gcc)                                         # [B, HV, NT, BT, BT]
    if BETA_IN_A_INV if beta_in_a_inv is None else beta_in_a_inv:
        a_inv = a_inv * bc[..., None, :]                                          # A_inv diag(β)
    a_inv = tc.from_chunks(a_inv, T).to(a_inv_dtype)                            # [B, T, HV, BT]
    gc = tc.from_chunks(gcc, T)                                                  # [B, T, HV]

    def per_segment(x: torch.Tensor) -> torch.Tensor:
        return head_major(x.reshape(B * segments, T // segments, HV))

    return per_segment(gc), per_segment(beta), a_inv, chunk_bounds_ref(k, g, beta, segments).float()


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
