"""The segmented Hopper forward's warm-ups (``hopper/forward.py``: ``segment_flags`` and ``forward_hopper(warm_up=
True)``) around the kernel's twin on the CPU: the plan's chunk counts against a brute-force float64 bound, and the
forward against the float64 recurrence with heads that warm up in one chunk, in two, or walk their maps. The plan's
Triton kernels against their twins: tests/ops/test_map_bound.py."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import chunk_fwd_ref as twins
from linattn.ops.hopper import forward as hopper_fwd

S, LC = 4, 8            # 4 segments of 8 chunks: warm-ups of up to WARM_UP_MAX_FRACTION · 8 chunks


@pytest.fixture(autouse=True)
def _no_wave_fill(monkeypatch):
    """These tests are about the warm-ups themselves: with ``forward.MAP_WAVE_FILL`` (on by default) the plan would
    send three_heads' two warming heads to their maps as well (phase A's wave has room for them), which
    :func:`test_wave_fill_forward_equals_the_recurrence` tests."""
    monkeypatch.setattr(hopper_fwd, "MAP_WAVE_FILL", False)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def three_heads(K=16, V=16, seed=0):
    """One sequence of S·LC chunks, unit keys, β < 1 (so a token's bound is its decay alone), three value heads
    with constant decays: −3 nats per token (one chunk of warm-up suffices), −0.25 (−23 log2 per chunk: two
    chunks), −0.003 (−0.28 log2 per chunk: no warm-up within a segment's 8 chunks, so the head walks its maps)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    T, HV = S * LC * 64, 3
    g = torch.tensor([-3.0, -0.25, -0.003], dtype=torch.float64).expand(1, T, HV).clone()
    return dict(q=F.normalize(r(1, T, 1, K), dim=-1), k=F.normalize(r(1, T, 1, K), dim=-1), v=r(1, T, HV, V), g=g,
                beta=torch.rand(1, T, HV, generator=gen, dtype=torch.float64) * 0.9,
                initial_state=r(1, HV, K, V) * 0.1)


def twins_recording_calls(monkeypatch) -> list:
    """forward_hopper's kernel and pre-pass replaced by their twins (the pre-pass's is tested against the Triton
    pre-pass in test_hopper_prepass.py: no interpreter run here); returns the list the kernel's keyword arguments are
    appended to, call by call (phase A, then phase C)."""
    from linattn.ops.hopper.prepass import prepass_hopper_ref
    calls = []

    def twin(*args, **kw):
        calls.append(kw)
        return twins.chunk_fwd_hopper_hm_ref(*args, **kw)

    monkeypatch.setattr(hopper_fwd, "chunk_fwd_hopper_hm", twin)
    # what run_prepass writes for these tests' fp32 A_inv: the Triton pre-pass's, never A_inv diag(β)
    monkeypatch.setattr(hopper_fwd, "run_prepass", lambda k, v, g, beta, S_, prepass, a_dtype:
                        prepass_hopper_ref(k, g, beta, S_, a_dtype, beta_in_a_inv=False))
    return calls


def test_plan_takes_the_fewest_chunks_whose_bound_is_negligible():
    x = three_heads()
    flags = hopper_fwd.segment_flags(x["k"], x["g"], x["beta"], S, warm_up=True)
    warm, walk = flags.warm, flags.walk
    assert torch.equal(flags.skip_m, torch.where(walk, 0, 2).int())       # phase A: the warmed heads' maps go
    assert warm.dtype == torch.int32 and warm.shape == (S, 3) and walk.shape == (S, 3)
    assert not walk[:, 0].any() and not walk[:, 1].any() and walk[:, 2].all()
    assert warm[0].eq(0).all()                              # segment 0 starts at the sequence's start
    # brute force: the fewest whole chunks before each segment whose summed per-token bound is below 2⁻³⁰
    per_token = x["g"][0] * math.log2(math.e)               # unit keys, β < 1: |1 − β‖k‖²| < 1
    for hv, expected in ((0, 1), (1, 2)):
        chunk_bound = per_token[:, hv].view(-1, 64).sum(1)
        for s in range(1, S):
            w = next(w for w in range(1, LC + 1) if chunk_bound[s * LC - w:s * LC].sum() < -30)
            assert w == expected and warm[s, hv] == w
    assert warm[:, 2].eq(0).all()                           # a walking head starts at its segments


def test_plan_sends_a_head_to_its_maps_when_one_segment_cannot_warm_up():
    """Only segment 1 of head 0 decays slowly, so segment 2 cannot warm up within a segment: the whole head walks
    its maps (the scan needs them all)."""
    x = three_heads()
    x["g"][0, LC * 64:2 * LC * 64, 0] = -0.001              # segment 1, the chunks before segment 2
    _, warm, walk, _ = hopper_fwd.segment_flags(x["k"], x["g"], x["beta"], S)
    assert walk[:, 0].all() and warm[:, 0].eq(0).all() and not walk[:, 1].any()


@pytest.mark.parametrize("skip_maps", [False, True])
def test_warm_forward_equals_the_recurrence(monkeypatch, skip_maps):
    """forward_hopper(segments=4, warm_up=True) around the twin, fp32: o and the final state equal the float64
    recurrence (the warm-ups' error is below 2⁻³⁰ of the state); phase A got skip flags 2 for the warmed heads and
    phase C the plan's chunk counts. Negative control: the same walk without warm-ups (every warmed segment from
    zero at its own start) is wrong. The plain segments: with LEAN_SEGMENTS the control's segments would start
    from the entering states the scan left unwritten (test_hopper_lean_segments.py tests the lean forward)."""
    monkeypatch.setattr(hopper_fwd, "LEAN_SEGMENTS", False)
    x = three_heads()
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")] + [0.25, x["initial_state"].float()]
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    calls = twins_recording_calls(monkeypatch)
    kw = dict(a_inv_dtype=torch.float32, segments=S, BV=16, warm_up=True, skip_maps=skip_maps)
    o, ht = hopper_fwd.forward_hopper(*args, **kw)
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    flags = hopper_fwd.segment_flags(x["k"], x["g"], x["beta"], S, None, skip_maps, True)
    assert calls[0]["affine"] and calls[0]["skip_m"][:, :2].eq(2).all()
    assert torch.equal(calls[0]["skip_m"][:, 2] != 2, flags.walk[:, 2])
    assert torch.equal(calls[1]["warm_chunks"], flags.warm)
    monkeypatch.setattr(hopper_fwd, "segment_flags", lambda *a: flags._replace(warm=torch.zeros_like(flags.warm)))
    o_bad, _ = hopper_fwd.forward_hopper(*args, **kw)
    assert rel(o_bad, ro) > 1e-4


@pytest.mark.parametrize("lean", [False, True])
def test_wave_fill_forward_equals_the_recurrence(monkeypatch, lean):
    """With ``MAP_WAVE_FILL`` the plan sends the two warming heads to their maps too (head 2 walks anyway: phase A's
    wave has room for 4 + 4 more programs, so phase C walks no warm-up; map_bound's costs), and the forward around
    the twin still equals the float64 recurrence, plain and lean: phase A walked every head's maps (no skip flag 2)
    and phase C got no warm-up."""
    monkeypatch.setattr(hopper_fwd, "LEAN_SEGMENTS", lean)
    monkeypatch.setattr(hopper_fwd, "MAP_WAVE_FILL", True)
    x = three_heads()
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")] + [0.25, x["initial_state"].float()]
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    flags = hopper_fwd.segment_flags(x["k"], x["g"], x["beta"], S, None, True, True)
    assert flags.walk.all() and not flags.warm.any()
    calls = twins_recording_calls(monkeypatch)
    o, ht = hopper_fwd.forward_hopper(*args, a_inv_dtype=torch.float32, segments=S, BV=16, warm_up=True,
                                      skip_maps=True)
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    assert calls[0]["affine"] and not calls[0]["skip_m"].eq(2).any()
    assert not calls[1]["warm_chunks"].any()


def test_wave_fill_decides_per_sequence(monkeypatch):
    """Two sequences with ``MAP_WAVE_FILL``: in sequence 0 head 2 walks its maps, so the two warming heads join it
    (phase A's wave has room: 66 slots per sequence); in sequence 1 every head warms up (head 2 forgets fast there),
    and a first wave of phase A and the scan would cost more than the 1–2 chunks they save, so nothing maps. o and
    the final states of both equal the float64 recurrence."""
    monkeypatch.setattr(hopper_fwd, "MAP_WAVE_FILL", True)
    a, b = three_heads(seed=1), three_heads(seed=2)
    b["g"][..., 2] = -3.0
    x = {n: torch.cat([a[n], b[n]]) for n in a}
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")] + [0.25, x["initial_state"].float()]
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    calls = twins_recording_calls(monkeypatch)
    o, ht = hopper_fwd.forward_hopper(*args, a_inv_dtype=torch.float32, segments=S, BV=16, warm_up=True,
                                      skip_maps=True)
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    skip_m = calls[0]["skip_m"].view(2, S, 3)
    warm = calls[1]["warm_chunks"].view(2, S, 3)
    assert not skip_m[0].eq(2).any() and not warm[0].any()                       # sequence 0: every head maps
    assert skip_m[1].eq(2).all() and warm[1, 1:].tolist() == [[1, 2, 1]] * (S - 1)  # sequence 1: the warm-ups


def test_warm_twin_keeps_each_segments_rows():
    """The warm walk's twin with warm-ups of 0 chunks from the true entering states (the float64 recurrence's) is
    the plain walk (what the kernel's o and final state per segment must equal)."""
    from linattn.ops.hopper.prepass import prepass_hopper_ref
    x = three_heads()
    q, k, v, g, beta = (x[n].float() for n in ("q", "k", "v", "g", "beta"))
    h0 = x["initial_state"].float()
    whole = twins.chunk_fwd_hopper_hm_ref(q, k, v, *prepass_hopper_ref(k, g, beta, 1, torch.float32, False)[:3],
                                           0.25, h0)
    L = LC * 64
    h_in = [h0[0]] + [gated_delta_rule_reference(**{n: t[:, :s * L] for n, t in x.items() if n != "initial_state"},
                                                 scale=0.25, initial_state=x["initial_state"])[1][0].float()
                      for s in range(1, S)]
    o, ht = twins.chunk_fwd_hopper_hm_ref(q, k, v, *prepass_hopper_ref(k, g, beta, S, torch.float32, False)[:3],
                                           0.25, torch.stack(h_in), warm_chunks=torch.zeros(S, 3, dtype=torch.int32))
    assert rel(o, whole[0]) < 1e-5 and rel(ht[-1], whole[1][0]) < 1e-5


def test_default_forward_plans_each_sequence_apart(monkeypatch):
    """Two sequences through forward_hopper with the module's defaults (both levers on): head 0 warms up in
    sequence 0, but in sequence 1 one segment of it decays slowly, so there it walks its maps; the flags are per
    (sequence, segment, head) and o and the final states of both sequences equal the float64 recurrence. A plan that
    read sequence 0's chunk sums for both (so sequence 1's slow map counted as negligible and was skipped) fails."""
    assert hopper_fwd.WARM_UP and hopper_fwd.SKIP_NEGLIGIBLE_MAPS
    a, b = three_heads(seed=1), three_heads(seed=2)
    slow = slice(LC * 64, 3 * LC * 64)                      # sequence 1, head 0: segments 1 and 2 keep their state
    b["g"][0, slow, 0] = -0.001
    b["beta"][0, slow, 0] = 0.0                             # (no projections either: their maps ≈ 0.6 I)
    x = {n: torch.cat([a[n], b[n]]) for n in a}
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")] + [0.25, x["initial_state"].float()]
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    calls = twins_recording_calls(monkeypatch)
    o, ht = hopper_fwd.forward_hopper(*args, a_inv_dtype=torch.float32, segments=S, BV=16)
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    skip_m = calls[0]["skip_m"].view(2, S, 3)
    assert skip_m[0, :, 0].eq(2).all() and not skip_m[1, :, 0].eq(2).any()     # head 0: warmed, then walking
    assert skip_m[:, :, 1].eq(2).all() and not skip_m[:, :, 2].eq(2).any()
    warm = calls[1]["warm_chunks"].view(2, S, 3)
    assert warm[0, 1:, 0].eq(1).all() and warm[1, :, 0].eq(0).all()


def test_planned_warm_ups_are_the_fewest_chunks_or_the_whole_prefix():
    """map_bound.warm_from_bound_ref (what the planned warm walk computes in each program): the fewest chunks before
    each segment whose bounds sum below 2⁻³⁰ — one for the fast head, two for the medium one — and for the head that
    never gets there within a segment's worth of chunks the whole prefix, from the sequence's start."""
    from linattn.ops.hopper.map_bound import chunk_bounds, warm_from_bound_ref
    x = three_heads()
    warm, from_start = warm_from_bound_ref(chunk_bounds(x["k"], x["g"], x["beta"], S), S,
                                           hopper_fwd.NEGLIGIBLE_M_LOG2)
    assert warm.dtype == torch.int32 and warm.shape == (S, 3)
    assert warm[0].eq(0).all() and from_start[0].all()                     # segment 0: the sequence's start
    assert warm[1:, 0].eq(1).all() and warm[1:, 1].eq(2).all() and not from_start[1:, :2].any()
    assert torch.equal(warm[:, 2], torch.arange(S, dtype=torch.int32) * LC) and from_start[:, 2].all()


@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
def test_planned_warm_forward_equals_the_recurrence(monkeypatch, with_h0):
    """forward_hopper(segments=4, plan_in_walk=True) around the twins, fp32: one walk (no plan, no maps, no scan)
    given the pre-pass's chunk bounds, and o and the final state equal the float64 recurrence — the slow head too,
    which walks every segment from the sequence's start. Negative control: a threshold that takes one chunk of
    warm-up everywhere (the slow head's entering states then start from zero) is wrong."""
    x = three_heads()
    h0 = x["initial_state"] if with_h0 else None
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")] + [0.25, None if h0 is None else h0.float()]
    ro, rht = gated_delta_rule_reference(**dict(x, initial_state=h0), scale=0.25)
    calls = twins_recording_calls(monkeypatch)
    kw = dict(a_inv_dtype=torch.float32, segments=S, BV=16, plan_in_walk=True)
    o, ht = hopper_fwd.forward_hopper(*args, **kw)
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    assert len(calls) == 1 and calls[0]["warm_bound"].shape == (S, 3, LC)
    assert calls[0]["warm_threshold"] == hopper_fwd.NEGLIGIBLE_M_LOG2 and "warm_chunks" not in calls[0]
    monkeypatch.setattr(hopper_fwd, "NEGLIGIBLE_M_LOG2", 1e9)
    o_bad, _ = hopper_fwd.forward_hopper(*args, **kw)
    assert rel(o_bad, ro) > 1e-4
