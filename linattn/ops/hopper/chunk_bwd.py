"""Hopper backward (TileLang): the unsegmented fused reverse walk, one program per (sequence, value head, V slice of
``BV`` columns), every step of :func:`chunk_bwd_ref.reverse_chunk_ref` in the same order and precision on its
slice (dS and Γ⊙dO as bf16 hi + lo, dA = −Y V_newᵀ on bf16 operands). Its twin is
:func:`chunk_bwd_ref.chunk_bwd_v_slices_ref`; the host chain around it is ``backward.py``; the design, docs/backward.md.

Why slices: the reverse step is column-separable in V (the chain's C1–C3 are left products, and every other
gradient is a sum over V of the slices' contributions), so the chains of one head's slices need no exchange.
Each writes its columns of dv and dh0 (complete) and partials of dg and dβ that the host adds in a fixed order.
At K = V = 128 the whole-V program needs 393 KB of shared memory; a BV = 64 slice fits one CTA (218 368 B; ptxas:
168 registers, no spill). Not warp-specialised by hand (TileLang adds its producer warpgroup: 384 threads), loads
single-buffered; dots that do not wait on each other are issued together (``T.wgmma_gemm``) and waited for where
their results are read, as far as the 168 registers allow (the compile test rejects a spill). Per chunk and
program at K = 128, BV = 64: 19.5 MFLOP on 20 bf16 wgmma dots; reads q, k 32 KB, v, dO 16, T 8, h 16 (72.5 KB);
writes dv 8 KB, and dq, dk as below.

dq and dk are added over the slices in the walk, in fp32 and a fixed order (:func:`_exchange_macros`): the NV slices of
a (sequence, value head) are one thread-block cluster, launched together, and each chunk's owner (slice step mod NV)
awaits the others' BT × K tiles in a ring in global memory (L2; per warp, flags with release and acquire), adds them to
its own and stores the sum: per value head where G = HV / H > 1 (the host adds the group; dq in bf16, dk in fp32:
:func:`qk_heads_dtypes`), the gradient itself in bf16 where G = 1. No shared memory for the exchange (the step uses 213
KB of the 227), no atomics, no fp32 partials (1 GB at B = 8, T = 4096, H = HV = 16). Per chunk and head (two slices):
one 64 KB fp32 pair of tiles through L2 and dq, dk stored once (32 KB in bf16) where the partials wrote 128 KB.
benchmarks/gpu_check_hopper_bwd.py checks it against the twin and float64 on the GPU, then times it.

The reverse warm-ups (:func:`build_warm_kernel`, launched by :func:`reverse_warm_ups_hopper`; twin
``chunk_bwd_ref.reverse_warm_ups_hopper_ref``) give the segmented walk's dS_out without maps or scan: per segment the
dS chain alone (the step's P, C1, Pᵀ dO, C2, C3: 8 dots, 7.3 MFLOP; reads T, dO, q, k, gc, β: 48.5 KB per chunk) over
the w chunks after it, w found in-kernel from the pre-pass's chunk bounds (docs/backward.md §5).

The timeline build (``build_kernel(timeline=True)``, launched by :func:`walk_timeline`; a benchmark's instrument,
never the op's): the same walk with one more output, the stamps (``timeline.py``): at each of ``timeline.POINTS`` of
every chunk step the first thread of each consumer warpgroup stores the SM's clock64 (one global store), and at the
step's start the global timer, which converts the cycles to µs. Its one change to the walk's order: the step's
inputs are all awaited at its "loads" point (the default build awaits each at its first use, within the recompute
and the chain). The default build is untouched (its prim_func is the same: no stamp, no parameter). At K = V = 128,
BV = 64 it sits at the 168-register wall: TileLang places the shared buffers differently from one compile to the
next, and ptxas spills 4 B in about one compile of five, none in the others (a start stamp at the loop's top, before
the wait on gc, spilled 8 B every time: the start is stamped after that wait). ``gpu_check_hopper_bwd.py
--timeline`` prints its table.

Inputs, per program: q, k ``[B, T, H, K]`` bf16; v, do ``[B, T, HV, V]`` bf16; gc, β ``[B, HV, Lp]`` fp32 head-major
(Lp = chunks · 64, zero-padded); T ``[B, T, HV, 64]`` bf16 (A_inv without β); h ``[B, NT, HV, K, V]`` bf16 (the states
entering each chunk, the Triton state pass's layout); dht ``[B, HV, K, V]`` fp32. Outputs: dq, dk ``[B, T, HV, K]``
(per value head in :func:`qk_heads_dtypes`; bf16 where HV = H), dv ``[B, T, HV, V]`` bf16, dg, dβ ``[NV, B, HV, Lp]``
fp32 partials, dh0 ``[B, HV, K, V]`` fp32 (NV = V / BV); the exchange's ring and flags (:func:`exchange_buffers`).
"""
import functools  # no "from __future__ import annotations": TileLang reads the kernel's annotations as objects
import types
from typing import Optional

import torch

from ..utils import output_tensor
from .chunk_bwd_ref import NEGLIGIBLE_LOG2
from .chunk_fwd import BT, compile_prim_func, launcher
from .compile import tile_dtype
from .timeline import POINTS, recorded_steps, stamps_shape

NEG = -1.0e30       # an exponent whose exp is 0 (masked decays: never e^{G_i − G_j} above the diagonal)
BV_DEFAULT = 64     # V columns per program: at K = V = 128 a whole-V program needs 393 KB of shared memory
FLAG_WARPS = 32     # a flag per warp of a program (1024 threads at most): the exchange is per warp
# The slices' exchange of dq, dk tiles (:func:`_exchange_macros`), per warp: a fragment's element → thread map is the
# same in every slice's program, so warp w of the owner reads only what warp w of each other slice wrote.
# publish: every lane's tile stores made visible at cluster scope, then the warp's flag set (release);
# await: every lane spins on its warp's flag (acquire) until the step is there. Cluster scope suffices (every reader
# is in the writer's cluster) and costs less than GPU scope's fence (docs/decisions.md)
EXCHANGE_SOURCE = """
__device__ __forceinline__ void linattn_warp_publish(int* flags, int step) {
  asm volatile("fence.acq_rel.cluster;" ::: "memory");
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    asm volatile("st.release.cluster.global.s32 [%0], %1;" :: "l"(flags + (threadIdx.x >> 5)), "r"(step) : "memory");
  }
}
__device__ __forceinline__ void linattn_warp_await(int* flags, int step) {
  int seen;
  do {
    asm volatile("ld.acquire.cluster.global.s32 %0, [%1];" : "=r"(seen) : "l"(flags + (threadIdx.x >> 5)) : "memory");
  } while (seen < step);
}
"""
# The timeline builds' stamp (``build_kernel(timeline=True)``, timeline.py): the first thread of each stamping
# warpgroup (from ``first_warpgroup`` on: TileLang's producer warpgroup is threads 0-127 and its consumers 128 on; the
# role-split walk's roles are 0-383) stores the SM's clock64 at ``row[point · warpgroups + its index]``, ``row`` =
# stamps[program, step] with program = ctaid.y · gridDim.x + ctaid.x (the slice walk's grid is (NV, B · HV), the
# role-split walk's (B · HV)); at point 0 also the global timer (ns) in the row's last entry. One global store
# per point and warpgroup. The row's address is formed here from volatile reads of the block index, so that no
# register holds it across the step (formed by TileLang, ptxas kept it live and spilled 8 B); the "memory" clobbers
# keep the compiler from moving loads and stores across the clock reads. ``Awaited...``: buffers the call names only
# so that TileLang awaits their loads before it (the "loads" point), unused.
TIMELINE_SOURCE = """
template <typename... Awaited>
__device__ __forceinline__ void linattn_stamp(int64_t* stamps, int step, int steps, int point, int points,
                                              int warpgroups, int first_warpgroup, Awaited...) {
  if ((threadIdx.x & 127) == 0) {
    unsigned slice, cluster;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(slice));
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(cluster));
    int64_t* row = stamps + ((int64_t)(cluster * gridDim.x + slice) * steps + step) * (points + 1) * warpgroups;
    const int wg = (threadIdx.x >> 7) - first_warpgroup;
    int64_t clock;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(clock) :: "memory");
    row[point * warpgroups + wg] = clock;
    if (point == 0) {
      int64_t ns;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns) :: "memory");
      row[points * warpgroups + wg] = ns;
    }
  }
}
"""


