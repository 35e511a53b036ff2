"""Triton kernels of the recurrent (token-by-token) gated delta rule: the training op for short sequences and
the serving decode step share one forward kernel; constexpr flags pick the variant.

Per value head the state S is ``K × V`` (K-major: row k holds V contiguous values, the layout of the chunked op's
initial/final states). One program owns one (sequence, value head, V tile): its ``K × BV`` slice of S lives in
registers for the whole sequence, so the state is read once and written once however many tokens it walks.
The delta rule is separable in V (column j of S only ever meets column j of v), so V tiles never talk to each
other in the forward; every reduction runs over K, inside the program.

    per token:  S ← e^g S;   u = β (v − Sᵀk);   S ← S + k uᵀ;   o = scale · Sᵀq

Memory traffic per (sequence, value head): state K·V·bytes read + the same written (+ K·V per token with
intermediate states); per token q, k (K each), v, o (V each), g, β. For decode that is all state traffic: the
kernel is memory-bound, and the tile choice below only has to keep enough loads in flight.

The backward walks each sequence in reverse and needs S_{t−1} at every token. The states cannot be recovered by
running the recurrence backwards (that divides by e^g, which underflows), so the forward kernel is re-run with
STORE_INTERMEDIATE into an fp32 scratch of B·T·HV·K·V floats, and the reverse kernel reads it. That memory is the
price of the recurrent form's backward: it is meant for short sequences (use the chunked op for long ones).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..common import MIN_LOG_DECAY, launch_options
from ..utils import cdiv, next_power_of_2


def one_step_path(T: int, cu_seqlens, intermediate_states) -> bool:
    """Whether a forward launch takes the kernel's ONE_STEP path: a decode step (one token per sequence, no
    intermediate states). That path keeps the state tile in the pool's dtype and widens it element by element
    instead of the token loop's fp32 copy, and holds the tile in registers from its load to its store (a streamed
    tile needs fewer registers but measured slower at every tile and layout): the step is one load and one store of
    the state per program, bound by the cross-warp reductions over K, so it gets tiles of its own (:func:`pick_tiles`)."""
    return T == 1 and cu_seqlens is None and intermediate_states is None


@triton.jit
def _prepare_token(p_q, p_k, p_g, p_beta, b_A, b_dt, m_k, scale,
                   USE_QK_L2NORM: tl.constexpr, USE_GATE_IN_KERNEL: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr):
    """Load one token's q, k (length K), g, β and apply the fused pre-processing, all in fp32.
    Returns (q·scale, k, g, β): exactly what the recurrence consumes."""
    b_q = tl.load(p_q, mask=m_k, other=0.).to(tl.float32)
    b_k = tl.load(p_k, mask=m_k, other=0.).to(tl.float32)
    if USE_QK_L2NORM:
        # the whole K row is in this program, so the norm needs no communication; eps 1e-6 as fla and transformers
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    b_g = tl.load(p_g).to(tl.float32)
    if USE_GATE_IN_KERNEL:
        b_x = b_g + b_dt
        # g = −exp(A_log)·softplus(x), softplus(x) = x above 20 (torch's threshold); both branches are evaluated,
        # and exp overflowing to inf in the unused one is harmless (where picks x)
        b_g = -b_A * tl.where(b_x > 20., b_x, tl.log(1. + tl.exp(b_x)))
        b_g = tl.where(b_g < MIN_LOG_DECAY, MIN_LOG_DECAY, b_g)   # e^{A_log} is inf from A_log ≈ 88.7 (utils)
    b_beta = tl.load(p_beta).to(tl.float32)
    if USE_BETA_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
    return b_q * scale, b_k, b_g, b_beta


@triton.jit
def _one_step(q, k, v, g, beta, o, h0, ht, b_A, b_dt, bos, i_s, has_slot, i_h, i_hv, o_k, o_v, m_k, m_v, m_h, o_h,
              scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
              USE_QK_L2NORM: tl.constexpr, USE_GATE_IN_KERNEL: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr):
    """The ONE_STEP path of :func:`fused_recurrent_fwd_kernel`: reads the K × BV slice of S (pool dtype), one
    token's q, k (K), v (BV), g, β; writes o (BV) and S' (pool dtype)."""
    b_q, b_k, b_g, b_beta = _prepare_token(q + (bos * H + i_h) * K + o_k, k + (bos * H + i_h) * K + o_k,
                                           g + bos * HV + i_hv, beta + bos * HV + i_hv, b_A, b_dt, m_k, scale,
                                           USE_QK_L2NORM, USE_GATE_IN_KERNEL, USE_BETA_SIGMOID)
    b_v = tl.load(v + (bos * HV + i_hv) * V + o_v, mask=m_v, other=0.).to(tl.float32)
    b_decay = tl.exp(b_g)
    if USE_INITIAL_STATE:
        b_s = tl.load(h0 + (i_s * HV + i_hv) * K * V + o_h, mask=m_h & has_slot, other=0.)
        b_sk = tl.sum(b_s.to(tl.float32) * b_k[:, None], 0)
        b_sq = tl.sum(b_s.to(tl.float32) * b_q[:, None], 0)
        b_u = b_beta * (b_v - b_decay * b_sk)
        b_o = b_decay * b_sq + tl.sum(b_q * b_k) * b_u
    else:
        b_u = b_beta * b_v
        b_o = tl.sum(b_q * b_k) * b_u
    tl.store(o + (bos * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_FINAL_STATE:
        b_new = b_k[:, None] * b_u[None, :]
        if USE_INITIAL_STATE:
            b_new += b_decay * b_s.to(tl.float32)
        p_ht = ht + (i_s * HV + i_hv) * K * V + o_h
        tl.store(p_ht, b_new.to(p_ht.dtype.element_ty), mask=m_h & has_slot)


@triton.jit
def fused_recurrent_fwd_kernel(
    q, k, v, g, beta, o,
    h0,                     # initial states [*, HV, K, V], read at row i_s (None without USE_INITIAL_STATE)
    ht,                     # final states [*, HV, K, V], written at row i_s (may be h0 itself: the decode pool)
    hs,                     # per-token states S_t [B·T, HV, K, V] (STORE_INTERMEDIATE)
    cu_seqlens, state_indices, A_log, dt_bias,
    scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, STORE_INTERMEDIATE: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_STATE_INDICES: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, USE_GATE_IN_KERNEL: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    ONE_STEP: tl.constexpr, STATE_VK: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)                       # grouped value heads: HV // H value heads share one q/k head
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
    # which state row this sequence reads and writes; a negative slot means "start from zero, write nothing"
    if USE_STATE_INDICES:
        i_s = tl.load(state_indices + i_n).to(tl.int64)
    else:
        i_s = i_n.to(tl.int64)
    has_slot = i_s >= 0
    i_s = tl.maximum(i_s, 0)                      # keep even the masked-off addresses inside the tensor

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    # offsets of this program's K × BV slice inside one state: K-major [K, V] (row k holds V values), or V-major
    # [V, K] (STATE_VK: row j holds the K values of column j). The tile is [BK, BV] either way; only the addresses
    # differ, and the compiler orders the tile's registers along whichever axis is contiguous in memory
    if STATE_VK:
        o_h = o_k[:, None] + o_v[None, :] * K
    else:
        o_h = o_k[:, None] * V + o_v[None, :]

    b_A = 0.
    b_dt = 0.
    if USE_GATE_IN_KERNEL:
        b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        b_dt = tl.load(dt_bias + i_hv).to(tl.float32)

    if ONE_STEP:
        # one token, no intermediate states (a decode step): the state tile stays in the pool's dtype and is widened
        # element by element, where the loop below holds an fp32 copy; o comes from the state entering the step,
        #     o = scale·S'ᵀq = e^g (Sᵀq') + (q'·k) u,   u = β (v − e^g Sᵀk),   S' = e^g S + k uᵀ   (q' = scale·q)
        # so both reductions read S as it arrives and S' is only formed for the store
        _one_step(q, k, v, g, beta, o, h0, ht, b_A, b_dt, bos, i_s, has_slot, i_h, i_hv, o_k, o_v, m_k, m_v, m_h,
                  o_h, scale, H, HV, K, V, BK, BV, USE_INITIAL_STATE, STORE_FINAL_STATE, USE_QK_L2NORM,
                  USE_GATE_IN_KERNEL, USE_BETA_SIGMOID)
        return

    # read the state once: K × BV elements
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        p_h0 = h0 + (i_s * HV + i_hv) * K * V + o_h
        b_h += tl.load(p_h0, mask=m_h & has_slot, other=0.).to(tl.float32)

    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_v = v + (bos * HV + i_hv) * V + o_v
    p_o = o + (bos * HV + i_hv) * V + o_v
    p_g = g + bos * HV + i_hv
    p_beta = beta + bos * HV + i_hv
    # a while loop, not range(T): the Triton 3.6 interpreter cannot take range() of a runtime int under NumPy 2
    i_t = 0
    while i_t < T:
        # per token: read q, k (K), v (BV), g, β; write o (BV)
        b_q, b_k, b_g, b_beta = _prepare_token(p_q, p_k, p_g, p_beta, b_A, b_dt, m_k, scale,
                                               USE_QK_L2NORM, USE_GATE_IN_KERNEL, USE_BETA_SIGMOID)
        b_v = tl.load(p_v, mask=m_v, other=0.).to(tl.float32)
        b_h *= tl.exp(b_g)
        b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)
        if STORE_INTERMEDIATE:
            # speculative decoding (and the backward) keep the state after every token: K × BV written per token
            p_hs = hs + ((bos + i_t) * HV + i_hv) * K * V + o_h
            tl.store(p_hs, b_h.to(p_hs.dtype.element_ty), mask=m_h)
        p_q += H * K
        p_k += H * K
        p_v += HV * V
        p_o += HV * V
        p_g += HV
        p_beta += HV
        i_t += 1

    # write the state once (unless the sequence has no slot)
    if STORE_FINAL_STATE:
        p_ht = ht + (i_s * HV + i_hv) * K * V + o_h
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=m_h & has_slot)


@triton.jit
def fused_recurrent_bwd_kernel(
    q, k, v, g, beta, do, dht,
    h0,                     # initial states [N, HV, K, V] (None without USE_INITIAL_STATE)
    hs,                     # S_t after every token [B·T, HV, K, V] fp32, from the forward kernel
    dq, dk,                 # [NV, B·T, HV, K] fp32: partial sums over this program's V tile
    dv,                     # [B·T, HV, V]: complete (the V tiles own disjoint columns)
    dg, dbeta,              # [NV, B·T, HV] fp32: partial sums
    dh0,                    # [N, HV, K, V] fp32
    cu_seqlens, A_log, dt_bias,
    scale, T, BT_total,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, USE_GATE_IN_KERNEL: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
):
    """Reverse walk carrying dS (the gradient of the state leaving the token). With S' = e^g S_{t−1},
    u = v − S'ᵀk, S_t = S' + β k uᵀ, o = scale·S_tᵀq, per token (t from last to first):

        dq = scale·S_t dO;   dS += scale·q dOᵀ;   d(βu) = dSᵀk;   dk = dS (βu) − S' du;   dβ = u·d(βu)
        du = β d(βu) = dv;   dS' = dS − k duᵀ;    dg = ⟨dS', S'⟩;   dS ← e^g dS'

    The gradients are those of the *prepared* q, k, g, β (after the fused L2 norm / gate / sigmoid); the chain
    rule through the pre-processing and the sum over grouped heads and V tiles run afterwards in PyTorch.
    Reads per token: S_{t−1} (K × BV), q, k, v, dO, g, β; writes dq, dk (K), dv (BV), dg, dβ."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    o_h = o_k[:, None] * V + o_v[None, :]

    b_A = 0.
    b_dt = 0.
    if USE_GATE_IN_KERNEL:
        b_A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        b_dt = tl.load(dt_bias + i_hv).to(tl.float32)

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRADIENT:
        b_dh += tl.load(dht + (i_n.to(tl.int64) * HV + i_hv) * K * V + o_h, mask=m_h, other=0.).to(tl.float32)

    i_pv = i_v.to(tl.int64) * BT_total          # this V tile's slice of the partial-sum buffers
    i_r = 0
    while i_r < T:
        i_t = bos + T - 1 - i_r                   # absolute token index, last to first
        b_q, b_k, b_g, b_beta = _prepare_token(q + (i_t * H + i_h) * K + o_k, k + (i_t * H + i_h) * K + o_k,
                                               g + i_t * HV + i_hv, beta + i_t * HV + i_hv, b_A, b_dt, m_k,
                                               scale, USE_QK_L2NORM, USE_GATE_IN_KERNEL, USE_BETA_SIGMOID)
        b_v = tl.load(v + (i_t * HV + i_hv) * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_do = tl.load(do + (i_t * HV + i_hv) * V + o_v, mask=m_v, other=0.).to(tl.float32)
        # S_{t−1}: the previous token's stored state, or the initial state at the first token
        if i_t > bos:
            b_hp = tl.load(hs + ((i_t - 1) * HV + i_hv) * K * V + o_h, mask=m_h, other=0.)
        elif USE_INITIAL_STATE:
            b_hp = tl.load(h0 + (i_n.to(tl.int64) * HV + i_hv) * K * V + o_h, mask=m_h, other=0.).to(tl.float32)
        else:
            b_hp = tl.zeros([BK, BV], dtype=tl.float32)
        b_eg = tl.exp(b_g)
        b_hp = b_hp * b_eg                                           # S'
        b_u = b_v - tl.sum(b_hp * b_k[:, None], 0)
        b_bu = b_beta * b_u
        b_h = b_hp + b_k[:, None] * b_bu[None, :]                    # S_t
        b_dq = scale * tl.sum(b_h * b_do[None, :], 1)
        b_dh += b_q[:, None] * b_do[None, :]                         # b_q carries the scale already
        b_dbu = tl.sum(b_dh * b_k[:, None], 0)
        b_du = b_beta * b_dbu
        b_dk = tl.sum(b_dh * b_bu[None, :], 1) - tl.sum(b_hp * b_du[None, :], 1)
        b_dbeta = tl.sum(b_u * b_dbu)
        b_dh = b_dh - b_k[:, None] * b_du[None, :]                   # dS'
        b_dg = tl.sum(b_dh * b_hp)
        b_dh = b_dh * b_eg                                           # dS_{t−1}

        tl.store(dq + ((i_pv + i_t) * HV + i_hv) * K + o_k, b_dq, mask=m_k)
        tl.store(dk + ((i_pv + i_t) * HV + i_hv) * K + o_k, b_dk, mask=m_k)
        p_dv = dv + (i_t * HV + i_hv) * V + o_v
        tl.store(p_dv, b_du.to(p_dv.dtype.element_ty), mask=m_v)
        tl.store(dg + (i_pv + i_t) * HV + i_hv, b_dg)
        tl.store(dbeta + (i_pv + i_t) * HV + i_hv, b_dbeta)
        i_r += 1

    tl.store(dh0 + (i_n.to(tl.int64) * HV + i_hv) * K * V + o_h, b_dh, mask=m_h)


# ----------------------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------------------
@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: pretend to be an H200 so the tiles match the GPU's


@functools.lru_cache(maxsize=1024)
def pick_tiles(num_programs_nh: int, K: int, V: int, device: torch.device, state_bytes: int = 4,
               multi_token: bool = False, one_step: bool = False, state_vk: bool = False) -> tuple[int, int, int]:
    """(BK, BV, num_warps). BK covers all of K (the reductions run over K inside a program). BV: rows of 128 bytes
    of state (whole cache lines: 32 fp32 or 64 bf16 values, ``state_bytes`` per value) when there are enough
    (sequence, head) pairs to fill the machine, narrower tiles (more programs, more loads in flight) when there
    are few, e.g. decode at batch 1. One warp per 4 KB of state slice (32 registers per thread, 4 warps for a
    128 × 32 fp32 or 128 × 64 bf16 slice; 8 warps measure slower).
    ``multi_token`` (T > 1): one-warp tiles of 8 to 32 columns by pool dtype and layout (see below); ``one_step``
    (the ONE_STEP path): one warp per 4096 state values, the columns by pool dtype and layout (see below);
    ``state_vk``: the states are V-major (``[*, HV, V, K]``), which has tiles of its own (below). Cached: a
    launch plan per shape, so a decode step pays one dict lookup instead of the arithmetic (the key has only whether
    T > 1: kernels never specialise on T)."""
    BK = next_power_of_2(K)
    fp32 = state_bytes == 4
    if one_step:
        # ONE_STEP, K-major: bf16 slices of 32 columns, fp32 of 64, one warp per 4096 values. The bf16 step is
        # bound by the shared-memory traffic of the cross-warp reductions over K, which scales with values, not
        # bytes: fewer warps per program, fewer cross-warp rounds. V-major (a program's slice is BV whole rows of K
        # values, one contiguous block): narrower one-warp tiles; a bf16 V-major pool is the fastest decode.
        BV = (32 if fp32 else 16) if state_vk else (64 if fp32 else 32)
    elif multi_token:
        # several tokens per sequence: the step is a chain of dependent reductions over K per token, so latency,
        # not bytes, sets the time; one-warp programs (reductions by shuffles, no cross-warp barrier), many per SM,
        # hide it best
        BV = (8 if fp32 else 16) if state_vk else (32 if fp32 else 16)
    else:
        BV = 128 // state_bytes
    BV = min(next_power_of_2(V), BV)
    while BV > 8 and num_programs_nh * cdiv(V, BV) < 4 * _num_sms(device):
        BV //= 2
    if multi_token:
        num_warps = 1
    else:
        num_warps = max(1, min(8, BK * BV // 4096 if one_step else BK * BV * state_bytes // 4096))
    return BK, BV, num_warps


def fused_recurrent_fwd(q, k, v, g, beta, scale, initial_state, final_state, intermediate_states, cu_seqlens,
                        state_indices, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid, BV=None, num_warps=None,
                        state_vk=False):
    """Launch the forward kernel; returns o ``[B, T, HV, V]`` in v's dtype.

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g, beta ``[B, T, HV]`` (all contiguous). initial_state /
    final_state: ``[*, HV, K, V]`` or None (they may be the same tensor: the decode pool, updated in place);
    sequence n reads and writes row ``state_indices[n]`` (or n), skipped when negative. intermediate_states:
    ``[B, T, HV, K, V]`` or None. ``state_vk``: the states (all three) are V-major, ``[*, HV, V, K]`` (the decode
    pool's ``state_layout="vk"``), with tiles of their own (:func:`pick_tiles`). BV / num_warps override the tile
    heuristic (benchmarks); launch options (a register cap) come from ``common.launch_options("fused_recurrent_fwd")``
    (none by default; ``common.launch_options_override`` for a sweep)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = final_state if final_state is not None else initial_state
    one_step = one_step_path(T, cu_seqlens, intermediate_states)
    BK, BV_, nw = pick_tiles(N * HV, K, V, q.device, state.element_size() if state is not None else 4, T > 1,
                             one_step, state_vk)
    BV, num_warps = BV or BV_, num_warps or nw
    o = torch.empty_like(v)
    grid = (cdiv(V, BV), N * HV)
    fused_recurrent_fwd_kernel[grid](
        q, k, v, g, beta, o, initial_state, final_state, intermediate_states, cu_seqlens, state_indices,
        A_log, dt_bias, scale, T, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=final_state is not None,
        STORE_INTERMEDIATE=intermediate_states is not None, IS_VARLEN=cu_seqlens is not None,
        USE_STATE_INDICES=state_indices is not None, USE_QK_L2NORM=use_qk_l2norm,
        USE_GATE_IN_KERNEL=A_log is not None, USE_BETA_SIGMOID=use_beta_sigmoid,
        ONE_STEP=one_step, STATE_VK=state_vk, num_warps=num_warps,
        **launch_options("fused_recurrent_fwd"))
    return o


def fused_recurrent_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, A_log, dt_bias, use_qk_l2norm,
                        use_beta_sigmoid, do, dht):
    """Gradients of the prepared inputs: dq, dk ``[B, T, HV, K]`` (per value head, before the sum over grouped
    heads), dv ``[B, T, HV, V]`` in v's dtype, dg, dbeta ``[B, T, HV]``, dh0 ``[N, HV, K, V]``; all fp32 but dv.
    Re-runs the forward kernel to materialise every S_t (B·T·HV·K·V fp32 scratch), then the reverse kernel."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    hs = q.new_empty(B, T, HV, K, V, dtype=torch.float32)
    fused_recurrent_fwd(q, k, v, g, beta, scale, initial_state, None, hs, cu_seqlens, None, A_log, dt_bias,
                        use_qk_l2norm, use_beta_sigmoid)
    BK, BV, num_warps = pick_tiles(N * HV, K, V, q.device)
    NV = cdiv(V, BV)
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = torch.empty(NV, B, T, HV, K, **f32)
    dk = torch.empty(NV, B, T, HV, K, **f32)
    dg = torch.empty(NV, B, T, HV, **f32)
    dbeta = torch.empty(NV, B, T, HV, **f32)
    dv = torch.empty_like(v)
    dh0 = torch.empty(N, HV, K, V, **f32)
    fused_recurrent_bwd_kernel[(NV, N * HV)](
        q, k, v, g, beta, do, dht, initial_state, hs, dq, dk, dv, dg, dbeta, dh0, cu_seqlens, A_log, dt_bias,
        scale, T, B * T, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_INITIAL_STATE=initial_state is not None, USE_FINAL_STATE_GRADIENT=dht is not None,
        IS_VARLEN=cu_seqlens is not None, USE_QK_L2NORM=use_qk_l2norm, USE_GATE_IN_KERNEL=A_log is not None,
        USE_BETA_SIGMOID=use_beta_sigmoid, num_warps=num_warps)
    return dq.sum(0), dk.sum(0), dv, dg.sum(0), dbeta.sum(0), dh0
