"""The Hopper forward's plan (``hopper/plan.py``) on the shapes of the anchors' table on a 132-SM card: the
unsegmented walk where its programs fill the card, segments where they do, the two-launch planned walk for small
(host-bound) segmented calls, None for the Triton paths, and the forced plan. The plan reads shapes only, so it runs
on the CPU."""
from __future__ import annotations

import dataclasses

import torch

from linattn.ops.hopper.plan import DEFAULT, hopper_launch, plan, plan_inputs, segment_count

WIDE, NARROW = DEFAULT.launch(), DEFAULT.launch(64)


def test_hopper_launch_needs_programs_that_fill_the_card():
    """BV=128 first, then 64 (more programs), else None. Issue 4's rows on 132 SMs."""
    assert hopper_launch(8, 16, 128, 132) == WIDE                  # B=8 T=4096 H=16: 128 programs
    assert hopper_launch(4, 32, 128, 132) == WIDE                  # 4×8192 HV=32
    assert hopper_launch(2, 32, 128, 132) == NARROW                # 2×16384 H=32: 64 at BV=128, 128 at 64
    assert hopper_launch(1, 16, 128, 132) is None                  # B=1 H=16: 32 programs at most
    assert hopper_launch(1, 8, 128, 132) is None
    assert hopper_launch(16, 16, 64, 132) == NARROW                # K = V = 64: BV=128 does not divide V
    assert hopper_launch(4, 16, 256, 132) == WIDE                  # V = 256: two tiles per head


def test_segment_count_fills_the_card_with_views():
    """The fewest power-of-two segments per sequence that fill the card, dividing T's chunks, each at least
    min_segment_chunks long."""
    assert segment_count(1, 16, 128, 32768, 132) == 8          # 16 → 128 programs of BV=128
    assert segment_count(1, 8, 128, 32768, 132) == 16          # 2/8 heads
    assert segment_count(1, 16, 128, 131072, 132) == 8
    assert segment_count(1, 16, 128, 4096, 132) == 4           # 64 chunks: 4 segments of 16 chunks
    assert segment_count(1, 16, 128, 4096 + 64, 132) is None   # 65 chunks: no equal segments
    assert segment_count(1, 16, 128, 1000, 132) is None        # T not a multiple of 64
    assert segment_count(1, 1, 128, 2048, 132) is None         # 32 chunks: 2 segments of 16 cannot fill 132 SMs
    shorter = dataclasses.replace(DEFAULT, min_segment_chunks=4)
    assert segment_count(1, 1, 128, 2048, 132, shorter) is None and segment_count(1, 4, 128, 4096, 132, shorter) == 16


def test_plan_takes_segments_where_the_walk_alone_cannot_fill_the_card():
    for forced in (False, True):
        found = plan(8, 16, 128, 4096, 132, forced)                                # fills: no segments
        assert (found.kernel_launch, found.segments, found.planned_walk) == (WIDE, 1, False)
        found = plan(1, 16, 128, 32768, 132, forced)                               # 8 × 16 programs, 2¹⁹ rows
        assert (found.kernel_launch, found.segments, found.planned_walk) == (WIDE, 8, False)
        found = plan(1, 8, 128, 32768, 132, forced)                                # 2¹⁸ rows: the five launches
        assert (found.segments, found.planned_walk) == (16, False)
    found = plan(1, 16, 128, 4096, 132)                         # 2¹⁶ rows: host-bound, the two-launch walk
    assert (found.kernel_launch, found.segments, found.planned_walk) == (NARROW, 4, True)
    found = plan(1, 16, 128, 4096, 132, forced=True)            # forced: the five launches at any size
    assert (found.segments, found.planned_walk) == (4, False)
    assert plan(1, 16, 128, 1000, 132) is None                  # T: no equal segments, so the Triton paths
    assert plan(1, 16, 128, 1000, 132, True).kernel_launch == WIDE
    assert plan(1, 16, 192, 1000, 132, True).kernel_launch == NARROW
    assert all(p.reason for p in (plan(8, 16, 128, 4096, 132), plan(1, 16, 128, 4096, 132)))


def test_a_config_moves_the_thresholds():
    """The plan reads its thresholds from the config it is given, and carries it (the forward reads it there)."""
    eager = dataclasses.replace(DEFAULT, min_segmented_head_tokens=1)
    found = plan(1, 16, 128, 4096, 132, config=eager)
    assert found.segments == 4 and not found.planned_walk and found.config is eager
    greedy = dataclasses.replace(DEFAULT, fill_fraction=2.0)           # two programs per SM to count as full
    assert plan(8, 16, 128, 4096, 132, config=greedy).segments == 4


def test_plan_inputs_says_why_not_off_the_gpu():
    """CPU, fp32 and misaligned inputs get no plan, each with its reason (the device gates run first)."""
    q = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    v = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)
    found, why = plan_inputs(q, v, (), None, None)
    assert found is None and "sm_90" in why
    found, why = plan_inputs(q.float(), v.float(), (), None, None, forced=True)
    assert found is None and "bf16" in why
