"""The split forward: the state pass walks the chunks, the output is computed in parallel afterwards.

    h, V_new, S_T = state_pass_fwd(k, W, U, gc, S_0)     sequential: per chunk W S and Kᵀ V_new (state_pass.py)
    o             = output_fwd(q, k, V_new, h, gc)        parallel over (V tile, chunk, value head) (output.py)

after the pre-pass (gc, W, U; fused_prepass.py). The walk (fused_fwd.py) does both in one program per (sequence,
value head, V slice); this path keeps only the two dots that feed the next chunk on the sequential chain and pays
for it with h (K·V fp32 per chunk and value head) and V_new written once and read once (docs/architecture.md).

When the state pass's programs cannot fill the SMs, long sequences are cut into segments exactly as for the walk
(``seq_parallel.py``: phase A the affine map of every segment, phase B the scan that gives each segment its true
entering state) and phase C is the state pass run over the segments as if each were a sequence of its own: the
segments are chunk-aligned, so the pseudo-sequences' chunks are the real ones in the same global order, h comes
out in the layout the output kernel reads, and only the final states need picking (the last segment's of each
sequence). The split is planned by ``seq_parallel.plan_segments`` with phase A costed against a state-pass chunk
(:data:`AFFINE_COST`) instead of a walk chunk.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..utils import cdiv
from . import CHUNK, dot_precision, num_sms
from .fused_fwd import fused_fwd_config, launch_walk
from .output import output_fwd
from .seq_parallel import affine_scan, plan_segments, segment_tables
from .state_pass import state_pass_fwd
from .varlen import chunk_tables
from .wy import wy_fwd

# phase A's chunk (two dots over the K + V columns of [M | N]) against a chunk of the state pass (the same two
# dots over V columns), per column slice. First estimate 1.0 (about equal work per program); run 12 measured the
# planned segments slower than none at both shapes it chose them for (1×32768 H=2 HV=8: 2.33 vs 2.20 ms forward;
# K = V = 64 H=16: 2.02 vs 1.91), which the model matches from ≈ 1.7 up, so 2.0: it splits only when far fewer
# programs than SMs walk very long sequences (e.g. HV = 1).
AFFINE_COST = 2.0

# The output kernel's two fp32 products (Q S, P V_new) for bf16 inputs: "bf16x3" (common/dot.py: Q stays bf16,
# so Q S is two bf16 MMAs and P V_new three, ≈ 2^-16 per product). Run 12 (bench_split_precision.py, H200):
# anchor o 1.731e-3 against float64 as at "tf32x3" (the walk's output precision; "tf32": 1.994e-3, at the bf16
# goal's edge), every gradient unchanged; output kernel 0.981 → 0.397 ms at B=8 T=4096 H=16 (0.141 → 0.063 at
# B=1), split forward 2.508 → 1.916 (0.421 → 0.339); gpu_check_core's K=60 V=100, K=128 V=256 and varlen cases
# in bf16 within 2× of the baseline at it. Other dtypes: ``dot_precision``.
OUTPUT_PREC_BF16 = "bf16x3"


# The dtype the split forward stores h and V_new in for bf16 inputs: "bf16" (since run 15) or "fp32". They are the
# two largest intermediates (h: K·V per chunk and value head) and are only read by the output kernel: the state
# pass keeps the state it carries in fp32 registers, so bf16 storage rounds what o reads (≈ 2^-9 relative, once,
# not compounding over chunks) and leaves the final state unchanged. Count at B=8 T=4096 H=16 K=V=128: the state
# pass writes h 537 MB + V_new 268 MB in fp32 of its ≈ 1.5 GB, the output kernel reads them of its ≈ 1.2 GB.
# Run 15 (bench_split_precision.py, H200; prediction in brackets): state pass 0.615 → 0.499 ms (≈ 0.50), output
# kernel 0.398 → 0.288 (≈ 0.28), split forward 1.623 → 1.394 (≈ 1.39) at B=8 T=4096 H=16; 2.253 → 2.045 at
# B=1 T=32768, 0.309 → 0.284 at B=1 T=4096; fwd+bwd 7.53 → 7.29. o's error 1.73e-3 → 2.43e-3 against float64
# (≈ 2.0e-3 predicted; the rounded-PyTorch baseline: 2.86e-3), the final state and every gradient bitwise as
# before. The split path's extra memory halves (h). Other input dtypes: fp32.
STORE_BF16 = "bf16"
# The dtype the split path's pre-pass writes W and U in for bf16 inputs, "fp32" or "bf16" (what fla does). Unlike
# h, W enters the state recurrence (V_new = U − W S), so its rounding reaches the final state and carries across
# chunks. Bytes at B=8 T=4096 H=16: 537 MB written by the pre-pass, read by the state pass. Run 15, on top of
# STORE_BF16 (prediction: pre-pass 0.61 → ≈ 0.53 ms, state pass −0.08): pre-pass 0.615 → 0.562, state pass 0.499
# → 0.478, split forward 1.394 → 1.322 at B=8 — but the state pass is *slower* where it is latency-bound (B=1
# T=32768: 1.125 → 1.330 ms, split forward 2.045 → 2.194; B=1 T=4096: 0.154 → 0.175), and the final state's error
# nearly doubles (1.05e-3 → 1.98e-3, o 2.43e-3 → 2.97e-3). Mixed speed for a doubled state error: stays "fp32".
WU_STORE_BF16 = "fp32"
STORES = ("fp32", "bf16")
# Where the split path forms the WY products: "state_pass" — the pre-pass writes each chunk's inverse A_inv and
# the state pass computes V_new = A_inv (β ⊙ V − βΓ ⊙ (K S)) from it and the values (state_pass.py, FROM_A_INV) —
# or "prepass" (W and U written by the pre-pass, read by the state pass; the only form until run 18); "auto" (the
# default): "state_pass" from WY_IN_STATE_PASS_MIN_PAIRS (sequences × value heads) on, else "prepass". Count at B=8
# T=4096 H=16 K=V=128 bf16: the pre-pass writes 134 MB (A_inv) instead of 805 (W, U fp32) and skips two
# [64, 64] × [64, 128] dots per chunk; the state pass reads A_inv 134 MB and V 134 MB instead of 805 MB and runs
# one more dot on its chain ([64, 64] × [64, BV]). ncu (run 18) had the pre-pass bound by L1 / shared-memory
# wavefronts (80%, DRAM 22%) and the state pass by load latency (long scoreboard, DRAM 39%). Prediction (written
# before timing it): pre-pass 0.589 → ≈ 0.28 ms (kkt_solve alone: 0.268), state pass 0.505 → ≈ 0.40, split forward
# 1.385 → ≈ 0.97 at B=8; at B=1 T=32768 (latency-bound state pass) pre-pass −0.3, state pass +≈ 0.2.
# Measured (run 18, benchmarks/bench_wy_form.py, H200, split forward ms prepass → state_pass form; pre-pass, state
# pass): B=8 T=4096 H=16 1.365 → 1.042 (0.586 → 0.277, 0.499 → 0.485: the state pass missed its prediction —
# 255 registers, spill requests 0.28 → 0.94 M under ncu), 4×8192 HV=32 2.638 → 2.032, 2×16384 H=HV=32 3.137 →
# 2.608, fp32 B=8 5.139 → 4.233; but where few (sequence, head) pairs walk long sequences the third dot on the
# chain costs more than the pre-pass saves: B=1 T=4096 H=16 0.276 → 0.278, T=32768 2.028 → 2.182 (state pass
# 1.133 → 1.604), T=131072 8.01 → 8.67, 1×32768 HV=8 1.582 → 1.911. Every error against float64 the same to two
# digits (five cases, bf16). Wins from 64 pairs, loses at 16 and below: the threshold is 64 (32 not measured).
WY_FORM = "auto"
WY_FORMS = ("auto", "state_pass", "prepass")
WY_IN_STATE_PASS_MIN_PAIRS = 64


def stored_dtype(dtype: torch.dtype, mode: str, name: str) -> torch.dtype:
    """The dtype an intermediate is stored in for inputs of ``dtype`` under a store setting ``mode`` (one of
    :data:`STORES`: "bf16" applies to bf16 inputs only), refusing any other value with the setting's ``name``."""
    if mode not in STORES:
        raise ValueError(f"{name} must be one of {STORES}, got {mode!r}")
    return torch.bfloat16 if mode == "bf16" and dtype == torch.bfloat16 else torch.float32


