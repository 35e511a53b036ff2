"""Fused forward, part 1: the parallel pre-pass — cumsum, kkt + triangular solve and WY of a chunk in ONE kernel.

Twin: ``torch_chunk.chunk_local_cumsum_ref`` → ``kkt_solve_ref`` → ``wy_ref`` (the three stages this kernel
fuses). One program per (chunk, value head), grid (NT, B·HV), like the stages it replaces. Per chunk it

    reads   BT gates, BT betas, BT×K keys (twice: once for K Kᵀ, once for W; the second read hits L2),
            BT×V values
    writes  gc [BT] fp32, W [BT, K] fp32, U [BT, V] fp32        — and nothing else: A_inv stays in registers.

or, with STORE_A_INV, gc and A_inv [BT, BT] fp32 instead of W and U (no V read, no W/U dots): the split forward's
state pass then forms W S and U per chunk from A_inv (``state_pass.py``, FROM_A_INV).

With queries given (STORE_P) it also reads BT×K queries and the keys once more (from L2) and writes the chunk's
P = Q Kᵀ ⊙ D ⊙ causal [BT, BT] fp32 (+25% writes at K = V = 128), so that the sequential walk (``fused_fwd.py``,
LOAD_P) loads P instead of recomputing it for every V slice. Twin: ``torch_chunk.qk_decay_ref``. The query scale
is NOT folded into P: P is then the same matrix as the twin's (and the backward's), and the walk applies the scale
once to the sum Γ ⊙ (Q S) + P V_new with or without a stored P, so both modes round the same way up to the order
of the Q Kᵀ sum. Without queries the flag is off and the kernel compiles to what it was.

Against the unfused stages (cumsum → kkt_solve → wy) this drops the A_inv round trip (BT² fp32 written and read
back: 32 KB per chunk and head), two launches, and the re-reads of gc and β.

The solve (``kkt_solve.kkt_inverse``) reads the cumulative gates back from ``gc`` in 16- and 32-row slices; the
program writes them first and then passes a CTA barrier, which makes its own global stores visible to all its
threads (the values come from L1/L2, not HBM). The solve hands back the inverse as one [BT, BT] register tile
(assembled with ``tl.join``, no data leaves the SM) so that W and U are [64, 64]-sized dots, shared with
``wy.wy_tiles``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..utils import cdiv
from . import CHUNK, MIN_LOG_DECAY, block_size, check_store_dtype, dot_precision, launch_options, triton_interpret
from .dot import dot
from .kkt_solve import a_inv_tile, kkt_inverse, merge_precision
from .launch import launch
from .varlen import chunk_bounds
from .wy import wy_tiles


@triton.jit(do_not_specialize=["T"])
def fused_prepass_kernel(g, k, v, beta, q, gc, w, u, p, a_inv, cu_seqlens, chunk_indices, T, H: tl.constexpr,
                         HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, DOT_PREC: tl.constexpr, INPUT_PREC: tl.constexpr,
                         IS_VARLEN: tl.constexpr, STORE_P: tl.constexpr, STORE_A_INV: tl.constexpr,
                         MERGE_PREC: tl.constexpr, INTERPRET: tl.constexpr):
    # grid (NT, B·HV): one program per (chunk, value head); value head i_hv reads key head i_hv // (HV // H)
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    _, i_c, bos, eos = chunk_bounds(i_t, i_b, cu_seqlens, chunk_indices, T, IS_VARLEN)
    T_seq = eos - bos
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T_seq

    # 1. gc = cumsum(g) in fp32: read BT gates, write BT fp32 (the tail of the last chunk is masked)
    o_g = (bos + o_t) * HV + i_hv
    b_g = tl.load(g + o_g, mask=m_t, other=0).to(tl.float32)
    b_gc = tl.cumsum(tl.where(b_g < MIN_LOG_DECAY, MIN_LOG_DECAY, b_g), axis=0)   # floored as cumsum.py does
    tl.store(gc + o_g, b_gc, mask=m_t)
    # the solve reads gc back in 16-row slices: a CTA barrier makes this program's stores visible to its threads
    tl.debug_barrier()

    if STORE_P:
        # 2. P = Q Kᵀ ⊙ D ⊙ causal for the walk: read BT×K queries and keys in BK-wide tiles, write BT×BT fp32.
        #    Q Kᵀ runs on the inputs at INPUT_PREC like the walk's (dot widens bf16 under the interpreter); D comes
        #    from the masked difference (→ −inf → 0). Rows past the sequence end are not stored; in a stored row t
        #    every column past the end is above the diagonal, so it is 0 (the varlen neighbour's keys never leak in)
        b_P = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(tl.cdiv(K, BK)):
            p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T_seq, K), (H * K, 1), (i_c * BT, i_k * BK), (BT, BK),
                                    (1, 0))
            p_kt = tl.make_block_ptr(k + (bos * H + i_h) * K, (K, T_seq), (1, H * K), (i_k * BK, i_c * BT),
                                     (BK, BT), (0, 1))
            b_P += dot(tl.load(p_q, boundary_check=(0, 1)), tl.load(p_kt, boundary_check=(0, 1)), INPUT_PREC,
                       INTERPRET)
        # (the mask is a select: a non-finite key never reaches an earlier row, finite.py)
        m_P = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
        b_P = tl.where(m_P, b_P * tl.exp(tl.where(m_P, b_gc[:, None] - b_gc[None, :], float("-inf"))), 0.)
        p_p = tl.make_block_ptr(p + (bos * HV + i_hv) * BT, (T_seq, BT), (HV * BT, 1), (i_c * BT, 0), (BT, BT),
                                (1, 0))
        tl.store(p_p, b_P, boundary_check=(0,))

    # 3. (I + A)⁻¹ as one [BT, BT] register tile (reads BT×K keys, BT gates and betas); K Kᵀ runs on the inputs
    #    (INPUT_PREC), W and U on the fp32 inverse (DOT_PREC)
    b_A, m_dead = kkt_inverse(k, beta, gc, bos, T_seq, i_c, i_h, i_hv, H, HV, K, BT, BK, INPUT_PREC, True,
                              MERGE_PREC, INTERPRET)

    if STORE_A_INV:
        # 4'. write A_inv [BT, BT] fp32 (the chunk's rows; zeros above the diagonal included): the state pass forms
        #     W S and U from it per chunk (state_pass.py, FROM_A_INV)
        tl.store(a_inv_tile(a_inv, bos, i_c, i_hv, T_seq, HV, BT), b_A.to(a_inv.dtype.element_ty),
                 boundary_check=(0, 1))
    else:
        # 4. W = A_inv (βΓ ⊙ K), U = A_inv (β ⊙ V): read BT×(K + V) inputs, write BT×(K + V) fp32
        b_beta = tl.load(beta + o_g, mask=m_t, other=0).to(tl.float32)
        b_bg = b_beta * tl.exp(b_gc)
        wy_tiles(b_A, m_dead, b_beta, b_bg, k, v, w, u, bos, T_seq, i_c, i_h, i_hv, H, HV, K, V, BT, BK, BV,
                 DOT_PREC)


def fused_prepass(g: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                  cu_seqlens: Optional[torch.Tensor] = None, chunk_indices: Optional[torch.Tensor] = None,
                  dot_prec: Optional[str] = None, chunk_size: int = CHUNK, q: Optional[torch.Tensor] = None,
                  store_dtype: torch.dtype = torch.float32, write_wy: bool = True) -> tuple[torch.Tensor, ...]:
    """gc, W and U of every chunk (and P, with ``q``), in one launch; or gc and A_inv (``write_wy=False``).

    Args:
        g: log decays ``[B, T, HV]``; k: keys ``[B, T, H, K]`` (value head i reads key head ``i // (HV // H)``);
            v: values ``[B, T, HV, V]``; beta: ``[B, T, HV]``.
        cu_seqlens, chunk_indices: varlen offsets ``[N + 1]`` and :func:`varlen.chunk_tables` indices, or None.
        dot_prec: override ``dot_precision(k.dtype)`` for the W/U dots (benchmarks).
        q: queries ``[B, T, H, K]`` (k's dtype) or None: given, P is computed too.
        store_dtype: the dtype w and u (or A_inv) are written in, fp32 or bf16 (``split_fwd.wu_store_dtype``).
        write_wy: False writes the chunks' inverses instead of W and U (for ``state_pass_fwd``'s ``a_inv``); not
            with ``q``.
    Returns:
        gc ``[B, T, HV]`` fp32, w ``[B, T, HV, K]``, u ``[B, T, HV, V]`` (``store_dtype``) — the same values (up
        to rounding order and the store's rounding) as ``chunk_local_cumsum`` → ``kkt_solve`` → ``wy_fwd`` — and,
        with ``q``, p ``[B, T, HV, BT]`` fp32: row t holds row t − c·BT of its chunk c's P = Q Kᵀ ⊙ D ⊙ causal (unscaled; columns at positions
        past the sequence end are 0), the layout of ``A_inv``; the input of ``fused_fwd``'s ``p``. With
        ``write_wy=False``: gc and A_inv ``[B, T, HV, BT]`` (``kkt_solve``'s layout and values; ``store_dtype``: the
        Hopper forward can take it in bf16).
    """
    check_store_dtype("fused_prepass", store_dtype)
    if not write_wy and q is not None:
        raise ValueError("fused_prepass writes P (q given) only with W and U (write_wy=True)")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    gc = torch.empty(B, T, HV, dtype=torch.float32, device=k.device)
    a_inv = None if write_wy else torch.empty(B, T, HV, chunk_size, dtype=store_dtype, device=k.device)
    w = torch.empty(B, T, HV, K, dtype=store_dtype, device=k.device) if write_wy else None
    u = torch.empty(B, T, HV, V, dtype=store_dtype, device=k.device) if write_wy else None
    p = torch.empty(B, T, HV, chunk_size, dtype=torch.float32, device=k.device) if q is not None else None
    NT = chunk_indices.shape[0] if cu_seqlens is not None else cdiv(T, chunk_size)
    # 4 warps: 8 spill less (none at K = V = 128) but run slower
    launch(fused_prepass_kernel, (NT, B * HV),
           g, k, v, beta, q, gc, w, u, p, a_inv, cu_seqlens, chunk_indices, T, H=H, HV=HV, K=K, V=V, BT=chunk_size,
           BK=block_size(K, 64), BV=block_size(V, 64), DOT_PREC=dot_prec or dot_precision(k.dtype),
           INPUT_PREC=dot_precision(k.dtype), IS_VARLEN=cu_seqlens is not None, STORE_P=q is not None,
           STORE_A_INV=not write_wy, MERGE_PREC=merge_precision(k.dtype), INTERPRET=triton_interpret(),
           num_warps=4, **launch_options("fused_prepass"))
    if not write_wy:
        return gc, a_inv
    return (gc, w, u) if q is None else (gc, w, u, p)
