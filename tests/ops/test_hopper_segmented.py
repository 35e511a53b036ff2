"""The segmented Hopper forward's phases around the kernels' twins on the CPU (``hopper/forward.py``: phase A's state
maps, the scan, phase C; the map norm bound that lets it skip negligible maps): o and the final state against the
float64 recurrence, with negative controls that corrupt the maps."""
from __future__ import annotations

import pytest
import torch

from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import chunk_fwd_ref as twins

from .hopper_twins import hand_plan, reference, run, use_twins
from .test_hopper_fwd import ON_HOPPER, gpu_inputs, inputs, rel


def _twin_with_m_scaled(factor):
    """The kernel's twin, with the affine walk's M (the first K columns of [M | N]) scaled by ``factor``: a wrong
    state map for the negative controls below."""
    def twin(*args, affine=False, **kwargs):
        o, S = twins.chunk_fwd_hopper_hm_ref(*args, affine=affine, **kwargs)
        if affine:
            S = S.clone()
            S[..., :args[0].shape[-1]] *= factor
        return o, S
    return twin


@pytest.mark.interpreter
@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
def test_segmented_forward_equals_the_recurrence(monkeypatch, with_h0):
    """The five-launch segmented forward (plan, phase A, scan, phase C) around the kernels' twins (the real kernels
    run only on an sm_90 GPU), the Triton plan and scan under the interpreter, fp32 inputs: o and the final state
    equal the float64 recurrence, and the unsegmented forward. The gates are weak (1/64 of logsigmoid: about e^-0.8
    over a 64-token segment) so that the entering state and with it M matter and every head walks its maps. The
    negative controls (M zeroed, M off by 5%) show it."""
    x = inputs(2, 256, 1, 2, 16, 16, dtype=torch.float32)
    x["g"] = x["g"] / 16
    ro, rht = reference(x, with_h0=with_h0)
    use_twins(monkeypatch)
    o4, ht4 = run(hand_plan(4), x, with_h0=with_h0)
    o1, ht1 = run(hand_plan(1), x, with_h0=with_h0)
    assert rel(o4, ro) < 1e-5 and rel(ht4, rht) < 1e-5
    assert rel(o4, o1) < 1e-5 and rel(ht4, ht1) < 1e-5
    with pytest.raises(ValueError, match="multiple of"):
        run(hand_plan(8), x, with_h0=with_h0)
    for factor in (0.0, 0.95):
        use_twins(monkeypatch, _twin_with_m_scaled(factor))
        o_bad, ht_bad = run(hand_plan(4), x, with_h0=with_h0)
        assert rel(o_bad, ro) > 1e-4 and rel(ht_bad, rht) > 1e-4, factor


def test_the_map_norm_bound_holds_for_the_exact_map():
    """The map bound (map_bound.py: the twin's chunk sums, and the Triton kernel's, summed per segment) against the
    exact state maps (the twin's affine walk in float64, no rounding):
    ‖M‖₂ ≤ 2^bound for every segment and head, with normalised keys and β < 1, and with keys of norm ≈ 1.4 and
    β up to 2 (where |1 − β‖k‖²| > 1 and the bound grows, loosely: products of the projections shrink more than
    their norms say); with unit keys it is within 2⁸ of ‖M‖₂, tight enough to matter."""
    from linattn.ops.hopper.map_bound import chunk_bounds, chunk_bounds_ref
    from linattn.ops.hopper.prepass import prepass_hopper_ref

    for key_scale, beta_scale in ((1.0, 1.0), (1.4, 2.0)):
        x = inputs(2, 256, 1, 2, 16, 16)
        k, beta = x["k"] * key_scale, x["beta"] * beta_scale
        gc_hm, beta_hm, a_inv, _ = prepass_hopper_ref(k, x["g"], beta, 4, a_inv_dtype=torch.float64)
        _, mn = twins.chunk_fwd_hopper_hm_ref(_seg(x["q"], 4), _seg(k, 4), _seg(x["v"], 4), gc_hm, beta_hm,
                                               _seg(a_inv, 4), 0.25, None, affine=True)
        norms = torch.linalg.matrix_norm(mn[..., :16], ord=2)                   # [B·S, HV]
        bound = chunk_bounds_ref(k, x["g"], beta, 4).sum(-1)                   # [B·S, HV]
        assert (norms.log2() <= bound + 1e-6).all(), (norms.log2() - bound).max()
        kernel_bound = chunk_bounds(k.float(), x["g"].float(), beta.float(), 4).double().sum(-1)
        assert (kernel_bound - bound).abs().max() < 1e-3
        if key_scale == 1.0:   # unit keys, β < 1: the decay is the bound, and nearly the norm
            assert (norms.log2() > bound - 8).all(), (bound - norms.log2()).max()


