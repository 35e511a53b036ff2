"""The Hopper backward's prepared calls (``hopper/backward_prepared.py``): with every kernel stubbed by a recorder (the
TileLang executables and the reverse scan's and the reductions' Triton kernels), a repeated signature's prepared
call issues the launches the plain backward issues — the same kernels (their compile arguments), in the same order,
each argument the same input view or the same fresh tensor (shape, dtype, strides, which earlier launch's tensor it
is) and the same scalars — and returns tensors of the same kind, on every path it prepares; the paths it does not
prepare keep the plain backward."""
from __future__ import annotations

import pytest
import torch

from linattn.ops.common import partial_sum, seq_parallel
from linattn.ops.hopper import (
    backward,
    backward_prepared,
    chunk_bwd,
    chunk_bwd_roles,
    chunk_fwd,
    map_bound,
    prepass,
    reverse_maps,
)
from linattn.ops.hopper import plan as plan_module

from .test_hopper_prepared import Recorder

# (B, T, H, HV, K): the paths at 132 SMs (backward.choose_walk, plan.plan, segments.takes_maps), and the launches
# each takes
CASES = {
    "row1_uncapped_planned_states": (1, 4096, 16, 16, 128),      # 8 segments, 56-chunk chains; states in 4, planned
    "maps_planned_states": (1, 16384, 4, 4, 128),                # 32 segments: the reverse maps; states in 16
    "maps_gva": (1, 8192, 1, 2, 64),                             # 16 segments, G = 2 (fp32 dq, dk summed)
    "unsegmented": (8, 512, 4, 4, 64),                           # no warm-ups, states unsegmented
    "five_launch_states_gva_batches": (1, 32768, 2, 8, 64),      # row 7's paths at K = 64: states in 16 segments,
}                                                                # the walk in 32, two batches of 16 rows
LAUNCHES = {"row1_uncapped_planned_states": ["prepass", "warm", "states", "walk", "sums"],
            "maps_planned_states": ["prepass", "warm", "maps", "scan", "states", "walk", "sums"],
            "maps_gva": ["prepass", "warm", "maps", "scan", "states", "walk", "sums"],
            "unsegmented": ["prepass", "states", "walk", "sums"],
            "five_launch_states_gva_batches": ["prepass", "warm", "maps", "scan", "plan", "maps", "affine_scan",
                                               "states", "walk", "sums", "walk", "sums"]}
KINDS = {"linattn.ops.hopper.prepass.compiled_kernel": "prepass", "linattn.ops.hopper.chunk_bwd.compiled_warm_kernel":
         "warm", "linattn.ops.hopper.chunk_bwd_roles.compiled_kernel": "walk"}
NAMES = "q k v g beta do h0 dht".split()


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    for module, name in ((chunk_fwd, "compiled_kernel"), (prepass, "compiled_kernel"), (chunk_bwd, "compiled_kernel"),
                         (chunk_bwd, "compiled_warm_kernel"), (chunk_bwd_roles, "compiled_kernel")):
        monkeypatch.setattr(module, name, lambda *a, name=f"{module.__name__}.{name}", **kw:
                            (name, a, tuple(sorted(kw.items()))))
    for module in (chunk_fwd, prepass, chunk_bwd, chunk_bwd_roles):
        monkeypatch.setattr(module, "launcher", rec.executable)
    for module, name, label in ((reverse_maps, "reverse_map_scan_kernel", "scan"),
                                (partial_sum, "partial_sums_kernel", "sums"),
                                (map_bound, "segment_plan_kernel", "plan"),
                                (seq_parallel, "affine_scan_kernel", "affine_scan")):
        monkeypatch.setattr(module, name, rec.triton(label, getattr(module, name)))
    monkeypatch.setattr(backward, "check_inputs", lambda *args: None)        # CPU tensors
    return rec


