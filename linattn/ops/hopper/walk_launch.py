"""The fused walk's launchers (``chunk_fwd.py``'s kernel): the compiled kernel for a launch's options
(:func:`walk_kernel`, :func:`warm_kernel`, :func:`states_kernel`; ``prepared.py`` takes the same ones) and the calls
that take tensors, check them, allocate o and the final state and launch (:func:`chunk_fwd_hopper_hm`: the plain
walk, phase A's affine walk, phase C's warm walks; :func:`chunk_states_hopper`: the backward's states, unsegmented
or phase C of their segments). Everything of ``chunk_fwd`` is read through the module at call time, so stand-ins set
there (tests, ``benchmarks/host_hopper.py``) apply here too.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import chunk_fwd
from .chunk_fwd import BT
from .compile import tile_dtype


def walk_kernel(H: int, HV: int, K: int, V: int, BV: int, scale: float, threads: int, num_stages: int,
                use_initial_state: bool, beta_dtype: torch.dtype, affine: bool, lean: bool,
                target: Optional[str] = None, beta_in_a_inv: bool = True, m_only: bool = False):
    """The compiled kernel of :func:`chunk_fwd_hopper_hm`'s plain walk (no warm-ups), or of its affine walk
    (phase A); ``lean``: phase A's lean maps (affine with skip_m only); ``target``: the compile target (None: the
    GPU's; "sm_90a" compiles without one, as the tests do); ``beta_in_a_inv`` False: the affine walk of the states
    walk's operator (plain T, β in X); ``m_only``: the affine walk's M alone."""
    return chunk_fwd.compiled_kernel(H, HV, K, V, BV, float(scale), threads, num_stages, target, use_initial_state,
                                     tile_dtype(beta_dtype), affine, lean=lean, beta_in_a_inv=beta_in_a_inv,
                                     m_only=m_only)


def warm_kernel(H: int, HV: int, K: int, V: int, BV: int, scale: float, threads: int, num_stages: int,
                use_initial_state: bool, beta_dtype: torch.dtype, threshold: Optional[float], lean: bool,
                target: Optional[str] = None):
    """The compiled kernel of the warm walk (phase C with ``warm_chunks``, or, ``threshold`` given, the walk that
    plans its warm-ups from the chunk bounds); ``target`` as :func:`walk_kernel`'s."""
    planned = threshold is not None
    return chunk_fwd.compiled_kernel(H, HV, K, V, BV, float(scale), threads, num_stages, target, use_initial_state,
                                     tile_dtype(beta_dtype), False, True, planned,
                                     float(threshold) if planned else -30.0, lean)


def states_kernel(H: int, HV: int, K: int, V: int, BV: int, threads: int, num_stages: int, use_initial_state: bool,
                  beta_dtype: torch.dtype, target: Optional[str] = None, warm: bool = False,
                  threshold: Optional[float] = None):
    """The compiled kernel of :func:`chunk_states_hopper` (the walk's ``store_states`` build; no scale: it forms no
    output); ``warm``: phase C of the states in segments (lean: warmed segments start from zero, ht the sequences'
    final states), and with ``threshold`` the warm walk that plans its warm-ups from the chunk bounds; ``target``
    as :func:`walk_kernel`'s."""
    planned = threshold is not None
    return chunk_fwd.compiled_kernel(H, HV, K, V, BV, 1.0, threads, num_stages, target, use_initial_state,
                                     tile_dtype(beta_dtype), warm=warm, warm_planned=planned,
                                     threshold=float(threshold) if planned else -30.0, lean=warm, store_states=True)


def chunk_fwd_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gc: torch.Tensor, beta: torch.Tensor,
                     a_inv: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
                     **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """o ``[B, T, HV, V]`` (v's dtype) and the final state ``[B, HV, K, V]`` fp32 from the Triton pre-pass's
    outputs gc ``[B, T, HV]`` and a_inv ``[B, T, HV, 64]`` fp32 or bf16 (``fused_prepass(write_wy=False)``) and β
    ``[B, T, HV]``. bf16 q/k/v, no varlen. ``launch``: :func:`chunk_fwd_hopper_hm`'s."""
    return chunk_fwd_hopper_hm(q, k, v, chunk_fwd.head_major(gc), chunk_fwd.head_major(beta), a_inv, scale,
                               initial_state, **launch)


