"""Backward stage 2: the reverse walk over chunks carrying dS (twin: ``torch_chunk.state_pass_bwd_ref``).

dS is the gradient of the state *leaving* the current chunk. Walking the chunks of one sequence backwards:

    dh[c]      = dS                                                   (stored for the local stages)
    dV_new     = dv_local + (K ⊙ e^{G_C − G}) dS                       (dv_local from local_bwd_dv.py)
    dS        ← e^{G_C} dS + scale·(diag(Γ) Q)ᵀ dO − Wᵀ dV_new
    dh0        = dS after the first chunk

One program per (V tile, sequence, value head) holds a K × BV tile of dS in fp32 registers for the whole walk;
the V tiles are independent because every update is column-wise in V. Per chunk it reads q, k, w (BT×K), dO and
dv_local (BT×BV) and the gates, and writes dh (K×BV) and dV_new (BT×BV), fp32. K is one tile (≤ 256), so BV
shrinks as K grows to bound the registers the carried state takes. dh stays fp32: in bf16 it rounded only what
local_bwd_dqk reads, but made the backward slower at long sequences.

The walk is linear in (dS, dO, dv_local) column by column, so the MAPS mode (phase A' of the sequence-parallel
walk, ``seq_parallel_bwd.py``) runs it on the widened K × (K + V) gradient [I | 0] with dO and dv_local shifted
into its last V columns, storing nothing per chunk: what leaves a segment's first chunk is [M_sᵀ | D_s],
dS_in = M_sᵀ dS_out + D_s over the segment.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..utils import cdiv
from . import fill_tile_v, launch_options, num_sms, state_tile_v
from .local_bwd_utils import bwd_dot_precision, mdot

BT = 64


@triton.jit
def _bwd_chunk(q, k, w, gc, do, dv_local, dh, dv_new, b_dh, scale, i_t, bos, boh, T, i_h, i_hv, i_v,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr, MAPS: tl.constexpr):
    """Chunk i_t of the reverse walk: store dS leaving it to dh, write its dV_new, return dS entering it (with
    MAPS: no stores, dO and dv_local read into columns K.. of the widened dS)."""
    DT = k.dtype.element_ty
    if not MAPS:
        p_dh = tl.make_block_ptr(dh + ((boh + i_t) * HV + i_hv) * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV),
                                 (1, 0))
        tl.store(p_dh, b_dh.to(p_dh.dtype.element_ty), boundary_check=(0, 1))

    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    b_g = tl.load(gc + (bos + o_t) * HV + i_hv, mask=m_t, other=0.)
    b_g_last = tl.load(gc + (bos + tl.minimum(i_t * BT + BT, T) - 1) * HV + i_hv)

    p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    p_w = tl.make_block_ptr(w + (bos * HV + i_hv) * K, (T, K), (HV * K, 1), (i_t * BT, 0), (BT, BK), (1, 0))
    if MAPS:
        # column c of the widened dS [Mᵀ | D]: c < K is a column of Mᵀ (no dO, no dv_local), c ≥ K column c − K
        # of D (dO's and dv_local's column c − K); a BV slice may straddle the two, so the mask is per element
        o_u = i_v * BV + tl.arange(0, BV) - K
        m_u = m_t[:, None] & ((o_u >= 0) & (o_u < V))[None, :]
        o_tu = ((bos + o_t) * HV + i_hv)[:, None] * V + o_u[None, :]
    else:
        p_do = tl.make_block_ptr(do + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * BT, i_v * BV), (BT, BV),
                                 (1, 0))
        p_dvl = tl.make_block_ptr(dv_local + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * BT, i_v * BV),
                                  (BT, BV), (1, 0))
        p_dvn = tl.make_block_ptr(dv_new + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * BT, i_v * BV),
                                  (BT, BV), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
    b_w = tl.load(p_w, boundary_check=(0, 1), padding_option="zero")
    if MAPS:
        b_do = tl.load(do + o_tu, mask=m_u, other=0)
    else:
        b_do = tl.load(p_do, boundary_check=(0, 1), padding_option="zero")

    # dV_new = dv_local + (K ⊙ e^{G_C − G}) dS; masked rows get exponent −inf, so padding stays 0
    b_k_decay = b_k * tl.exp(tl.where(m_t, b_g_last - b_g, float('-inf')))[:, None]
    if MAPS:
        b_dv = tl.load(dv_local + o_tu, mask=m_u, other=0)
    else:
        b_dv = tl.load(p_dvl, boundary_check=(0, 1), padding_option="zero")
    b_dv += mdot(b_k_decay, b_dh, DT, DOT_PREC)
    if not MAPS:
        tl.store(p_dvn, b_dv, boundary_check=(0, 1))

    # dS ← e^{G_C} dS + scale·(diag(Γ) Q)ᵀ dO − Wᵀ dV_new (Γ ≤ 1: G is a cumsum of g ≤ 0)
    b_q_decay = b_q * (scale * tl.exp(tl.where(m_t, b_g, float('-inf'))))[:, None]
    b_dh *= tl.exp(b_g_last)
    b_dh += mdot(tl.trans(b_q_decay), b_do, DT, DOT_PREC)
    b_dh -= mdot(tl.trans(b_w), b_dv, DT, DOT_PREC)
    return b_dh


@triton.jit(do_not_specialize=["T"])
def state_pass_bwd_kernel(
    q, k, w, gc, do, dv_local, dht, dh, dv_new, dh0, cu_seqlens, chunk_offsets, scale,
    T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr, IS_VARLEN: tl.constexpr, MAPS: tl.constexpr,
):
    # grid (cdiv(VS, BV), N·HV). MAPS (phase A' of seq_parallel_bwd.py, each "sequence" a segment): the walked dS
    # is the widened K × (K + V) [Mᵀ | D], starting from [I | 0] instead of dht; nothing is stored per chunk, and
    # the dS leaving the first chunk goes to dh0 [N, HV, K, K + V]
    if MAPS:
        VS: tl.constexpr = K + V
    else:
        VS: tl.constexpr = V
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        T = (eos - bos).to(tl.int32)
        NT = tl.cdiv(T, BT)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos, eos = i_n.to(tl.int64) * T, i_n.to(tl.int64) * T + T
        NT = tl.cdiv(T, BT)
        boh = i_n.to(tl.int64) * NT

    if MAPS:
        o_k, o_c = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
        b_dh = ((o_k[:, None] == o_c[None, :]) & (o_k[:, None] < K)).to(tl.float32)
    else:
        p_dht = tl.make_block_ptr(dht + i_nh.to(tl.int64) * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        b_dh = tl.load(p_dht, boundary_check=(0, 1), padding_option="zero").to(tl.float32)

    # a while loop, never software-pipelined: prefetching the next chunks measured slower at every shape and tile
    i_t = NT - 1
    while i_t >= 0:
        b_dh = _bwd_chunk(q, k, w, gc, do, dv_local, dh, dv_new, b_dh, scale, i_t, bos, boh, T, i_h, i_hv, i_v,
                          H, HV, K, V, BT, BK, BV, DOT_PREC, MAPS)
        i_t -= 1

    p_dh0 = tl.make_block_ptr(dh0 + i_nh.to(tl.int64) * K * VS, (K, VS), (VS, 1), (0, i_v * BV), (BK, BV), (1, 0))
    tl.store(p_dh0, b_dh, boundary_check=(0, 1))


def widest_tile_v(K: int) -> int:
    """The widest V tile of the reverse walk at key dimension K: the carried dS tile is BK × BV fp32, kept at ≤ 8K
    elements (64 registers a thread at 4 warps)."""
    return min(64, max(16, 8192 // max(16, triton.next_power_of_2(K))))


def state_pass_bwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, gc: torch.Tensor, do: torch.Tensor,
                   dv_local: torch.Tensor, dht: torch.Tensor, scale: float, cu_seqlens: torch.Tensor | None = None,
                   chunk_offsets: torch.Tensor | None = None, num_chunks: int | None = None,
                   dot_prec: str | None = None, block_v: int | None = None):
    """Reverse pass. q, k ``[B, T, H, K]``; w ``[B, T, HV, K]``; gc ``[B, T, HV]`` fp32; do, dv_local
    ``[B, T, HV, V]``; dht ``[N, HV, K, V]``. With cu_seqlens (B == 1), chunk_offsets ``[N + 1]`` gives each
    sequence's first chunk and num_chunks the total. Returns dh ``[B, NT, HV, K, V]`` (dS leaving each chunk),
    dv_new ``[B, T, HV, V]`` and dh0 ``[N, HV, K, V]``, all fp32. ``block_v`` (None: the rule below) is for
    benchmarks."""
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    NT = num_chunks if cu_seqlens is not None else cdiv(T, BT)
    dh = torch.empty(B, NT, HV, K, V, dtype=torch.float32, device=q.device)
    dv_new = torch.empty(B, T, HV, V, dtype=torch.float32, device=q.device)
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    BK = max(16, triton.next_power_of_2(K))
    # within the widest tile, as narrow as it takes to fill the SMs (the walk is latency-bound where few programs run)
    sms = num_sms(q.device)
    BV = state_tile_v(block_v, fill_tile_v(N * HV, V, widest_tile_v(K), sms))
    grid = (cdiv(V, BV), N * HV)
    state_pass_bwd_kernel[grid](
        q, k, w, gc, do, dv_local, dht, dh, dv_new, dh0, cu_seqlens, chunk_offsets, scale, T,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, DOT_PREC=bwd_dot_precision(q.dtype, dot_prec), IS_VARLEN=cu_seqlens is not None,
        MAPS=False,
        num_warps=4,
        **launch_options("state_pass_bwd"),
    )
    return dh, dv_new, dh0
