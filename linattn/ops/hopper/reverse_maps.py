"""The reverse maps of the Hopper backward's segments (issue 45, docs/backward.md §5): the gradients of the states
leaving the segments where the gates keep the state longer than a segment.

The reverse chain is linear: over segment s, dS_in(s) = M_sᵀ dS_out(s) + D_s, with M_s the forward's own map of the
segment's state (S_out = M_s S_in + N_s) and D_s the segment's reverse chain from dS_out = 0. The reverse warm-ups
(``chunk_bwd.reverse_warm_ups_hopper``) walk that chain from zero over the chunks after a segment until the chunks'
norm bounds sum below −30 (the rest is below 2⁻³⁰ of ‖dS‖), or to the sequence's end. Where a head never forgets,
segment s's warm-up would walk the whole rest of the sequence: (S − 1 − s)·L chain steps, the first segment's the
longest, and a program of the walk waits for it. Capped at one segment (``map_flags``), a warm-up gives either
dS_out(s) itself (its sum fell below −30) or D_{s+1} (it did not), and the flags mark the second kind. Then:

    maps   M_{s+1} of every flagged segment: the forward's affine walk of the states' operator
           (``chunk_fwd.build_kernel(affine=True, beta_in_a_inv=False, m_only=True)``), its M tiles alone, one
           launch
    scan   dS_out(s) = W_s + M_{s+1}ᵀ dS_out(s + 1) from the last segment (dht) back, where s is flagged
           (W_s the warm-up's output, updated in place), one launch (:func:`reverse_map_scan`)

so the longest chain is a segment's warm-up, a segment's map and the scan's S steps, whatever the gates. The maps
carry the affine walk's bf16 operands, as the forward's segments' maps do, and the scan's products run in tf32.
Twins: ``chunk_bwd_ref.reverse_warm_ups_hopper_ref(capped=True)`` and :func:`reverse_map_scan_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.launch import BoundLaunch, launch
from . import walk_launch
from .plan import DEFAULT, fitted_launch, hopper_launch

MAP_WALKED = 3      # map_flags' value where the segment's map is walked and the scan reads it (the others are 2)
SCAN_BV = 32        # V columns of a scan program
SCAN_WARPS = 8      # a whole [K, K] map in registers at K = 128: 64 fp32 a thread


def segment_maps(k: torch.Tensor, v: torch.Tensor, gc_s: torch.Tensor, beta_s: torch.Tensor, t_inv: torch.Tensor,
                 map_flags: torch.Tensor, sms: int) -> torch.Tensor:
    """M_s ``[B·S, HV, K, K]`` fp32, the state map of every segment flagged :data:`MAP_WALKED` in ``map_flags
    [B·S, HV]`` (the other segments' maps, flagged 2, left unwritten), from the segment views
    of k ``[B·S, L·64, H, K]``, v ``[B·S, L·64, HV, V]`` and T ``[B·S, L·64, HV, 64]`` bf16 (without β) and the
    segments' gc, β head-major ``[B·S, HV, L·64]`` fp32. One program per (segment, head, K tile): the launch the
    forward's walk would take over K columns."""
    rows, HV, K = gc_s.shape[0], gc_s.shape[1], k.shape[3]
    return walk_launch.states_maps(k, v, gc_s, beta_s, t_inv, map_flags, m_only=True, **maps_tiles(rows, HV, K, sms))


def maps_tiles(rows: int, HV: int, K: int, sms: int) -> dict:
    """The maps' launch (BV, threads, num_stages) over ``rows`` segments of HV heads: the forward walk's over K
    columns."""
    return fitted_launch(K, hopper_launch(rows, HV, K, sms) or DEFAULT.launch(64))


@triton.jit(do_not_specialize=["NSEG"])     # one binary for every segment count
def reverse_map_scan_kernel(ds_out, maps, map_flags, NSEG, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BV: tl.constexpr, FLAG: tl.constexpr):
    # grid (V / BV, B·HV): one program walks the segments of one (sequence, value head) back from the last, for BV
    # columns. Segment s's dS_out row is W_s (the warm-up's); where the flag of segment s + 1 is FLAG it becomes
    # W_s + M_{s+1}ᵀ dS_out(s + 1), the map read transposed from maps [B·S, HV, K, K]
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_kv = o_k[:, None] * V + o_v[None, :]
    o_mt = o_k[None, :] * K + o_k[:, None]                # Mᵀ[i, j] = M[j, i]
    row = i_b * NSEG + NSEG - 1
    b_ds = tl.load(ds_out + (row * HV + i_hv).to(tl.int64) * K * V + o_kv)
    first = i_b * NSEG
    while row > first:
        row -= 1
        p_ds = ds_out + (row * HV + i_hv).to(tl.int64) * K * V + o_kv
        b_w = tl.load(p_ds)
        if tl.load(map_flags + (row + 1) * HV + i_hv) == FLAG:
            b_mt = tl.load(maps + ((row + 1) * HV + i_hv).to(tl.int64) * K * K + o_mt)
            b_ds = b_w + tl.dot(b_mt, b_ds, input_precision="tf32")
            tl.store(p_ds, b_ds)
        else:
            b_ds = b_w


def reverse_map_scan(ds_out: torch.Tensor, maps: torch.Tensor, map_flags: torch.Tensor, segments: int) -> None:
    """The scan, in place: ds_out ``[B·S, HV, K, V]`` fp32 (the capped warm-ups' W_s, segment s of sequence b at
    b·S + s) becomes every segment's dS_out, from ``maps`` (:func:`segment_maps`) where ``map_flags [B·S, HV]``
    int32 is :data:`MAP_WALKED`. S = ``segments`` ≥ 1."""
    rows, HV, K, V = ds_out.shape
    if rows % segments or maps.shape != (rows, HV, K, K) or map_flags.shape != (rows, HV):
        raise ValueError(f"the scan needs S = {segments} dividing the {rows} rows, maps [B·S, HV, K, K] = "
                         f"{(rows, HV, K, K)} and map_flags [B·S, HV], got {tuple(maps.shape)} and "
                         f"{tuple(map_flags.shape)}")
    if ds_out.dtype != torch.float32 or maps.dtype != torch.float32 or map_flags.dtype != torch.int32:
        raise TypeError(f"ds_out and maps must be fp32 and map_flags int32, got {ds_out.dtype}, {maps.dtype}, "
                        f"{map_flags.dtype}")
    grid, constexprs = _scan_launch(rows // segments, HV, K, V)
    launch(reverse_map_scan_kernel, grid, ds_out, maps, map_flags, segments, num_warps=SCAN_WARPS, **constexprs)


def _scan_launch(B: int, HV: int, K: int, V: int) -> tuple[tuple, dict]:
    """reverse_map_scan_kernel's grid and constexprs for B sequences of HV heads."""
    BV = min(SCAN_BV, V)
    return (V // BV, B * HV), dict(HV=HV, K=K, V=V, BV=BV, FLAG=MAP_WALKED)


def reverse_map_scan_launcher(B: int, HV: int, K: int, V: int) -> BoundLaunch:
    """:func:`reverse_map_scan` for a prepared call (``hopper/backward_prepared.py``): its launch configuration once;
    then ``scan(ds_out, maps, map_flags, segments)`` on tensors of its shapes, none of the per-call checks."""
    grid, constexprs = _scan_launch(B, HV, K, V)
    return BoundLaunch(reverse_map_scan_kernel, grid, num_warps=SCAN_WARPS, **constexprs)


def reverse_map_scan_ref(ds_out: torch.Tensor, maps: torch.Tensor, map_flags: torch.Tensor, segments: int
                         ) -> torch.Tensor:
    """The twin of :func:`reverse_map_scan` (its layouts; a new tensor, ds_out unchanged), in ds_out's dtype."""
    rows, HV, K, V = ds_out.shape
    out = ds_out.clone().view(rows // segments, segments, HV, K, V)
    mt = maps.transpose(-1, -2).to(ds_out.dtype).view(rows // segments, segments, HV, K, K)
    walked = (map_flags == MAP_WALKED).view(rows // segments, segments, HV, 1, 1)
    for s in reversed(range(segments - 1)):
        out[:, s] += torch.where(walked[:, s + 1], mt[:, s + 1] @ out[:, s + 1], 0.0)
    return out.view(rows, HV, K, V)