def chunk_fwd_hopper_hm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gc_hm: torch.Tensor,
                        beta_hm: torch.Tensor, a_inv: torch.Tensor, scale: float,
                        initial_state: Optional[torch.Tensor], *, BV: int = 128, threads: int = 256,
                        num_stages: int = 2, affine: bool = False, skip_m: Optional[torch.Tensor] = None,
                        warm_chunks: Optional[torch.Tensor] = None, warm_bound: Optional[torch.Tensor] = None,
                        warm_threshold: Optional[float] = None, lean: bool = False, beta_in_a_inv: bool = True,
                        m_only: bool = False) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """:func:`chunk_fwd_hopper` with gc and β already head-major ``[B, HV, Tp]`` (:func:`head_major`). BV: the V
    tile of one program; threads: its consumer threads (TileLang adds a producer warpgroup for the TMA loads);
    num_stages: the depth of the chunk loop's load pipeline (the defaults: ``forward.LAUNCH``'s). A_inv ``[B, T, HV,
    64]`` bf16 is the pre-pass's A_inv diag(β) (``prepass.prepass_hopper``): β is not read. ``affine`` (no initial
    state): each sequence's state map [M | N] ``[B, HV, K, K + V]`` fp32 instead of the final state, and o None
    (:func:`chunk_fwd.build_kernel`). In the affine walk ``skip_m`` ``[B, HV]`` (bool or int, optional) marks the
    maps whose M is negligible (``forward.segment_flags``): their M is written as zeros without a walk (2: the whole
    map, M and N). ``m_only`` (affine only): M alone, ``[B, HV, K, K]`` (the backward's reverse maps read nothing
    else: no program walks N). ``beta_in_a_inv`` False (affine only):
    a_inv is the plain T (``prepass_hopper(beta_in_a_inv=False)``) and β is read, X = β ⊙ (V − Γ ⊙ K S): the maps
    of the states walk's operator (``backward.segmented_states``).

    ``warm_chunks`` ``[B·S, HV]`` (int): the segmented forward's phase C with warm-ups (:func:`build_kernel`'s
    ``warm``): q, k, v, a_inv whole ``[B, T, ...]``, gc and β per segment ``[B·S, HV, L]`` (L = T/S, a multiple of
    64), initial_state ``[B·S, HV, K, V]`` the state each walk starts from; segment s's walk starts
    warm_chunks[s] ≤ s·L/64 chunks before it (not checked: a device read). Returns o ``[B, T, HV, V]`` and each
    segment's final state ``[B·S, HV, K, V]``.

    ``warm_bound`` ``[B·S, HV, L/64]`` fp32 (the pre-pass's chunk bounds, log2) instead of ``warm_chunks``: the
    warm walk that finds each segment's warm-up itself (:func:`build_kernel`'s ``warm_planned``; twin
    ``map_bound.warm_from_bound_ref``): the fewest chunks before the segment whose bounds sum below
    ``warm_threshold``, else the whole prefix from ``initial_state`` ``[B, HV, K, V]`` (the sequences' own, or
    None).

    ``lean`` (:func:`build_kernel`'s; ``forward.LEAN_SEGMENTS``): with ``skip_m`` in the affine walk, the maps
    flagged 2 are left unwritten; with ``warm_chunks`` or ``warm_bound`` the final state returned is the
    sequences' ``[B, HV, K, V]`` (their last segments'), and with ``warm_chunks`` a segment whose warm-up is above
    zero starts from zero, not from initial_state (whose entries for it are then never read). Elsewhere no effect."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if q.dtype != torch.bfloat16:
        raise TypeError(f"the Hopper forward takes bf16 q/k/v, got {q.dtype}")
    if V % BV or (affine and K % BV):
        raise ValueError(f"V = {V}" + (f" and K = {K}" if affine else "") + f" must be multiples of BV = {BV}")
    if beta_hm.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"beta must be fp32 or bf16, got {beta_hm.dtype}")
    if a_inv.dtype != torch.bfloat16:
        raise TypeError(f"a_inv must be the pre-pass's bf16 A_inv, got {a_inv.dtype}")
    if not (beta_in_a_inv or affine) or (m_only and not affine):
        raise ValueError("beta_in_a_inv=False (β in X) and m_only are the affine walk's: pass affine=True")
    if warm_chunks is not None or warm_bound is not None:
        if (warm_chunks is None) == (warm_bound is None) or (warm_bound is not None) != (warm_threshold is not None):
            raise ValueError("give warm_chunks, or warm_bound with warm_threshold")
        if affine:
            raise ValueError("warm_chunks is phase C's walk: not with affine")
        return _warm_walk(q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state, warm_chunks, BV, threads,
                          num_stages, warm_bound, warm_threshold, lean)
    if affine and initial_state is not None:
        raise ValueError("the affine walk starts from [I | 0]: no initial state")
    Tp = chunk_fwd.padded_length(T)
    if gc_hm.shape != (B, HV, Tp) or beta_hm.shape != (B, HV, Tp):
        raise ValueError(f"gc and beta must be head-major [B, HV, Tp] = {[B, HV, Tp]}, got {list(gc_hm.shape)} and "
                         f"{list(beta_hm.shape)}")
    if skip_m is not None and not affine:
        raise ValueError("skip_m applies to the affine walk (affine=True)")
    if skip_m is not None and skip_m.shape != (B, HV):
        raise ValueError(f"skip_m must be [B, HV] = {[B, HV]}, got {list(skip_m.shape)}")
    kernel = walk_kernel(H, HV, K, V, BV, scale, threads, num_stages, initial_state is not None, beta_hm.dtype,
                         affine, lean and affine and skip_m is not None,      # elsewhere lean is the same kernel
                         beta_in_a_inv=beta_in_a_inv, m_only=m_only)
    h0 = state_arg(initial_state, (B, HV, K, V), q.device)
    v = v.contiguous()                  # the affine walk writes no o: v stands in for it
    o = v if affine else torch.empty_like(v)
    ht = torch.empty(B, HV, K, K if m_only else K + V if affine else V, dtype=torch.float32, device=q.device)
    args = [q.contiguous(), k.contiguous(), v, gc_hm.contiguous(), beta_hm.contiguous(), a_inv.contiguous(), h0]
    # skip_m: read only by the affine walk (zeros there: every M walked); a placeholder elsewhere
    args.append(skip_m.to(torch.int32).contiguous() if skip_m is not None else
                torch.zeros(B, HV, dtype=torch.int32, device=q.device) if affine else
                torch.empty(B, HV, dtype=torch.int32, device=q.device))
    chunk_fwd.launcher(kernel)(*args, o, ht)
    return (None if affine else o), ht


def state_arg(initial_state: Optional[torch.Tensor], shape: tuple, device) -> torch.Tensor:
    """The kernels' h0 argument: the initial state in fp32, contiguous; without one the kernel never reads h0, so an
    uninitialised tensor of the shape (the launcher checks shapes and strides) costs an allocation, not a memset."""
    if initial_state is not None:
        return initial_state.float().contiguous()
    return torch.empty(shape, dtype=torch.float32, device=device)


def _warm_walk(q, k, v, gc_hm, beta_hm, a_inv, scale, initial_state, warm_chunks, BV, threads, num_stages,
               bound=None, threshold=None, lean=False):
    """:func:`chunk_fwd_hopper_hm` with ``warm_chunks``, or ``bound`` and ``threshold`` (the walk that plans its
    warm-ups; dtypes and BV checked there): the layouts, then the warm kernel."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NB, L = _segment_rows(gc_hm, beta_hm, B, T, HV), gc_hm.shape[2]
    planned = bound is not None
    if planned:
        # the walk plans its warm-ups from the chunk bounds and starts a warm-up that reaches the sequence's start
        # from the sequence's own initial state
        _check_warm_bound(bound, initial_state, NB, HV, L, B, K, V)
        h0, ctl = state_arg(initial_state, (B, HV, K, V), q.device), bound.contiguous()
    else:
        _check_warm_start(initial_state, warm_chunks, NB, HV, K, V)
        h0, ctl = state_arg(initial_state, (NB, HV, K, V), q.device), warm_chunks.to(torch.int32).contiguous()
    o = torch.empty_like(v)
    ht = torch.empty(B if lean else NB, HV, K, V, dtype=torch.float32, device=q.device)
    kernel = warm_kernel(H, HV, K, V, BV, scale, threads, num_stages, not planned or initial_state is not None,
                         beta_hm.dtype, threshold if planned else None, lean)
    chunk_fwd.launcher(kernel)(q.contiguous(), k.contiguous(), v.contiguous(), gc_hm.contiguous(),
                               beta_hm.contiguous(), a_inv.contiguous(), h0, ctl, o, ht)
    return o, ht


