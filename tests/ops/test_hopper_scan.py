"""Phase B of the Hopper forward's segmented path on the GPU with its switches (``forward.SCAN_WHOLE_MAP``,
``forward.SCAN_PRECISION``): the kernel itself is tested against its twin in ``test_seq_parallel.py`` (interpreter)
and its switches' route to the launch in ``test_hopper_prepared.py``; here the op's accuracy against the float64
recurrence where every head (slow gates) or some heads (mixed gates) step through the scan."""
from __future__ import annotations

import pytest
import torch

from linattn.ops.gated_delta.reference import gated_delta_rule_reference

from .test_hopper_deferred_decay import mixed_gates
from .test_hopper_fwd import ON_HOPPER, gpu_inputs, rel

SCAN_VARIANTS = [(False, "tf32x3"), (True, "tf32x3"), (True, "tf32")]


@ON_HOPPER
@pytest.mark.parametrize("gates", ["slow", "mixed"])
def test_scan_variants_keep_the_forward_accurate_on_the_gpu(monkeypatch, gates):
    """bf16 B=1 T=16384 H=HV=16 K=V=128 through the op ("auto": the five-launch segmented forward, 8 segments) at
    gates divided by 65536 (no head forgets: every map walked, every scan step taken) or mixed: the whole-map scan at
    tf32x3 as accurate as the row blocks' (within 5%: the same products summed in another order), at tf32 within
    15% of them, all within 1e-2; each variant's prepared (second) call bitwise its first."""
    import linattn
    from linattn.ops.gated_delta import triton_chunk
    from linattn.ops.hopper import forward as hopper_fwd
    monkeypatch.setattr(triton_chunk, "FORWARD_PATH", "auto")
    x = gpu_inputs(1, 16384, 16, 16, 128, 128, seed=3)
    x = dict(x, g=x["g"] / 65536) if gates == "slow" else mixed_gates(x)
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    errors = []
    for whole_map, precision in SCAN_VARIANTS:
        monkeypatch.setattr(hopper_fwd, "SCAN_WHOLE_MAP", whole_map)
        monkeypatch.setattr(hopper_fwd, "SCAN_PRECISION", precision)
        with torch.no_grad():
            first, second = (linattn.chunk_gated_delta_rule(**x, output_final_state=True) for _ in range(2))
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
        errors.append((rel(first[0], ro), rel(first[1], rht)))
    (o_rows, h_rows), (o_whole, h_whole), (o_tf32, h_tf32) = errors
    assert max(max(e) for e in errors) < 1e-2, errors
    assert o_whole < 1.05 * o_rows and h_whole < 1.05 * h_rows, errors
    assert o_tf32 < 1.15 * o_rows and h_tf32 < 1.15 * h_rows, errors
