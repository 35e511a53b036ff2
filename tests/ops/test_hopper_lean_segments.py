"""The segmented Hopper forwards without the writes nobody reads (``hopper/forward.py``'s ``LEAN_SEGMENTS``,
``chunk_fwd_hopper_hm(lean=True)``, ``affine_scan(skip_writes=True)``): around the kernel's twin on the CPU with
every ``torch.empty`` filled with NaN (a read of anything left unwritten shows), the compiled sm_90a source's guards
where TileLang is installed, and on the GPU the op's outputs bitwise those of the plain segmented forwards."""
from __future__ import annotations

import pytest
import torch

from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import forward as hopper_fwd

from .test_hopper_deferred_decay import COMPILES, KERNEL_VARIANTS, kernel_source, mixed_gates
from .test_hopper_fwd import ON_HOPPER, gpu_inputs, op_outputs_off_and_on
from .test_hopper_warm_up import (
    S,
    _no_wave_fill,  # noqa: F401  (autouse: three_heads keeps its warm-ups)
    rel,
    three_heads,
    twins_recording_calls,
)


def poisoned(empty):
    """``torch.empty`` whose floating tensors come back NaN (integer ones −1): what nothing writes shows."""
    def alloc(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)
    return alloc


@pytest.mark.parametrize("plan_in_walk", [False, True], ids=["five_launch", "two_launch"])
def test_lean_forward_reads_nothing_it_left_unwritten(monkeypatch, plan_in_walk):
    """forward_hopper(segments=4) around the twin, fp32, three heads (two warm up, one walks its maps): with
    LEAN_SEGMENTS and every torch.empty NaN, o and the final state equal the float64 recurrence and, bitwise, the
    plain forward's; phase A and phase C were asked for the lean kernels, and the lean twin's unwritten maps (NaN)
    were not read by the scan."""
    x = three_heads()
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")] + [0.25, x["initial_state"].float()]
    kw = dict(a_inv_dtype=torch.float32, segments=S, BV=16, plan_in_walk=plan_in_walk)
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    calls = twins_recording_calls(monkeypatch)
    plain = hopper_fwd.forward_hopper(*args, **kw)
    calls.clear()
    monkeypatch.setattr(hopper_fwd, "LEAN_SEGMENTS", True)
    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    o, ht = hopper_fwd.forward_hopper(*args, **kw)
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    assert torch.equal(o, plain[0]) and torch.equal(ht, plain[1]) and ht.shape == plain[1].shape
    assert all(call["lean"] for call in calls) and len(calls) == (1 if plan_in_walk else 2)
    if not plan_in_walk:
        assert calls[0]["affine"] and calls[0]["skip_m"].eq(2).any()      # maps left unwritten (NaN in the twin)


def test_lean_twin_writes_only_the_last_segments_final_states():
    """The warm walk's twin with ``lean``: the sequences' final states ``[B, HV, K, V]``, each its last segment's, and
    a segment whose warm-up is above zero starts from zero whatever its entering state holds (NaN here)."""
    from linattn.ops.hopper import chunk_fwd_ref as twins
    from linattn.ops.hopper.prepass import prepass_hopper_ref
    x = three_heads()
    q, k, v, g, beta = (x[n].float() for n in ("q", "k", "v", "g", "beta"))
    pre = prepass_hopper_ref(k, g, beta, S, torch.float32, False)[:3]
    warm = torch.full((S, 3), 2, dtype=torch.int32)
    warm[0] = 0
    h0 = torch.zeros(S, 3, 16, 16)
    h0[0] = x["initial_state"].float()[0]
    o, ht = twins.chunk_fwd_hopper_hm_ref(q, k, v, *pre, 0.25, h0, warm_chunks=warm)
    h0[1:] = float("nan")
    lo, lht = twins.chunk_fwd_hopper_hm_ref(q, k, v, *pre, 0.25, h0, warm_chunks=warm, lean=True)
    assert lht.shape == (1, 3, 16, 16) and torch.equal(lht[0], ht[-1]) and torch.equal(lo, o)


@COMPILES
def test_lean_kernels_guard_their_reads_and_writes():
    """sm_90a source: phase A's lean kernel writes a map only where its flag is not 2; the lean warm walk reads h0
    only where the warm-up is zero, and both warm walks write the final state only from a sequence's last segment
    (segment index T/L − 1), where the plain kernels read and write unconditionally."""
    variants = dict(KERNEL_VARIANTS, warm=dict(warm=True, async_o=True, async_ax=True))
    last = "% (T / L)) == ((T / L) - 1)) {"
    for name, guards in (("affine", ["if (ctl[((int64_t)((int)blockIdx.y))] != 2) {"]),
                         ("warm", ["if (0 < ctl[((int64_t)((int)blockIdx.y))]) {", last]),
                         ("warm_planned", [last])):
        plain, lean = (kernel_source(variants[name], lean=on) for on in (False, True))
        assert all(guard in lean and guard not in plain for guard in guards), name


@ON_HOPPER
@pytest.mark.parametrize("B,T,gates", [(1, 16384, "drawn"), (1, 16384, "mixed"), (1, 4096, "drawn")],
                         ids=["segmented", "segmented_mixed", "two_launch"])
def test_lean_segments_are_bitwise_the_plain_forward_on_the_gpu(monkeypatch, B, T, gates):
    """bf16 H=16 K=V=128 through the op ("auto": the five-launch segmented forward, with every head warming up or
    some walking their maps, and the two-launch one) with LEAN_SEGMENTS off and on: o and the final state bitwise
    equal (the same arithmetic; only unread writes go)."""
    x = gpu_inputs(B, T, 16, 16, 128, 128, seed=5)
    outs = op_outputs_off_and_on(monkeypatch, hopper_fwd, "LEAN_SEGMENTS", mixed_gates(x) if gates == "mixed" else x)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
