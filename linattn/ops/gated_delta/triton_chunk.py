"""Triton forward of the chunked gated delta rule: chains the stages of ``linattn/ops/common``.

    gc     = chunk_local_cumsum(g)                     [B, T, HV]      fp32
    A_inv  = kkt_solve(k, β, gc)                       [B, T, HV, BT]  fp32  (row t: row of its chunk's (I + A)⁻¹)
    w, u   = wy_fwd(k, v, β, gc, A_inv)                [B, T, HV, K], [B, T, HV, V]  fp32
    h, v_new, final_state = state_pass_fwd(k, w, u, gc, initial_state)
                                                       [B, NT, HV, K, V] fp32 (state entering each chunk),
                                                       [B, T, HV, V] fp32, [N, HV, K, V] fp32
    o      = output_fwd(q, k, v_new, h, gc, scale)     [B, T, HV, V]   v.dtype

Layout contract with the backward (token-major, like the public API): as above, chunk size BT = 64; with
``cu_seqlens`` (B == 1) chunks never cross a sequence boundary and h's chunk axis is NT_total, indexed through
``chunk_offsets`` (first global chunk of each sequence). Grouped value heads (HV > H) read q/k head
``i_hv // (HV // H)`` in the kernels; the repeat is never materialised.

Intermediate dtype: w, u and v_new (like gc, A_inv and h) are fp32 for every input dtype, and the dots that
touch them run on tf32 operands for bf16/fp16 inputs ("ieee" for fp32 inputs; ``common/__init__.py``). Why: at
the accuracy anchor (bf16, B=2, T=300, H=4, K=V=128, relative L2 of o against float64) merely rounding the exact
o to bf16 costs 1.66e-3 of the 2e-3 budget. A PyTorch emulation of the kernels' roundings gives 1.69e-3 with fp32
intermediates and tf32 operands, but 3.3e-3 when A_inv, w, u, v_new and the dot operands are rounded to bf16 (the
fla design; fla measures 3.7e-3). benchmarks/gpu_check_fwd.py measures it on the GPU (``--dot-prec`` to compare).
"""
from __future__ import annotations

import functools
import warnings
from typing import NamedTuple, Optional

import torch

from ..common import CHUNK, num_sms
from ..common.cumsum import chunk_local_cumsum
from ..common.fused_prepass import fused_prepass
from ..common.kkt_solve import kkt_solve
from ..common.output import output_fwd
from ..common.seq_parallel import fused_fwd_seq_parallel
from ..common.split_fwd import output_precision as split_output_precision
from ..common.split_fwd import split_fwd, wu_store_dtype, wy_in_state_pass
from ..common.state_pass import state_pass_fwd
from ..common.varlen import chunk_tables
from ..common.wy import wy_fwd
from ..utils import cdiv

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The fused forward's P = Q Kᵀ ⊙ D ⊙ causal: computed once per (chunk, value head) by the pre-pass and read by the
# walk (True, the default), or recomputed by the walk for every V slice (False). Predicted from the walk's MMA
# share: walk −20–30% at B=1 T=4096 H=16. Measured on the H200 (docs/performance.md run 9, bf16, K=V=128): walk
# 0.734 → 0.536 ms at B=1 (BV=16), 1.550 → 1.451 at B=8 (BV=64); whole forward 0.861 → 0.674 at B=1, 2.574 →
# 2.571 at B=8 (the pre-pass's extra writes, +0.09 ms, eat the walk's gain there); o unchanged (1.715e-3 vs
# float64 at the anchor case, 6e-7 from the path without P). The backward path (fwd_stages) never uses it.
PRECOMPUTE_QK = True


