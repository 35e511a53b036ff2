"""The state maps' norm bound, per chunk, and the segmented Hopper forward's two plans made from it (``forward.py``:
the negligible maps phase A skips, and the warm-ups), in two Triton launches instead of ≈ 30 small PyTorch ops.

A token's transition S ← γ_t (I − β_t k_t k_tᵀ) S has 2-norm γ_t · max(1, |1 − β_t ‖k_t‖²|), so the map over a run
of tokens has a norm below 2 to the sum of

    b_t = g_t log2 e + log2 max(1, |1 − β_t ‖k_t‖²|)                  (g_t = log γ_t)

over the run. :func:`chunk_bounds` sums b_t per 64-token chunk ([B, HV, NC], fp32 accumulated); :func:`segment_plan`
turns those sums into, per segment s and value head, (1) whether the segment's own map is negligible (its sum below
``threshold``), (2) the warm-up: the fewest w ≤ ``w_max`` chunks before s ≥ 1 whose sum is below ``threshold``, and
(3) whether the head has a segment with no such w (it then walks its maps, and its warm-ups are 0). The twins are
:func:`chunk_bounds_ref` and :func:`segment_plan_ref` (PyTorch, float64 sums).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..utils import cdiv

BT = 64
LOG2E = math.log2(math.e)
BLOCK = 128          # the plan's chunks per step of its loops (a segment's sum, a warm-up's running sum)


@triton.jit(do_not_specialize=["T", "NC"])      # lengths: a new T compiles nothing
def chunk_bounds_kernel(k, g, beta, bound, T, NC, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                        BK: tl.constexpr, BT: tl.constexpr, LOG2E: tl.constexpr):
    # grid (NC, B·HV): one chunk of one value head. Reads its 64 rows of k (the head's qk head), g and β; writes the
    # sum of b_t over them (rows past T add nothing: g = β = 0 there) to bound [B, HV, NC]
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T
    rows = i_b.to(tl.int64) * T + o_t
    o_k = tl.arange(0, BK)
    b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k[None, :] < K),
                  other=0).to(tl.float32)
    norm2 = tl.sum(b_k * b_k, 1)
    b_g = tl.load(g + rows * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    b_beta = tl.load(beta + rows * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    b_t = b_g * LOG2E + tl.log2(tl.maximum(tl.abs(1 - b_beta * norm2), 1.0))
    tl.store(bound + i_bh.to(tl.int64) * NC + i_c, tl.sum(b_t, 0))


def chunk_bounds(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``[B, HV, NC]`` fp32: Σ b_t over each 64-token chunk (NC = ⌈T/64⌉) from keys ``[B, T, H, K]``, log decays g
    and β ``[B, T, HV]``. One launch; reads k once."""
    B, T, H, K = k.shape
    HV = g.shape[2]
    NC = cdiv(T, BT)
    bound = torch.empty(B, HV, NC, dtype=torch.float32, device=k.device)
    chunk_bounds_kernel[(NC, B * HV)](k.contiguous(), g.contiguous(), beta.contiguous(), bound, T, NC, H=H, HV=HV,
                                      K=K, BK=triton.next_power_of_2(K), BT=BT, LOG2E=LOG2E, num_warps=4)
    return bound


