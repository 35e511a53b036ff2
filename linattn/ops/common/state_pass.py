"""Stage 4 (forward): the sequential walk over chunks, the only stage that is not parallel over chunks.

Twin: ``torch_chunk.state_pass_fwd_ref``. Per chunk, with S the state entering it (fp32, in registers):

    h[chunk]  = S                                        write BK×BV (fp32, or bf16: ``store_dtype``)
    V_new     = U − W S                                  read BT×K (W) + BT×BV (U) fp32, write BT×BV (as h)
    S        ← e^{G_C} S + (K ⊙ e^{G_C − G})ᵀ V_new      read BT×K keys + BT gates

or, with A_inv given (FROM_A_INV, ``a_inv``), W and U are never stored: since W = A_inv (βΓ ⊙ K) and
U = A_inv (β ⊙ V),

    V_new     = A_inv (β ⊙ V − βΓ ⊙ (K S))               read BT×BT A_inv fp32 + BT×BV values + BT betas

one extra [BT, BT] × [BT, BV] dot on the chain per chunk, for which the pre-pass writes A_inv (BT² fp32 per chunk
and value head) instead of W and U (BT·(K + V) fp32) and this pass reads A_inv and V in the input dtype instead
of W and U: at K = V = 128, bf16, 64 KB of stores and 64 KB of loads per chunk and head become 16 + 16 KB each.
K S runs on the keys as given (exact in tf32), the βΓ row scale applied to its fp32 result.

One program owns one (sequence, value head, BV-wide slice of V) and holds the whole K extent of the state
(BK = next power of two ≥ K, up to 256), because W S needs every row of S. BV is what keeps the register tile
[BK, BV] fp32 bounded: 64 columns up to K = 128, 32 beyond (≤ 8192 fp32 per program); the V slices of one head
are independent programs, which also multiplies the parallelism of this sequential stage.
The decay of the last token, e^{G_C − G_t}, is formed from the masked difference (padded rows → −inf → 0).
With ``USE_DELTA`` off (no ``w`` or ``a_inv``) the same walk serves plain gated linear attention (V_new = U = V).
The stored h and V_new are only read by later kernels: storing them in bf16 (``store_dtype``) rounds what the
output reads, never the state the walk carries in registers, so the final state is the same either way.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..utils import cdiv
from . import (
    CHUNK,
    block_size,
    check_store_dtype,
    dot_precision,
    fill_tile_v,
    launch_options,
    loop_stages,
    num_sms,
    state_tile_v,
    triton_interpret,
)
from .dot import dot
from .finite import from_first, nan_rows, nonfinite, nonfinite_rows, zero_rows
from .kkt_solve import a_inv_tile
from .launch import launch


@triton.jit
def _chunk_step(k, w, u, a_inv, beta, gc, h, v_new, b_h, i_c, bos, boh, T_seq, i_h, i_hv, i_v, H: tl.constexpr,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, DOT_PREC: tl.constexpr, USE_DECAY: tl.constexpr, USE_DELTA: tl.constexpr,
                FROM_A_INV: tl.constexpr, INTERPRET: tl.constexpr):
    """One chunk of the walk: write h[chunk] = S and V_new, return the state leaving the chunk."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    # the state entering chunk i_c (rounded to h's dtype on the way out; the walk keeps b_h in fp32)
    p_h = h + ((boh + i_c) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=m_kv)
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T_seq

    p_u = tl.make_block_ptr(u + (bos * HV + i_hv) * V, (T_seq, V), (HV * V, 1), (i_c * BT, i_v * BV), (BT, BV),
                            (1, 0))
    b_v = tl.load(p_u, boundary_check=(0, 1)).to(tl.float32)
    if USE_DELTA:
        if FROM_A_INV:
            # V_new = A_inv (β ⊙ V − βΓ ⊙ (K S)); b_v holds V here. Padded rows of K, V and A_inv load as 0, and
            # a valid row's A_inv is 0 right of its diagonal, so padded rows never reach a valid V_new
            b_beta = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0).to(tl.float32)
            b_bg = b_beta
            if USE_DECAY:
                b_bg = b_beta * tl.exp(tl.load(gc + (bos + o_t) * HV + i_hv, mask=m_t, other=0))
            p_kr = tl.make_block_ptr(k + (bos * H + i_h) * K, (T_seq, K), (H * K, 1), (i_c * BT, 0), (BT, BK),
                                     (1, 0))
            b_kr = tl.load(p_kr, boundary_check=(0, 1))
            b_ks = dot(b_kr, b_h, DOT_PREC, INTERPRET)
            b_a = tl.load(a_inv_tile(a_inv, bos, i_c, i_hv, T_seq, HV, BT), boundary_check=(0, 1))
            # rows from the first non-finite value, β, βΓ or key on are zeroed before the product and NaN in V_new
            # (finite.py); found from the inputs alone (a NaN state makes every row NaN anyway), off the chain
            b_vb = b_v * b_beta[:, None]
            m_dead = from_first(nonfinite_rows(b_vb) | nonfinite_rows(b_kr) | nonfinite(b_bg))
            b_v = nan_rows(tl.dot(b_a, zero_rows(b_vb - b_ks * b_bg[:, None], m_dead), input_precision=DOT_PREC),
                           m_dead)
        else:
            # V_new = U − W S (padded rows of W and U load as 0, so their V_new is 0)
            p_w = tl.make_block_ptr(w + (bos * HV + i_hv) * K, (T_seq, K), (HV * K, 1), (i_c * BT, 0), (BT, BK),
                                    (1, 0))
            b_w = tl.load(p_w, boundary_check=(0, 1)).to(tl.float32)
            b_v -= tl.dot(b_w, b_h, input_precision=DOT_PREC)
        p_vn = tl.make_block_ptr(v_new + (bos * HV + i_hv) * V, (T_seq, V), (HV * V, 1), (i_c * BT, i_v * BV),
                                 (BT, BV), (1, 0))
        tl.store(p_vn, b_v.to(p_vn.dtype.element_ty), boundary_check=(0, 1))

    # S ← e^{G_C} S + Kᵀ (e^{G_C − G} ⊙ V_new): the decay scales V_new's rows ([BT, BV]) instead of K's columns
    # ([BK, BT]), so K is loaded in the input dtype and widened only as the dot's operand (``dot``): no spills on
    # sm_90. Split-bf16 ("bf16x3") key dots here fault on sm_90 (illegal memory access, as in the walk:
    # fused_fwd.py) and are not offered
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (K, T_seq), (1, H * K), (0, i_c * BT), (BK, BT), (0, 1))
    b_kt = tl.load(p_k, boundary_check=(0, 1))
    if USE_DECAY:
        i_last = tl.minimum((i_c + 1) * BT, T_seq) - 1
        b_g_last = tl.load(gc + (bos + i_last) * HV + i_hv)
        b_gc = tl.load(gc + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
        b_v = b_v * tl.exp(tl.where(m_t, b_g_last - b_gc, float("-inf")))[:, None]
        b_h *= tl.exp(b_g_last)
    b_h += dot(b_kt, b_v, DOT_PREC, INTERPRET)
    return b_h


@triton.jit(do_not_specialize=["T", "NT"])
def state_pass_fwd_kernel(k, w, u, a_inv, beta, gc, h, v_new, h0, ht, cu_seqlens, chunk_offsets, T, NT,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr, USE_DECAY: tl.constexpr,
                          USE_DELTA: tl.constexpr, FROM_A_INV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
                          IS_VARLEN: tl.constexpr, INTERPRET: tl.constexpr, NUM_STAGES: tl.constexpr):
    # grid (cdiv(V, BV), N·HV)
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        boh = i_n.to(tl.int64) * NT
    T_seq = eos - bos

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    o_kv = o_k[:, None] * V + o_v[None, :]
    o_s = i_nh.to(tl.int64) * K * V
    if USE_INITIAL_STATE:
        b_h = tl.load(h0 + o_s + o_kv, mask=m_kv, other=0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)

    NT_seq = tl.cdiv(T_seq, BT)
    if INTERPRET or NUM_STAGES == 0:
        # a while loop: the interpreter cannot take range() of a runtime bound (numpy >= 2 refuses int() of its
        # 1-element arrays), and NUM_STAGES = 0 (a grid of more than one wave) is never software-pipelined
        i_c = 0
        while i_c < NT_seq:
            b_h = _chunk_step(k, w, u, a_inv, beta, gc, h, v_new, b_h, i_c, bos, boh, T_seq, i_h, i_hv, i_v, H, HV,
                              K, V, BT, BK, BV, DOT_PREC, USE_DECAY, USE_DELTA, FROM_A_INV, INTERPRET)
            i_c += 1
    else:
        # a for loop Triton can software-pipeline: the next chunks' W, U, K and gates arrive (cp.async) while this
        # chunk's dots run; int32 bound: block-pointer offsets must be 32-bit
        for i_c in tl.range(0, NT_seq.to(tl.int32), num_stages=NUM_STAGES):
            b_h = _chunk_step(k, w, u, a_inv, beta, gc, h, v_new, b_h, i_c, bos, boh, T_seq, i_h, i_hv, i_v, H, HV,
                              K, V, BT, BK, BV, DOT_PREC, USE_DECAY, USE_DELTA, FROM_A_INV, INTERPRET)

    tl.store(ht + o_s + o_kv, b_h, mask=m_kv)


def state_pass_fwd(k: torch.Tensor, w: Optional[torch.Tensor], u: torch.Tensor, gc: Optional[torch.Tensor],
                   initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor] = None,
                   chunk_offsets: Optional[torch.Tensor] = None, num_chunks: Optional[int] = None,
                   chunk_size: int = CHUNK, num_stages: Optional[int] = None, block_v: Optional[int] = None,
                   store_dtype: torch.dtype = torch.float32, a_inv: Optional[torch.Tensor] = None,
                   beta: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Walk the chunks of every sequence in order.

    Args:
        k: keys ``[B, T, H, K]`` (value head i reads key head ``i // (HV // H)``).
        w: ``[B, T, HV, K]`` fp32 (the delta rule's W), or None for plain gated linear attention or with ``a_inv``.
        u: ``[B, T, HV, V]``: the WY U (delta rule), or the values (plain GLA, or with ``a_inv``).
        a_inv, beta: the delta rule from the chunks' inverses instead of W and U (FROM_A_INV, above): a_inv
            ``[B, T, HV, 64]`` fp32 (``kkt_solve``'s layout) and beta ``[B, T, HV]``, with ``w`` None and the
            values in ``u``; or both None.
        gc: ``[B, T, HV]`` fp32 chunk-local cumulative log decay, or None (no decay).
        initial_state: ``[N, HV, K, V]`` (any float dtype; read as fp32) or None (zeros).
        cu_seqlens, chunk_offsets, num_chunks: varlen offsets ``[N + 1]``, :func:`varlen.chunk_tables`
            chunk_offsets and NT_total; or None.
        num_stages, block_v: the loop's pipelining (None: 3 stages when the grid is one wave, else 0) and the V
            tile (None: ``common.fill_tile_v``, at most 64, 32 beyond K = 128), for benchmarks.
        store_dtype: the dtype h and v_new are written in, fp32 or bf16 (``split_fwd.store_dtype``: half the
            bytes of the two largest intermediates; the final state is fp32 and unchanged by it).
    Returns:
        h ``[B, NT, HV, K, V]`` (the state entering each chunk; varlen: B = 1, NT = NT_total),
        v_new ``[B, T, HV, V]`` (None without ``w`` or ``a_inv``), both ``store_dtype``; final state ``[N, HV, K, V]`` fp32.
    """
    check_store_dtype("state_pass_fwd", store_dtype)
    if (a_inv is None) != (beta is None) or (a_inv is not None and w is not None):
        raise ValueError("state_pass_fwd takes a_inv and beta together, and then no w (the values go in u)")
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    delta = w is not None or a_inv is not None
    is_varlen = cu_seqlens is not None
    N = cu_seqlens.shape[0] - 1 if is_varlen else B
    NT = num_chunks if is_varlen else cdiv(T, chunk_size)
    h = torch.empty(B, NT, HV, K, V, dtype=store_dtype, device=k.device)
    v_new = torch.empty(B, T, HV, V, dtype=store_dtype, device=k.device) if delta else None
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=k.device)
    BK = block_size(K, 256)
    sms = num_sms(k.device)
    # from A_inv the wider V tiles pay from 90% of the SMs filled (their third dot on the chain is per column)
    BV = state_tile_v(block_v, fill_tile_v(N * HV, V, 64 if BK <= 128 else 32, sms,
                                           0.9 if a_inv is not None else 1.0))
    grid = (cdiv(V, BV), N * HV)
    # a one-wave grid is latency-bound: three stages of prefetch hide the next chunks' loads
    stages = loop_stages(num_stages, 3, grid[0] * grid[1], sms)
    launch(state_pass_fwd_kernel, grid,
           k, w, u, a_inv, beta, gc, h, v_new, initial_state, ht, cu_seqlens, chunk_offsets, T, NT, H=H, HV=HV, K=K,
           V=V, BT=chunk_size, BK=BK, BV=BV, DOT_PREC=dot_precision(k.dtype), USE_DECAY=gc is not None,
           USE_DELTA=delta, FROM_A_INV=a_inv is not None, USE_INITIAL_STATE=initial_state is not None,
           IS_VARLEN=is_varlen, INTERPRET=triton_interpret(), NUM_STAGES=stages, num_warps=4,
           **launch_options("state_pass_fwd"))
    return h, v_new, ht