# Which forward the op runs. "walk" is the fused sequential kernel — pre-pass (gc, W, U, P), then one program per
# (sequence, value head, V slice) walking the chunks with the state on chip and writing o; "split" keeps only the
# state update sequential — pre-pass (gc, W, U), the forward state pass (h of every chunk and V_new to HBM), then
# the output as a kernel parallel over chunks. Run 11 made the state pass alone 2.5× faster than the walk at B=1
# H=16 (0.161 vs 0.399 ms): its per-chunk chain is two dots, not five. Prediction (written before any run): split
# forward at B=1 T=4096 H=16 ≈ 0.13 + 0.16 + 0.05 ≈ 0.35 ms (walk 0.541), B=8 ≈ 1.9 (2.55), B=1 T=32768 ≈ 2.5
# (4.28). Measured (run 12, bench_forward_paths.py, the output kernel at tf32x3), split vs walk: 0.417 vs 0.532
# (the stages sum to 0.367: host time), 2.48 vs 2.46, 3.11 vs 4.14; T=131072 12.29 vs 16.46; 2×16384 H=32 5.36 vs
# 5.86; 1×32768 2/8 2.13 vs 2.74; K = V = 64 1.69 vs 1.79; K=128 V=256 5.44 vs 8.26; but 4×8192 HV=32 4.89 vs
# 4.68: the walk won (by 1–4%) where the (sequence, value head) pairs alone fill the SMs. Then the output kernel
# at bf16x3 for bf16 inputs (split_fwd.OUTPUT_PREC_BF16) made the split 0.339 ms at B=1 and 1.916 at B=8 (walk
# 2.456): 22% ahead at 128 pairs, the most measured. So "auto" (the default) runs the split for bf16 and fp32 at
# every shape, and for fp16 (output dots at tf32x3) the walk from WALK_MIN_PAIRS pairs. The split writes h (64 KB
# per chunk and value head in fp32); both split long sequences into segments when their programs cannot fill the
# SMs.
# The Hopper forward (ops/hopper/, TileLang, an optional dependency): the Triton pre-pass writes A_inv, then one
# fused kernel walks the chunks with the state on chip and writes only o (docs/architecture.md, "The Hopper
# forward"). "auto" takes it for bf16 on sm_90 with TileLang installed, equal-length sequences, where its programs
# fill the card (hopper_plan; run 20, B=8 T=4096 H=16: 0.653 ms against the split's 1.005); cut into segments where
# they fill the card, once hopper.forward.SEGMENTED_AUTO is on (run 21, B=1 T=32768 H=16: 1.196 ms against 1.687;
# hopper.forward.plan); "hopper" forces it wherever the kernel takes the inputs; inputs it does not take
# (hopper.chunk_fwd.unsupported_reason) run the Triton paths. Its bf16 error is FlashQLA's (o 3.4e-3, final state
# 2.4e-3 at the anchor case, against the split's 2.4e-3 / 7.3e-4 and the rounded baseline's 2.9e-3 / 1.7e-3):
# "split" keeps the more accurate path.
FORWARD_PATHS = ("auto", "walk", "split", "hopper")
FORWARD_PATH = "auto"
# "auto": the walk when N·HV (sequences × value heads) is at least this for the inputs' dtype, else the split;
# None: the split at every shape. bf16: see above. fp32 and fp16 in their own dtypes (run 16, bench_pipelining.py
# table 4, T=4096 H=16, forward ms walk / split): fp32 (dots at tf32x3) 0.942 / 0.927 at B=1, 6.40 / 5.62 at B=8, so
# the split everywhere (it was the walk from 128 pairs, 86 ms at B=8 at "ieee"); fp16 0.599 / 0.674 at B=1, 3.10 /
# 3.20 at B=8: the walk won at both, so fp16 keeps the walk from 128 pairs (16 pairs at T=4096 favour the walk too,
# but long sequences, where the bf16 split is 25% ahead, are not measured in fp16 — left as is).
WALK_MIN_PAIRS = {torch.bfloat16: None, torch.float16: 128, torch.float32: None}


def forward_path(num_sequences: int, HV: int, dtype: torch.dtype) -> str:
    """The forward path :func:`chunk_gated_delta_rule_fwd_triton` runs for ``num_sequences`` sequences of ``HV``
    value heads with inputs of ``dtype``: :data:`FORWARD_PATH`, with "auto" resolved by :data:`WALK_MIN_PAIRS`."""
    if FORWARD_PATH not in FORWARD_PATHS:
        raise ValueError(f"triton_chunk.FORWARD_PATH must be one of {FORWARD_PATHS}, got {FORWARD_PATH!r}")
    if FORWARD_PATH not in ("auto", "hopper"):
        return FORWARD_PATH
    pairs = WALK_MIN_PAIRS.get(dtype)
    return "walk" if pairs is not None and num_sequences * HV >= pairs else "split"


@functools.cache
def _hopper_modules():
    """(hopper.chunk_fwd, hopper.forward, hopper.varlen), imported on first use: an import statement in the call
    path costs ≈ 1–2 µs of host time per call, and the CPU / fp16 / fp32 paths never need them. Their attributes are
    read at call time, so switches and monkeypatches on those modules still apply."""
    from ..hopper import chunk_fwd, forward, varlen
    return chunk_fwd, forward, varlen