def chunk_bounds_ref(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The twin of :func:`chunk_bounds`, in float64."""
    B, T, H, _ = k.shape
    HV = g.shape[2]
    norm2 = k.double().square().sum(-1).repeat_interleave(HV // H, dim=2)
    b_t = g.double() * LOG2E + torch.log2(torch.clamp((1 - beta.double() * norm2).abs(), min=1.0))
    NC = cdiv(T, BT)
    b_t = torch.nn.functional.pad(b_t, (0, 0, 0, NC * BT - T))
    return b_t.view(B, NC, BT, HV).sum(2).transpose(1, 2)


@triton.jit(do_not_specialize=["NC", "S", "LC", "W_MAX"])
def segment_plan_kernel(bound, negligible, warm, walk, NC, S, LC, W_MAX, THRESHOLD, HV: tl.constexpr,
                        BLOCK: tl.constexpr):
    # grid (B·HV,): one (sequence, value head). Reads its NC chunk sums; writes, per segment s (of LC chunks),
    # negligible / warm / walk [B·S, HV]: the segment's sum below THRESHOLD; the fewest w ≤ W_MAX chunks before it
    # whose running sum (from the chunk just before it backwards) falls below THRESHOLD (0 for s = 0); and, for every
    # segment, whether some s ≥ 1 has no such w (then every warm-up of the head is 0)
    i_bh = tl.program_id(0)
    i_b, i_hv = i_bh // HV, i_bh % HV
    base = bound + i_bh.to(tl.int64) * NC
    o = tl.arange(0, BLOCK)
    NONE = 1 << 30
    # while loops throughout: the bounds are run-time values (Triton's interpreter cannot range over them)
    any_missing = tl.zeros([], dtype=tl.int32)
    s = tl.zeros([], dtype=tl.int32)
    while s < S:
        # the segment's own sum
        total = tl.zeros([], dtype=tl.float32)
        c0 = tl.zeros([], dtype=tl.int32)
        while c0 < LC:
            total += tl.sum(tl.load(base + s * LC + c0 + o, mask=c0 + o < LC, other=0), 0)
            c0 += BLOCK
        out = (i_b * S + s) * HV + i_hv
        tl.store(negligible + out, (total < THRESHOLD).to(tl.int8))
        # the warm-up: running sums over the chunks p − 1, p − 2, ... (p = s·LC), the first below THRESHOLD
        w = tl.zeros([], dtype=tl.int32)
        if s > 0:
            carry = tl.zeros([], dtype=tl.float32)
            w = tl.full([], NONE, dtype=tl.int32)
            w0 = tl.zeros([], dtype=tl.int32)
            while w0 < W_MAX:
                m = w0 + o < W_MAX
                vals = tl.load(base + s * LC - 1 - w0 - o, mask=m, other=0)
                running = carry + tl.cumsum(vals, 0)
                w = tl.minimum(w, tl.min(tl.where(m & (running < THRESHOLD), w0 + o + 1, NONE), 0))
                carry += tl.sum(vals, 0)
                w0 += BLOCK
            any_missing = tl.maximum(any_missing, (w == NONE).to(tl.int32))
        tl.store(warm + out, w)
        s += 1
    s = tl.zeros([], dtype=tl.int32)
    while s < S:
        out = (i_b * S + s) * HV + i_hv
        tl.store(walk + out, any_missing.to(tl.int8))
        if any_missing != 0:
            tl.store(warm + out, 0)
        s += 1


def segment_plan(bound: torch.Tensor, segments: int, w_max: int, threshold: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(negligible, warm, walk), each ``[B·S, HV]`` (bool, int32, bool), from chunk sums ``[B, HV, NC]``
    (:func:`chunk_bounds`) for ``segments`` = S segments of NC/S chunks (S divides NC): see the module's docstring.
    ``w_max`` ≤ NC/S. One launch; no host sync."""
    B, HV, NC = bound.shape
    S = segments
    if NC % S or not 1 <= w_max <= NC // S:
        raise ValueError(f"{S} segments of {NC} chunks with warm-ups of at most {w_max}: need S | NC and "
                         f"1 ≤ w_max ≤ NC/S")
    negligible = torch.empty(B * S, HV, dtype=torch.int8, device=bound.device)
    walk = torch.empty_like(negligible)
    warm = torch.empty(B * S, HV, dtype=torch.int32, device=bound.device)
    segment_plan_kernel[(B * HV,)](bound.contiguous(), negligible, warm, walk, NC, S, NC // S, w_max,
                                   float(threshold), HV=HV, BLOCK=BLOCK, num_warps=4)
    return negligible.bool(), warm, walk.bool()


def segment_plan_ref(bound: torch.Tensor, segments: int, w_max: int, threshold: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin of :func:`segment_plan` (float64 sums)."""
    B, HV, NC = bound.shape
    S, LC = segments, NC // segments
    b = bound.double().transpose(1, 2)                                      # [B, NC, HV]
    negligible = b.view(B, S, LC, HV).sum(2) < threshold                    # [B, S, HV]
    cs = torch.cat([b.new_zeros(B, 1, HV), b.cumsum(1)], 1)                 # over chunks [c, p): cs[p] − cs[c]
    starts = torch.arange(1, S, device=b.device) * LC
    w = torch.arange(1, w_max + 1, device=b.device)
    ok = (cs[:, starts, None, :] - cs[:, starts[:, None] - w[None, :], :]) < threshold   # [B, S − 1, w_max, HV]
    found = ok.any(2)
    walk = ~found.all(1)                                                    # [B, HV]
    warm = torch.where(found & ~walk[:, None], ok.int().argmax(2) + 1, 0)
    warm = torch.cat([warm.new_zeros(B, 1, HV), warm], 1)
    return (negligible.reshape(B * S, HV), warm.reshape(B * S, HV).to(torch.int32),
            walk[:, None].expand(B, S, HV).reshape(B * S, HV))
