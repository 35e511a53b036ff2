"""Intra-card sequence parallelism of the backward's reverse walk (``state_pass_bwd.py``): segments, stitched exactly.

The reverse walk carries dS, the gradient of the state leaving the current chunk, from each sequence's end back to
its start, one program per (sequence, value head, V tile): few (sequence, head) pairs with long sequences leave
most of the card idle while a few programs walk thousands of chunks (the forward's problem, ``seq_parallel.py``).
The walk is linear in dS and column-separable in V (docs/backward.md §5): over a segment s of chunks,
dS_in(s) = M_sᵀ dS_out(s) + D_s, M_s the forward's map of the segment and D_s the walk from dS_out = 0. Sequences
cut into chunk-aligned segments of L chunks run in three phases:

    A'  maps[s] = [M_sᵀ | D_s]        state_pass_bwd_kernel, MAPS: the walk of the widened K × (K + V) gradient
                                      [I | 0] over the segment, dO and dv_local in its last V columns, nothing
                                      stored per chunk                                grid (cdiv(K+V, BV), NS·HV)
    B'  dS_out(s − 1) = M_sᵀ dS_out(s) + D_s
                                      affine_scan_kernel, REVERSE: from dht, last segment first (fp32, tf32x3
                                      products)                                       grid (cdiv(V, BVs), N·HV)
    C'  dh, dv_new, dh0               state_pass_bwd over the segments as pseudo-sequences (the same chunks in the
                                      same global order, so dh and dv_new come out in the unsegmented layout) from
                                      their dS_out; dh0 is the first segment's        grid (cdiv(V, BV), NS·HV)

Phase C' is the plain walk from an exactly stitched dS, so every output equals the unsegmented one up to the
rounding of dS_out (fp32 rounding for fp32 inputs). :func:`segment_grads` (A' → B') returns each segment's dS_out
alone: the entry point of a backward that walks its segments itself (a fused Hopper backward). Everything is a
fixed-order computation: no atomics, deterministic.

Twins (float64, from ``torch_chunk.state_pass_bwd_ref``): :func:`reverse_maps_ref` (phase A'),
:func:`reverse_scan_ref` (phase B') and :func:`segmented_bwd_ref` (A' → B' → C' for one batch of equal sequences).
The split is planned by ``seq_parallel.plan_segments`` (:func:`plan_reverse_segments`).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from ..gated_delta import torch_chunk as tc
from ..utils import cdiv
from . import CHUNK, fill_tile_v, launch_options, num_sms
from .local_bwd_utils import bwd_dot_precision
from .seq_parallel import SegmentLayout, affine_scan, plan_segments, segment_layout
from .state_pass_bwd import BT, state_pass_bwd, state_pass_bwd_kernel, widest_tile_v

# phase A' per chunk and column slice, relative to a chunk of the plain reverse walk (the planner widens A' by
# (K + V) / V itself). The model counts chunks, not the tile width, and the unsplit walk's narrow tiles (BV = 16)
# run a chunk far cheaper than the segments' BV = 64: on an H100 a split walk was no faster at HV = 16 (B=1,
# T=4096 to 131072) and 1.8× faster at HV = 8 (B=1 T=32768). 4.0 splits the latter and none of the former.
REVERSE_MAP_COST = 4.0


def split_tile_v(K: int, V: int) -> int:
    """The V tile of phases A' and C': the widest the carried registers allow (``widest_tile_v``), at most V's
    power-of-two cover. The segments are there to fill the SMs, so the narrow tiles the unsegmented walk takes for
    parallelism would only repeat the per-chunk loads of q, k and W once per tile."""
    return min(widest_tile_v(K), max(16, triton.next_power_of_2(V)))


def plan_reverse_segments(chunks: list[int], HV: int, K: int, V: int, sms: int) -> Optional[int]:
    """Segment length L (in chunks) of the reverse walk over sequences of ``chunks`` chunks, or None for no split:
    ``seq_parallel.plan_segments`` with the unsegmented walk at its own V tile (``state_pass_bwd``'s fill rule),
    phases A' and C' at :func:`split_tile_v` and phase A' costed at :data:`REVERSE_MAP_COST`."""
    unsplit_bv = fill_tile_v(len(chunks) * HV, V, widest_tile_v(K), sms)
    return plan_segments(chunks, HV, K, V, unsplit_bv, sms, affine_cost=REVERSE_MAP_COST,
                         split_bv=split_tile_v(K, V))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[B, T, ...]`` as the one packed sequence ``[1, B·T, ...]`` the segments index (a view: inputs are
    contiguous)."""
    return t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:])


def reverse_maps(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, gc: torch.Tensor, do: torch.Tensor,
                 dv_local: torch.Tensor, scale: float, layout: SegmentLayout, dot_prec: Optional[str] = None,
                 block_v: Optional[int] = None) -> torch.Tensor:
    """Phase A': ``[NS, HV, K, K + V]`` fp32, [M_sᵀ | D_s] of every segment of ``layout``. Tensors as
    ``state_pass_bwd`` takes them, in the packed layout ``[1, ΣT, ...]`` of ``layout.cu_seqlens``."""
    _, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    BV = block_v or split_tile_v(K, V)
    maps = torch.empty(layout.num_segments, HV, K, K + V, dtype=torch.float32, device=q.device)
    grid = (cdiv(K + V, BV), layout.num_segments * HV)
    state_pass_bwd_kernel[grid](
        q, k, w, gc, do, dv_local, None, None, None, maps, layout.seg_cu_seqlens, layout.seg_chunk_offsets, scale,
        T, H=H, HV=HV, K=K, V=V, BT=BT, BK=max(16, triton.next_power_of_2(K)), BV=BV,
        DOT_PREC=bwd_dot_precision(q.dtype, dot_prec), IS_VARLEN=True, MAPS=True, num_warps=4,
        **launch_options("state_pass_bwd"))
    return maps


def segment_grads(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, gc: torch.Tensor, do: torch.Tensor,
                  dv_local: torch.Tensor, dht: torch.Tensor, scale: float, layout: SegmentLayout,
                  dot_prec: Optional[str] = None) -> torch.Tensor:
    """Phases A' → B': dS_out ``[NS, HV, K, V]`` fp32, the gradient of the state leaving every segment of
    ``layout`` (the last segment's of sequence n is dht[n]); walking segment s backwards from dS_out[s] gives
    exactly the unsegmented walk's dh, dv_new over it. Tensors as ``state_pass_bwd`` takes them, in the packed
    layout ``[1, ΣT, ...]`` of ``layout.cu_seqlens``; dht ``[N, HV, K, V]``."""
    HV, V = do.shape[2], do.shape[3]
    maps = reverse_maps(q, k, w, gc, do, dv_local, scale, layout, dot_prec)
    N = layout.segment_first.shape[0] - 1
    scan_bv = fill_tile_v(N * HV, V, 64, num_sms(q.device))
    return affine_scan(maps, dht, V, N, layout.segment_first, 1, BV=scan_bv, reverse=True)


def state_pass_bwd_seq_parallel(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, gc: torch.Tensor,
                                do: torch.Tensor, dv_local: torch.Tensor, dht: torch.Tensor, scale: float,
                                cu_seqlens: Optional[torch.Tensor], chunk_offsets: Optional[torch.Tensor],
                                num_chunks: int, offsets: list[int], dot_prec: Optional[str] = None,
                                segment_chunks: Optional[int] = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``state_pass_bwd`` with long sequences split into segments when the unsplit walk cannot fill the SMs.

    Args: as ``state_pass_bwd`` (q, k ``[B, T, H, K]``; w ``[B, T, HV, K]``; gc ``[B, T, HV]`` fp32; do, dv_local
        ``[B, T, HV, V]``; dht ``[N, HV, K, V]``; cu_seqlens, chunk_offsets or None; num_chunks: NT_total, or the
        chunks per sequence), plus offsets: the host token offsets of the N sequences (cu_seqlens', or ``b·T``);
        segment_chunks: force segments of this many chunks (≥ 1; a value ≥ the longest sequence's chunk count runs
        unsegmented; tests and benchmarks), None: :func:`plan_reverse_segments`.
    Returns: dh ``[B, NT, HV, K, V]``, dv_new ``[B, T, HV, V]``, dh0 ``[N, HV, K, V]``, all fp32, as
        ``state_pass_bwd``.
    """
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if segment_chunks is not None and segment_chunks < 1:
        raise ValueError(f"segment_chunks must be >= 1, got {segment_chunks}")
    chunks = [-(-(e - b) // CHUNK) for b, e in zip(offsets[:-1], offsets[1:])]
    L = segment_chunks or plan_reverse_segments(chunks, HV, K, V, num_sms(q.device))
    if L is None or L >= max(chunks, default=0):
        return state_pass_bwd(q, k, w, gc, do, dv_local, dht, scale, cu_seqlens, chunk_offsets, num_chunks,
                              dot_prec)
    layout = segment_layout(offsets, L, CHUNK, q.device)
    q1, k1, w1, gc1, do1, dvl1 = (_flat(t) for t in (q, k, w, gc, do, dv_local))
    dS_out = segment_grads(q1, k1, w1, gc1, do1, dvl1, dht, scale, layout, dot_prec)
    dh, dv_new, seg_dh0 = state_pass_bwd(q1, k1, w1, gc1, do1, dvl1, dS_out, scale, layout.seg_cu_seqlens,
                                         layout.seg_chunk_offsets, sum(chunks), dot_prec,
                                         block_v=split_tile_v(K, V))
    dh0 = seg_dh0[layout.segment_first[:-1].long()]
    if cu_seqlens is None:
        dh, dv_new = dh.view(B, cdiv(T, BT), HV, K, V), dv_new.view(B, T, HV, V)
    return dh, dv_new, dh0


# ----------------------------------------------------------------------------------------------------------------
# twins (chunked layout [B, HV, NT, C, d] of torch_chunk.py; one segment or one batch of equal sequences)
# ----------------------------------------------------------------------------------------------------------------
def reverse_maps_ref(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, gc: torch.Tensor, do: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(M ᵀ ``[B, HV, K, K]``, D ``[B, HV, K, V]``) of the chunks given: dS_in = Mᵀ dS_out + D over them (no
    chunk: the identity map). The walk of the widened [I | 0] with dO widened to [0 | dO] (whose local part
    scale·Pᵀ[0 | dO] is then [0 | dv_local])."""
    B, HV, NT, _, K = k.shape
    V = do.shape[-1]
    eye = torch.eye(K, dtype=k.dtype, device=k.device).expand(B, HV, K, K)
    if NT == 0:
        return eye, k.new_zeros(B, HV, K, V)
    start = torch.cat([eye, k.new_zeros(B, HV, K, V)], -1)
    wide_do = torch.cat([do.new_zeros(*do.shape[:-1], K), do], -1)
    dS = tc.state_pass_bwd_ref(q, k, w, gc, wide_do, start, scale)[2]
    return dS[..., :K], dS[..., K:]


def reverse_scan_ref(Mt: torch.Tensor, D: torch.Tensor, dht: torch.Tensor) -> torch.Tensor:
    """The gradients of the states leaving each segment ``[S, ..., K, V]`` from Mᵀ ``[S, ..., K, K]``, D
    ``[S, ..., K, V]`` and dht ``[..., K, V]`` (the last segment's), in segment order:
    dS_out(s − 1) = Mᵀ_s dS_out(s) + D_s."""
    outs = [dht]
    for s in reversed(range(1, Mt.shape[0])):
        outs.append(Mt[s] @ outs[-1] + D[s])
    return torch.stack(outs[::-1])


def segmented_bwd_ref(q, k, w, gc, do, dht: torch.Tensor, scale: float, L: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phases A' → B' → C' on one batch of equal sequences in the chunked layout, segments of L chunks: dh, dv_new
    and dh0 as ``state_pass_bwd_ref`` returns them, equal to it in exact arithmetic."""
    NT = k.shape[2]
    cuts = [(c, min(c + L, NT)) for c in range(0, NT, L)]
    maps = [reverse_maps_ref(*(t[:, :, a:b] for t in (q, k, w, gc, do)), scale) for a, b in cuts]
    dS_out = reverse_scan_ref(torch.stack([m for m, _ in maps]), torch.stack([d for _, d in maps]), dht)
    dhs, dvns, dh0 = [], [], None
    for (a, b), dS in zip(cuts, dS_out):
        dh, dv_new, dS_in = tc.state_pass_bwd_ref(*(t[:, :, a:b] for t in (q, k, w, gc, do)), dS, scale)
        dhs.append(dh)
        dvns.append(dv_new)
        dh0 = dS_in if dh0 is None else dh0
    return torch.cat(dhs, 2), torch.cat(dvns, 2), dh0
