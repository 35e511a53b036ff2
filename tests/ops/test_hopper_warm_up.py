"""The segmented Hopper forward's warm-ups (``hopper/forward.py``: ``segment_flags``, the five-launch forward and
the two-launch planned warm walk) around the kernels' twins on the CPU: the plan's chunk counts against a
brute-force float64 bound, and the forward against the float64 recurrence with heads that warm up in one chunk, in
two, or walk their maps. The plan's Triton kernels against their twins: tests/ops/test_map_bound.py."""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import chunk_fwd_ref as twins
from linattn.ops.hopper import forward as hopper_fwd
from linattn.ops.hopper.map_bound import chunk_bounds, segment_plan
from linattn.ops.hopper.plan import DEFAULT
from linattn.ops.hopper.prepass import prepass_hopper_ref

from .hopper_twins import hand_plan, use_twins

S, LC = 4, 8            # 4 segments of 8 chunks: warm-ups of up to warm_up_max_fraction · 8 chunks
THRESHOLD = DEFAULT.negligible_m_log2


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


def warm_plan(x: dict):
    """The segment plan without the wave-fill rule (map_slots 0), whose extra maps would hide the warm-ups."""
    return segment_plan(chunk_bounds(x["k"], x["g"], x["beta"], S), S, LC, THRESHOLD, True, True, 0)


def recording_twins(monkeypatch) -> list:
    """forward.py's kernels replaced by their twins; returns the list the walk's keyword arguments are appended to,
    call by call (phase A, then phase C)."""
    calls = []
    use_twins(monkeypatch, lambda *a, **kw: calls.append(kw) or twins.chunk_fwd_hopper_hm_ref(*a, **kw))
    return calls


def forward(x: dict, plan, h0=True):
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")]
    return hopper_fwd.forward_hopper(plan, *args, 0.25, x["initial_state"].float() if h0 else None)


def test_plan_takes_the_fewest_chunks_whose_bound_is_negligible():
    x = three_heads()
    flags = warm_plan(x)
    warm, walk = flags.warm, flags.walk
    assert torch.equal(flags.skip_m[walk], torch.zeros_like(flags.skip_m[walk]))   # the mapped head's maps walk
    assert flags.skip_m[~walk].eq(2).all()                                        # the warmed heads' maps go
    assert warm.dtype == torch.int32 and warm.shape == (S, 3) and walk.shape == (S, 3)
    assert not walk[:, 0].any() and not walk[:, 1].any() and walk[:, 2].all()
    assert warm[0].eq(0).all()                              # segment 0 starts at the sequence's start
    # brute force: the fewest whole chunks before each segment whose summed per-token bound is below 2⁻³⁰
    per_token = x["g"][0] * math.log2(math.e)               # unit keys, β < 1: |1 − β‖k‖²| < 1
    for hv, expected in ((0, 1), (1, 2)):
        chunk_bound = per_token[:, hv].view(-1, 64).sum(1)
        for s in range(1, S):
            w = next(w for w in range(1, LC + 1) if chunk_bound[s * LC - w:s * LC].sum() < THRESHOLD)
            assert w == expected and warm[s, hv] == w
    assert warm[:, 2].eq(0).all()                           # a walking head starts at its segments


def test_plan_sends_a_head_to_its_maps_when_one_segment_cannot_warm_up():
    """Only segment 1 of head 0 decays slowly, so segment 2 cannot warm up within a segment: the whole head walks
    its maps (the scan needs them all)."""
    x = three_heads()
    x["g"][0, LC * 64:2 * LC * 64, 0] = -0.001              # segment 1, the chunks before segment 2
    _, warm, walk, _ = warm_plan(x)
    assert walk[:, 0].all() and warm[:, 0].eq(0).all() and not walk[:, 1].any()


