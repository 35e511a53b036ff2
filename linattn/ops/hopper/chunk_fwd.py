"""Experimental Hopper forward (TileLang): the state walk and the output fused in one kernel, on wgmma and TMA.

Not the default: ``chunk_gated_delta_rule`` runs it only when ``triton_chunk.FORWARD_PATH = "hopper"`` (opt-in) and
the inputs suit it (:func:`unsupported_reason`). Compiled for sm_90a on a CPU (TileLang + nvcc); not yet run on a
GPU (benchmarks/hopper_fwd_check.py does that: errors against float64 and times beside the Triton forward).

Why (issue 4, docs/architecture.md): the Triton split forward writes every chunk's state h (32 KB per chunk and
head in bf16, twice the size of the chunk's queries) and V_new to HBM and reads them back in a second kernel, and
Triton 3.6 cannot warp-specialise the sequential walk that would keep them on chip. This kernel walks the chunks of
one (sequence, value head, V tile) with the state in registers and writes only o and the final state; TileLang
pipelines the next chunk's loads (TMA) under this chunk's dots.

Inputs as the split forward's after its pre-pass (``fused_prepass(write_wy=False)``, or the TileLang one in
``prepass.py``; ``forward.py`` chains them): gc (chunk-local cumulative log decays, fp32) and A_inv (each chunk's
(I + strictly-lower(β K Kᵀ ⊙ D))⁻¹, fp32). Per chunk c, with S the state entering it (K × BV slice, fp32
registers), Γ = e^{gc} per row and γ = e^{gc of the chunk's last token}:

    S_b   = bf16(S)                                     the state as a dot operand (fla's precision for h)
    X     = β ⊙ V − (β Γ) ⊙ (K S_b)                     [BT, BV]
    V_new = A_inv X                                     tf32 (A_inv stays fp32)
    O     = scale · [Γ ⊙ (Q S_b) + (Q Kᵀ ⊙ D ⊙ causal) bf16(V_new)]
    S     = γ S + Kᵀ bf16((γ / Γ) ⊙ V_new)

Reads per chunk and program, every one by TMA from the producer warpgroup: Q, K (BT × K), V (BT × BV), A_inv
(BT × BT fp32), gc and β (passed head-major, :func:`head_major`, so that a chunk's 64 values are one contiguous
copy); writes O (BT × BV). Shapes are compiled per (H, HV, K, V, BV, scale); B and T are symbolic (a new T costs no
compile).
"""
import functools  # no "from __future__ import annotations": TileLang reads the kernel's annotations as objects
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
                 threads: int = 128, num_stages: int = 2, split_state: bool = False, use_initial_state: bool = True,
                 beta_dtype: str = "float32"):
    """The TileLang prim_func of the fused forward for these static sizes (B and T symbolic). ``split_state``: the
    state and the decayed V_new of the state update enter their dots as bf16 hi + lo pairs (two MMAs each, ≈ 2^-16
    relative instead of 2^-9: the Triton state pass's accuracy) instead of one bf16 rounding. Without
    ``use_initial_state`` the state starts at zero and h0 is not read. β is read in ``beta_dtype`` (the inputs' own,
    widened on load)."""
    import tilelang.language as T

    acc = "float32"
    B = T.symbolic("B")
    Tn = T.symbolic("T")
    Tp = T.symbolic("Tp")   # gc and β are passed head-major, [B, HV, Tp], T padded for TMA (see head_major)
    G = HV // H

    @T.prim_func
    def gdn_chunk_fwd(q: T.Tensor((B, Tn, H, K), dtype), k: T.Tensor((B, Tn, H, K), dtype),
                      v: T.Tensor((B, Tn, HV, V), dtype), gc: T.Tensor((B, HV, Tp), acc),
                      beta: T.Tensor((B, HV, Tp), beta_dtype), a_inv: T.Tensor((B, Tn, HV, BT), acc),
                      h0: T.Tensor((B, HV, K, V), acc), o: T.Tensor((B, Tn, HV, V), dtype),
                      ht: T.Tensor((B, HV, K, V), acc)):
        with T.Kernel(T.ceildiv(V, BV), B * HV, threads=threads) as (iv, bh):
            ib = bh // HV
            ihv = bh % HV
            ih = ihv // G
            Qs = T.alloc_shared((BT, K), dtype)
            Ks = T.alloc_shared((BT, K), dtype)
            Vs = T.alloc_shared((BT, BV), dtype)
            As = T.alloc_shared((BT, BT), acc)
            gcs = T.alloc_shared((BT,), acc)
            bs = T.alloc_shared((BT,), beta_dtype)     # β as given: a TMA copy, widened where it is read
            Ss = T.alloc_shared((K, BV), dtype)        # bf16 state, the B operand of K S and Q S
            Sl = T.alloc_shared((K, BV), dtype)        # split_state: its low half, S − bf16(S)
            Vdl = T.alloc_shared((BT, BV), dtype)      # split_state: the low half of the decayed V_new
            Xt = T.alloc_shared((BV, BT), acc)         # Xᵀ: a K-major B operand for the tf32 A_inv X
            Ps = T.alloc_shared((BT, BT), dtype)
            Vns = T.alloc_shared((BT, BV), dtype)
            Vds = T.alloc_shared((BT, BV), dtype)
            S = T.alloc_fragment((K, BV), acc)
            KS = T.alloc_fragment((BT, BV), acc)
            QK = T.alloc_fragment((BT, BT), acc)
            Vn = T.alloc_fragment((BT, BV), acc)
            Of = T.alloc_fragment((BT, BV), acc)

            if use_initial_state:
                T.copy(h0[ib, ihv, 0:K, iv * BV:(iv + 1) * BV], S)
            else:
                T.clear(S)
            for c in T.Pipelined(T.ceildiv(Tn, BT), num_stages=num_stages):
                T.copy(k[ib, c * BT:(c + 1) * BT, ih, 0:K], Ks)
                T.copy(q[ib, c * BT:(c + 1) * BT, ih, 0:K], Qs)
                T.copy(v[ib, c * BT:(c + 1) * BT, ihv, iv * BV:(iv + 1) * BV], Vs)
                T.copy(a_inv[ib, c * BT:(c + 1) * BT, ihv, 0:BT], As)
                T.copy(gc[ib, ihv, c * BT:(c + 1) * BT], gcs)
                T.copy(beta[ib, ihv, c * BT:(c + 1) * BT], bs)
                if split_state:
                    for i, j in T.Parallel(K, BV):
                        Ss[i, j] = T.cast(S[i, j], dtype)
                        Sl[i, j] = T.cast(S[i, j] - T.cast(T.cast(S[i, j], dtype), acc), dtype)
                else:
                    T.copy(S, Ss)
                T.gemm(Ks, Ss, KS, clear_accum=True)
                T.gemm(Qs, Ss, Of, clear_accum=True)
                if split_state:
                    T.gemm(Ks, Sl, KS)
                    T.gemm(Qs, Sl, Of)
                T.gemm(Qs, Ks, QK, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    Xt[j, i] = T.cast(bs[i], acc) * (Vs[i, j] - T.exp(gcs[i]) * KS[i, j])
                T.gemm(As, Xt, Vn, transpose_B=True, clear_accum=True)
                g_last = gcs[T.min(BT, Tn - c * BT) - 1]
                for i, j in T.Parallel(BT, BT):
                    Ps[i, j] = T.if_then_else(i >= j, QK[i, j] * T.exp(gcs[i] - gcs[j]), 0.0)
                if split_state:
                    for i, j in T.Parallel(BT, BV):
                        Vns[i, j] = Vn[i, j]
                        Vds[i, j] = T.cast(Vn[i, j] * T.exp(g_last - gcs[i]), dtype)
                        Vdl[i, j] = T.cast(Vn[i, j] * T.exp(g_last - gcs[i])
                                           - T.cast(T.cast(Vn[i, j] * T.exp(g_last - gcs[i]), dtype), acc), dtype)
                else:
                    for i, j in T.Parallel(BT, BV):
                        Vns[i, j] = Vn[i, j]
                        Vds[i, j] = Vn[i, j] * T.exp(g_last - gcs[i])
                for i, j in T.Parallel(BT, BV):
                    Of[i, j] = Of[i, j] * T.exp(gcs[i])
                T.gemm(Ps, Vns, Of)
                for i, j in T.Parallel(BT, BV):
                    Of[i, j] = Of[i, j] * scale
                T.copy(Of, o[ib, c * BT:(c + 1) * BT, ihv, iv * BV:(iv + 1) * BV])
                for i, j in T.Parallel(K, BV):
                    S[i, j] = S[i, j] * T.exp(g_last)
                T.gemm(Ks, Vds, S, transpose_A=True)
                if split_state:
                    T.gemm(Ks, Vdl, S, transpose_A=True)
            T.copy(S, ht[ib, ihv, 0:K, iv * BV:(iv + 1) * BV])

    return gdn_chunk_fwd


@functools.lru_cache(maxsize=64)
def compiled_kernel(H: int, HV: int, K: int, V: int, BV: int, scale: float, dtype: str = "bfloat16",
                    threads: int = 128, num_stages: int = 2, target: Optional[str] = None, split_state: bool = False,
                    use_initial_state: bool = True, beta_dtype: str = "float32"):
    """The compiled kernel (cached per static configuration). ``target``: None for the current GPU, or an arch
    such as "sm_90a" to compile without one (the CPU compile check)."""
    import tilelang
    func = build_kernel(H, HV, K, V, BV, scale, dtype, threads, num_stages, split_state, use_initial_state,
                        beta_dtype)
    tgt = {"kind": "cuda", "arch": target} if target else "auto"
    return tilelang.compile(func, target=tgt)


def unsupported_reason(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> Optional[str]:
    """Why the Hopper forward cannot take these inputs (None: it can): bf16 on an sm_90 GPU with TileLang
    installed, K and V multiples of 64 up to 256 and 128 (the TMA boxes), equal-length sequences."""
    if q.dtype != torch.bfloat16:
        return f"takes bf16 inputs, got {q.dtype}"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "needs an sm_90 (Hopper) GPU"
    if cu_seqlens is not None:
        return "no varlen (cu_seqlens) yet"
    K, V = q.shape[-1], v.shape[-1]
    if K % 64 or V % 64 or K > 128 or V > 256:
        return f"K and V must be multiples of 64 (K <= 128, V <= 256), got K={K}, V={V}"
    if not tilelang_available():
        return "TileLang is not installed"
    return None


def chunk_fwd_hopper_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float, initial_state: Optional[torch.Tensor],
                         operand_dtype: torch.dtype = torch.bfloat16,
                         split_state: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's PyTorch twin, chunk by chunk in fp32 (float64 for float64 inputs), rounding to
    ``operand_dtype`` exactly where the kernel does: the state as the operand of K S and Q S, P, V_new as P V_new's
    operand, and the decayed V_new of the state update (A_inv X stays in the working precision; the kernel runs it
    at tf32); with ``split_state`` the state and the decayed V_new as hi + lo pairs. With ``operand_dtype`` the
    working dtype nothing is rounded: the algebra alone, equal to the token-by-token reference. g: the log decays
    (not their cumulative sums); A_inv comes from ``kkt_solve_ref``. Returns o ``[B, T, HV, V]`` in v's dtype and
    the final state ``[B, HV, K, V]`` in the working dtype."""
    from ..gated_delta import torch_chunk as tc
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    rnd = (lambda t: t) if operand_dtype == work else (lambda t: t.to(operand_dtype).to(work))
    rnd_state = (lambda t: rnd(t) + rnd(t - rnd(t))) if split_state else rnd
    qc, kc = (tc.to_chunks(x.to(work).repeat_interleave(HV // H, 2), BT) for x in (q, k))
    vc, bc = tc.to_chunks(v.to(work), BT), tc.to_chunks(beta.to(work), BT)
    gc = tc.chunk_local_cumsum_ref(tc.to_chunks(g.to(work), BT))
    a_inv = tc.kkt_solve_ref(kc, bc, gc)
    S = (initial_state.to(work) if initial_state is not None
         else torch.zeros(B, HV, K, V, dtype=work, device=q.device))
    outs = []
    for c in range(qc.shape[2]):
        Qc, Kc, Vc, bt, Gc = qc[:, :, c], kc[:, :, c], vc[:, :, c], bc[:, :, c], gc[:, :, c]
        Sb = rnd_state(S)
        X = bt[..., None] * (Vc - Gc.exp()[..., None] * (Kc @ Sb))
        Vn = a_inv[:, :, c] @ X
        P = rnd(tc.qk_decay_ref(Qc, Kc, Gc))
        outs.append(scale * (Gc.exp()[..., None] * (Qc @ Sb) + P @ rnd(Vn)))
        g_last = Gc[..., -1]
        S = g_last.exp()[..., None, None] * S + Kc.transpose(-1, -2) @ rnd_state(
            (g_last[..., None] - Gc).exp()[..., None] * Vn)
    return tc.from_chunks(torch.stack(outs, 2), T).to(v.dtype), S


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


def chunk_fwd_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gc: torch.Tensor, beta: torch.Tensor,
                     a_inv: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
                     BV: int = 64, threads: int = 128, num_stages: int = 2,
                     split_state: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """o ``[B, T, HV, V]`` (v's dtype) and the final state ``[B, HV, K, V]`` fp32 from the Triton pre-pass's
    outputs gc ``[B, T, HV]`` and a_inv ``[B, T, HV, 64]`` (``fused_prepass(write_wy=False)``) and β ``[B, T, HV]``.
    bf16 q/k/v, no varlen."""
    return chunk_fwd_hopper_hm(q, k, v, head_major(gc), head_major(beta), a_inv, scale, initial_state, BV, threads,
                               num_stages, split_state)


def chunk_fwd_hopper_hm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gc_hm: torch.Tensor,
                        beta_hm: torch.Tensor, a_inv: torch.Tensor, scale: float,
                        initial_state: Optional[torch.Tensor], BV: int = 64, threads: int = 128,
                        num_stages: int = 2, split_state: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_fwd_hopper` with gc and β already head-major ``[B, HV, Tp]`` (:func:`head_major`, or the
    TileLang pre-pass ``prepass.prepass_hopper``, which writes them so)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if q.dtype != torch.bfloat16:
        raise TypeError(f"the Hopper forward takes bf16 q/k/v, got {q.dtype}")
    if V % BV:
        raise ValueError(f"V = {V} must be a multiple of BV = {BV}")
    if beta_hm.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"beta must be fp32 or bf16, got {beta_hm.dtype}")
    Tp = padded_length(T)
    if gc_hm.shape != (B, HV, Tp) or beta_hm.shape != (B, HV, Tp):
        raise ValueError(f"gc and beta must be head-major [B, HV, Tp] = {[B, HV, Tp]}, got {list(gc_hm.shape)} and "
                         f"{list(beta_hm.shape)}")
    kernel = compiled_kernel(H, HV, K, V, BV, float(scale), "bfloat16", threads, num_stages, None, split_state,
                             initial_state is not None, str(beta_hm.dtype).removeprefix("torch."))
    # without an initial state the kernel never reads h0: an uninitialised tensor of the shape (the launcher checks
    # shapes and strides) costs an allocation, not a memset
    h0 = (initial_state.float().contiguous() if initial_state is not None
          else torch.empty(B, HV, K, V, dtype=torch.float32, device=q.device))
    o = torch.empty_like(v)
    ht = torch.empty(B, HV, K, V, dtype=torch.float32, device=q.device)
    kernel(q.contiguous(), k.contiguous(), v.contiguous(), gc_hm.contiguous(), beta_hm.contiguous(),
           a_inv.contiguous(), h0, o, ht)
    return o, ht
