"""The Hopper forward's plan: whether it runs for a call, and how (the walk's launch, segments, the planned warm
walk), from shapes alone (no host sync). The few values that stay tunable live in :class:`HopperPlanConfig`.

    plan_inputs(q, v, ...)    the device and dtype gates, packed sequences by padding, then :func:`plan`
    plan(N, HV, V, T, sms)    unsegmented where its programs fill the card, else segments where they do

The unsegmented walk runs one program per (sequence, value head, V tile) over all chunks of its sequence: with fewer
programs than SMs the card idles, so there the sequence is cut into segments (sequence parallelism, exact through
the state maps or warm-ups: ``forward.py``). Small segmented calls are host-bound, so below
``min_segmented_head_tokens`` they take the two-launch planned warm walk instead of the five-launch forward.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..common import num_sms
from .chunk_fwd import BT, misaligned, unsupported_reason
from .varlen import padded_rows, worth_padding


@dataclass(frozen=True)
class HopperPlanConfig:
    """The Hopper forward's tunables (``docs/decisions.md`` gives each one's measurement).

    fill_fraction: the share of the SMs a launch's programs must cover to count as filling the card.
    min_segment_chunks: the shortest segment, in 64-token chunks.
    min_segmented_head_tokens: sequences × tokens × value heads from which a segmented call takes the five-launch
        forward (maps, scan, warm-ups); below it the two-launch planned warm walk (host time decides there).
    negligible_m_log2: a map whose norm bound is below 2^this is negligible: the entering state moves the next
        segment's by less than fp32 keeps (2⁻²⁴).
    warm_up_max_fraction: the longest warm-up, as a fraction of a segment's chunks.
    scan_bv: the state scan's V slice; scan_precision: its products ("tf32" or "tf32x3": the maps come from bf16 dots,
        so tf32 is below what they already carry).
    max_padded_fraction: packed sequences are padded to one length only where the padding is at most this fraction
        of the padded batch (beyond it the Triton split, which walks the packed rows as they are).
    BV, threads, num_stages: the walk's launch (BV = 64 where 128 does not divide the width, or fills the card where
        128 does not).
    """
    fill_fraction: float = 0.9
    min_segment_chunks: int = 16
    min_segmented_head_tokens: int = 2 ** 18
    negligible_m_log2: float = -30.0
    warm_up_max_fraction: float = 1.0
    scan_bv: int = 16
    scan_precision: str = "tf32"
    max_padded_fraction: float = 0.2
    BV: int = 128
    threads: int = 256
    num_stages: int = 2

    def launch(self, BV: Optional[int] = None) -> dict:
        """The walk's launch keywords at ``BV`` (None: :attr:`BV`)."""
        return dict(BV=BV or self.BV, threads=self.threads, num_stages=self.num_stages)


DEFAULT = HopperPlanConfig()


@dataclass(frozen=True)
class CacheLimits:
    """The process-wide caches of repeated calls.

    prepared: prepared signatures kept (``prepared.py``; a process that sees more starts over: each holds no tensors).
    routes: the op's routes kept (``route.py``; likewise).
    scratch_bytes: the prepared calls' kept scratch per device, at most (``prepared.scratch``): larger calls are
        GPU-bound, so the allocations' host time does not count there.
    """
    prepared: int = 256
    routes: int = 256
    scratch_bytes: int = 64 << 20


CACHE_LIMITS = CacheLimits()


@dataclass(frozen=True)
class HopperPlan:
    """How the Hopper forward runs one call: the walk's ``launch`` (BV, threads, num_stages), ``segments`` per
    sequence (1: unsegmented), ``planned_walk`` (segmented as two launches: the walk finds its own warm-ups),
    ``padded_rows`` (packed sequences padded to this length; None: equal-length inputs), the ``config`` it was
    made under and the ``reason`` it was chosen."""
    launch: tuple
    segments: int = 1
    planned_walk: bool = False
    padded_rows: Optional[int] = None
    config: HopperPlanConfig = DEFAULT
    reason: str = ""

    @property
    def kernel_launch(self) -> dict:
        return dict(self.launch)


def fitted_launch(width: int, launch: dict) -> dict:
    """``launch`` with BV = 64 where its BV does not divide ``width`` (a multiple of 64: V, or K for the affine walk,
    whose tiles must not straddle M and N)."""
    return launch if width % launch["BV"] == 0 else dict(launch, BV=64)


def fills_card(programs: int, sms: int, config: HopperPlanConfig = DEFAULT) -> bool:
    """Whether ``programs`` walking programs cover ``config.fill_fraction`` of ``sms`` SMs."""
    return programs >= config.fill_fraction * sms