def _seg(x, S):
    return x.reshape(x.shape[0] * S, x.shape[1] // S, *x.shape[2:])


@pytest.mark.interpreter
def test_segmented_forward_skipping_negligible_maps_equals_the_recurrence(monkeypatch):
    """The five-launch forward around the twins: one value head decays fast (its 64-token segments' maps are below
    2⁻³⁰), the other slowly (its maps walked); o and the final state equal the float64 recurrence. A plan that
    drops every M (a skip where the map matters) fails."""
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper.map_bound import SegmentPlan, chunk_bounds
    x = inputs(2, 256, 1, 2, 16, 16, dtype=torch.float32)
    x["g"] = x["g"].clone()
    x["g"][..., 0] = x["g"][..., 0] * 16                    # fast head: ≈ −3 nats per token... −190 per segment
    x["g"][..., 1] = x["g"][..., 1] / 16                    # slow head: ≈ −0.8 per segment
    flags = hopper_fwd.segment_flags(chunk_bounds(x["k"], x["g"], x["beta"], 4), 4, x["k"].device, 2)
    assert flags.negligible[:, 0].all() and not flags.negligible[:, 1].any()
    ro, rht = reference(x)
    seen = []
    use_twins(monkeypatch, lambda *a, **kw: seen.append(kw.get("skip_m")) or twins.chunk_fwd_hopper_hm_ref(*a, **kw))
    o, ht = run(hand_plan(4), x)
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    assert torch.equal(seen[0], flags.skip_m)               # phase A got the flags
    everything = torch.ones(8, 2, dtype=torch.bool)
    monkeypatch.setattr(hopper_fwd, "segment_flags", lambda *a: SegmentPlan(
        everything, torch.zeros(8, 2, dtype=torch.int32), everything, torch.ones(8, 2, dtype=torch.int32)))
    o_bad, _ = run(hand_plan(4), x)
    assert rel(o_bad, ro) > 1e-4


def _walks_and_long_warm_ups(x: dict) -> dict:
    """``x`` with head 0 keeping its state (its gates / 1024: it walks its maps) and heads 1 and 2 forgetting only
    after ≈ 30 and ≈ 16 of a 32-chunk segment's chunks (mean log decays −0.011 and −0.02 per token); the others
    keep their drawn gates and warm up within a few chunks."""
    g = x["g"].clone()
    g[..., 0] = g[..., 0] / 1024
    for head, rate in ((1, 0.011), (2, 0.02)):
        g[..., head] = g[..., head] * (rate / -g[..., head].mean())
    return dict(x, g=g)


@ON_HOPPER
def test_wave_fill_through_the_op_on_the_gpu():
    """bf16 B=1 T=16384 H=HV=16 K=V=128 through the op (the five-launch segmented forward, 8 segments of 32 chunks)
    with one head walking its maps and two long warm-ups: the wave-fill rule sends more heads to their maps than the
    plan without it (the compiled plan equal to its twin), o and the final state are within 1e-2 of the float64
    recurrence, and the prepared (second) call is bitwise the first."""
    import linattn
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper.map_bound import chunk_bounds, segment_plan, segment_plan_ref
    from linattn.ops.hopper.plan import DEFAULT, map_slots, segment_count
    x = _walks_and_long_warm_ups(gpu_inputs(1, 16384, 16, 16, 128, 128, seed=9))
    S = segment_count(1, 16, 128, 16384, torch.cuda.get_device_properties(0).multi_processor_count)
    bound = chunk_bounds(x["k"], x["g"], x["beta"], S)
    flags = hopper_fwd.segment_flags(bound, S, bound.device, 1)
    twin = segment_plan_ref(bound.cpu(), S, bound.shape[-1], DEFAULT.negligible_m_log2, True, True,
                            map_slots(bound.device, 1))
    for name, a, b in zip(flags._fields, flags, twin):
        assert torch.equal(a.cpu(), b), name
    without = segment_plan(bound, S, bound.shape[-1], DEFAULT.negligible_m_log2, True, True, 0)
    assert without.walk[0].tolist() == [True] + [False] * 15, without.walk[0]
    assert (flags.walk >= without.walk).all() and flags.walk[0, 1] and flags.walk[0, 2], flags.walk[0]
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    with torch.no_grad():
        first, second = (linattn.chunk_gated_delta_rule(**x, output_final_state=True) for _ in range(2))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert max(rel(first[0], ro), rel(first[1], rht)) < 1e-2
