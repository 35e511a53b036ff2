"""Hopper backward (TileLang), first cut: the unsegmented fused reverse walk, one program per (sequence, value head)
with the whole V tile, every step of :func:`chunk_bwd_ref.reverse_chunk_ref` in the same order and precision (dS
and Γ⊙dO as bf16 hi + lo, dA's operands fp32 on tf32 dots). Written for the CPU compile check only: it has never run
on a GPU, so nothing about its results is known yet (its twin is ``chunk_bwd_ref.py``; the plan and the budgets are
docs/backward.md). Not warp-specialised by hand (TileLang adds its producer warpgroup: 384 threads) and no
shared buffer aliased. ptxas 13 for sm_90a: at K = V = 64, 168 registers, no spill, 208 KB of shared memory; at
K = V = 128, 393 KB of shared memory (no sm_90 CTA holds it), 852 bytes of spill stores and every wgmma serialised
for want of registers (C7512). So the compile test builds K = V = 64, and K = V = 128 waits for the design's §4
(BV = 64 in a 2-CTA cluster). dA's tf32 dots lower to mma.sync, the rest to wgmma.

Inputs, per program: q, k ``[B, T, H, K]`` bf16; v, do ``[B, T, HV, V]`` bf16; gc, β ``[B, HV, Lp]`` fp32
head-major (Lp = chunks · 64); T ``[B, T, HV, 64]`` bf16 (A_inv without β); h ``[B, HV, chunks · K, V]`` bf16 (the
recompute's states entering each chunk); dht ``[B, HV, K, V]`` fp32. Outputs: dq, dk ``[B, T, HV, K]`` bf16 per value
head (the GVA sum is a later step), dv ``[B, T, HV, V]`` bf16, dg, dβ ``[B, HV, Lp]`` fp32, dh0 ``[B, HV, K, V]`` fp32.
"""
import functools  # no "from __future__ import annotations": TileLang reads the kernel's annotations as objects
import types
from typing import Optional

import torch

from .chunk_fwd import BT, compile_prim_func, launcher

NEG = -1.0e30       # an exponent whose exp is 0 (masked decays: never e^{G_i − G_j} above the diagonal)


