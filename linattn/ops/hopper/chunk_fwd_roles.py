"""Hopper forward, role-split (experimental): ``chunk_fwd.py``'s fused chunk walk with its steps given to three
consumer warpgroups that run at the same time, handing tiles to each other through shared memory behind explicit
mbarriers, and one producer warp that loads every chunk by TMA two chunks ahead.

Compiled for sm_90a on a CPU; not yet run on a GPU. ``chunk_fwd_hopper_hm(roles=True)`` selects it (bf16 A_inv;
the affine walk of the segmented forward's phase A too, on the state and delta roles alone);
benchmarks/hopper_fwd_check.py --roles checks it against the kernel and its twin and times both. Run it under
``timeout``: a wrong barrier hangs the GPU call.

Why: ``chunk_fwd.py``'s two consumer warpgroups split every tile between them and run every step in turn, so the
output's work (Q Kᵀ, its masked decays, Q S, P V_new, the store of o) sits on the state's chain: ≈ 6 µs per chunk
at BV = 128, where the chain's own dots take ≈ 1 µs of tensor-core time. FlashQLA's Hopper kernel (read, not
copied) takes ≈ 3.7 µs with its warpgroups in roles. Here, per chunk c (S: the fp32 state entering it, K × BV):

    state   (warpgroup 0, S in registers)     S_b = bf16(S) → shared                     ─┐ sb_ready
            after delta's V_d:                S = γ S + Kᵀ V_d                          ◀─┘ (its only dot)
    delta   (warpgroup 1)                     K S_b; X = β ⊙ (V − Γ ⊙ K S_b);
                                              V_new = A_inv X → V_new, V_d = ρ ⊙ V_new    ─▶ vn_ready
    output  (warpgroup 2)                     Q Kᵀ and P = its masked decays (before S_b is ready);
                                              Γ ⊙ Q S_b; + P V_new; o = scale · that      (off the chain)
    producer (one warp of warpgroup 3)        Q, K, V, A_inv, gc, β of chunk c + 2 by TMA  ─▶ full[c % 2]

The chain per chunk is S_b → K S_b → X → A_inv X → V_d → the update → S_b: three dots and three hand-offs; the
output's three dots and the next chunk's Q Kᵀ run beside it. The arithmetic and every bf16 rounding point are
``chunk_fwd.py``'s (its twin, ``chunk_fwd_ref.chunk_fwd_hopper_hm_ref``, holds for both).

Hand-offs (single-buffered; an mbarrier per direction, parity = the chunk's, waits for the previous phase pass at
once on a fresh barrier):

    sb_ready   state → delta, output     S_b(c) written           sb_free   delta, output → state   S_b(c) read
    vn_ready   delta → state, output     V_new(c), V_d(c) written  vn_free   state, output → delta   both read
    full[s]    producer → all            stage s loaded           empty[s]  all three roles → producer

tests/ops/test_hopper_roles_protocol.py model-checks this protocol on the CPU (the roles' waits, arrivals and tile
uses in this file's order, random interleavings, TMA landing late): no tile is read stale or overwritten before its
last read, and no schedule hangs; four broken variants are caught. A change to the waits or arrivals below must be
made there too.
"""
import functools  # no "from __future__ import annotations": TileLang reads the kernel's annotations as objects
from typing import Optional

from .chunk_fwd import BT, affine_walk_chunks, compile_prim_func

STAGES = 2
# registers per thread of each role (setmaxnreg; the launch gives 128 to each of the 512 threads): the state's
# K × BV fp32 tile alone is 128 at K = BV = 128
STATE_REGS, DELTA_REGS, OUTPUT_REGS, PRODUCER_REGS = 168, 136, 136, 40