def store_dtype(dtype: torch.dtype, override: Optional[str] = None) -> torch.dtype:
    """The dtype the split forward stores h and V_new in for inputs of ``dtype`` (:data:`STORE_BF16`, or
    ``override``; checked)."""
    return stored_dtype(dtype, override or STORE_BF16, "split_fwd store")


def wu_store_dtype(dtype: torch.dtype, override: Optional[str] = None) -> torch.dtype:
    """The dtype the split path's pre-pass writes W and U in for inputs of ``dtype`` (:data:`WU_STORE_BF16`, or
    ``override``; checked)."""
    return stored_dtype(dtype, override or WU_STORE_BF16, "split_fwd W/U store")


def wy_in_state_pass(num_sequences: int, HV: int, dtype: torch.dtype) -> bool:
    """Whether the split path's pre-pass writes A_inv for the state pass instead of W and U, for ``num_sequences``
    sequences of ``HV`` value heads (:data:`WY_FORM`, checked; "auto": from :data:`WY_IN_STATE_PASS_MIN_PAIRS`
    pairs); W and U stored in bf16 (:data:`WU_STORE_BF16`) keep the pre-pass form."""
    if WY_FORM not in WY_FORMS:
        raise ValueError(f"split_fwd.WY_FORM must be one of {WY_FORMS}, got {WY_FORM!r}")
    if wu_store_dtype(dtype) != torch.float32 or WY_FORM == "prepass":
        return False
    return WY_FORM == "state_pass" or num_sequences * HV >= WY_IN_STATE_PASS_MIN_PAIRS


