"""Phase B of the Hopper forward's segmented path on the GPU at its two precisions (``plan.HopperPlanConfig``'s
scan_precision): the kernel itself is tested against its twin in ``test_seq_parallel.py`` (interpreter) and the
precision's route to the launch in ``test_hopper_prepared.py``; here the forward's accuracy against the float64
recurrence where every head (slow gates) or some heads (mixed gates) step through the scan."""
from __future__ import annotations

import pytest
import torch

from linattn.ops.gated_delta.reference import gated_delta_rule_reference

from .test_hopper_deferred_decay import mixed_gates
from .test_hopper_fwd import ON_HOPPER, gpu_inputs, rel


@ON_HOPPER
@pytest.mark.parametrize("gates", ["slow", "mixed"])
def test_scan_precisions_keep_the_forward_accurate_on_the_gpu(gates):
    """bf16 B=1 T=16384 H=HV=16 K=V=128 on the op's plan (the five-launch segmented forward, 8 segments) at gates
    divided by 65536 (no head forgets: every map walked, every scan step taken) or mixed: the scan at tf32 (the
    default) within 15% of tf32x3's error, both within 1e-2 of the float64 recurrence; each plan's prepared (second)
    call bitwise its first."""
    import dataclasses

    from linattn.ops.hopper.forward import forward_hopper
    from linattn.ops.hopper.plan import plan_inputs
    x = gpu_inputs(1, 16384, 16, 16, 128, 128, seed=3)
    x = dict(x, g=x["g"] / 65536) if gates == "slow" else mixed_gates(x)
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    found, why = plan_inputs(x["q"], x["v"], (x["k"], x["g"], x["beta"], x["initial_state"]), None, None)
    assert found is not None and found.segments > 1 and not found.planned_walk, why
    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [128 ** -0.5, x["initial_state"]]
    errors = []
    for precision in ("tf32x3", "tf32"):
        plan = dataclasses.replace(found, config=dataclasses.replace(found.config, scan_precision=precision))
        with torch.no_grad():
            first, second = (forward_hopper(plan, *args) for _ in range(2))
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
        errors.append((rel(first[0], ro), rel(first[1], rht)))
    (o_x3, h_x3), (o_tf32, h_tf32) = errors
    assert max(max(e) for e in errors) < 1e-2, errors
    assert o_tf32 < 1.15 * o_x3 and h_tf32 < 1.15 * h_x3, errors