def test_warm_forward_equals_the_recurrence(monkeypatch):
    """The five-launch forward around the twins, fp32, with two heads that warm up and none that walks (so the
    wave-fill rule maps nothing): o and the final state equal the float64 recurrence (the warm-ups' error is below
    2⁻³⁰ of the state); phase A skipped every map (flag 2) and phase C got the plan's chunk counts. Negative
    control: the same walk without warm-ups, whose segments start from the entering states the scan left unwritten
    for warmed heads, is wrong."""
    x = three_heads()
    x = {n: (t[:, :2] if n == "initial_state" else t[:, :, :2] if n in ("v", "g", "beta") else t)
         for n, t in x.items()}
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    calls = recording_twins(monkeypatch)
    o, ht = forward(x, hand_plan(S))
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    flags = hopper_fwd.segment_flags(chunk_bounds(x["k"], x["g"], x["beta"], S), S, o.device, 1)
    assert calls[0]["affine"] and calls[0]["skip_m"].eq(2).all()
    assert torch.equal(calls[1]["warm_chunks"], flags.warm) and flags.warm[1:].gt(0).all()
    monkeypatch.setattr(hopper_fwd, "segment_flags", lambda *a: flags._replace(warm=torch.zeros_like(flags.warm)))
    o_bad, _ = forward(x, hand_plan(S))
    assert not rel(o_bad, ro) < 1e-4


def test_wave_fill_forward_equals_the_recurrence(monkeypatch):
    """With head 2 walking its maps anyway, the wave-fill rule sends the two warming heads to their maps too (phase
    A's wave has room for them, so phase C walks no warm-up; map_bound's costs), and the forward around the twins
    still equals the float64 recurrence: phase A walked every head's maps (no flag 2) and phase C got no warm-up."""
    x = three_heads()
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    calls = recording_twins(monkeypatch)
    o, ht = forward(x, hand_plan(S))
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    assert calls[0]["affine"] and not calls[0]["skip_m"].eq(2).any()
    assert not calls[1]["warm_chunks"].any()


def test_wave_fill_decides_per_sequence(monkeypatch):
    """Two sequences: in sequence 0 head 2 walks its maps, so the two warming heads join it (phase A's wave has
    room: 66 slots per sequence); in sequence 1 every head warms up (head 2 forgets fast there), and a first wave
    of phase A and the scan would cost more than the 1–2 chunks they save, so nothing maps. o and the final states
    of both equal the float64 recurrence."""
    a, b = three_heads(seed=1), three_heads(seed=2)
    b["g"][..., 2] = -3.0
    x = {n: torch.cat([a[n], b[n]]) for n in a}
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    calls = recording_twins(monkeypatch)
    o, ht = forward(x, hand_plan(S))
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    skip_m = calls[0]["skip_m"].view(2, S, 3)
    warm = calls[1]["warm_chunks"].view(2, S, 3)
    assert not skip_m[0].eq(2).any() and not warm[0].any()                       # sequence 0: every head maps
    assert skip_m[1].eq(2).all() and warm[1, 1:].tolist() == [[1, 2, 1]] * (S - 1)  # sequence 1: the warm-ups


def test_warm_twin_keeps_each_segments_rows():
    """The warm walk's twin with warm-ups of 0 chunks from the true entering states (the float64 recurrence's) is
    the plain walk (what the kernel's o and final state per segment must equal)."""
    x = three_heads()
    q, k, v, g, beta = (x[n].float() for n in ("q", "k", "v", "g", "beta"))
    h0 = x["initial_state"].float()
    whole = twins.chunk_fwd_hopper_hm_ref(q, k, v, *prepass_hopper_ref(k, g, beta, 1, torch.float32)[:3],
                                           0.25, h0)
    L = LC * 64
    h_in = [h0[0]] + [gated_delta_rule_reference(**{n: t[:, :s * L] for n, t in x.items() if n != "initial_state"},
                                                 scale=0.25, initial_state=x["initial_state"])[1][0].float()
                      for s in range(1, S)]
    o, ht = twins.chunk_fwd_hopper_hm_ref(q, k, v, *prepass_hopper_ref(k, g, beta, S, torch.float32)[:3],
                                           0.25, torch.stack(h_in), warm_chunks=torch.zeros(S, 3, dtype=torch.int32))
    assert rel(o, whole[0]) < 1e-5 and rel(ht[-1], whole[1][0]) < 1e-5