def hopper_plan(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                num_sequences: int, offsets: Optional[list[int]] = None, others: tuple = ()) -> Optional[dict]:
    """The Hopper forward's launch for these inputs, or None to run the Triton paths: None where the kernel cannot
    take them (``hopper.chunk_fwd.unsupported_reason``: not bf16, not sm_90, no TileLang, ...; packed sequences
    only with ``hopper.varlen.VARLEN_BY_PADDING``, planned for ``num_sequences`` rows of the padded length, and
    under "auto" only where padding wastes little: ``hopper.varlen.worth_padding`` on the host ``offsets``); under
    "auto" also where neither the kernel's programs nor the segmented forward's fill the card
    (``hopper.forward.plan``, which may choose differently under CUDA graph capture: the host's cost is then paid
    once); "hopper" then runs the unsegmented kernel. ``others``: the kernel's other inputs (k, g, β, the initial
    state), which like q and v must start on a 16-byte boundary (``hopper.chunk_fwd.misaligned``)."""
    if q.device.type != "cuda" or q.dtype != torch.bfloat16:
        return None      # the common CPU / fp16 / fp32 case decided without importing the Hopper modules
    hopper, hopper_forward, hopper_varlen = _hopper_modules()
    padded = cu_seqlens is not None and hopper_varlen.VARLEN_BY_PADDING
    if hopper.unsupported_reason(q, v, None if padded else cu_seqlens) is not None or \
            hopper.misaligned(q, v, *others) is not None:
        return None
    forced = FORWARD_PATH == "hopper"
    T = q.shape[1]
    if padded:
        offsets = offsets if offsets is not None else cu_seqlens.tolist()
        T = hopper_varlen.padded_rows(offsets)
        if not (forced or hopper_varlen.worth_padding(offsets, T)):
            return None
    # whether the call is being captured in a CUDA graph: asked only where the plan would use the answer
    capturing = hopper_forward.SEGMENTED_WHEN_CAPTURED and torch.cuda.is_current_stream_capturing()
    return hopper_forward.plan(num_sequences, v.shape[2], v.shape[-1], T, num_sms(q.device), forced, capturing)


class FwdStages(NamedTuple):
    """Everything the forward computes; the backward recomputes it with :func:`chunk_gated_delta_rule_fwd_stages`.

    Shapes (varlen: B = 1, NT = NT_total): o ``[B, T, HV, V]`` (v.dtype); final_state ``[N, HV, K, V]``; gc
    ``[B, T, HV]``; A_inv ``[B, T, HV, 64]``; w ``[B, T, HV, K]``; u, v_new ``[B, T, HV, V]``; h
    ``[B, NT, HV, K, V]``, all fp32. chunk_indices ``[NT_total, 2]`` / chunk_offsets ``[N + 1]`` int32 (None
    without cu_seqlens).
    """
    o: torch.Tensor
    final_state: torch.Tensor
    gc: torch.Tensor
    A_inv: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    v_new: torch.Tensor
    h: torch.Tensor
    chunk_indices: Optional[torch.Tensor]
    chunk_offsets: Optional[torch.Tensor]


def chunk_gated_delta_rule_fwd_stages(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
                                      cu_seqlens: Optional[torch.Tensor], offsets: Optional[list[int]]
                                      ) -> FwdStages:
    """Run every forward stage and return the output, the final state and the intermediates.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (HV % H == 0); g (log decay), beta: ``[B, T, HV]``;
            all contiguous (the public op makes them so). q, k, v share one dtype: fp16, bf16 or fp32.
        scale: query scale. initial_state: ``[N, HV, K, V]`` or None.
        cu_seqlens: ``[N + 1]`` device offsets (B == 1) or None; offsets: the same values as a host list.
    """
    if v.dtype not in TRITON_DTYPES:
        raise TypeError(f"backend='triton' takes fp16, bf16 or fp32 inputs, got {v.dtype}; use backend='torch' "
                        "for float64")
    B, T = q.shape[:2]
    if cu_seqlens is not None:
        if offsets is None:
            offsets = cu_seqlens.tolist()
        chunk_indices, chunk_offsets = chunk_tables(offsets, CHUNK, q.device)
        num_chunks = chunk_indices.shape[0]
    else:
        chunk_indices = chunk_offsets = None
        num_chunks = cdiv(T, CHUNK)
    HV = v.shape[2]

    gc = chunk_local_cumsum(g, cu_seqlens, chunk_indices)
    A_inv = kkt_solve(k, beta, gc, HV, cu_seqlens, chunk_indices)
    w, u = wy_fwd(k, v, beta, gc, A_inv, cu_seqlens, chunk_indices)
    h, v_new, final_state = state_pass_fwd(k, w, u, gc, initial_state, cu_seqlens, chunk_offsets, num_chunks)
    o = output_fwd(q, k, v_new, h, gc, scale, v.dtype, cu_seqlens, chunk_indices)
    return FwdStages(o, final_state, gc, A_inv, w, u, v_new, h, chunk_indices, chunk_offsets)


