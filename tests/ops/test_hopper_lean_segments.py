"""The segmented Hopper forwards leave out the writes nobody reads (``chunk_fwd_hopper_hm(lean=True)``,
``affine_scan(skip_writes=True)``): around the kernels' twins on the CPU with every ``torch.empty`` filled with NaN
(a read of anything left unwritten shows), and the compiled sm_90a source's guards where TileLang is installed."""
from __future__ import annotations

import pytest
import torch

from linattn.ops.gated_delta.reference import gated_delta_rule_reference

from .hopper_twins import hand_plan
from .test_hopper_deferred_decay import COMPILES, KERNEL_VARIANTS, kernel_source
from .test_hopper_warm_up import S, forward, recording_twins, rel, three_heads


def poisoned(empty):
    """``torch.empty`` whose floating tensors come back NaN (integer ones −1): what nothing writes shows."""
    def alloc(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)
    return alloc


@pytest.mark.parametrize("planned_walk", [False, True], ids=["five_launch", "two_launch"])
def test_lean_forward_reads_nothing_it_left_unwritten(monkeypatch, planned_walk):
    """The segmented forwards around the twins, fp32, with every torch.empty NaN: two heads that warm up and one
    that forgets fast in one sequence (no head walks there, so every map is left unwritten) and, five-launch, a slow
    head in another (its maps walked): o and the final state equal the float64 recurrence; phase A and phase C were
    asked for the lean kernels, and the lean twin's unwritten maps (NaN) were not read by the scan."""
    a, b = three_heads(seed=1), three_heads(seed=2)
    a["g"][..., 2] = -3.0
    x = a if planned_walk else {n: torch.cat([a[n], b[n]]) for n in a}    # (the planned twin walks slowly)
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    calls = recording_twins(monkeypatch)
    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    o, ht = forward(x, hand_plan(S, planned_walk=planned_walk))
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5 and ht.shape == x["initial_state"].shape
    assert all(call["lean"] for call in calls) and len(calls) == (1 if planned_walk else 2)
    if not planned_walk:
        assert calls[0]["affine"] and calls[0]["skip_m"].eq(2).any()      # maps left unwritten (NaN in the twin)


def test_lean_twin_writes_only_the_last_segments_final_states():
    """The warm walk's twin with ``lean``: the sequences' final states ``[B, HV, K, V]``, each its last segment's, and
    a segment whose warm-up is above zero starts from zero whatever its entering state holds (NaN here)."""
    from linattn.ops.hopper import chunk_fwd_ref as twins
    from linattn.ops.hopper.prepass import prepass_hopper_ref
    x = three_heads()
    q, k, v, g, beta = (x[n].float() for n in ("q", "k", "v", "g", "beta"))
    pre = prepass_hopper_ref(k, g, beta, S, torch.float32)[:3]
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
    variants = dict(KERNEL_VARIANTS, warm=dict(warm=True))
    last = "% (T / L)) == ((T / L) - 1)) {"
    flag = "ctl[((int64_t)((int)blockIdx.y))]"
    for name, guards in (("affine", [f"if ({flag} != 2) {{"]),
                         ("warm", ["if (0 < ctl[((int64_t)((int)blockIdx.y))]) {", last]),
                         ("warm_planned", [last])):
        plain, lean = (kernel_source(variants[name], lean=on) for on in (False, True))
        assert all(guard in lean and guard not in plain for guard in guards), name