def chunk_states_hopper(k: torch.Tensor, v: torch.Tensor, gc_hm: torch.Tensor, beta_hm: torch.Tensor,
                        t_inv: torch.Tensor, initial_state: Optional[torch.Tensor], *, BV: int = 128,
                        threads: int = 256, num_stages: int = 2, warm_chunks: Optional[torch.Tensor] = None,
                        warm_bound: Optional[torch.Tensor] = None, warm_threshold: Optional[float] = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hopper backward's recompute of the states (``backward.recompute``): h ``[B, NT, HV, K, V]`` bf16, the
    state entering each chunk (``chunk_bwd``'s layout), and the final state ``[B, HV, K, V]`` fp32, from bf16 k
    ``[B, T, H, K]``, v ``[B, T, HV, V]``, the pre-pass's gc and β head-major ``[B, HV, Lp]`` (Lp ≥ T, a multiple
    of 8: ``padded_length(T)`` or whole chunks) and its plain T = (I + A)⁻¹ ``[B, T, HV, 64]`` bf16
    (``prepass_hopper(beta_in_a_inv=False)``): the walk's ``store_states`` build, unsegmented (one program per
    sequence, value head and V tile of ``BV``). Twin: ``chunk_fwd_ref.chunk_states_hopper_ref``.

    ``warm_chunks`` ``[B·S, HV]`` (int): phase C of the states in segments (``backward.segmented_states``; the
    build's ``warm``, lean): gc and β per segment ``[B·S, HV, L]`` (L = T/S, a multiple of 64), initial_state
    ``[B·S, HV, K, V]`` the state entering each segment (the scan's), read only where the segment's warm-up is 0;
    segment s's program starts warm_chunks[s] ≤ s·L/64 chunks before it (not checked: a device read), from zero
    where that is above 0, and stores h at its own chunks. The final state returned is the sequences'.

    ``warm_bound`` ``[B·S, HV, L/64]`` fp32 (the pre-pass's chunk bounds per segment) with ``warm_threshold``, in
    place of ``warm_chunks``: the states in two launches (``backward.states`` where the forward's plan is its planned
    walk): each segment's program finds its warm-up itself, the fewest chunks before it whose bounds sum below
    the threshold, else the whole prefix from ``initial_state`` ``[B, HV, K, V]`` (the sequences' own, or None:
    exact), as :func:`chunk_fwd_hopper_hm`'s ``warm_bound`` walk does."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or t_inv.dtype != torch.bfloat16:
        raise TypeError(f"the Hopper states walk takes bf16 k, v and T, got {k.dtype}, {v.dtype}, {t_inv.dtype}")
    if beta_hm.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"beta must be fp32 or bf16, got {beta_hm.dtype}")
    if V % BV:
        raise ValueError(f"V = {V} must be a multiple of BV = {BV}")
    if t_inv.shape != (B, T, HV, BT):
        raise ValueError(f"T must be [B, T, HV, 64] = {[B, T, HV, BT]}, got {list(t_inv.shape)}")
    planned = warm_bound is not None
    if planned != (warm_threshold is not None) or (planned and warm_chunks is not None):
        raise ValueError("give warm_chunks, or warm_bound with warm_threshold")
    if planned:
        _check_warm_bound(warm_bound, initial_state, _segment_rows(gc_hm, beta_hm, B, T, HV), HV, gc_hm.shape[2],
                          B, K, V)
        h0_rows, ctl = B, warm_bound.contiguous()
    else:
        h0_rows = _check_states_rows(gc_hm, beta_hm, initial_state, warm_chunks, B, T, HV, K, V)
        # the warm-ups of phase C, or a placeholder the unsegmented walk never reads
        ctl = (warm_chunks.to(torch.int32).contiguous() if warm_chunks is not None else
               torch.empty(B, HV, dtype=torch.int32, device=k.device))
    kernel = states_kernel(H, HV, K, V, BV, threads, num_stages, initial_state is not None, beta_hm.dtype,
                           warm=warm_chunks is not None or planned, threshold=warm_threshold)
    h = torch.empty(B, -(-T // BT), HV, K, V, dtype=torch.bfloat16, device=k.device)
    ht = torch.empty(B, HV, K, V, dtype=torch.float32, device=k.device)
    k = k.contiguous()
    # q is not read: k stands in for it
    chunk_fwd.launcher(kernel)(k, k, v.contiguous(), gc_hm.contiguous(), beta_hm.contiguous(), t_inv.contiguous(),
                               state_arg(initial_state, (h0_rows, HV, K, V), k.device), ctl, h, ht)
    return h, ht


def states_maps(k: torch.Tensor, v: torch.Tensor, gc_hm: torch.Tensor, beta_hm: torch.Tensor, t_inv: torch.Tensor,
                skip_m: torch.Tensor, m_only: bool = False, **launch) -> torch.Tensor:
    """[M | N] ``[B, HV, K, K + V]`` fp32 (``m_only``: M ``[B, HV, K, K]``), each row's map of the states walk's
    operator (T without β, X = β ⊙ (V − Γ ⊙ K S)): :func:`chunk_fwd_hopper_hm`'s lean affine walk with
    ``beta_in_a_inv=False`` on bf16 k ``[B, T, H, K]``, v ``[B, T, HV, V]``, T ``[B, T, HV, 64]`` and head-major gc,
    β ``[B, HV, T]``, the maps ``skip_m`` flags ``[B, HV]`` not walked or written as it says. The backward's segment
    maps, forwards (``backward.segmented_states``) and in reverse (``reverse_maps.segment_maps``: M alone);
    ``launch``: BV, threads, num_stages."""
    # k stands in for q, which the affine walk does not read; the scale shapes no map
    return chunk_fwd_hopper_hm(k, k, v, gc_hm, beta_hm, t_inv, 1.0, None, affine=True, skip_m=skip_m, lean=True,
                               beta_in_a_inv=False, m_only=m_only, **launch)[1]


def _check_states_rows(gc_hm, beta_hm, initial_state, warm_chunks, B, T, HV, K, V) -> int:
    """ValueError unless gc, β, the initial state (and ``warm_chunks``) have :func:`chunk_states_hopper`'s shapes:
    whole sequences, or (``warm_chunks`` given) B·S segments of L tokens. Returns the program sequences (B or
    B·S)."""
    if warm_chunks is None:
        Lp = gc_hm.shape[-1]
        if gc_hm.shape != (B, HV, Lp) or beta_hm.shape != gc_hm.shape or Lp < T or Lp % 8:
            raise ValueError(f"gc and beta must be head-major [B, HV, Lp] with B, HV = {B}, {HV} and Lp ≥ T = {T} "
                             f"a multiple of 8, got {list(gc_hm.shape)} and {list(beta_hm.shape)}")
        if initial_state is not None and initial_state.shape != (B, HV, K, V):
            raise ValueError(f"initial_state must be [B, HV, K, V] = {[B, HV, K, V]}, got "
                             f"{list(initial_state.shape)}")
        return B
    NB = _segment_rows(gc_hm, beta_hm, B, T, HV)
    _check_warm_start(initial_state, warm_chunks, NB, HV, K, V)
    return NB


def _segment_rows(gc_hm, beta_hm, B: int, T: int, HV: int) -> int:
    """B·S, after a ValueError unless gc and β are per segment ``[B·S, HV, L]``, L a multiple of 64 dividing T (the
    warm walks' rows: the segmented forward's phase C and the states in segments)."""
    NB, L = gc_hm.shape[0], gc_hm.shape[-1]
    if gc_hm.dim() != 3 or L % BT or T % L or NB != B * (T // L) or gc_hm.shape[1] != HV or \
            beta_hm.shape != gc_hm.shape:
        raise ValueError(f"gc and beta must be per segment [B·S, HV, L] with L a multiple of {BT} dividing T = {T} "
                         f"and B·S = {B}·T/L, HV = {HV}, got {list(gc_hm.shape)} and {list(beta_hm.shape)}")
    return NB


def _check_warm_bound(bound, initial_state, NB: int, HV: int, L: int, B: int, K: int, V: int) -> None:
    """ValueError unless a walk that plans its warm-ups (the forward's or the states') has the chunk bounds of its
    B·S segments of L tokens ``[B·S, HV, L/64]`` fp32 and the sequences' initial state ``[B, HV, K, V]`` (or None)."""
    if bound.shape != (NB, HV, L // BT) or bound.dtype != torch.float32:
        raise ValueError(f"warm_bound must be [B·S, HV, L/64] = {[NB, HV, L // BT]} fp32, got "
                         f"{list(bound.shape)} {bound.dtype}")
    if initial_state is not None and initial_state.shape != (B, HV, K, V):
        raise ValueError(f"the planned walk takes the sequences' initial state [B, HV, K, V] = {[B, HV, K, V]}, "
                         f"got {list(initial_state.shape)}")


def _check_warm_start(initial_state, warm_chunks, NB: int, HV: int, K: int, V: int) -> None:
    """ValueError unless a warm walk with ``warm_chunks`` has each segment's entering state ``[B·S, HV, K, V]`` and
    its warm-ups ``[B·S, HV]``."""
    if initial_state is None or initial_state.shape != (NB, HV, K, V):
        raise ValueError(f"the segments' walk needs each segment's entering state [B·S, HV, K, V] = "
                         f"{[NB, HV, K, V]}, got {None if initial_state is None else list(initial_state.shape)}")
    if warm_chunks.shape != (NB, HV):
        raise ValueError(f"warm_chunks must be [B·S, HV] = {[NB, HV]}, got {list(warm_chunks.shape)}")
