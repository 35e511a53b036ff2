"""The segmented Hopper forward's phases around the kernel's twin on the CPU (``hopper/forward.py``: phase A's state
maps, the scan, phase C; the map norm bound that lets it skip negligible maps): o and the final state against the
float64 recurrence, with negative controls that corrupt the maps."""
from __future__ import annotations

import pytest
import torch

from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import chunk_fwd_ref as twins

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
    """Phases A → B → C of forward_hopper(segments=S) around the kernel's twin (chunk_fwd_hopper_hm_ref: the
    kernel's contract, affine walk included; the real kernel runs only on an sm_90 GPU), the Triton pre-pass and
    affine scan under the interpreter, fp32 inputs: o and the final state equal the float64 recurrence, and the
    unsegmented forward. The gates are weak (1/64 of logsigmoid: about e^-0.8 over a 64-token segment) so that the
    entering state and with it M matter: with the default gates (1/4) M is ≈ e^-13 and a zero M passed this test
    too. The negative controls (M zeroed, M off by 5%: o off by ≈ 4e-2 and ≈ 2e-3) show it."""
    from linattn.ops.hopper import forward as hopper_fwd
    x = inputs(2, 256, 1, 2, 16, 16, dtype=torch.float32)
    x["g"] = x["g"] / 16
    h0 = x["initial_state"].float() if with_h0 else None
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")]
    exact = {n: t.double() for n, t in x.items()}
    ro, rht = gated_delta_rule_reference(**dict(exact, initial_state=exact["initial_state"] if with_h0 else None),
                                         scale=0.25)
    monkeypatch.setattr(hopper_fwd, "chunk_fwd_hopper_hm", twins.chunk_fwd_hopper_hm_ref)
    o4, ht4 = hopper_fwd.forward_hopper(*args, 0.25, h0, a_inv_dtype=torch.float32, segments=4, BV=16)
    o1, ht1 = hopper_fwd.forward_hopper(*args, 0.25, h0, a_inv_dtype=torch.float32, BV=16)
    assert rel(o4, ro) < 1e-5 and rel(ht4, rht) < 1e-5
    assert rel(o4, o1) < 1e-5 and rel(ht4, ht1) < 1e-5
    with pytest.raises(ValueError, match="multiple of"):
        hopper_fwd.forward_hopper(*args, 0.25, h0, a_inv_dtype=torch.float32, segments=8, BV=16)
    for factor in (0.0, 0.95):
        monkeypatch.setattr(hopper_fwd, "chunk_fwd_hopper_hm", _twin_with_m_scaled(factor))
        o_bad, ht_bad = hopper_fwd.forward_hopper(*args, 0.25, h0, a_inv_dtype=torch.float32, segments=4, BV=16)
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
        gc_hm, beta_hm, a_inv, _ = prepass_hopper_ref(k, x["g"], beta, 4, a_inv_dtype=torch.float64,
                                                      beta_in_a_inv=False)
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
@pytest.mark.parametrize("roles", [False, True])
def test_segmented_forward_skipping_negligible_maps_equals_the_recurrence(monkeypatch, roles):
    """forward_hopper(segments=4, skip_maps=True) around the kernel's twin (either kernel): one value head decays
    fast (its 64-token segments' maps are below 2⁻³⁰: M skipped), the other slowly (M walked); o and the final state
    equal the float64 recurrence as without the skip. A twin that drops every M (a skip where the map matters)
    fails."""
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper.map_bound import SegmentPlan
    x = inputs(2, 256, 1, 2, 16, 16, dtype=torch.float32)
    x["g"] = x["g"].clone()
    x["g"][..., 0] = x["g"][..., 0] * 16                    # fast head: ≈ −3 nats per token... −190 per segment
    x["g"][..., 1] = x["g"][..., 1] / 16                    # slow head: ≈ −0.8 per segment
    skip = hopper_fwd.segment_flags(x["k"], x["g"], x["beta"], 4)[0]
    assert skip[:, 0].all() and not skip[:, 1].any()
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")] + [0.25, x["initial_state"].float()]
    exact = {n: t.double() for n, t in x.items()}
    ro, rht = gated_delta_rule_reference(**exact, scale=0.25)
    seen = []
    monkeypatch.setattr(hopper_fwd, "chunk_fwd_hopper_hm",
                        lambda *a, **kw: seen.append(kw.get("skip_m")) or twins.chunk_fwd_hopper_hm_ref(*a, **kw))
    kw = dict(a_inv_dtype=torch.float32, segments=4, BV=16, roles=roles, skip_maps=True, warm_up=False)
    o, ht = hopper_fwd.forward_hopper(*args, **kw)
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    assert torch.equal(seen[0], skip.int())                 # phase A got the flags
    everything = torch.ones(8, 2, dtype=torch.bool)
    monkeypatch.setattr(hopper_fwd, "segment_flags", lambda *a: SegmentPlan(
        everything, torch.zeros(8, 2, dtype=torch.int32), everything, torch.ones(8, 2, dtype=torch.int32)))
    o_bad, _ = hopper_fwd.forward_hopper(*args, **kw)
    assert rel(o_bad, ro) > 1e-4
    seen.clear()
    hopper_fwd.forward_hopper(*args, **dict(kw, skip_maps=False))
    assert seen[0] is None                                  # skip_maps=False: every M walked


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
def test_wave_fill_through_the_op_on_the_gpu(monkeypatch):
    """bf16 B=1 T=16384 H=HV=16 K=V=128 through the op ("auto": the five-launch segmented forward, 8 segments of 32
    chunks) with one head walking its maps and two long warm-ups: with ``forward.MAP_WAVE_FILL`` the plan sends
    more heads to their maps (the compiled plan equal to its twin), and o and the final state stay as accurate
    against the float64 recurrence (within 15% of the rule-free errors, all within 1e-2); the prepared (second)
    call is bitwise the first."""
    import linattn
    from linattn.ops.gated_delta import triton_chunk
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper.map_bound import chunk_bounds, segment_plan_ref
    monkeypatch.setattr(triton_chunk, "FORWARD_PATH", "auto")
    x = _walks_and_long_warm_ups(gpu_inputs(1, 16384, 16, 16, 128, 128, seed=9))
    S = hopper_fwd.segment_count(1, 16, 128, 16384, torch.cuda.get_device_properties(0).multi_processor_count)
    walks, errors = [], []
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    for on in (False, True):
        monkeypatch.setattr(hopper_fwd, "MAP_WAVE_FILL", on)
        flags = hopper_fwd.segment_flags(x["k"], x["g"], x["beta"], S, skip_maps=True, warm_up=True)
        # the compiled plan kernel against its twin on the same chunk sums
        bound = chunk_bounds(x["k"], x["g"], x["beta"], S)
        twin = segment_plan_ref(bound.cpu(), S, bound.shape[-1], hopper_fwd.NEGLIGIBLE_M_LOG2, True, True,
                                hopper_fwd.map_slots(bound.device, 1))
        for name, a, b in zip(flags._fields, flags, twin):
            assert torch.equal(a.cpu(), b), name
        walks.append(flags.walk)
        with torch.no_grad():
            first, second = (linattn.chunk_gated_delta_rule(**x, output_final_state=True) for _ in range(2))
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
        errors.append((rel(first[0], ro), rel(first[1], rht)))
    assert walks[0][0].tolist() == [True] + [False] * 15, walks[0][0]
    assert (walks[1] >= walks[0]).all() and walks[1][0, 1] and walks[1][0, 2], walks[1][0]
    (o_off, h_off), (o_on, h_on) = errors
    assert max(o_off, h_off, o_on, h_on) < 1e-2, errors
    assert o_on < 1.15 * o_off and h_on < 1.15 * h_off, errors