def output_precision(dtype: torch.dtype) -> str:
    """The split forward's output-kernel precision for inputs of ``dtype``."""
    return OUTPUT_PREC_BF16 if dtype == torch.bfloat16 else dot_precision(dtype)


def segment_offsets(offsets: list[int], L: int, chunk_size: int) -> list[int]:
    """Token offsets of every segment of L chunks, sequence by sequence (``segment_tables``' order); a sequence of
    at most L chunks, empty included, is one segment."""
    out = [0]
    for bos, eos in zip(offsets[:-1], offsets[1:]):
        nt = -(-(eos - bos) // chunk_size)
        out += [bos + c * chunk_size for c in range(L, nt, L)] + [eos]
    return out


@functools.lru_cache(maxsize=16)
def _segment_layout(offsets: tuple, L: int, chunk_size: int, device: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(offsets, segment offsets) as int64 tensors on ``device`` and the segments' first global chunks
    (``chunk_tables``' chunk_offsets of the pseudo-sequences): built once per batch layout and split (a training
    step's repeated shapes hit the cache). Callers must not write into them."""
    seg = segment_offsets(list(offsets), L, chunk_size)
    both = torch.tensor(list(offsets) + seg, dtype=torch.int64).to(device)
    return both[:len(offsets)], both[len(offsets):], chunk_tables(seg, chunk_size, device)[1]


def split_fwd(q: torch.Tensor, k: torch.Tensor, wy: list, gc: torch.Tensor, scale: float,
              initial_state: Optional[torch.Tensor], out_dtype: torch.dtype, cu_seqlens: Optional[torch.Tensor],
              offsets: Optional[list[int]], chunk_indices: Optional[torch.Tensor],
              chunk_offsets: Optional[torch.Tensor], out_prec: Optional[str] = None,
              segment_chunks: Optional[int] = None, chunk_size: int = CHUNK,
              store: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """o ``[B, T, HV, V]`` in ``out_dtype`` and the final state ``[N, HV, K, V]`` fp32.

    Args: q, k ``[B, T, H, K]``; wy: the chunks' WY form from the pre-pass, either the list [w ``[B, T, HV, K]``,
        u ``[B, T, HV, V]``] or [A_inv ``[B, T, HV, 64]`` fp32, beta ``[B, T, HV]``, v ``[B, T, HV, V]``] (the state
        pass then forms W S and U per chunk: state_pass.py, FROM_A_INV; segments, which phase A walks with W and
        U, get them from ``wy_fwd`` first). This function empties the list once the state pass has read it: when
        the caller keeps no other reference (the op does not), W and U (or A_inv) are free before the output
        kernel runs (at B=8 T=4096 H=16 K=V=128, W and U are 537 MB of the forward's 1.07 GB peak of
        intermediates); gc ``[B, T, HV]`` fp32 (the pre-pass);
        initial_state ``[N, HV, K, V]`` or None; cu_seqlens / offsets (device and host) with chunk_indices /
        chunk_offsets from ``varlen.chunk_tables``, or all None; out_prec: the output kernel's precision for its
        fp32 dots (``output_fwd``'s dot_prec); segment_chunks: force segments of this many chunks (≥ 1, tests and
        benchmarks), None: planned; store: the dtype of h and V_new (None: :func:`store_dtype` of the inputs).
    """
    if len(wy) not in (2, 3):
        raise ValueError(f"split_fwd takes [w, u] or [a_inv, beta, v], got a list of {len(wy)}")
    from_a_inv = len(wy) == 3
    w, u, a_inv, beta = (None, wy[2], wy[0], wy[1]) if from_a_inv else (*wy, None, None)
    wy.clear()
    B, T, H, K = q.shape
    HV, V = u.shape[2], u.shape[3]
    if cu_seqlens is not None and offsets is None:
        offsets = cu_seqlens.tolist()
    flat = offsets if cu_seqlens is not None else [b * T for b in range(B + 1)]
    chunks = [-(-(e - b) // chunk_size) for b, e in zip(flat[:-1], flat[1:])]
    N, NT_total = len(chunks), sum(chunks)
    if segment_chunks is not None and segment_chunks < 1:
        raise ValueError(f"segment_chunks must be >= 1, got {segment_chunks}")
    sms = num_sms(q.device)
    _, BV, num_warps = fused_fwd_config(K, V, N * HV, sms)
    L = segment_chunks or plan_segments(chunks, HV, K, V, BV, sms, affine_cost=AFFINE_COST)
    store = store or store_dtype(q.dtype)
    if L is None or L >= max(chunks, default=0):
        h, v_new, final_state = state_pass_fwd(k, w, u, gc, initial_state, cu_seqlens, chunk_offsets,
                                               NT_total if cu_seqlens is not None else None, store_dtype=store,
                                               a_inv=a_inv, beta=beta)
        del w, u, a_inv  # their last reader
        o = output_fwd(q, k, v_new, h, gc, scale, out_dtype, cu_seqlens, chunk_indices, dot_prec=out_prec)
        return o, final_state

    if from_a_inv:
        # phase A walks the segments with W and U (seq_parallel.py): form them (rare: few, very long sequences)
        w, u = wy_fwd(k, u, beta, gc, a_inv, cu_seqlens, chunk_indices)
        del a_inv
    # phases A and B (seq_parallel.py): every segment's entering state
    segments, segment_first = segment_tables(flat, L, chunk_size, q.device)
    NS = segments.shape[0]
    if cu_seqlens is None:
        # the walk indexes equal sequences by position: give it the flat layout's tables instead
        q1, k1, w1, u1, gc1 = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, w, u, gc))
    else:
        q1, k1, w1, u1, gc1 = q, k, w, u, gc
    cu_flat, seg_cu, seg_chunk_offsets = _segment_layout(tuple(flat), L, chunk_size, str(q.device))
    cu_flat = cu_seqlens if cu_seqlens is not None else cu_flat
    mn = torch.empty(NS, HV, K, K + V, dtype=torch.float32, device=q.device)
    launch_walk(q1, k1, w1, u1, gc1, None, None, mn, scale, cu_flat, BV=BV, num_warps=num_warps, dot_prec=None,
                state_prec=None, chunk_size=chunk_size, num_segments=NS, segments=segments, nseg=1, seg_len=L,
                segmented=True, affine=True)
    h_in = affine_scan(mn, initial_state, V, N, segment_first, 1, BV=BV)

    # phase C: the state pass over the segments as pseudo-sequences (chunk-aligned: same chunks, same order)
    h, v_new, seg_final = state_pass_fwd(k1, w1, u1, gc1, h_in, seg_cu, seg_chunk_offsets, NT_total,
                                         store_dtype=store)
    del w, u, w1, u1  # their last reader
    final_state = seg_final[(segment_first[1:] - 1).long()]
    if cu_seqlens is None:
        h = h.view(B, cdiv(T, chunk_size), HV, K, V)
        v_new = v_new.view(B, T, HV, V)
    o = output_fwd(q, k, v_new, h, gc, scale, out_dtype, cu_seqlens, chunk_indices, dot_prec=out_prec)
    return o, final_state
