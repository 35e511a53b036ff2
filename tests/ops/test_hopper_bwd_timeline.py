"""The reverse walk's timeline instrument (linattn/ops/hopper/timeline.py, ``chunk_bwd.build_kernel(timeline=True)``):

* the host's reduction of stamps to µs per phase recovers known phase times from synthetic stamps (per program
  clocks, clock64 offsets per SM, a slow first step, the exchange's roles), and rejects unwritten stamps;
* the timeline build compiles for sm_90a at K = V = 128, BV = 64 within its spill bound, its stamps in the consumer
  warpgroups only, one call per point; the default build carries no timer at all;
* ``chunk_bwd.walk_timeline`` launches the timeline build with the walk's arguments and the stamps (CPU stand-ins,
  the launch recorded, not run).
* the role-split walk's (``chunk_bwd_roles.build_kernel(timeline=True)``): each role's column reduced with its own
  points, the build's stamps one per point in each role's branch, its launch.
What they measure on the GPU: benchmarks/gpu_check_hopper_bwd.py --timeline, gpu_check_roles_walk.py --timeline.
"""
from __future__ import annotations

import re

import pytest
import torch

from linattn.ops.hopper import timeline

from .test_hopper_bwd import COMPILES, TIMELINE_SPILL_BYTES, assert_launch_matches_params

POINTS = timeline.POINTS
# The role-split walk's timeline build spills 32 B where its default build spills 20 (test_hopper_bwd_roles): ptxas
# places the two builds' registers differently, and the stamps hold registers of their own. Its cost is measured
# beside the walk (gpu_check_roles_walk --timeline: ≈ 12% at row 2).
ROLES_TIMELINE_SPILL_BYTES = 32
# µs per phase (each point's, from the point before it) in later steps, warpgroup 0; warpgroup 1 takes 0.25 µs more
# in every phase; the first step takes 10× each; the gap between steps 0.5 µs
LATER_US = {name: 0.5 + i for i, name in enumerate(POINTS[1:])}


def synthetic_stamps(programs: int, steps: int, slices: int, clocks: list[float]) -> torch.Tensor:
    """Stamps of known phase times: program p's SM at ``clocks[p % len(clocks)]`` cycles per ns, its clock64 offset
    by an arbitrary count; dq_sum and dk_sum take 3 µs more where the program's slice owns the step."""
    stamps = torch.empty(timeline.stamps_shape(programs, steps, 2), dtype=torch.int64)
    for p in range(programs):
        rate, offset = clocks[p % len(clocks)], 10 ** 9 * (p + 1)
        for w in range(2):
            ns = 5_000 * p           # the program's start on the global timer
            for s in range(steps):
                stamps[p, s, len(POINTS), w] = ns
                stamps[p, s, 0, w] = round(ns * rate) + offset
                for i, name in enumerate(POINTS[1:], start=1):
                    us = LATER_US[name] + 0.25 * w
                    if name in ("dq_sum", "dk_sum") and s % slices == p % slices and slices > 1:
                        us += 3.0
                    ns += 1000 * us * (10 if s == 0 else 1)
                    stamps[p, s, i, w] = round(ns * rate) + offset
                ns += 500
    return stamps


def test_timeline_phases_recovers_known_phase_times():
    """Per phase and warpgroup the median and p90 of later steps, and the first step's, equal the stamped times at
    each program's own clock (two clocks, programs of both); the step is the sum of its phases, the gap 0.5 µs;
    with two slices the exchange phases split into the owner's (3 µs more) and the other's."""
    programs, steps, slices = 6, 5, 2
    stamps = synthetic_stamps(programs, steps, slices, clocks=[1.5, 2.0])
    clock = timeline.cycles_per_ns(stamps)
    assert torch.allclose(clock[:, 0], torch.tensor([1.5, 2.0] * 3, dtype=torch.float64), rtol=1e-9)
    summary = timeline.timeline_phases(stamps, slices)
    assert summary["cycles_per_ns"] == pytest.approx(1.75) and summary["start_spread_us"] == pytest.approx(25.0)
    for w in range(2):
        wg = f"wg{w}"
        for name in POINTS[1:]:
            if name in ("dq_sum", "dk_sum"):
                by_role = summary[name + "_by_role"][wg]
                assert by_role["other"]["p50"] == pytest.approx(LATER_US[name] + 0.25 * w, abs=1e-6)
                assert by_role["owner"]["p50"] == pytest.approx(LATER_US[name] + 0.25 * w + 3.0, abs=1e-6)
                continue
            later, first = summary[name][wg]["later"], summary[name][wg]["first"]
            assert later["p50"] == pytest.approx(LATER_US[name] + 0.25 * w, abs=1e-6), (name, w)
            assert later["p90"] == pytest.approx(LATER_US[name] + 0.25 * w, abs=1e-6), (name, w)
            assert first["p50"] == pytest.approx(10 * (LATER_US[name] + 0.25 * w), abs=1e-5), (name, w)
        assert summary["gap"][wg]["later"]["p50"] == pytest.approx(0.5, abs=1e-6)
        steps_us = timeline.phase_us(stamps)["step"][:, 1:, w]
        expected = sum(LATER_US.values()) + 0.25 * w * len(LATER_US)
        assert steps_us.min().item() == pytest.approx(expected, abs=1e-6)
        assert steps_us.max().item() == pytest.approx(expected + 6.0, abs=1e-6)   # owner steps: both exchanges
    assert "dq_sum owner" in timeline.format_table(summary, "synthetic")