def _recompute_macros(K: int, V: int, scale: float) -> types.SimpleNamespace:
    """The chunk's recompute, the dS chain and the X terms as TileLang macros (and the column-sum helper)."""
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"

    @T.macro
    def column_sums_out(Ms, out):
        """out_j −= Σ_i M_ij, one thread per column from shared memory (a fragment's reduction over its rows does not
        lower in TileLang 0.1.15 for the dots' accumulator layouts)."""
        for j in T.Parallel(BT):
            for i in T.serial(BT):
                out[j] = out[j] - Ms[i, j]

    @T.macro
    def recompute(t, rows):
        """The chunk's forward recomputed (K S, X, V_new, P) and γ Σ h⊙dS with the dS leaving it."""
        Qs, Ks, Vs, As, Hs, gcs, bs, Xs, Vns, Vnf, Ps, dS, KS, Vn, QK, hdS, hdS_rows, hrs = (
            t.Qs, t.Ks, t.Vs, t.As, t.Hs, t.gcs, t.bs, t.Xs, t.Vns, t.Vnf, t.Ps, t.dS, t.KS, t.Vn, t.QK, t.hdS,
            t.hdS_rows, t.hrs)
        # recompute: KS, X = β(V − Γ KS), V_new = T bf16(X), P = Q Kᵀ ⊙ D
        T.gemm(Ks, Hs, KS, clear_accum=True)
        for i, j in T.Parallel(BT, V):
            Xs[i, j] = T.cast(bs[i] * (T.cast(Vs[i, j], acc) - T.exp(gcs[i]) * KS[i, j]), bf)
        T.gemm(As, Xs, Vn, clear_accum=True)
        for i, j in T.Parallel(BT, V):
            Vns[i, j] = T.cast(Vn[i, j], bf)
            Vnf[i, j] = Vn[i, j]
        T.gemm(Qs, Ks, QK, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(BT, BT):
            Ps[i, j] = T.cast(QK[i, j] * T.exp(T.if_then_else((i >= j) & (i < rows), gcs[i] - gcs[j], NEG)),
                              bf)
        # γ Σ h⊙dS with the dS leaving the chunk, before the chain replaces it
        for i, j in T.Parallel(K, V):
            hdS[i, j] = T.cast(Hs[i, j], acc) * dS[i, j]
        T.reduce_sum(hdS, hdS_rows, dim=1)
        T.copy(hdS_rows, hrs)

    @T.macro
    def chain(t, g_last):
        """The dS chain: C1 (dS hi + lo), C2, C3 into dS."""
        Qs, Ks, dOs, As, gcs, bs, dVns, Ysn, Gh, Gl, Yf, dSh, dSl, Ps, dS, KdS, dVn, Y = (
            t.Qs, t.Ks, t.dOs, t.As, t.gcs, t.bs, t.dVns, t.Ysn, t.Gh, t.Gl, t.Yf, t.dSh, t.dSl, t.Ps, t.dS, t.KdS,
            t.dVn, t.Y)
        # the chain: C1 (dS hi + lo), C2, C3 into dS
        T.gemm(Ks, dSh, KdS, clear_accum=True)
        T.gemm(Ks, dSl, KdS)
        T.gemm(Ps, dOs, dVn, transpose_A=True, clear_accum=True)
        for i, j in T.Parallel(BT, V):
            KdS[i, j] = KdS[i, j] * T.exp(g_last - gcs[i])
            dVn[i, j] = dVn[i, j] * scale + KdS[i, j]
            dVns[i, j] = T.cast(dVn[i, j], bf)
        T.gemm(As, dVns, Y, transpose_A=True, clear_accum=True)
        for i, j in T.Parallel(BT, V):
            Ysn[i, j] = T.cast(-bs[i] * T.exp(gcs[i]) * Y[i, j], bf)
            Yf[i, j] = Y[i, j]
            Gh[i, j] = T.cast(scale * T.exp(gcs[i]) * T.cast(dOs[i, j], acc), bf)
            Gl[i, j] = T.cast(scale * T.exp(gcs[i]) * T.cast(dOs[i, j], acc) - T.cast(Gh[i, j], acc), bf)
        for i, j in T.Parallel(K, V):
            dS[i, j] = dS[i, j] * T.exp(g_last)
        T.gemm(Qs, Gh, dS, transpose_A=True)
        T.gemm(Qs, Gl, dS, transpose_A=True)
        T.gemm(Ks, Ysn, dS, transpose_A=True)

    @T.macro
    def x_terms(t):
        """The update's ρ term t and the X terms of dG and dβ."""
        Vs, gcs, bs, dGs, ts, dbs, KS, Vn, KdS, Y, tmpV, rowsV = (
            t.Vs, t.gcs, t.bs, t.dGs, t.ts, t.dbs, t.KS, t.Vn, t.KdS, t.Y, t.tmpV, t.rowsV)
        # t_i = V_new_i · (ρ ⊙ K dS)_i; β's X term rowsum(Y ⊙ W) and Γ's X term rowsum(Y ⊙ KS)
        for i, j in T.Parallel(BT, V):
            tmpV[i, j] = Vn[i, j] * KdS[i, j]
        T.reduce_sum(tmpV, rowsV, dim=1)
        for i in T.Parallel(BT):
            ts[i] = rowsV[i]
        for i, j in T.Parallel(BT, V):
            tmpV[i, j] = Y[i, j] * KS[i, j]
        T.reduce_sum(tmpV, rowsV, dim=1)
        for i in T.Parallel(BT):
            dGs[i] = -bs[i] * T.exp(gcs[i]) * rowsV[i]
            dbs[i] = -T.exp(gcs[i]) * rowsV[i]
        for i, j in T.Parallel(BT, V):
            tmpV[i, j] = Y[i, j] * T.cast(Vs[i, j], acc)
        T.reduce_sum(tmpV, rowsV, dim=1)
        for i in T.Parallel(BT):
            dbs[i] = dbs[i] + rowsV[i]

    return types.SimpleNamespace(column_sums_out=column_sums_out, recompute=recompute, chain=chain, x_terms=x_terms)


def _gradient_macros(K: int, V: int, scale: float, column_sums_out=None) -> types.SimpleNamespace:
    """The q side, the k side and the chunk's finish as TileLang macros; ``column_sums_out`` from
    :func:`_recompute_macros`."""
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"

    @T.macro
    def q_side(t, rows, ib, ihv, c):
        """The q side, dq written."""
        Qs, Ks, dOs, Hs, gcs, Vns, dPs, dLs, dGs, QK, dP, dqS, dqf, tmpK, rowsK, rowsB = (
            t.Qs, t.Ks, t.dOs, t.Hs, t.gcs, t.Vns, t.dPs, t.dLs, t.dGs, t.QK, t.dP, t.dqS, t.dqf, t.tmpK, t.rowsK,
            t.rowsB)
        # the q side: dP = scale (dO V_newᵀ) ⊙ D, dq = dP K + scale Γ ⊙ (dO h_bᵀ)
        T.gemm(dOs, Vns, dP, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(BT, BT):
            dP[i, j] = dP[i, j] * scale * T.exp(T.if_then_else((i >= j) & (i < rows), gcs[i] - gcs[j], NEG))
            dPs[i, j] = T.cast(dP[i, j], bf)
            dP[i, j] = T.if_then_else(i > j, dP[i, j] * QK[i, j], 0.0)   # dlogD of P, diagonal left out
        T.reduce_sum(dP, rowsB, dim=1)
        T.copy(dP, dLs)
        for i in T.Parallel(BT):
            dGs[i] = dGs[i] + rowsB[i]
        column_sums_out(dLs, dGs)
        T.gemm(dOs, Hs, dqS, transpose_B=True, clear_accum=True)
        T.gemm(dPs, Ks, dqf, clear_accum=True)
        for i, j in T.Parallel(BT, K):
            tmpK[i, j] = T.cast(Qs[i, j], acc) * dqS[i, j]
            dqf[i, j] = dqf[i, j] + scale * T.exp(gcs[i]) * dqS[i, j]
        T.reduce_sum(tmpK, rowsK, dim=1)
        for i in T.Parallel(BT):
            dGs[i] = dGs[i] + scale * T.exp(gcs[i]) * rowsK[i]
        T.copy(dqf, t.dq[ib, c * BT:(c + 1) * BT, ihv, 0:K])

    @T.macro
    def k_side(t, rows, g_last, ib, ihv, c):
        """The k side, dk and dv written."""
        Qs, Ks, Hs, gcs, bs, Vns, Ysn, Vnf, Yf, dSh, dPs, dKDs, KKs, dLs, dGs, dbs, Y, QK, dA, dkf, tmpK, rowsA = (
            t.Qs, t.Ks, t.Hs, t.gcs, t.bs, t.Vns, t.Ysn, t.Vnf, t.Yf, t.dSh, t.dPs, t.dKDs, t.KKs, t.dLs, t.dGs,
            t.dbs, t.Y, t.QK, t.dA, t.dkf, t.tmpK, t.rowsA)
        # the k side: dA = −Y V_newᵀ (tf32), dKD = β dA ⊙ D, dk
        T.gemm(Yf, Vnf, dA, transpose_B=True, clear_accum=True)
        T.gemm(Ks, Ks, QK, transpose_B=True, clear_accum=True)            # K Kᵀ
        T.copy(QK, KKs)
        for i, j in T.Parallel(BT, BT):
            dA[i, j] = T.if_then_else((i > j) & (i < rows), -dA[i, j] * T.exp(gcs[i] - gcs[j]), 0.0)
            dKDs[i, j] = T.cast(bs[i] * dA[i, j], bf)
            dA[i, j] = dA[i, j] * KKs[i, j]
        T.reduce_sum(dA, rowsA, dim=1)
        for i, j in T.Parallel(BT, BT):
            dLs[i, j] = dA[i, j] * bs[i]
        for i in T.Parallel(BT):
            dbs[i] = dbs[i] + rowsA[i]
            dGs[i] = dGs[i] + bs[i] * rowsA[i]
        column_sums_out(dLs, dGs)
        T.gemm(Vns, dSh, tmpK, transpose_B=True, clear_accum=True)
        T.gemm(dPs, Qs, dkf, transpose_A=True, clear_accum=True)
        T.gemm(dKDs, Ks, dkf)
        T.gemm(dKDs, Ks, dkf, transpose_A=True)
        T.gemm(Ysn, Hs, dkf, transpose_B=True)
        for i, j in T.Parallel(BT, K):
            dkf[i, j] = dkf[i, j] + T.exp(g_last - gcs[i]) * tmpK[i, j]
        T.copy(dkf, t.dk[ib, c * BT:(c + 1) * BT, ihv, 0:K])
        for i, j in T.Parallel(BT, V):
            Y[i, j] = Y[i, j] * bs[i]
        T.copy(Y, t.dv[ib, c * BT:(c + 1) * BT, ihv, 0:V])

    @T.macro
    def finish(t, g_last, ib, ihv, c):
        """Dg and dβ written; the gradient entering the chunk as the next one's C1 operands."""
        dSh, dSl, dGs, ts, dbs, dS, hrs = (
            t.dSh, t.dSl, t.dGs, t.ts, t.dbs, t.dS, t.hrs)
        # dg: reverse cumsum of dG, then Σ_{j<i} t_j and γ Σ h⊙dS on every row
        T.cumsum(dGs, dim=0, reverse=True)
        T.cumsum(ts, dim=0)
        gam_sum = T.alloc_var(acc, init=0.0)
        for kk in T.serial(K):
            gam_sum = gam_sum + hrs[kk]
        for i in T.Parallel(BT):
            dGs[i] = dGs[i] + T.if_then_else(i > 0, ts[T.max(i, 1) - 1], 0.0) + T.exp(g_last) * gam_sum
        T.copy(dGs, t.dg[ib, ihv, c * BT:(c + 1) * BT])
        T.copy(dbs, t.dbeta[ib, ihv, c * BT:(c + 1) * BT])
        # the gradient entering this chunk, as the next chunk's C1 operands
        for i, j in T.Parallel(K, V):
            dSh[i, j] = T.cast(dS[i, j], bf)
            dSl[i, j] = T.cast(dS[i, j] - T.cast(T.cast(dS[i, j], bf), acc), bf)

    return types.SimpleNamespace(q_side=q_side, k_side=k_side, finish=finish)


def step_macros(K: int, V: int, scale: float) -> types.SimpleNamespace:
    """The reverse walk's chunk step as TileLang macros (recompute, the dS chain, the X terms, the q and k sides,
    finish), defined outside the prim_func (TileLang 0.1.15 takes no macro defined inside it)."""
    first = _recompute_macros(K, V, scale)
    return types.SimpleNamespace(**vars(first), **vars(_gradient_macros(K, V, scale, first.column_sums_out)))


def build_kernel(H: int, HV: int, K: int, V: int, scale: float, threads: int = 256):
    """The TileLang prim_func of the reverse walk for these static sizes (B and T symbolic)."""
    import tilelang.language as T

    acc, bf = "float32", "bfloat16"
    B, Tn, Lp, TK = T.symbolic("B"), T.symbolic("T"), T.symbolic("Lp"), T.symbolic("TK")
    G = HV // H

    m = step_macros(K, V, scale)

    @T.prim_func
    def gdn_chunk_bwd(q: T.Tensor((B, Tn, H, K), bf), k: T.Tensor((B, Tn, H, K), bf),
                      v: T.Tensor((B, Tn, HV, V), bf), do: T.Tensor((B, Tn, HV, V), bf),
                      gc: T.Tensor((B, HV, Lp), acc), beta: T.Tensor((B, HV, Lp), acc),
                      a_inv: T.Tensor((B, Tn, HV, BT), bf), h: T.Tensor((B, HV, TK, V), bf),
                      dht: T.Tensor((B, HV, K, V), acc),
                      dq: T.Tensor((B, Tn, HV, K), bf), dk: T.Tensor((B, Tn, HV, K), bf),
                      dv: T.Tensor((B, Tn, HV, V), bf), dg: T.Tensor((B, HV, Lp), acc),
                      dbeta: T.Tensor((B, HV, Lp), acc), dh0: T.Tensor((B, HV, K, V), acc)):
        with T.Kernel(B * HV, threads=threads) as bh:
            ib, ihv = bh // HV, bh % HV
            ih = ihv // G
            chunks = T.ceildiv(Tn, BT)
            # inputs of one chunk (TMA; rows past T arrive as zeros)
            Qs, Ks = T.alloc_shared((BT, K), bf), T.alloc_shared((BT, K), bf)
            Vs, dOs = T.alloc_shared((BT, V), bf), T.alloc_shared((BT, V), bf)
            As, Hs = T.alloc_shared((BT, BT), bf), T.alloc_shared((K, V), bf)
            gcs, bs = T.alloc_shared((BT,), acc), T.alloc_shared((BT,), acc)
            # operands formed on chip
            Xs, Vns, dVns = T.alloc_shared((BT, V), bf), T.alloc_shared((BT, V), bf), T.alloc_shared((BT, V), bf)
            Ysn, Gh, Gl = T.alloc_shared((BT, V), bf), T.alloc_shared((BT, V), bf), T.alloc_shared((BT, V), bf)
            Vnf, Yf = T.alloc_shared((BT, V), acc), T.alloc_shared((BT, V), acc)      # dA's tf32 operands
            dSh, dSl = T.alloc_shared((K, V), bf), T.alloc_shared((K, V), bf)
            Ps, dPs, dKDs = T.alloc_shared((BT, BT), bf), T.alloc_shared((BT, BT), bf), T.alloc_shared((BT, BT), bf)
            KKs = T.alloc_shared((BT, BT), acc)     # K Kᵀ for dA's loop (the tf32 dot's accumulator has its own layout)
            dLs = T.alloc_shared((BT, BT), acc)     # dlogD of P, then of A: their column sums read from here
            dGs, ts, dbs = T.alloc_shared((BT,), acc), T.alloc_shared((BT,), acc), T.alloc_shared((BT,), acc)
            # accumulators
            dS = T.alloc_fragment((K, V), acc)
            KS, Vn, KdS = T.alloc_fragment((BT, V), acc), T.alloc_fragment((BT, V), acc), T.alloc_fragment((BT, V), acc)
            dVn, Y, tmpV = T.alloc_fragment((BT, V), acc), T.alloc_fragment((BT, V), acc), T.alloc_fragment((BT, V), acc)
            QK, dP, dA = T.alloc_fragment((BT, BT), acc), T.alloc_fragment((BT, BT), acc), T.alloc_fragment((BT, BT), acc)
            dqS, dqf = T.alloc_fragment((BT, K), acc), T.alloc_fragment((BT, K), acc)
            dkf, tmpK = T.alloc_fragment((BT, K), acc), T.alloc_fragment((BT, K), acc)
            rowsV, rowsK, rowsB = T.alloc_fragment((BT,), acc), T.alloc_fragment((BT,), acc), T.alloc_fragment((BT,), acc)
            rowsA = T.alloc_fragment((BT,), acc)    # in dA's (tf32) layout
            hdS, hdS_rows = T.alloc_fragment((K, V), acc), T.alloc_fragment((K,), acc)
            hrs = T.alloc_shared((K,), acc)

            t = types.SimpleNamespace(Qs=Qs, Ks=Ks, Vs=Vs, dOs=dOs, As=As, Hs=Hs, gcs=gcs, bs=bs, Xs=Xs, Vns=Vns,
                                      dVns=dVns, Ysn=Ysn, Gh=Gh, Gl=Gl, Vnf=Vnf, Yf=Yf, dSh=dSh, dSl=dSl, Ps=Ps,
                                      dPs=dPs, dKDs=dKDs, KKs=KKs, dLs=dLs, dGs=dGs, ts=ts, dbs=dbs, dS=dS, KS=KS,
                                      Vn=Vn, KdS=KdS, dVn=dVn, Y=Y, tmpV=tmpV, QK=QK, dP=dP, dA=dA, dqS=dqS, dqf=dqf,
                                      dkf=dkf, tmpK=tmpK, rowsV=rowsV, rowsK=rowsK, rowsB=rowsB, rowsA=rowsA,
                                      hdS=hdS, hdS_rows=hdS_rows, hrs=hrs, dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta)
            T.copy(dht[ib, ihv, 0:K, 0:V], dS)
            for i, j in T.Parallel(K, V):
                dSh[i, j] = T.cast(dS[i, j], bf)
                dSl[i, j] = T.cast(dS[i, j] - T.cast(T.cast(dS[i, j], bf), acc), bf)
            for cr in T.Pipelined(chunks, num_stages=1):
                c = chunks - 1 - cr
                T.copy(k[ib, c * BT:(c + 1) * BT, ih, 0:K], Ks)
                T.copy(q[ib, c * BT:(c + 1) * BT, ih, 0:K], Qs)
                T.copy(v[ib, c * BT:(c + 1) * BT, ihv, 0:V], Vs)
                T.copy(do[ib, c * BT:(c + 1) * BT, ihv, 0:V], dOs)
                T.copy(a_inv[ib, c * BT:(c + 1) * BT, ihv, 0:BT], As)
                T.copy(h[ib, ihv, c * K:(c + 1) * K, 0:V], Hs)
                T.copy(gc[ib, ihv, c * BT:(c + 1) * BT], gcs)
                T.copy(beta[ib, ihv, c * BT:(c + 1) * BT], bs)
                rows = T.min(BT, Tn - c * BT)
                g_last = gcs[rows - 1]
                m.recompute(t, rows)
                m.chain(t, g_last)
                m.x_terms(t)
                m.q_side(t, rows, ib, ihv, c)
                m.k_side(t, rows, g_last, ib, ihv, c)
                m.finish(t, g_last, ib, ihv, c)
            T.copy(dS, dh0[ib, ihv, 0:K, 0:V])

    return gdn_chunk_bwd


@functools.lru_cache(maxsize=32)
def compiled_kernel(H: int, HV: int, K: int, V: int, scale: float, target: Optional[str] = None):
    """:func:`build_kernel` compiled by TileLang (``chunk_fwd.compile_prim_func``) for ``target`` (None: this GPU;
    "sm_90a" without one)."""
    return compile_prim_func(build_kernel(H, HV, K, V, scale), target)


def chunk_bwd_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, gc: torch.Tensor,
                     beta: torch.Tensor, a_inv: torch.Tensor, h: torch.Tensor, dht: Optional[torch.Tensor],
                     scale: float) -> tuple[torch.Tensor, ...]:
    """Launch the reverse walk on an sm_90 GPU (layouts in the module docstring; h ``[B, HV, NT, K, V]`` bf16 or its
    ``[B, HV, NT·K, V]`` view). Returns dq, dk ``[B, T, HV, K]`` bf16 per value head, dv ``[B, T, HV, V]`` bf16,
    dg, dβ ``[B, HV, Lp]`` fp32 head-major and dh0 ``[B, HV, K, V]`` fp32."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NT = -(-T // BT)
    if gc.shape != (B, HV, NT * BT) or beta.shape != gc.shape:
        raise ValueError(f"gc and beta must be [B, HV, chunks·64] = {(B, HV, NT * BT)}, got {tuple(gc.shape)}, "
                         f"{tuple(beta.shape)}")
    if h.numel() != B * HV * NT * K * V:
        raise ValueError(f"h must hold [B, HV, chunks, K, V] = {(B, HV, NT, K, V)} values, got {tuple(h.shape)}")
    dht = dht.float().contiguous() if dht is not None else q.new_zeros(B, HV, K, V, dtype=torch.float32)
    dq, dk = (q.new_empty(B, T, HV, K) for _ in range(2))
    dv = torch.empty_like(v)
    dg, dbeta = torch.empty_like(gc), torch.empty_like(gc)
    dh0 = torch.empty(B, HV, K, V, dtype=torch.float32, device=q.device)
    kernel = compiled_kernel(H, HV, K, V, scale)
    launcher(kernel)(q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous(), gc.contiguous(),
                     beta.float().contiguous(), a_inv.contiguous(), h.reshape(B, HV, NT * K, V).contiguous(), dht,
                     dq, dk, dv, dg, dbeta, dh0)
    return dq, dk, dv, dg, dbeta, dh0