def inputs(B, T, H, HV, K, with_state=False, with_dht=False):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = r(B, T, H, K).bfloat16(), r(B, T, H, K).bfloat16()
    v, do = r(B, T, HV, K).bfloat16(), r(B, T, HV, K).bfloat16()
    g, beta = -torch.rand(B, T, HV, generator=gen), torch.rand(B, T, HV, generator=gen).bfloat16()
    return dict(q=q, k=k, v=v, g=g, beta=beta, do=do, h0=r(B, HV, K, K) if with_state else None,
                dht=r(B, HV, K, K) if with_dht else None)


def traced_call(rec: Recorder, x: dict, **options) -> list:
    """One backward call's launches and returned tensors, each tensor named by its storage (the inputs by their
    names); ``options`` go to the backward."""
    rec.trace.clear()
    rec.labels = {t.untyped_storage().data_ptr(): n for n, t in x.items() if isinstance(t, torch.Tensor)}
    grads = backward.chunk_gated_delta_rule_bwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                       x["q"].shape[-1] ** -0.5, x["h0"], x["do"], x["dht"], **options)
    return [(kernel, described) for kernel, described, _ in rec.trace] + [rec.describe(t) for t in grads]


@pytest.mark.parametrize("state", ["none", "h0", "h0_dht"])
@pytest.mark.parametrize("case", list(CASES))
def test_prepared_call_issues_the_plain_backwards_launches(recorder, monkeypatch, case, state):
    """The first call takes the plain backward and prepares the signature; the second takes the prepared call (the
    plain backward's stages are not entered): the two traces are equal."""
    x = inputs(*CASES[case], with_state=state != "none", with_dht=state == "h0_dht")
    plain = traced_call(recorder, x)
    assert len(backward_prepared._prepared) == 1 and None not in backward_prepared._prepared.values()
    monkeypatch.setattr(backward, "backward_equal_lengths", None)     # a prepared call must not need it
    again = traced_call(recorder, x)
    assert again == plain
    assert [kind(kernel) for kernel, _ in plain[:-6]] == LAUNCHES[case]


def kind(kernel) -> str:
    """A recorded launch's kind: the Triton kernels' labels, the TileLang builds' by their builder and options."""
    if kernel[0] != "linattn.ops.hopper.chunk_fwd.compiled_kernel":
        return KINDS.get(kernel[0], kernel[0])
    options = dict(kernel[2])
    return "maps" if options.get("lean") and not options.get("store_states") else "states"


def test_unprepared_paths_keep_the_plain_backward(recorder):
    """The slice walk (B = 1, T = 256, 2 heads of 128, BV = 64 asked for) and a stage stood in for (a benchmark's
    timed wrapper) are not prepared: each call runs the plain backward, whose launches are the same every time."""
    x = inputs(1, 256, 2, 2, 128)
    first = traced_call(recorder, x, BV=64)
    assert not any(backward_prepared._prepared.values()) and traced_call(recorder, x, BV=64) == first
    backward_prepared._prepared.clear()
    solve = backward.solve
    backward.solve = lambda *a: solve(*a)
    try:
        x = inputs(*CASES["unsegmented"])
        traced_call(recorder, x)
        assert not backward_prepared._prepared and not backward.stages_in_place()
    finally:
        backward.solve = solve
    assert backward.stages_in_place()


def test_a_new_signature_is_prepared_anew(recorder):
    """Another shape, another dtype of β or another kind of state is another signature; the cache is bounded."""
    x = inputs(*CASES["unsegmented"])
    traced_call(recorder, x)
    traced_call(recorder, dict(x, beta=x["beta"].float()))
    traced_call(recorder, dict(x, h0=torch.zeros(8, 4, 64, 64)))
    assert len(backward_prepared._prepared) == 3
    limit = plan_module.CACHE_LIMITS.prepared
    for i in range(limit):
        backward_prepared.remember(("filler", i), lambda: None)
    assert len(backward_prepared._prepared) <= limit