def test_timeline_phases_rejects_bad_stamps():
    """An entry the kernel never stamped (−1, the launcher's fill), a single recorded step (no clock) or a wrong
    shape raise a clear error instead of a table of nonsense."""
    stamps = synthetic_stamps(2, 3, 1, clocks=[1.5])
    unwritten = stamps.clone()
    unwritten[1, 2, 4, 0] = -1
    with pytest.raises(ValueError, match="unwritten"):
        timeline.timeline_phases(unwritten)
    with pytest.raises(ValueError, match="two recorded steps"):
        timeline.timeline_phases(stamps[:, :1])
    with pytest.raises(ValueError, match="int64"):
        timeline.timeline_phases(stamps[:, :, 1:])


@COMPILES
def test_walk_timeline_build_compiles_for_sm90a(tmp_path):
    """The timeline build at K = V = 128, BV = 64 (GVA, two slices): ptxas spills at most TIMELINE_SPILL_BYTES (see
    there) and serialises no wgmma within the walk's 168 registers; the walk's 20 dots are all there; one stamp call
    per point, every one in the consumers' branch (after the producer's loads), the loads' point after the waits on
    all eight input barriers. The default build of the same sizes holds no timer, no stamp and no stamps
    parameter."""
    from linattn.ops.hopper import chunk_bwd
    from linattn.ops.hopper.cubin import compile_sm90a, ptxas_summary
    source = chunk_bwd.compiled_kernel(2, 4, 128, 128, 128 ** -0.5, 64, "sm_90a", timeline=True).get_kernel_source()
    assert source.count("tl::wgmma_ss<tl::DataType::kBFloat16") == 20
    assert "int64_t* __restrict__ stamps" in source
    calls = [m.start() for m in re.finditer(r"linattn_stamp\(\(", source)]
    assert len(calls) == len(POINTS), len(calls)
    assert min(calls) > source.rindex("tl::tma_load("), "a stamp in the producer's branch"
    loads = source[calls[0]:calls[1]]
    assert len(set(re.findall(r"mbarrier\[(\d+)\]\.wait", loads))) == 7, loads[:2000]   # gc's wait precedes start
    ptxas = ptxas_summary(compile_sm90a(source, tmp_path)[1])
    assert max(ptxas["spill_stores"], ptxas["spill_loads"]) <= TIMELINE_SPILL_BYTES, ptxas
    assert not ptxas["wgmma_serialised"], ptxas
    default = chunk_bwd.compiled_kernel(2, 4, 128, 128, 128 ** -0.5, 64, "sm_90a").get_kernel_source()
    assert not any(word in default for word in ("linattn_stamp", "clock64", "globaltimer", "stamps")), "timer"


def stand_in_walk_inputs(B: int, NT: int) -> tuple:
    """A walk's inputs as CPU zeros (H = 2, HV = 4, K = V = 128, T = 100) and its scale, for a recorded launch."""
    T, K, bf = 100, 128, torch.bfloat16
    q, k = (torch.zeros(B, T, 2, K, dtype=bf) for _ in range(2))
    v, do = (torch.zeros(B, T, 4, K, dtype=bf) for _ in range(2))
    gc, beta = (torch.zeros(B, 4, NT * 64) for _ in range(2))
    return (q, k, v, do, gc, beta, torch.zeros(B, T, 4, 64, dtype=bf), torch.zeros(B, NT, 4, K, K, dtype=bf), None,
            K ** -0.5)