def test_forward_plans_each_sequence_apart(monkeypatch):
    """Two sequences: head 0 warms up in sequence 0, but in sequence 1 one segment of it decays slowly, so there it
    walks its maps; the flags are per (sequence, segment, head) and o and the final states of both sequences equal
    the float64 recurrence. A plan that read sequence 0's chunk sums for both (so sequence 1's slow map counted as
    negligible and was skipped) fails."""
    a, b = three_heads(seed=1), three_heads(seed=2)
    for x in (a, b):
        x["g"][..., 2] = -3.0                               # no head walks everywhere: no wave-fill maps
    slow = slice(LC * 64, 3 * LC * 64)                      # sequence 1, head 0: segments 1 and 2 keep their state
    b["g"][0, slow, 0] = -0.001
    b["beta"][0, slow, 0] = 0.0                             # (no projections either: their maps ≈ 0.6 I)
    x = {n: torch.cat([a[n], b[n]]) for n in a}
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    calls = recording_twins(monkeypatch)
    o, ht = forward(x, hand_plan(S))
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    skip_m = calls[0]["skip_m"].view(2, S, 3)
    assert skip_m[0, :, 0].eq(2).all() and not skip_m[1, :, 0].eq(2).any()     # head 0: warmed, then walking
    warm = calls[1]["warm_chunks"].view(2, S, 3)
    assert warm[0, 1:, 0].eq(1).all() and warm[1, :, 0].eq(0).all()


def test_planned_warm_ups_are_the_fewest_chunks_or_the_whole_prefix():
    """map_bound.warm_from_bound_ref (what the planned warm walk computes in each program): the fewest chunks before
    each segment whose bounds sum below 2⁻³⁰ — one for the fast head, two for the medium one — and for the head that
    never gets there within a segment's worth of chunks the whole prefix, from the sequence's start."""
    from linattn.ops.hopper.map_bound import warm_from_bound_ref
    x = three_heads()
    warm, from_start = warm_from_bound_ref(chunk_bounds(x["k"], x["g"], x["beta"], S), S, THRESHOLD)
    assert warm.dtype == torch.int32 and warm.shape == (S, 3)
    assert warm[0].eq(0).all() and from_start[0].all()                     # segment 0: the sequence's start
    assert warm[1:, 0].eq(1).all() and warm[1:, 1].eq(2).all() and not from_start[1:, :2].any()
    assert torch.equal(warm[:, 2], torch.arange(S, dtype=torch.int32) * LC) and from_start[:, 2].all()


def test_planned_warm_forward_equals_the_recurrence(monkeypatch):
    """The two-launch planned warm walk around the twins, fp32, with and without an initial state: one walk (no
    plan, no maps, no scan) given the pre-pass's chunk bounds, and o and the final state equal the float64
    recurrence — the slow head too, which walks every segment from the sequence's start. Negative control: a
    threshold that takes one chunk of warm-up everywhere (the slow head's entering states then start from zero) is
    wrong."""
    x = three_heads()
    calls = recording_twins(monkeypatch)
    for with_h0 in (False, True):
        ro, rht = gated_delta_rule_reference(**dict(x, initial_state=x["initial_state"] if with_h0 else None),
                                             scale=0.25)
        calls.clear()
        o, ht = forward(x, hand_plan(S, planned_walk=True), h0=with_h0)
        assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
        assert len(calls) == 1 and calls[0]["warm_bound"].shape == (S, 3, LC)
        assert calls[0]["warm_threshold"] == THRESHOLD and "warm_chunks" not in calls[0]
    loose = dataclasses.replace(DEFAULT, negligible_m_log2=1e9)
    o_bad, _ = forward(x, hand_plan(S, planned_walk=True, config=loose))
    assert rel(o_bad, ro) > 1e-4