def hopper_launch(num_sequences: int, HV: int, V: int, sms: int, config: HopperPlanConfig = DEFAULT
                  ) -> Optional[dict]:
    """The walk's launch for ``num_sequences`` sequences of ``HV`` value heads of width ``V`` on ``sms`` SMs: the
    widest V tile (``config.BV``, then 64) whose programs fill the card, or None."""
    for BV in (config.BV, 64):
        if V % BV == 0 and fills_card(num_sequences * HV * (V // BV), sms, config):
            return config.launch(BV)
    return None


def segment_count(num_sequences: int, HV: int, V: int, T: int, sms: int, config: HopperPlanConfig = DEFAULT
                  ) -> Optional[int]:
    """Segments per sequence where the unsegmented walk's programs do not fill the card: the fewest S in 2, 4, …, 64
    that divides T's chunks (T a multiple of 64: the segments are views), leaves segments of at least
    ``config.min_segment_chunks`` chunks and gives programs that fill the card at ``config.BV``, else at 64 (a wider
    tile walks a chunk in less than twice a narrower one's time, so more segments at the wider tile win); None
    where none does."""
    if T % BT:
        return None
    chunks = T // BT
    candidates = [S for S in (2, 4, 8, 16, 32, 64) if chunks % S == 0 and chunks // S >= config.min_segment_chunks]
    for BV in (config.BV, 64):
        for S in candidates:
            if V % BV == 0 and fills_card(num_sequences * S * HV * (V // BV), sms, config):
                return S
    return None


def plan(num_sequences: int, HV: int, V: int, T: int, sms: int, forced: bool = False,
         config: HopperPlanConfig = DEFAULT) -> Optional[HopperPlan]:
    """The plan for ``num_sequences`` equal-length sequences of ``T`` tokens and ``HV`` value heads of width ``V`` on
    ``sms`` SMs, or None for the Triton paths: the unsegmented walk where its programs fill the card
    (:func:`hopper_launch`), else segments where they do (:func:`segment_count`; the planned warm walk below
    ``config.min_segmented_head_tokens`` unless ``forced``), else None — or, ``forced``, the unsegmented walk (at
    BV = 64 where the configured tile does not divide V)."""
    launch = hopper_launch(num_sequences, HV, V, sms, config)
    if launch is not None:
        return HopperPlan(tuple(launch.items()), config=config, reason="its programs fill the card")
    segments = segment_count(num_sequences, HV, V, T, sms, config)
    if segments is None:
        if forced:
            return HopperPlan(tuple(fitted_launch(V, config.launch()).items()), config=config,
                              reason="forced; no segmentation fills the card")
        return None
    launch = hopper_launch(num_sequences * segments, HV, V, sms, config)
    small = num_sequences * T * HV < config.min_segmented_head_tokens and not forced
    reason = (f"{segments} segments fill the card" +
              (", two launches (host-bound size)" if small else ", maps and warm-ups"))
    return HopperPlan(tuple(launch.items()), segments, planned_walk=small, config=config, reason=reason)


def input_blocker(q: torch.Tensor, v: torch.Tensor, *others: Optional[torch.Tensor]) -> Optional[str]:
    """Why the Hopper kernels cannot read these tensors (None: they can): ``chunk_fwd.unsupported_reason`` (not bf16,
    not sm_90, no TileLang, K or V out of range), then any of q, v and ``others`` (None skipped) starting off a
    16-byte boundary (``chunk_fwd.misaligned``: their TMA loads). The forward's plan and the backward's dispatch
    ask it."""
    why = unsupported_reason(q, v)
    if why is None and misaligned(q, v, *others) is not None:
        why = "an input starts off a 16-byte boundary"
    return why


def plan_inputs(q: torch.Tensor, v: torch.Tensor, others: tuple, cu_seqlens: Optional[torch.Tensor],
                offsets: Optional[list[int]], forced: bool = False, config: HopperPlanConfig = DEFAULT
                ) -> tuple[Optional[HopperPlan], str]:
    """(the plan for these inputs or None, why): None where the kernels cannot take them (not bf16, not sm_90, no
    TileLang, K or V out of range: ``chunk_fwd.unsupported_reason``; an input off a 16-byte boundary, ``others``
    being k, g, β and the initial state), where packed sequences would waste more than
    ``config.max_padded_fraction`` to padding (unless ``forced``), and where :func:`plan` finds no launch that fills
    the card (unless ``forced``). ``offsets``: ``cu_seqlens`` on the host."""
    why = input_blocker(q, v, *others)
    if why is not None:
        return None, f"the Hopper kernels cannot take it: {why}"
    num_sequences, T, rows = q.shape[0], q.shape[1], None
    if cu_seqlens is not None:
        num_sequences, T = len(offsets) - 1, padded_rows(offsets)
        if not (forced or worth_padding(offsets, T, config.max_padded_fraction)):
            return None, "packed sequences would waste too much to padding"
        rows = T
    found = plan(num_sequences, v.shape[2], v.shape[3], T, num_sms(q.device), forced, config)
    if found is None:
        return None, "no Hopper launch fills the card"
    return dataclasses.replace(found, padded_rows=rows), found.reason


def scan_options(K: int, config: HopperPlanConfig = DEFAULT) -> dict:
    """``seq_parallel.affine_scan``'s keywords: one [K, K] map tile per step (the state kept in registers from step
    to step) where K ≤ 128, at 8 warps; row blocks at 4 warps beyond."""
    whole = K <= 128
    return dict(precision=config.scan_precision, whole_map=whole, num_warps=8 if whole else 4)


def map_slots(device: torch.device, num_sequences: int) -> int:
    """``map_bound.segment_plan``'s map_slots: phase A's programs per wave for each sequence (one program per SM, the
    SMs shared evenly), for the wave-fill rule."""
    return max(1, num_sms(device) // num_sequences)


def warm_up_max(chunks: int, config: HopperPlanConfig = DEFAULT) -> int:
    """The longest warm-up in chunks for segments of ``chunks`` chunks."""
    return max(1, int(chunks * config.warm_up_max_fraction))