@COMPILES
def test_walk_timeline_launch_matches_the_kernels_parameters(monkeypatch):
    """chunk_bwd.walk_timeline's tensors (CPU stand-ins; the launch recorded, not run) against the timeline build's
    parameters: the walk's, then the stamps int64 [B·HV·NV, steps, points + 1, 2] filled with −1, steps the chunks
    (None) or fewer; the outputs returned are the ones launched."""
    from linattn.ops.hopper import chunk_bwd
    compiled = chunk_bwd.compiled_kernel(2, 4, 128, 128, 128 ** -0.5, 64, "sm_90a", timeline=True)
    launched = []
    monkeypatch.setattr(chunk_bwd, "compiled_kernel", lambda *args, **kwargs: compiled)
    monkeypatch.setattr(chunk_bwd, "launcher", lambda kernel: lambda *args: launched.append(args))
    B, NT = 2, 2
    args = stand_in_walk_inputs(B, NT)
    outputs, stamps = chunk_bwd.walk_timeline(*args)
    assert stamps.shape == timeline.stamps_shape(B * 4 * 2, NT) and (stamps == -1).all()
    assert chunk_bwd.walk_timeline(*args, steps=1)[1].shape[1] == 1
    with pytest.raises(ValueError, match="steps"):
        chunk_bwd.walk_timeline(*args, steps=0)
    first = launched[0]
    assert len(first) == len(compiled.params) and first[-1] is stamps and first[9] is outputs[0]
    assert_launch_matches_params(first, compiled.params)


@pytest.mark.parametrize("roles", [False, True], ids=["slices", "roles"])
def test_walk_ab_precompiles_every_builds_kernels(monkeypatch, roles):
    """benchmarks/walk_ab.py's precompile list (the GPU A/B of walk builds): per build the walk (and, for the slice
    walk, the warm-ups) at each row's heads and the timeline build at row 2's, plus the recompute's kernels; every
    entry a build of the module it names (a second module here: this tree's walk module under another name); the
    role-split walk's builds take no BV."""
    from pathlib import Path

    from linattn.ops.hopper import chunk_bwd, chunk_bwd_roles, precompile
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    import gpu_check_hopper_bwd as g
    import walk_ab
    seen = []
    monkeypatch.setattr(precompile, "precompile", lambda builds: seen.extend(builds) or "none")
    module = chunk_bwd_roles if roles else chunk_bwd
    walk_ab.precompile_all({"this tree": module, "copy": module}, [2, 7, 5], roles)
    recompute = len(g.recompute_configs())
    walks = [b for b in seen[recompute:] if b.compile is module.compiled_kernel and not b.kwargs]
    warms = [b for b in seen[recompute:] if b.compile is chunk_bwd.compiled_warm_kernel]
    timelines = [b for b in seen[recompute:] if b.kwargs == dict(timeline=True)]
    per_row = 1 if roles else 2
    assert len(seen) == recompute + 2 * (3 * per_row + 1)
    assert sorted(b.args[:2] for b in walks) == sorted(2 * [(16, 16), (2, 8), (16, 32)])
    assert all(len(b.args) == (5 if roles else 6) for b in walks + timelines)
    assert len(warms) == (0 if roles else 6) and len(timelines) == 2
    assert all(b.args[:2] == (16, 16) for b in timelines)


def test_role_timeline_reduces_each_roles_column_with_its_points():
    """The role-split walk's stamps (one column per role, each role's points first, the global timer last): each
    role's phases come from its own points at its own clock; a role with fewer points than the row holds ignores
    the entries past them; a wrong shape raises."""
    programs, steps = 3, 4
    stamps = torch.full(timeline.role_stamps_shape(programs, steps), -1, dtype=torch.int64)
    rates = {"S": 1.5, "B": 1.5, "A": 1.5}
    phase = {role: {name: 0.25 * (r + 1) * (i + 1) for i, name in enumerate(points[1:])}
             for r, (role, points) in enumerate(timeline.ROLE_POINTS.items())}
    for r, (role, points) in enumerate(timeline.ROLE_POINTS.items()):
        for p in range(programs):
            ns = 1000.0 * p
            for s in range(steps):
                stamps[p, s, -1, r] = round(ns)
                stamps[p, s, 0, r] = round(ns * rates[role]) + 7 * p
                for i, name in enumerate(points[1:], start=1):
                    ns += 1000 * phase[role][name]
                    stamps[p, s, i, r] = round(ns * rates[role]) + 7 * p
                ns += 300
    summaries = timeline.role_timeline(stamps)
    assert list(summaries) == list(timeline.ROLE_POINTS)
    for role, points in timeline.ROLE_POINTS.items():
        summary = summaries[role]
        assert summary["phases"] == points[1:] + ("step", "gap")
        for name in points[1:]:
            assert summary[name]["wg0"]["later"]["p50"] == pytest.approx(phase[role][name], abs=2e-3), (role, name)
        assert summary["step"]["wg0"]["later"]["p50"] == pytest.approx(sum(phase[role].values()), abs=2e-3)
        assert summary["gap"]["wg0"]["later"]["p50"] == pytest.approx(0.3, abs=2e-3)
        assert "role " + role in timeline.format_table(summary, "role " + role)
    with pytest.raises(ValueError, match="stamps must be"):
        timeline.role_timeline(stamps[:, :, 1:])
    # a build with A idle never stamps A's column: the busy roles alone, the same summaries
    stamps[..., 2] = -1
    busy = timeline.role_timeline(stamps, "SB")
    assert list(busy) == ["S", "B"] and busy["B"]["dk"] == summaries["B"]["dk"]
    with pytest.raises(ValueError, match="unwritten"):
        timeline.role_timeline(stamps)
    with pytest.raises(ValueError, match="roles must be"):
        timeline.role_timeline(stamps, "SX")