def build_kernel_roles(H: int, HV: int, K: int, V: int, BV: int, scale: float, use_initial_state: bool = True,
                       beta_dtype: str = "float32", affine: bool = False):
    """The TileLang prim_func of the role-split walk for these static sizes (B and T symbolic), bf16 q/k/v and
    A_inv, gc and β head-major (``chunk_fwd.head_major``). Without ``use_initial_state`` the state starts at zero
    and h0 is not read. ``affine``: phase A of the segmented forward as in ``chunk_fwd.build_kernel`` (the walk of
    [I | 0] with values [0 | V] over K + V columns into ht ``[B, HV, K, K + V]``; BV divides K): the state and
    delta roles only — no queries loaded, no output, the output warpgroup idle and out of every hand-off. There
    ``skip_m [B, HV]`` (int32, read in the affine walk only) skips tiles as ``chunk_fwd.affine_walk_chunks`` says
    (1: the M tiles of a negligible map, 2: the whole map)."""
    import tilelang.language as T

    acc, dtype = "float32", "bfloat16"
    B = T.symbolic("B")
    Tn = T.symbolic("T")
    Tp = T.symbolic("Tp")
    G = HV // H
    assert (STATE_REGS + DELTA_REGS + OUTPUT_REGS + PRODUCER_REGS) * 128 <= 65536
    W = K + V if affine else V                       # the state's columns: [M | N] in phase A
    if affine and K % BV:
        raise ValueError(f"the affine walk needs BV ({BV}) to divide K ({K})")
    readers = 1 if affine else 2                     # the roles that read S_b and V_new: delta and output, or one

    @T.prim_func
    def gdn_chunk_fwd_roles(q: T.Tensor((B, Tn, H, K), dtype), k: T.Tensor((B, Tn, H, K), dtype),
                            v: T.Tensor((B, Tn, HV, V), dtype), gc: T.Tensor((B, HV, Tp), acc),
                            beta: T.Tensor((B, HV, Tp), beta_dtype), a_inv: T.Tensor((B, Tn, HV, BT), dtype),
                            h0: T.Tensor((B, HV, K, V), acc), skip_m: T.Tensor((B, HV), "int32"),
                            o: T.Tensor((B, Tn, HV, V), dtype), ht: T.Tensor((B, HV, K, W), acc)):
        with T.Kernel(T.ceildiv(W, BV), B * HV, threads=512) as (iv, bh):
            ib = bh // HV
            ihv = bh % HV
            ih = ihv // G
            chunks = T.ceildiv(Tn, BT)
            if affine:
                # the maps' skip flags (every role reads the same flag: one loop count)
                chunks = affine_walk_chunks(iv * BV < K, skip_m[ib, ihv], T.ceildiv(Tn, BT))
            # the stages: chunk c's inputs in stage c % STAGES
            Qs = T.alloc_shared((STAGES, BT, K), dtype)
            Ks = T.alloc_shared((STAGES, BT, K), dtype)
            Vs = T.alloc_shared((STAGES, BT, BV), dtype)
            As = T.alloc_shared((STAGES, BT, BT), dtype)
            gcs = T.alloc_shared((STAGES, BT), acc)
            bs = T.alloc_shared((STAGES, BT), beta_dtype)
            # the hand-offs, and each role's own tiles
            Sb = T.alloc_shared((K, BV), dtype)          # state → delta, output
            Vns = T.alloc_shared((BT, BV), dtype)        # delta → output
            Vds = T.alloc_shared((BT, BV), dtype)        # delta → state
            Xt = T.alloc_shared((BV, BT), dtype)         # delta: Xᵀ, the K-major B operand of A_inv X
            Gd = T.alloc_shared((BT,), acc)              # delta: Γ_i = e^{gc_i}
            Rd = T.alloc_shared((BT,), acc)              # delta: ρ_i = e^{gc_last − gc_i}
            Ps = T.alloc_shared((BT, BT), dtype)         # output: P = Q Kᵀ ⊙ D ⊙ causal
            Go = T.alloc_shared((BT,), acc)              # output: Γ_i
            S = T.alloc_fragment((K, BV), acc)           # state
            KS = T.alloc_fragment((BT, BV), acc)         # delta
            Vn = T.alloc_fragment((BT, BV), acc)         # delta
            QK = T.alloc_fragment((BT, BT), acc)         # output
            Of = T.alloc_fragment((BT, BV), acc)         # output
            full = T.alloc_barrier([32] * STAGES)        # the producer warp's 32 threads
            empty = T.alloc_barrier([128 * (1 + readers)] * STAGES)   # the consumer warpgroups at work
            sb_ready = T.alloc_barrier(128)
            sb_free = T.alloc_barrier(128 * readers)
            vn_ready = T.alloc_barrier(128)
            vn_free = T.alloc_barrier(128 * readers)
            tx = T.get_thread_binding()
            v0 = iv * BV                                 # V's first column for this tile
            if affine:
                # N's tiles read V shifted by K; M's read V's first tile and zero it (v_on)
                v0 = T.max(iv * BV - K, 0)
                v_on = T.if_then_else(iv * BV >= K, 1.0, 0.0)

            if tx < 128:
                # state: S in registers; per chunk, publish S_b, then take delta's V_d into the update
                T.set_max_nreg(STATE_REGS, 1)
                if affine:
                    for i, j in T.Parallel(K, BV):       # [I | 0]: this tile's columns of the identity, or zeros
                        S[i, j] = T.if_then_else((iv * BV + j == i) & (chunks > 0), 1.0, 0.0)
                elif use_initial_state:
                    T.copy(h0[ib, ihv, 0:K, iv * BV:(iv + 1) * BV], S)
                else:
                    T.clear(S)
                for c in T.serial(chunks):
                    s = c % STAGES
                    T.barrier_wait(sb_free, (c + 1) % 2)            # delta and output have read S_b(c − 1)
                    T.copy(S, Sb)
                    T.fence_proxy_async()                            # generic-proxy writes → wgmma reads
                    T.barrier_arrive(sb_ready)
                    T.barrier_wait(full[s], (c // STAGES) % 2)
                    g_last = gcs[s, T.min(BT, Tn - c * BT) - 1]
                    for i, j in T.Parallel(K, BV):
                        S[i, j] = S[i, j] * T.exp(g_last)
                    T.barrier_wait(vn_ready, c % 2)
                    T.gemm(Ks[s, :, :], Vds, S, transpose_A=True)
                    T.barrier_arrive(vn_free)
                    T.barrier_arrive(empty[s])
                T.copy(S, ht[ib, ihv, 0:K, iv * BV:(iv + 1) * BV])

            elif tx < 256:
                # delta: V_new and V_d from S_b, the chunk's inputs and A_inv
                T.set_max_nreg(DELTA_REGS, 1)
                for c in T.serial(chunks):
                    s = c % STAGES
                    T.barrier_wait(full[s], (c // STAGES) % 2)
                    g_last = gcs[s, T.min(BT, Tn - c * BT) - 1]
                    for i in T.Parallel(BT):
                        Gd[i] = T.exp(gcs[s, i])
                        Rd[i] = T.exp(g_last - gcs[s, i])
                    T.barrier_wait(sb_ready, c % 2)
                    T.gemm(Ks[s, :, :], Sb, KS, clear_accum=True)
                    T.barrier_arrive(sb_free)
                    for i, j in T.Parallel(BT, BV):
                        vij = Vs[s, i, j] * v_on if affine else Vs[s, i, j]
                        Xt[j, i] = T.cast(bs[s, i], acc) * (vij - Gd[i] * KS[i, j])
                    T.gemm(As[s, :, :], Xt, Vn, transpose_B=True, clear_accum=True)
                    T.barrier_wait(vn_free, (c + 1) % 2)            # state and output have read chunk c − 1's
                    T.copy(Vn, Vns)
                    for i, j in T.Parallel(BT, BV):     # ρ in registers, then one copy (a loop writing both
                        Vn[i, j] = Vn[i, j] * Rd[i]     # tiles got a named barrier per unrolled step)
                    T.copy(Vn, Vds)
                    T.fence_proxy_async()
                    T.barrier_arrive(vn_ready)
                    T.barrier_arrive(empty[s])

            elif tx < 384:
                # output: P and Q S_b beside the chain, then P V_new once delta has it (idle in phase A)
                T.set_max_nreg(OUTPUT_REGS, 1)
                for c in T.serial(0 if affine else chunks):
                    s = c % STAGES
                    T.barrier_wait(full[s], (c // STAGES) % 2)
                    T.gemm(Qs[s, :, :], Ks[s, :, :], QK, transpose_B=True, clear_accum=True)
                    for i in T.Parallel(BT):
                        Go[i] = T.exp(gcs[s, i])
                    for i, j in T.Parallel(BT, BT):
                        Ps[i, j] = T.if_then_else(i >= j, QK[i, j] * T.exp(gcs[s, i] - gcs[s, j]), 0.0)
                    T.barrier_wait(sb_ready, c % 2)
                    T.gemm(Qs[s, :, :], Sb, Of, clear_accum=True)
                    T.barrier_arrive(sb_free)
                    for i, j in T.Parallel(BT, BV):
                        Of[i, j] = Of[i, j] * Go[i]
                    T.barrier_wait(vn_ready, c % 2)
                    T.gemm(Ps, Vns, Of)
                    T.barrier_arrive(vn_free)
                    T.barrier_arrive(empty[s])
                    for i, j in T.Parallel(BT, BV):
                        Of[i, j] = Of[i, j] * scale
                    T.copy(Of, o[ib, c * BT:(c + 1) * BT, ihv, iv * BV:(iv + 1) * BV])

            else:
                # producer: one warp issues chunk c's loads into stage c % STAGES once the roles freed it (rows
                # past T arrive as zeros: TMA fills what lies outside the tensor)
                T.set_max_nreg(PRODUCER_REGS, 0)
                if tx < 384 + 32:
                    for c in T.serial(chunks):
                        s = c % STAGES
                        T.barrier_wait(empty[s], (c // STAGES + 1) % 2)
                        T.tma_copy(k[ib, c * BT:(c + 1) * BT, ih, 0:K], Ks[s, :, :], barrier=full[s])
                        if not affine:
                            T.tma_copy(q[ib, c * BT:(c + 1) * BT, ih, 0:K], Qs[s, :, :], barrier=full[s])
                        T.tma_copy(v[ib, c * BT:(c + 1) * BT, ihv, v0:v0 + BV], Vs[s, :, :], barrier=full[s])
                        T.tma_copy(a_inv[ib, c * BT:(c + 1) * BT, ihv, 0:BT], As[s, :, :], barrier=full[s])
                        T.tma_copy(gc[ib, ihv, c * BT:(c + 1) * BT], gcs[s, :], barrier=full[s])
                        T.tma_copy(beta[ib, ihv, c * BT:(c + 1) * BT], bs[s, :], barrier=full[s])
                        T.barrier_arrive(full[s])

    return gdn_chunk_fwd_roles


@functools.lru_cache(maxsize=64)
def compiled_kernel_roles(H: int, HV: int, K: int, V: int, BV: int, scale: float, use_initial_state: bool = True,
                          beta_dtype: str = "float32", affine: bool = False, target: Optional[str] = None):
    """The compiled role-split kernel (cached per static configuration); ``target`` as
    ``chunk_fwd.compile_prim_func``'s."""
    return compile_prim_func(build_kernel_roles(H, HV, K, V, BV, scale, use_initial_state, beta_dtype, affine),
                             target)