def _recompute_macros(K: int, BV: int, scale: float) -> types.SimpleNamespace:
    """The chunk's recompute, the dS chain and the X terms as TileLang macros (and the column-sum helper), on a
    slice of ``BV`` value columns."""
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"

    @T.macro
    def column_sums_out(Ms, sums, sums_s, out):
        """out_j −= Σ_i M_ij: per column a sum in registers (the fragment ``sums``, one thread per column and its
        replicas) from shared memory, then through ``sums_s`` (shared) into out, once per column. (A fragment's
        reduction over its rows does not lower in TileLang 0.1.15 for the dots' accumulator layouts.)"""
        for j in T.Parallel(BT):
            sums[j] = 0.0
            for i in T.unroll(BT):
                sums[j] = sums[j] + Ms[i, j]
        T.copy(sums, sums_s)
        for j in T.Parallel(BT):
            out[j] = out[j] - sums_s[j]

    @T.macro
    def recompute(t, rows, outputs):
        """The chunk's forward recomputed (K S, X, V_new, P) and γ Σ h⊙dS with the dS leaving it (this slice's).
        ``outputs`` (a Python bool) False: a warm-up's chunk, P and C1 alone (the chain reads no state). K S, Q Kᵀ
        and C1 are issued together, Γ ⊙ dO as bf16 hi + lo (the chain's C2 operands) formed under them, and
        V_new = T X left running while P forms."""
        if outputs:
            # γ Σ h⊙dS with the dS leaving the chunk, before the chain replaces it (first:
            # its K × BV fragment is dead before the dots' accumulators are live)
            for i, j in T.Parallel(K, BV):
                t.hdS[i, j] = T.cast(t.Hs[i, j], acc) * t.dS[i, j]
            T.reduce_sum(t.hdS, t.hdS_rows, dim=1)
            T.copy(t.hdS_rows, t.hrs)
            # recompute: KS, X = β(V − Γ KS), V_new = T bf16(X), P = Q Kᵀ ⊙ D; and the chain's C1 = K [dS_hi;
            # dS_lo], which reads only the chunk's keys and the dS leaving it
            T.wgmma_gemm(t.Ks, t.Hs, t.KS, clear_accum=True)
        T.wgmma_gemm(t.Qs, t.Ks, t.QK, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(t.Ks, t.dSh, t.KdS, clear_accum=True)
        T.wgmma_gemm(t.Ks, t.dSl, t.KdS)
        for i, j in T.Parallel(BT, BV):
            t.Gh[i, j] = T.cast(scale * T.exp(t.gcs[i]) * T.cast(t.dOs[i, j], acc), bf)
            t.Gl[i, j] = T.cast(scale * T.exp(t.gcs[i]) * T.cast(t.dOs[i, j], acc) - T.cast(t.Gh[i, j], acc), bf)
        T.wait_wgmma(0)
        if outputs:
            for i, j in T.Parallel(BT, BV):
                t.Xs[i, j] = T.cast(t.bs[i] * (T.cast(t.Vs[i, j], acc) - T.exp(t.gcs[i]) * t.KS[i, j]), bf)
            T.wgmma_gemm(t.As, t.Xs, t.Vn, clear_accum=True)
        for i, j in T.Parallel(BT, BT):
            t.Ps[i, j] = T.cast(t.QK[i, j] * T.exp(T.if_then_else((i >= j) & (i < rows), t.gcs[i] - t.gcs[j], NEG)),
                                bf)

    @T.macro
    def chain(t, g_last, outputs):
        """The dS chain after C1 (:func:`recompute` issues it): Pᵀ dO and the two Qᵀ (Γ ⊙ dO) terms issued together,
        C2 (synchronous: it waits for every dot before it), C3 into dS; with ``outputs`` V_new's and Y's bf16 copies
        for the q and k sides, and C3 left running under the X terms (the q side's first dot waits for it). A
        warm-up's C3 is synchronous: K's last use there."""
        for i, j in T.Parallel(K, BV):
            t.dS[i, j] = t.dS[i, j] * T.exp(g_last)
        T.wgmma_gemm(t.Ps, t.dOs, t.dVn, transpose_A=True, clear_accum=True)
        T.wgmma_gemm(t.Qs, t.Gh, t.dS, transpose_A=True)
        T.wgmma_gemm(t.Qs, t.Gl, t.dS, transpose_A=True)
        T.wait_wgmma(2)     # V_new and Pᵀ dO (the Qᵀ terms may still run: C2 waits for them)
        if outputs:
            T.copy(t.Vn, t.Vns)
        for i, j in T.Parallel(BT, BV):
            t.KdS[i, j] = t.KdS[i, j] * T.exp(g_last - t.gcs[i])
            t.dVn[i, j] = t.dVn[i, j] * scale + t.KdS[i, j]
            t.dVns[i, j] = T.cast(t.dVn[i, j], bf)
        T.gemm(t.As, t.dVns, t.Y, transpose_A=True, clear_accum=True)
        for i, j in T.Parallel(BT, BV):
            t.Ysn[i, j] = T.cast(-t.bs[i] * T.exp(t.gcs[i]) * t.Y[i, j], bf)
            if outputs:
                t.Yb[i, j] = T.cast(t.Y[i, j], bf)
        if outputs:
            T.wgmma_gemm(t.Ks, t.Ysn, t.dS, transpose_A=True)
        else:
            T.gemm(t.Ks, t.Ysn, t.dS, transpose_A=True)

    @T.macro
    def x_terms(t):
        """The update's ρ term t and the X terms of dG and dβ (this slice's shares)."""
        # t_i = V_new_i · (ρ ⊙ K dS)_i; β's X term rowsum(Y ⊙ W) and Γ's X term rowsum(Y ⊙ KS)
        for i, j in T.Parallel(BT, BV):
            t.tmpV[i, j] = t.Vn[i, j] * t.KdS[i, j]
        T.reduce_sum(t.tmpV, t.rowsV, dim=1)
        for i in T.Parallel(BT):
            t.ts[i] = t.rowsV[i]
        for i, j in T.Parallel(BT, BV):
            t.tmpV[i, j] = t.Y[i, j] * t.KS[i, j]
        T.reduce_sum(t.tmpV, t.rowsV, dim=1)
        for i in T.Parallel(BT):
            t.dGs[i] = -t.bs[i] * T.exp(t.gcs[i]) * t.rowsV[i]
            t.dbs[i] = -T.exp(t.gcs[i]) * t.rowsV[i]
        for i, j in T.Parallel(BT, BV):
            t.tmpV[i, j] = t.Y[i, j] * T.cast(t.Vs[i, j], acc)
        T.reduce_sum(t.tmpV, t.rowsV, dim=1)
        for i in T.Parallel(BT):
            t.dbs[i] = t.dbs[i] + t.rowsV[i]

    return types.SimpleNamespace(column_sums_out=column_sums_out, recompute=recompute, chain=chain, x_terms=x_terms)


def _exchange_macros(K: int, slices: int) -> types.SimpleNamespace:
    """The slices' sums of the dq and dk tiles (``slices`` = NV programs of one sequence and value head, one
    cluster) as a TileLang macro, ``sum_out``, at each tile's exchange point. Step s (the loop's count) is owned by
    slice o = s mod NV, which adds the slices' tiles in the cyclic order from itself, ((p_o + p_{o+1}) + p_{o+2}) +
    ..., and stores the sum; the owners alternate, so the loads and adds fall on every slice alike. Flags hold the
    step + 1 that set them (zero every launch).

    Every other slice stores its tile in the ring's slot o at its place after the owner and publishes it; the owner
    awaits them there and adds them to its tile in registers. Slot o is written again NV steps later, after the owner
    read it: each other slice owns one of the NV − 1 steps between, where it awaited the owner's tile of that step,
    written after that read.

    No deadlock: an owner awaits only tiles that the others publish without waiting in between; the cluster launches
    the NV programs together (an owner spinning on a slice that no SM holds yet could otherwise keep every SM busy
    waiting). Only the consumer warps take part (each warp alone: the same fragment layout in every slice, so warp w
    reads only what warp w of the others wrote), never TileLang's producer warpgroup, which runs ahead on its own
    barriers. One slice: a plain store."""
    import tilelang.language as T

    @T.macro
    def sum_out(t, tile, out, which, c, step):
        """``tile`` (this slice's BT × K fp32 fragment) summed over the slices into ``out``'s chunk ``c``;
        ``which``: 0 for dq, 1 for dk (their own scratch and flags)."""
        if slices == 1:
            T.copy(tile, out[t.ib, c * BT:(c + 1) * BT, t.ihv, 0:K])
        else:
            owner = T.truncmod(step, slices)
            if t.iv == owner:
                for place in T.unroll(slices - 1):      # one tile at a time: all NV − 1 loaded at once spilled
                    T.call_extern("handle", "linattn_warp_await",
                                  T.address_of(t.flags[t.ib, t.ihv, which, owner, place, 0]), step + 1)
                    for i, j in T.Parallel(BT, K):
                        tile[i, j] = tile[i, j] + t.scratch[t.ib, t.ihv, which, owner, place, i, j]
                T.copy(tile, out[t.ib, c * BT:(c + 1) * BT, t.ihv, 0:K])
            else:
                place = T.truncmod(t.iv - owner + slices, slices) - 1
                T.copy(tile, t.scratch[t.ib, t.ihv, which, owner, place, 0:BT, 0:K])
                T.call_extern("handle", "linattn_warp_publish", T.address_of(t.flags[t.ib, t.ihv, which, owner, place, 0]),
                              step + 1)

    return types.SimpleNamespace(sum_out=sum_out)


def timeline_macros(warpgroups: int, points: int = len(POINTS), first_warpgroup: int = 1) -> types.SimpleNamespace:
    """The timeline build's ``stamp`` (:data:`TIMELINE_SOURCE`): point ``point`` (an index of ``timeline.POINTS``,
    or of the ``points`` a row holds) of step ``step`` stamped into the program's row of ``t.stamps`` while ``step``
    is below the steps it records (its shape's second size), by ``warpgroups`` warpgroups from ``first_warpgroup``
    on; TileLang awaits the loads of the shared buffers ``awaited`` before the stamp."""
    import tilelang.language as T

    @T.macro
    def stamp(t, step, point, awaited=()):
        if step < t.stamps.shape[1]:
            T.call_extern("handle", "linattn_stamp", T.address_of(t.stamps[0, 0, 0, 0]), step, t.stamps.shape[1],
                          point, points, warpgroups, first_warpgroup,
                          *[T.address_of(b[(0,) * len(b.shape)]) for b in awaited])

    return types.SimpleNamespace(stamp=stamp)


def hi_lo_split_macro(K: int, width: int):
    """A TileLang macro over a tile namespace ``t``: its fp32 ``dS`` fragment (K × ``width``) as the C1 operands bf16
    hi + lo in ``t.dSh`` and ``t.dSl``. The slice walk's and the role-split walk's (``chunk_bwd_roles``) one split."""
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"

    @T.macro
    def split(t):
        """dS as the C1 operands bf16 hi + lo."""
        for i, j in T.Parallel(K, width):
            t.dSh[i, j] = T.cast(t.dS[i, j], bf)
            t.dSl[i, j] = T.cast(t.dS[i, j] - T.cast(T.cast(t.dS[i, j], bf), acc), bf)

    return split


def _gradient_macros(K: int, BV: int, scale: float, column_sums_out=None, exchange=None,
                     stamp=None) -> types.SimpleNamespace:
    """The q side, the k side and the chunk's finish as TileLang macros; ``column_sums_out`` from
    :func:`_recompute_macros`; ``stamp`` the timeline build's (:func:`timeline_macros`; None: no stamps), stamping
    the X terms' end (after the q side's first dot) and before and after the slices' exchanges.

    A staged input's slot goes back to the producer right after its last use in program order, so the next chunk's
    loads stream in under the later steps; where that last use is an asynchronous dot's issue, the producer's load
    order keeps the slot from being refilled before the dot has read it (``build_kernel``)."""
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"
    sum_out = exchange.sum_out
    timed = stamp is not None
    X_TERMS, Q_SIDE, K_SIDE, DK_SUM = (POINTS.index(n) for n in ("x_terms", "q_side", "k_side", "dk_sum"))

    @T.macro
    def q_side(t, rows, c, step):
        """The q side: dP = scale (dO V_newᵀ) ⊙ D, dq = dP K + scale Γ ⊙ (dO h_bᵀ) (this slice's partial); dP K runs
        under dlogD of P."""
        T.gemm(t.dOs, t.Vns, t.dP, transpose_B=True, clear_accum=True)
        if timed:
            stamp(t, step, X_TERMS)     # after the q side's first dot: C3, under the X terms, is done there
        for i, j in T.Parallel(BT, BT):
            t.dP[i, j] = t.dP[i, j] * scale * T.exp(T.if_then_else((i >= j) & (i < rows), t.gcs[i] - t.gcs[j], NEG))
            t.dPs[i, j] = T.cast(t.dP[i, j], bf)
            t.dP[i, j] = T.if_then_else(i > j, t.dP[i, j] * t.QK[i, j], 0.0)   # dlogD of P, diagonal left out
        T.reduce_sum(t.dP, t.rowsB, dim=1)     # dP keeps dlogD of P: its column sums leave with A's (k_side)
        for i in T.Parallel(BT):
            t.dGs[i] = t.dGs[i] + t.rowsB[i]
        T.wgmma_gemm(t.dPs, t.Ks, t.dqf, clear_accum=True)
        T.gemm(t.dOs, t.Hs, t.dqS, transpose_B=True, clear_accum=True)     # dO's last use: waits for both
        for i, j in T.Parallel(BT, K):     # Q ⊙ (dO h_bᵀ) in place: no third BT × K fragment
            t.dqf[i, j] = t.dqf[i, j] + scale * T.exp(t.gcs[i]) * t.dqS[i, j]
            t.dqS[i, j] = T.cast(t.Qs[i, j], acc) * t.dqS[i, j]
        T.reduce_sum(t.dqS, t.rowsK, dim=1)
        for i in T.Parallel(BT):
            t.dGs[i] = t.dGs[i] + scale * T.exp(t.gcs[i]) * t.rowsK[i]
        if timed:
            stamp(t, step, Q_SIDE)
        sum_out(t, t.dqf, t.dq, 0, c, step)

    @T.macro
    def k_side(t, rows, g_last, c, step):
        """The k side: dA = −Y V_newᵀ (bf16 operands), dKD = β dA ⊙ D, dk (partial); dv written."""
        T.wgmma_gemm(t.Yb, t.Vns, t.dA, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(t.Ks, t.Ks, t.QK, transpose_B=True, clear_accum=True)            # K Kᵀ, in dA's layout
        T.wgmma_gemm(t.Vns, t.dSh, t.dkf, transpose_B=True, clear_accum=True)
        T.wait_wgmma(1)     # dA and K Kᵀ; V_new dS_hiᵀ runs under their element-wise work
        for i, j in T.Parallel(BT, BT):
            t.dA[i, j] = T.if_then_else((i > j) & (i < rows), -t.dA[i, j] * T.exp(t.gcs[i] - t.gcs[j]), 0.0)
            t.dKDs[i, j] = T.cast(t.bs[i] * t.dA[i, j], bf)
            t.dA[i, j] = t.dA[i, j] * t.QK[i, j]
        T.reduce_sum(t.dA, t.rowsA, dim=1)
        for i, j in T.Parallel(BT, BT):     # dlogD of P and A (the same accumulator layout), one store
            t.dLs[i, j] = t.dP[i, j] + t.dA[i, j] * t.bs[i]
        for i in T.Parallel(BT):
            t.dbs[i] = t.dbs[i] + t.rowsA[i]
            t.dGs[i] = t.dGs[i] + t.bs[i] * t.rowsA[i]
        column_sums_out(t.dLs, t.cols, t.cols_s, t.dGs)     # P's and A's column sums, one pass
        # the update's term ρ ⊙ (V_new dS_hiᵀ) first, its rows scaled in the accumulator, then the rest added to it
        # (one BT × K fragment) in one group of dots
        T.wait_wgmma(0)
        for i, j in T.Parallel(BT, K):
            t.dkf[i, j] = T.exp(g_last - t.gcs[i]) * t.dkf[i, j]
        T.wgmma_gemm(t.dKDs, t.Ks, t.dkf)
        T.wgmma_gemm(t.dKDs, t.Ks, t.dkf, transpose_A=True)
        T.wgmma_gemm(t.dPs, t.Qs, t.dkf, transpose_A=True)
        T.gemm(t.Ysn, t.Hs, t.dkf, transpose_B=True)       # h's last use: waits for the group
        if timed:
            stamp(t, step, K_SIDE)
        sum_out(t, t.dkf, t.dk, 1, c, step)
        if timed:
            stamp(t, step, DK_SUM)
        for i, j in T.Parallel(BT, BV):
            t.Y[i, j] = t.Y[i, j] * t.bs[i]
        T.copy(t.Y, t.dv[t.ib, c * BT:(c + 1) * BT, t.ihv, t.iv * BV:(t.iv + 1) * BV])

    split_state = hi_lo_split_macro(K, BV)

    @T.macro
    def finish(t, g_last, c):
        """dg and dβ (partials) written; the gradient entering the chunk as the next one's C1 operands."""
        # dg_i = Σ_{j ≥ i} dG_j + Σ_{j < i} t_j + γ Σ h⊙dS: one select per term in a fixed order (T.cumsum on shared
        # memory runs on threads 0–31 only, which here belong to the producer warpgroup)
        gam_sum = T.alloc_var(acc, init=0.0)
        for kk in T.serial(K):
            gam_sum = gam_sum + t.hrs[kk]
        for i in T.Parallel(BT):
            t.cols[i] = 0.0
            for j in T.unroll(BT):
                t.cols[i] = t.cols[i] + T.if_then_else(j >= i, t.dGs[j], t.ts[j])
        T.copy(t.cols, t.cols_s)
        for i in T.Parallel(BT):
            t.dGs[i] = t.cols_s[i] + T.exp(g_last) * gam_sum
        T.copy(t.dGs, t.dg[t.iv, t.ib, t.ihv, c * BT:(c + 1) * BT])
        T.copy(t.dbs, t.dbeta[t.iv, t.ib, t.ihv, c * BT:(c + 1) * BT])
        split_state(t)

    return types.SimpleNamespace(q_side=q_side, k_side=k_side, finish=finish, split_state=split_state)


def step_macros(K: int, BV: int, scale: float, slices: int = 1, timeline_warpgroups: int = 0) -> types.SimpleNamespace:
    """The reverse walk's chunk step as TileLang macros (recompute, the dS chain, the X terms, the q and k sides,
    finish), defined outside the prim_func (TileLang 0.1.15 takes no macro defined inside it). With
    ``timeline_warpgroups`` (the consumer warpgroups; 0: none) ``full_step`` stamps each of ``timeline.POINTS``
    (the timeline build)."""
    import tilelang.language as T

    timed = timeline_warpgroups > 0
    stamp = timeline_macros(timeline_warpgroups).stamp if timed else None
    first = _recompute_macros(K, BV, scale)
    exchange = _exchange_macros(K, slices)
    second = _gradient_macros(K, BV, scale, first.column_sums_out, exchange, stamp)
    START, LOADS, RECOMPUTE, CHAIN, DQ_SUM, DV, FINISH = (
        POINTS.index(n) for n in ("start", "loads", "recompute", "chain", "dq_sum", "dv", "finish"))

    @T.macro
    def full_step(t, rows, g_last, c, step):
        """One chunk's whole reverse step (the walk's ``step``-th)."""
        if timed:
            stamp(t, step, START)
            stamp(t, step, LOADS, (t.As, t.Vs, t.dOs, t.Qs, t.Hs, t.Ks, t.gcs, t.bs))
        first.recompute(t, rows, True)
        if timed:
            stamp(t, step, RECOMPUTE)
        first.chain(t, g_last, True)
        if timed:
            stamp(t, step, CHAIN)
        first.x_terms(t)
        second.q_side(t, rows, c, step)
        if timed:
            stamp(t, step, DQ_SUM)
        second.k_side(t, rows, g_last, c, step)
        if timed:
            stamp(t, step, DV)
        second.finish(t, g_last, c)
        if timed:
            stamp(t, step, FINISH)

    @T.macro
    def chain_step(t, rows, g_last):
        """A warm-up's chunk: the dS chain alone (P and C1, then Pᵀ dO, C2, C3), dS split for the next C1."""
        first.recompute(t, rows, False)
        first.chain(t, g_last, False)
        second.split_state(t)

    return types.SimpleNamespace(**vars(first), **vars(second), **vars(exchange), full_step=full_step,
                                 chain_step=chain_step)


def alloc_tiles(K: int, BV: int, **program) -> types.SimpleNamespace:
    """The program's shared tiles and register fragments (call inside the kernel), with ``program``'s indices and
    outputs beside them (a TileLang macro sees only its arguments). Shared memory at K = 128,
    BV = 64: the chunk's inputs 72.5 KB, the bf16 operands formed on chip 112 KB (dS hi + lo 32), dlogD 16 KB fp32."""
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"
    shared = dict(
        # inputs of one chunk (TMA; rows past T arrive as zeros)
        Qs=((BT, K), bf), Ks=((BT, K), bf), Vs=((BT, BV), bf), dOs=((BT, BV), bf), As=((BT, BT), bf),
        Hs=((K, BV), bf), gcs=((BT,), acc), bs=((BT,), acc),
        # operands formed on chip
        Xs=((BT, BV), bf), Vns=((BT, BV), bf), dVns=((BT, BV), bf), Ysn=((BT, BV), bf), Yb=((BT, BV), bf),
        Gh=((BT, BV), bf), Gl=((BT, BV), bf), dSh=((K, BV), bf), dSl=((K, BV), bf),
        Ps=((BT, BT), bf), dPs=((BT, BT), bf), dKDs=((BT, BT), bf),
        dLs=((BT, BT), acc),        # dlogD of P plus that of A: their column sums read from here
        dGs=((BT,), acc), ts=((BT,), acc), dbs=((BT,), acc), hrs=((K,), acc), cols_s=((BT,), acc))
    fragments = dict(
        dS=(K, BV), KS=(BT, BV), Vn=(BT, BV), KdS=(BT, BV), dVn=(BT, BV), Y=(BT, BV), tmpV=(BT, BV),
        QK=(BT, BT), dP=(BT, BT), dA=(BT, BT), dqS=(BT, K), dqf=(BT, K), dkf=(BT, K),
        rowsV=(BT,), rowsK=(BT,), rowsB=(BT,), rowsA=(BT,), cols=(BT,), hdS=(K, BV), hdS_rows=(K,))
    tiles = {n: T.alloc_shared(shape, dtype) for n, (shape, dtype) in shared.items()}
    tiles.update({n: T.alloc_fragment(shape, acc) for n, shape in fragments.items()})
    return types.SimpleNamespace(**tiles, **program)


def build_kernel(H: int, HV: int, K: int, V: int, scale: float, BV: int = BV_DEFAULT, threads: int = 256,
                 timeline: bool = False, state_grads: bool = True):
    """The TileLang prim_func of the reverse walk for these static sizes (B and T symbolic); ``BV`` divides V.
    ``timeline``: the benchmark's instrument (timeline.py), the same walk with one more parameter, ``stamps`` int64
    ``[B·HV·NV, steps, len(POINTS) + 1, threads / 128]`` (steps symbolic: the first ``steps`` steps of every program
    are stamped), and a stamp at each of ``timeline.POINTS``. ``state_grads`` False: the walk starts from a zero
    gradient of the final state and writes no dh0 (no initial state, no dht: the buffers of ``[B, HV, K, V]`` fp32
    they would take are not allocated); dht and dh0 are then one-element placeholders."""
    import tilelang.language as T

    if V % BV:
        raise ValueError(f"BV ({BV}) must divide V ({V})")
    acc, bf = "float32", "bfloat16"
    B, Tn, Lp, NT = T.symbolic("B"), T.symbolic("T"), T.symbolic("Lp"), T.symbolic("NT")
    G, NV = HV // H, V // BV
    warpgroups = threads // 128

    m = step_macros(K, BV, scale, NV, warpgroups if timeline else 0)
    dq_out, dk_out = map(tile_dtype, qk_heads_dtypes(G))
    scratch_shape, flags_shape = exchange_shapes(B, HV, K, NV)
    state_shape = (B, HV, K, V) if state_grads else (1,)

    @T.macro
    def walk(q, k, v, do, gc, beta, a_inv, h, dht, dq, dk, dv, dg, dbeta, dh0, scratch, flags, stamps):
        """The kernel (``stamps`` None: no timeline)."""
        with T.Kernel(NV, B * HV, threads=threads, cluster_dims=NV) as (iv, bh):
            T.import_source(EXCHANGE_SOURCE + TIMELINE_SOURCE if timeline else EXCHANGE_SOURCE)   # one per kernel
            ib, ihv = bh // HV, bh % HV
            ih = ihv // G
            v0 = iv * BV
            chunks = T.ceildiv(Tn, BT)
            timed = dict(stamps=stamps) if timeline else {}
            t = alloc_tiles(K, BV, iv=iv, ib=ib, ihv=ihv, dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta,
                            scratch=scratch, flags=flags, **timed)
            if state_grads:
                T.copy(dht[ib, ihv, 0:K, v0:v0 + BV], t.dS)
            else:
                T.clear(t.dS)
            m.split_state(t)
            for cr in T.Pipelined(chunks, num_stages=1):
                c = chunks - 1 - cr
                # single-buffered loads, issued by TileLang's producer in this order, each once its slot is released
                # (after its last use: every dot here waits for its result), so the next chunk's T and dO stream in
                # under the q and k sides. v comes after k, not in its place by last use (the X terms): the X terms
                # release v's slot right after issuing their shared loads of it, before those values are used, and a
                # producer parked on that slot refilled it under them (dβ not repeatable at K = 64: decisions.md)
                T.copy(a_inv[ib, c * BT:(c + 1) * BT, ihv, 0:BT], t.As)
                T.copy(do[ib, c * BT:(c + 1) * BT, ihv, v0:v0 + BV], t.dOs)
                T.copy(h[ib, c, ihv, 0:K, v0:v0 + BV], t.Hs)
                T.copy(q[ib, c * BT:(c + 1) * BT, ih, 0:K], t.Qs)
                T.copy(k[ib, c * BT:(c + 1) * BT, ih, 0:K], t.Ks)
                T.copy(v[ib, c * BT:(c + 1) * BT, ihv, v0:v0 + BV], t.Vs)
                T.copy(gc[ib, ihv, c * BT:(c + 1) * BT], t.gcs)
                T.copy(beta[ib, ihv, c * BT:(c + 1) * BT], t.bs)
                rows = T.min(BT, Tn - c * BT)
                g_last = t.gcs[rows - 1]
                m.full_step(t, rows, g_last, c, cr)
            if state_grads:
                T.copy(t.dS, dh0[ib, ihv, 0:K, v0:v0 + BV])

    if timeline:
        @T.prim_func
        def gdn_chunk_bwd_timeline(
                q: T.Tensor((B, Tn, H, K), bf), k: T.Tensor((B, Tn, H, K), bf),
                v: T.Tensor((B, Tn, HV, V), bf), do: T.Tensor((B, Tn, HV, V), bf),
                gc: T.Tensor((B, HV, Lp), acc), beta: T.Tensor((B, HV, Lp), acc),
                a_inv: T.Tensor((B, Tn, HV, BT), bf), h: T.Tensor((B, NT, HV, K, V), bf),
                dht: T.Tensor(state_shape, acc),
                dq: T.Tensor((B, Tn, HV, K), dq_out), dk: T.Tensor((B, Tn, HV, K), dk_out),
                dv: T.Tensor((B, Tn, HV, V), bf), dg: T.Tensor((NV, B, HV, Lp), acc),
                dbeta: T.Tensor((NV, B, HV, Lp), acc), dh0: T.Tensor(state_shape, acc),
                scratch: T.Tensor(scratch_shape, acc), flags: T.Tensor(flags_shape, "int32"),
                stamps: T.Tensor(stamps_shape(B * HV * NV, T.symbolic("steps"), warpgroups), "int64")):
            walk(q, k, v, do, gc, beta, a_inv, h, dht, dq, dk, dv, dg, dbeta, dh0, scratch, flags, stamps)

        return gdn_chunk_bwd_timeline

    @T.prim_func
    def gdn_chunk_bwd(q: T.Tensor((B, Tn, H, K), bf), k: T.Tensor((B, Tn, H, K), bf),
                      v: T.Tensor((B, Tn, HV, V), bf), do: T.Tensor((B, Tn, HV, V), bf),
                      gc: T.Tensor((B, HV, Lp), acc), beta: T.Tensor((B, HV, Lp), acc),
                      a_inv: T.Tensor((B, Tn, HV, BT), bf), h: T.Tensor((B, NT, HV, K, V), bf),
                      dht: T.Tensor(state_shape, acc),
                      dq: T.Tensor((B, Tn, HV, K), dq_out), dk: T.Tensor((B, Tn, HV, K), dk_out),
                      dv: T.Tensor((B, Tn, HV, V), bf), dg: T.Tensor((NV, B, HV, Lp), acc),
                      dbeta: T.Tensor((NV, B, HV, Lp), acc), dh0: T.Tensor(state_shape, acc),
                      scratch: T.Tensor(scratch_shape, acc), flags: T.Tensor(flags_shape, "int32")):
        walk(q, k, v, do, gc, beta, a_inv, h, dht, dq, dk, dv, dg, dbeta, dh0, scratch, flags, None)

    return gdn_chunk_bwd


def build_warm_kernel(H: int, HV: int, K: int, V: int, scale: float, BV: int = BV_DEFAULT, threads: int = 256,
                      threshold: float = NEGLIGIBLE_LOG2, capped: bool = False):
    """The TileLang prim_func of the reverse warm-ups (docs/backward.md §5; twin ``chunk_bwd_ref.reverse_warm_ref``
    with ``reverse_warm_ups_ref``'s w): dS_out ``[B·S, HV, K, V]`` fp32, the gradient of the state leaving every
    segment, for the walk in segments (``segments.py``). One program per
    (segment, value head, V slice); S = dS_out's rows / B, each segment NT/S chunks (NT = ⌈T/64⌉ a multiple of S).
    q, k, do, gc, β and T are the whole sequences' (a warm-up crosses segment boundaries); ``bound`` the pre-pass's
    chunk bounds ``[B, HV, NT]`` fp32 (log2 units). The program of segment s finds its warm-up w itself, as
    ``chunk_fwd``'s ``warm_planned`` does forwards: the fewest chunks after the segment whose bounds, added in fp32
    nearest first, sum below ``threshold`` (the map from there to the segment's end has norm < 2^threshold), else
    every chunk to the sequence's end. It starts at chunk end + w − 1, from dht where that is the sequence's last
    chunk (exact; w = 0 for the last segment), else from zero, and runs the dS chain alone (P, C1, Pᵀ dO, C2, C3:
    no state, no value, no gradient but dS) over the w chunks.

    ``capped`` (the reverse maps', ``reverse_maps.py``): a warm-up walks one segment at most, and one more output,
    ``map_flags [B·S, HV]`` int32, says for each segment whether the scan needs its map: the program of segment s
    writes the flag of segment s + 1, 3 (walk M alone: ``chunk_fwd.affine_walk_chunks``) where its warm-up stopped at
    the cap with the bounds' sum still above the threshold (dS_out is then D_{s+1}, the next segment's own term), else
    2 (no map); the last segment's program writes the first segment's, 2. Twin: ``reverse_warm_ups_hopper_ref(capped=
    True)``.

    A kernel of its own, not a branch of the walk: at K = V = 128 the walk's step uses the 168 registers a thread
    has at 384 threads, and a chain-only branch inside its chunk loop made ptxas spill (340 B) and serialise every
    wgmma; a second pipelined loop after the warm-up's is not warp-specialised by TileLang 0.1.15."""
    import tilelang.language as T

    if V % BV:
        raise ValueError(f"BV ({BV}) must divide V ({V})")
    acc, bf = "float32", "bfloat16"
    B, Tn, Lp, NT = T.symbolic("B"), T.symbolic("T"), T.symbolic("Lp"), T.symbolic("NT")
    BS = T.symbolic("BS")
    G, NV = HV // H, V // BV

    m = step_macros(K, BV, scale)
    # the most chunks a warm-up walks: one segment where capped, else (the sequence's chunks) to the sequence's end
    warm_cap = (lambda last, nseg: T.truncdiv(last, nseg)) if capped else (lambda last, nseg: last)

    @T.prim_func
    def gdn_chunk_bwd_warm(q: T.Tensor((B, Tn, H, K), bf), k: T.Tensor((B, Tn, H, K), bf),
                           do: T.Tensor((B, Tn, HV, V), bf), gc: T.Tensor((B, HV, Lp), acc),
                           beta: T.Tensor((B, HV, Lp), acc), a_inv: T.Tensor((B, Tn, HV, BT), bf),
                           dht: T.Tensor((B, HV, K, V), acc), bound: T.Tensor((B, HV, NT), acc),
                           ds_out: T.Tensor((BS, HV, K, V), acc), map_flags: T.Tensor((BS, HV), "int32")):
        with T.Kernel(NV, BS * HV, threads=threads) as (iv, bh):
            ibn, ihv = bh // HV, bh % HV              # the program's segment, value head
            ih = ihv // G
            v0 = iv * BV
            # truncating divisions: every index is ≥ 0 (floor divisions on symbolic sizes expand to sign tests)
            nseg = T.truncdiv(BS, B)
            ib = T.truncdiv(ibn, nseg)
            last = T.ceildiv(Tn, BT)
            end = (T.truncmod(ibn, nseg) + 1) * T.truncdiv(last, nseg)
            # w: the bounds of the chunks after the segment summed nearest first until the sum falls below the
            # threshold, else to the sequence's end. Every thread runs the same loads and adds: the same w
            wv = T.alloc_var("int32", init=0)
            run = T.alloc_var(acc, init=0.0)
            most = T.min(last - end, warm_cap(last, nseg))
            while (wv < most) and ((wv == 0) or (run >= threshold)):
                run = run + bound[ib, ihv, end + wv]
                wv = wv + 1
            if capped:
                if iv == 0:
                    # the map of the segment after this one (the first segment's, 2, from the last segment's program)
                    row = T.if_then_else(end == last, ibn + 1 - nseg, ibn + 1)
                    map_flags[row, ihv] = T.if_then_else((end + wv < last) & (run >= threshold), 3, 2)
            t = alloc_tiles(K, BV)
            if end + wv == last:                      # from the sequence's end: dht, exact
                T.copy(dht[ib, ihv, 0:K, v0:v0 + BV], t.dS)
            else:                                     # a warm-up that ends earlier: from zero
                T.clear(t.dS)
            m.split_state(t)
            for cr in T.Pipelined(wv, num_stages=1):
                c = end + wv - 1 - cr
                # the chain's loads, in the order it last reads each (T at C2, the rest at C3)
                T.copy(a_inv[ib, c * BT:(c + 1) * BT, ihv, 0:BT], t.As)
                T.copy(do[ib, c * BT:(c + 1) * BT, ihv, v0:v0 + BV], t.dOs)
                T.copy(q[ib, c * BT:(c + 1) * BT, ih, 0:K], t.Qs)
                T.copy(k[ib, c * BT:(c + 1) * BT, ih, 0:K], t.Ks)
                T.copy(gc[ib, ihv, c * BT:(c + 1) * BT], t.gcs)
                T.copy(beta[ib, ihv, c * BT:(c + 1) * BT], t.bs)
                rows = T.min(BT, Tn - c * BT)
                g_last = t.gcs[rows - 1]
                m.chain_step(t, rows, g_last)
            T.copy(t.dS, ds_out[ibn, ihv, 0:K, v0:v0 + BV])

    return gdn_chunk_bwd_warm


def _check_slices_and_gates(B: int, HV: int, V: int, NT: int, BV: int, gc: torch.Tensor, beta: torch.Tensor) -> None:
    """The launchers' common checks: BV divides V; gc and β head-major ``[B, HV, NT·64]``."""
    if V % BV:
        raise ValueError(f"BV ({BV}) must divide V ({V})")
    if gc.shape != (B, HV, NT * BT) or beta.shape != gc.shape:
        raise ValueError(f"gc and beta must be [B, HV, chunks·64] = {(B, HV, NT * BT)}, got {tuple(gc.shape)}, "
                         f"{tuple(beta.shape)}")


@functools.lru_cache(maxsize=32)
def compiled_kernel(H: int, HV: int, K: int, V: int, scale: float, BV: int = BV_DEFAULT,
                    target: Optional[str] = None, timeline: bool = False, state_grads: bool = True):
    """:func:`build_kernel` compiled by TileLang (``chunk_fwd.compile_prim_func``) for ``target`` (None: this GPU;
    "sm_90a" without one); ``timeline``: the benchmark's timeline build (:func:`walk_timeline`); ``state_grads``
    False: the build without dht and dh0."""
    return compile_prim_func(build_kernel(H, HV, K, V, scale, BV, timeline=timeline, state_grads=state_grads),
                             target)


def chunk_bwd_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, gc: torch.Tensor,
                     beta: torch.Tensor, a_inv: torch.Tensor, h: torch.Tensor, dht: Optional[torch.Tensor],
                     scale: float, BV: int = BV_DEFAULT, want_dh0: bool = True,
                     **out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Launch the reverse walk on an sm_90 GPU (layouts in the module docstring; h ``[B, NT, HV, K, V]`` bf16).
    Returns dq, dk ``[B, T, HV, K]`` (the slices added: per value head where G = HV / H > 1, in :func:`qk_heads_dtypes`,
    for the host to add over each group; the gradients themselves in bf16 where G = 1), dv ``[B, T, HV, V]`` bf16, the
    partials dg, dβ ``[NV, B, HV, Lp]`` fp32 head-major and dh0 ``[B, HV, K, V]`` fp32 (``backward.py`` adds the
    partials). ``out``: any of dq, dk, dv, dh0 given as contiguous tensors of those shapes and dtypes, written in place
    of new ones (the host's views of its gradients); dh0 may be dht itself (fp32, contiguous), overwritten: each program
    reads its block of dht before its walk and writes the same block of dh0 after it. ``want_dh0`` False with dht None:
    the walk's build without state gradients (``build_kernel(state_grads=False)``: from a zero dS, no dh0 buffer); dh0
    is then None."""
    state_grads = want_dh0 or dht is not None
    arguments, outputs = walk_arguments(q, k, v, do, gc, beta, a_inv, h, dht, BV, out, state_grads)
    B, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    launcher(compiled_kernel(H, HV, K, V, scale, BV, state_grads=state_grads))(
        *arguments, *exchange_buffers(B, HV, K, V // BV, q.device))
    return outputs


def walk_timeline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, gc: torch.Tensor,
                  beta: torch.Tensor, a_inv: torch.Tensor, h: torch.Tensor, dht: Optional[torch.Tensor],
                  scale: float, BV: int = BV_DEFAULT,
                  steps: Optional[int] = None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The reverse walk's timeline build (``build_kernel(timeline=True)``; a benchmark's instrument): launched as
    :func:`chunk_bwd_hopper` launches the walk, on the same inputs. Returns its outputs (:func:`chunk_bwd_hopper`'s,
    the same bits) and the stamps int64 ``[B·HV·NV, steps, len(POINTS) + 1, 2]`` of the first ``steps`` steps of
    every program (None: every step; layout in timeline.py, unwritten entries −1), which
    ``timeline.timeline_phases(stamps, NV)`` reduces to µs per phase."""
    arguments, outputs = walk_arguments(q, k, v, do, gc, beta, a_inv, h, dht, BV)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    recorded = recorded_steps(steps, -(-T // BT))
    stamps = torch.full(stamps_shape(B * HV * (V // BV), recorded), -1, dtype=torch.int64, device=q.device)
    launcher(compiled_kernel(H, HV, K, V, scale, BV, timeline=True))(
        *arguments, *exchange_buffers(B, HV, K, V // BV, q.device), stamps)
    return outputs, stamps


def qk_heads_dtypes(G: int) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes a walk stores dq and dk in, per value head: bf16 where G = HV / H = 1 (the gradients themselves);
    where G > 1 (the host adds each group) dq in bf16, which halves its buffer and bytes, and dk in fp32: a bf16 dk
    per value head moves dk's error at a repeated token from 1.57× to 1.82× the rounded baseline, a bf16 dq moves
    dq's worst case from 1.41× to 1.60× (the twin, decisions.md)."""
    return torch.bfloat16, (torch.bfloat16 if G == 1 else torch.float32)


def walk_arguments(q, k, v, do, gc, beta, a_inv, h, dht, BV: int, out: Optional[dict] = None,
                   state_grads: bool = True) -> tuple[list, tuple[torch.Tensor, ...]]:
    """A walk's launch arguments up to dh0 (inputs checked, outputs allocated, or taken from ``out``:
    :func:`chunk_bwd_hopper`; the slices' exchange buffers are the caller's) and its outputs; without
    ``state_grads`` one-element placeholders for dht and dh0, and dh0 None among the outputs. The role-split walk
    (``chunk_bwd_roles``) takes the same with BV = V."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = -(-T // BT)
    _check_slices_and_gates(B, HV, V, NT, BV, gc, beta)
    NV = V // BV
    if h.shape != (B, NT, HV, K, V) or h.dtype != torch.bfloat16:
        raise ValueError(f"h must be bf16 [B, chunks, HV, K, V] = {(B, NT, HV, K, V)}, got {h.dtype} "
                         f"{tuple(h.shape)}")
    out = out or {}
    if unknown := set(out) - {"dq", "dk", "dv", "dh0"}:
        raise TypeError(f"the walk writes only dq, dk, dv, dh0, got {sorted(unknown)}")
    if not state_grads and out.get("dh0") is not None:
        raise ValueError("dh0 given to a walk without state gradients (want_dh0=False)")
    state_shape = (B, HV, K, V) if state_grads else (1,)
    if dht is not None:
        dht = dht.float().contiguous()
    else:
        dht = q.new_zeros(state_shape, dtype=torch.float32)
    dq, dk = (output_tensor(out.get(n), n, (B, T, HV, K), dtype, q.device)
              for n, dtype in zip(("dq", "dk"), qk_heads_dtypes(HV // H)))
    dv = output_tensor(out.get("dv"), "dv", v.shape, v.dtype, q.device)
    dh0 = output_tensor(out.get("dh0"), "dh0", state_shape, torch.float32, q.device)
    dg, dbeta = (gc.new_empty(NV, B, HV, NT * BT) for _ in range(2))
    arguments = [q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(), gc.contiguous(),
                 beta.float().contiguous(), a_inv.contiguous(), h.contiguous(), dht, dq, dk, dv, dg, dbeta, dh0]
    return arguments, (dq, dk, dv, dg, dbeta, dh0 if state_grads else None)


def exchange_shapes(B, HV: int, K: int, NV: int) -> tuple[tuple, tuple]:
    """The shapes of the walk's exchange ring (fp32 tiles) and its flags (int32), per (sequence, value head): dq's and
    dk's tiles, a slot per owner, a place per other slice and one flag per warp; one element each where one slice
    needs no exchange. ``B`` an int or TileLang's symbolic size."""
    if NV == 1:
        return (1,), (1,)
    return (B, HV, 2, NV, NV - 1, BT, K), (B, HV, 2, NV, NV - 1, FLAG_WARPS)


def exchange_buffers(B: int, HV: int, K: int, NV: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk's exchange ring (uninitialised: every tile is written before it is read) and its flags, zero (the
    walk's steps count from 1): :func:`exchange_shapes`. At B = 8, HV = 16, K = 128, NV = 2: 16 MiB and 64 KiB."""
    ring, flags = exchange_shapes(B, HV, K, NV)
    return (torch.empty(ring, dtype=torch.float32, device=device),
            torch.zeros(flags, dtype=torch.int32, device=device))


@functools.lru_cache(maxsize=32)
def compiled_warm_kernel(H: int, HV: int, K: int, V: int, scale: float, BV: int = BV_DEFAULT,
                         target: Optional[str] = None, capped: bool = False):
    """:func:`build_warm_kernel` compiled by TileLang for ``target`` (None: this GPU; "sm_90a" without one)."""
    return compile_prim_func(build_warm_kernel(H, HV, K, V, scale, BV, capped=capped), target)


def reverse_warm_ups_hopper(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, gc: torch.Tensor,
                            beta: torch.Tensor, a_inv: torch.Tensor, bound: torch.Tensor, dht: Optional[torch.Tensor],
                            scale: float, segments: int, BV: int = BV_DEFAULT,
                            map_flags: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch the reverse warm-ups (:func:`build_warm_kernel`) on an sm_90 GPU: dS_out ``[B·S, HV, K, V]`` fp32, the
    gradient of the state leaving each of ``segments`` = S segments of every sequence (segment s of sequence b at
    b·S + s), from the whole sequences' q, k ``[B, T, H, K]``, do ``[B, T, HV, V]`` bf16, gc, β ``[B, HV, NT·64]``
    fp32 head-major, T ``[B, T, HV, 64]`` bf16 (without β), the pre-pass's chunk bounds ``bound [B, HV, NT]`` fp32
    and dht ``[B, HV, K, V]`` (None: zeros). S divides NT = ⌈T/64⌉. ``map_flags`` ``[B·S, HV]`` int32: the capped
    build (one segment at most per warm-up) writes there which segments' maps the reverse scan needs
    (``reverse_maps.py``); None: warm-ups to the sequence's end where the gates never forget."""
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    NT = -(-T // BT)
    _check_slices_and_gates(B, HV, V, NT, BV, gc, beta)
    if bound.shape != (B, HV, NT) or not isinstance(segments, int) or segments < 1 or NT % segments:
        raise ValueError(f"the warm-ups need bound [B, HV, chunks] = {(B, HV, NT)} and segments dividing {NT} "
                         f"chunks, got {tuple(bound.shape)} and {segments!r}")
    capped = map_flags is not None
    if capped and (map_flags.shape != (B * segments, HV) or map_flags.dtype != torch.int32):
        raise ValueError(f"map_flags must be int32 [B·S, HV] = {(B * segments, HV)}, got {map_flags.dtype} "
                         f"{tuple(map_flags.shape)}")
    dht = dht.float().contiguous() if dht is not None else q.new_zeros(B, HV, K, V, dtype=torch.float32)
    ds_out = torch.empty(B * segments, HV, K, V, dtype=torch.float32, device=q.device)
    if not capped:      # the uncapped build writes no flag (the launch checks every argument's shape and strides)
        map_flags = torch.empty(B * segments, HV, dtype=torch.int32, device=q.device)
    kernel = compiled_warm_kernel(H, HV, K, V, scale, BV, capped=capped)
    launcher(kernel)(q.contiguous(), k.contiguous(), do.contiguous(), gc.contiguous(), beta.float().contiguous(),
                     a_inv.contiguous(), dht, bound.float().contiguous(), ds_out, map_flags)
    return ds_out
