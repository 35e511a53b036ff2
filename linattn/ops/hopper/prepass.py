"""Experimental Hopper pre-pass (TileLang) for ``chunk_fwd.py``: gc and each chunk's inverse A_inv in one kernel.

Compiled for sm_90a on a CPU, not yet run on a GPU (benchmarks/hopper_fwd_check.py times it against the Triton
pre-pass, ``fused_prepass(write_wy=False)``, 0.277 ms at B=8 T=4096 H=16 in run 18).

One program per (chunk, sequence, value head), 128 threads:

    gc    = cumsum(g) over the chunk                          fp32, shared memory
    KKᵀ   = K Kᵀ                                              one bf16 wgmma, fp32 accumulators (exact products)
    A     = strictly_lower(β_i (K Kᵀ)_ij e^{gc_i − gc_j})     fp32, shared memory
    A_inv = (I + A)⁻¹                                         forward substitution in fp32 ("ieee" FMAs): thread
                                                              c solves column c, x_i = δ_ic − Σ_{j<i} A_ij x_j,
                                                              its x in a shared-memory column (banks by c)

Writes A_inv ``[B, T, HV, 64]`` fp32 (``kkt_solve``'s layout, what ``chunk_fwd`` reads) and gc and β head-major
``[B, HV, Tp]`` (``chunk_fwd.head_major``'s layout, so the fused kernel needs no transposes). The solve is 2016
dependent FMAs per column: ≈ 4 µs per program, hidden by the other programs of the SM (no sequential chain across
chunks here). Twin: ``torch_chunk.chunk_local_cumsum_ref`` → ``kkt_solve_ref``.
"""
import functools  # no "from __future__ import annotations": TileLang reads the kernel's annotations as objects
from typing import Optional

import torch

from .chunk_fwd import BT, padded_length


def build_kernel(H: int, HV: int, K: int, dtype: str = "bfloat16", beta_dtype: str = "bfloat16",
                 threads: int = 128):
    """The TileLang prim_func of the pre-pass for these static sizes (B, T and the padded Tp symbolic)."""
    import tilelang.language as T

    acc = "float32"
    B = T.symbolic("B")
    Tn = T.symbolic("T")
    Tp = T.symbolic("Tp")
    G = HV // H

    @T.prim_func
    def gdn_prepass(k: T.Tensor((B, Tn, H, K), dtype), g: T.Tensor((B, Tn, HV), acc),
                    beta: T.Tensor((B, Tn, HV), beta_dtype), a_inv: T.Tensor((B, Tn, HV, BT), acc),
                    gc_hm: T.Tensor((B, HV, Tp), acc), beta_hm: T.Tensor((B, HV, Tp), beta_dtype)):
        with T.Kernel(T.ceildiv(Tn, BT), B * HV, threads=threads) as (c, bh):
            ib = bh // HV
            ihv = bh % HV
            ih = ihv // G
            Ks = T.alloc_shared((BT, K), dtype)
            gs = T.alloc_shared((BT,), acc)
            gcs = T.alloc_shared((BT,), acc)
            bs = T.alloc_shared((BT,), beta_dtype)
            As = T.alloc_shared((BT, BT), acc)
            Xs = T.alloc_shared((BT, BT), acc)     # column c of A_inv, built by thread c
            KK = T.alloc_fragment((BT, BT), acc)

            T.copy(k[ib, c * BT:(c + 1) * BT, ih, 0:K], Ks)
            for i in T.Parallel(BT):                # past the sequence's end: g = 0, β = 0 (no decay, no update)
                gs[i] = T.if_then_else(c * BT + i < Tn, g[ib, c * BT + i, ihv], 0.0)
                bs[i] = T.if_then_else(c * BT + i < Tn, beta[ib, c * BT + i, ihv], T.cast(0.0, beta_dtype))
            T.cumsum(gs, gcs, dim=0)
            T.copy(gcs, gc_hm[ib, ihv, c * BT:(c + 1) * BT])
            T.copy(bs, beta_hm[ib, ihv, c * BT:(c + 1) * BT])
            T.gemm(Ks, Ks, KK, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(BT, BT):
                As[i, j] = T.if_then_else(i > j, T.cast(bs[i], acc) * KK[i, j] * T.exp(gcs[i] - gcs[j]), 0.0)
            # every thread's A before any column's solve (which only half the threads run, and whose shared memory
            # TileLang may place over gc's and β's): the compiler's own barriers here cover the solving threads only
            T.sync_threads()
            tx = T.get_thread_binding()
            if tx < BT:
                for i in T.serial(BT):
                    x = T.alloc_var(acc)
                    x = T.if_then_else(tx == i, 1.0, 0.0)
                    for j in T.serial(i):
                        x = x - As[i, j] * Xs[j, tx]
                    Xs[i, tx] = x
            T.copy(Xs, a_inv[ib, c * BT:(c + 1) * BT, ihv, 0:BT])

    return gdn_prepass


@functools.lru_cache(maxsize=64)
def compiled_kernel(H: int, HV: int, K: int, dtype: str = "bfloat16", beta_dtype: str = "bfloat16",
                    threads: int = 128, target: Optional[str] = None):
    """The compiled pre-pass (cached per static configuration); ``target`` as ``chunk_fwd.compiled_kernel``'s."""
    import tilelang
    func = build_kernel(H, HV, K, dtype, beta_dtype, threads)
    return tilelang.compile(func, target={"kind": "cuda", "arch": target} if target else "auto")


def prepass_hopper(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gc head-major ``[B, HV, Tp]``, β head-major ``[B, HV, Tp]``, A_inv ``[B, T, HV, 64]`` fp32) for
    :func:`chunk_fwd.chunk_fwd_hopper_hm` from bf16 keys ``[B, T, H, K]``, log decays and β ``[B, T, HV]``."""
    B, T, H, K = k.shape
    HV = g.shape[2]
    if k.dtype != torch.bfloat16 or beta.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"the Hopper pre-pass takes bf16 keys and bf16/fp32 β, got {k.dtype}, {beta.dtype}")
    g = g.float()   # the gates' arithmetic is fp32 (a no-op for the fp32 gates the op passes)
    kernel = compiled_kernel(H, HV, K, "bfloat16", str(beta.dtype).removeprefix("torch."))
    Tp = padded_length(T)
    # every row below Tp is written (the chunks cover T rounded up to 64): no memsets
    a_inv = torch.empty(B, T, HV, BT, dtype=torch.float32, device=k.device)
    gc_hm = torch.empty(B, HV, Tp, dtype=torch.float32, device=k.device)
    beta_hm = torch.empty(B, HV, Tp, dtype=beta.dtype, device=k.device)
    kernel(k.contiguous(), g.contiguous(), beta.contiguous(), a_inv, gc_hm, beta_hm)
    return gc_hm, beta_hm, a_inv