def fwd_prepass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu_seqlens: Optional[torch.Tensor] = None, chunk_indices: Optional[torch.Tensor] = None,
                dot_prec: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The fused forward's pre-pass as the default path runs it: (gc, W, U, P), P None unless
    :data:`PRECOMPUTE_QK` (read at call time, so tests and benchmarks can switch it)."""
    if PRECOMPUTE_QK:
        return fused_prepass(g, k, v, beta, cu_seqlens, chunk_indices, dot_prec=dot_prec, q=q)
    return (*fused_prepass(g, k, v, beta, cu_seqlens, chunk_indices, dot_prec=dot_prec), None)


def chunk_gated_delta_rule_fwd_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
                                      cu_seqlens: Optional[torch.Tensor], offsets: Optional[list[int]]
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the triton backend: o ``[B, T, HV, V]`` in v.dtype and the final state ``[N, HV, K, V]`` fp32.
    Arguments as :func:`chunk_gated_delta_rule_fwd_stages`.

    :func:`forward_path` picks the path from :data:`FORWARD_PATH` and the shape. "split" (docs/architecture.md,
    "The split forward"): one parallel pre-pass writes gc, W, U; the state pass walks the chunks (only the state
    update on the sequential chain) and writes h and V_new; the output kernel runs parallel over chunks. "walk"
    (docs/architecture.md, "Fused forward"): the pre-pass, then one sequential kernel per (sequence, value head,
    V slice) that keeps the state on chip and writes only o and the final state; with :data:`PRECOMPUTE_QK` the
    pre-pass also writes P and the walk reads it. Both split long sequences into segments stitched exactly through
    their affine state maps when their programs cannot fill the SMs (``common/seq_parallel.py``,
    ``common/split_fwd.py``). Before either, :func:`hopper_plan` may send bf16 inputs on sm_90 to the Hopper
    forward (``ops/hopper/``, TileLang)."""
    if v.dtype not in TRITON_DTYPES:
        raise TypeError(f"backend='triton' takes fp16, bf16 or fp32 inputs, got {v.dtype}; use backend='torch' "
                        "for float64")
    num_sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cu_seqlens is not None and offsets is None:
        offsets = cu_seqlens.tolist()
    if FORWARD_PATH in ("auto", "hopper"):
        launch = hopper_plan(q, v, cu_seqlens, num_sequences, offsets, others=(k, g, beta, initial_state))
        if launch is not None:
            hopper, hopper_forward, hopper_varlen = _hopper_modules()
            try:
                if cu_seqlens is not None:          # packed sequences, padded to one length (hopper/varlen.py)
                    return hopper_varlen.forward_hopper_padded(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                                               offsets, **launch)
                return hopper_forward.forward_hopper(q, k, v, g, beta, scale, initial_state, **launch)
            except hopper.HopperCompileError as e:    # once per process: the Triton paths from here on
                hopper.COMPILE_FAILED = str(e)
                warnings.warn(f"linattn: the Hopper forward (TileLang) did not compile here, so the Triton forward "
                              f"runs instead: {e}", RuntimeWarning, stacklevel=2)
    path = forward_path(num_sequences, v.shape[2], v.dtype)
    chunk_indices = chunk_offsets = None
    if cu_seqlens is not None:
        chunk_indices, chunk_offsets = chunk_tables(offsets, CHUNK, q.device)
    if path == "split":
        # the pre-pass writes A_inv for the state pass, or W and U (split_fwd.WY_FORM; W and U stored at
        # split_fwd.wu_store_dtype); the output dots at split_fwd.output_precision (bf16x3 for bf16). Handed over
        # in a list that split_fwd empties, so they are freed after the state pass
        if wy_in_state_pass(num_sequences, v.shape[2], v.dtype):
            gc, a_inv = fused_prepass(g, k, v, beta, cu_seqlens, chunk_indices, write_wy=False)
            wy = [a_inv, beta, v]
            del a_inv
        else:
            gc, *wy = fused_prepass(g, k, v, beta, cu_seqlens, chunk_indices, store_dtype=wu_store_dtype(v.dtype))
        return split_fwd(q, k, wy, gc, scale, initial_state, v.dtype, cu_seqlens, offsets, chunk_indices,
                         chunk_offsets, out_prec=split_output_precision(v.dtype))
    gc, w, u, p = fwd_prepass(q, k, v, g, beta, cu_seqlens, chunk_indices)
    return fused_fwd_seq_parallel(q, k, w, u, gc, scale, initial_state, v.dtype, cu_seqlens, offsets, p=p)