@COMPILES
def test_role_split_walk_timeline_build_compiles_for_sm90a(tmp_path):
    """The role-split walk's timeline build: one stamp call per point of each role (in that role's branch: after
    its register allocation), none in the producer's; the walk's 25 dots; its spill within ROLES_TIMELINE_SPILL_BYTES.
    The default build holds no timer."""
    from linattn.ops.hopper import chunk_bwd_roles
    from linattn.ops.hopper.cubin import compile_sm90a, ptxas_summary

    from .test_hopper_bwd_roles import DOTS
    source = chunk_bwd_roles.compiled_kernel(16, 16, 128, 128, 128 ** -0.5, "sm_90a", False, True).get_kernel_source()
    assert source.count("tl::wgmma_ss<tl::DataType::kBFloat16") == DOTS
    assert "int64_t* __restrict__ stamps" in source
    branches = source.split("tl::warpgroup_reg_")[1:]      # S, B, A (alloc), then the producer (dealloc)
    assert len(branches) == 4
    for branch, points in zip(branches, timeline.ROLE_POINTS.values()):
        assert len(re.findall(r"linattn_stamp\(\(", branch)) == len(points)
    assert "linattn_stamp((" not in branches[3]
    ptxas = ptxas_summary(compile_sm90a(source, tmp_path)[1])
    assert ptxas["spill_stores"] <= ROLES_TIMELINE_SPILL_BYTES and not ptxas["wgmma_serialised"], ptxas
    default = chunk_bwd_roles.compiled_kernel(16, 16, 128, 128, 128 ** -0.5, "sm_90a").get_kernel_source()
    assert not any(word in default for word in ("linattn_stamp", "clock64", "globaltimer", "stamps")), "timer"


@COMPILES
def test_role_split_walk_timeline_launch_matches_the_kernels_parameters(monkeypatch):
    """chunk_bwd_roles.walk_timeline's tensors (CPU stand-ins, the launch recorded) against the timeline build's
    parameters: the walk's, then the stamps int64 role_stamps_shape(B·HV, steps) filled with −1."""
    from linattn.ops.hopper import chunk_bwd_roles
    compiled = chunk_bwd_roles.compiled_kernel(2, 4, 128, 128, 128 ** -0.5, "sm_90a", False, True)
    launched = []
    monkeypatch.setattr(chunk_bwd_roles, "compiled_kernel", lambda *args, **kwargs: compiled)
    monkeypatch.setattr(chunk_bwd_roles, "launcher", lambda kernel: lambda *args: launched.append(args))
    B, NT = 2, 2
    args = stand_in_walk_inputs(B, NT)
    outputs, stamps = chunk_bwd_roles.walk_timeline(*args, want_dh0=False)
    assert stamps.shape == timeline.role_stamps_shape(B * 4, NT) and (stamps == -1).all()
    assert chunk_bwd_roles.walk_timeline(*args, want_dh0=False, steps=1)[1].shape[1] == 1
    with pytest.raises(ValueError, match="steps"):
        chunk_bwd_roles.walk_timeline(*args, want_dh0=False, steps=0)
    first = launched[0]
    assert len(first) == len(compiled.params) and first[-1] is stamps and first[9] is outputs[0]
    assert_launch_matches_params(first, compiled.params)
