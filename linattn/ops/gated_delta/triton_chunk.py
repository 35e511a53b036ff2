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
touch them run on tf32 operands for bf16/fp16 inputs ("ieee" for fp32 inputs; ``common/__init__.py``). Why: merely
rounding the exact o to bf16 takes most of the bf16 error budget, and rounding A_inv, w, u, v_new and the dot
operands to bf16 as well (the fla design) about doubles the error; fp32 intermediates keep it near the rounding's.
benchmarks/gpu_check_fwd.py measures it on the GPU (``--dot-prec`` to compare).
"""
from __future__ import annotations

from typing import Literal, NamedTuple, Optional

import torch

from ..common import CHUNK
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
                dot_prec: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused walk's pre-pass: (gc, W, U, P). P = Q Kᵀ ⊙ D ⊙ causal is computed once per (chunk, value head) here
    and read by the walk for every V slice, instead of recomputed per slice (the walk's dot chain is the sequential
    part of the forward)."""
    return fused_prepass(g, k, v, beta, cu_seqlens, chunk_indices, dot_prec=dot_prec, q=q)


def _checked(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor], offsets: Optional[list[int]]):
    """(offsets, chunk_indices, chunk_offsets) for a Triton forward, after the dtype check."""
    if v.dtype not in TRITON_DTYPES:
        raise TypeError(f"backend='triton' takes fp16, bf16 or fp32 inputs, got {v.dtype}; use backend='torch' "
                        "for float64")
    if cu_seqlens is None:
        return None, None, None
    if offsets is None:
        offsets = cu_seqlens.tolist()
    return (offsets, *chunk_tables(offsets, CHUNK, q.device))


def forward_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                  offsets: Optional[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The split forward (docs/architecture.md, "The split forward"): one parallel pre-pass writes gc and W, U (or
    A_inv, the state pass then forming them); the state pass walks the chunks with only the state update on the
    sequential chain and writes h and V_new; the output kernel runs parallel over chunks. Long sequences whose
    programs cannot fill the SMs are cut into segments stitched exactly through their affine state maps
    (``common/split_fwd.py``). Arguments and results as :func:`chunk_gated_delta_rule_fwd_triton`."""
    offsets, chunk_indices, chunk_offsets = _checked(q, v, cu_seqlens, offsets)
    num_sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # the pre-pass writes A_inv for the state pass, or W and U (stored at split_fwd.wu_store_dtype); the output dots
    # at split_fwd.output_precision (bf16x3 for bf16). Handed over in a list that split_fwd empties, so they are
    # freed after the state pass
    if wy_in_state_pass(num_sequences, v.shape[2], v.dtype):
        gc, a_inv = fused_prepass(g, k, v, beta, cu_seqlens, chunk_indices, write_wy=False)
        wy = [a_inv, beta, v]
        del a_inv
    else:
        gc, *wy = fused_prepass(g, k, v, beta, cu_seqlens, chunk_indices, store_dtype=wu_store_dtype(v.dtype))
    return split_fwd(q, k, wy, gc, scale, initial_state, v.dtype, cu_seqlens, offsets, chunk_indices,
                     chunk_offsets, out_prec=split_output_precision(v.dtype))


def forward_walk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 scale: float, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                 offsets: Optional[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused walk (docs/architecture.md, "Fused forward"): the pre-pass (gc, W, U, P), then one sequential
    kernel per (sequence, value head, V slice) that keeps the state on chip and writes only o and the final state;
    segments stitched through their state maps where its programs cannot fill the SMs (``common/seq_parallel.py``).
    Arguments and results as :func:`chunk_gated_delta_rule_fwd_triton`."""
    offsets, chunk_indices, _ = _checked(q, v, cu_seqlens, offsets)
    gc, w, u, p = fwd_prepass(q, k, v, g, beta, cu_seqlens, chunk_indices)
    return fused_fwd_seq_parallel(q, k, w, u, gc, scale, initial_state, v.dtype, cu_seqlens, offsets, p=p)


def chunk_gated_delta_rule_fwd_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
                                      cu_seqlens: Optional[torch.Tensor], offsets: Optional[list[int]],
                                      path: Literal["split", "walk"] = "split") -> tuple[torch.Tensor, torch.Tensor]:
    """A Triton forward: o ``[B, T, HV, V]`` in v.dtype and the final state ``[N, HV, K, V]`` fp32, by ``path``
    (:func:`forward_split` or :func:`forward_walk`; ``dispatch.py`` chooses for the public op). Arguments as
    :func:`chunk_gated_delta_rule_fwd_stages`."""
    if path not in ("split", "walk"):
        raise ValueError(f"path must be 'split' or 'walk', got {path!r}")
    run = forward_walk if path == "walk" else forward_split
    return run(q, k, v, g, beta, scale, initial_state, cu_seqlens, offsets)
