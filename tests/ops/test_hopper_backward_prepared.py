"""The Hopper backward's prepared calls (``hopper/backward_prepared.py``): with every kernel stubbed by a recorder (the
TileLang executables and the reverse scan's and the reductions' Triton kernels), a repeated signature's prepared
call issues the launches the plain backward issues — the same kernels (their compile arguments), in the same order,
each argument the same input view or the same fresh tensor (shape, dtype, strides, which earlier launch's tensor it
is) and the same scalars — and returns tensors of the same kind, on every path it prepares; the paths it does not
prepare keep the plain backward."""
from __future__ import annotations

import pytest
import torch

from linattn.ops.common import partial_sum
from linattn.ops.hopper import backward, backward_prepared, chunk_bwd, chunk_bwd_roles, chunk_fwd, prepass, reverse_maps
from linattn.ops.hopper import plan as plan_module

from .test_hopper_prepared import Recorder

# (B, T, H, HV, K): the paths at 132 SMs (backward.choose_walk, plan.plan, segments.takes_maps)
CASES = {
    "row1_uncapped_planned_states": (1, 4096, 16, 16, 128),      # 8 segments, 56-chunk chains; states in 4, planned
    "maps_planned_states": (1, 16384, 4, 4, 128),                # 32 segments: the reverse maps; states in 16
    "maps_gva": (1, 8192, 1, 2, 64),                             # 16 segments, G = 2 (fp32 dq, dk summed)
    "unsegmented": (8, 512, 4, 4, 64),                           # no warm-ups, states unsegmented
}
NAMES = "q k v g beta do h0 dht".split()


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    for module, name in ((chunk_fwd, "compiled_kernel"), (prepass, "compiled_kernel"),
                         (chunk_bwd, "compiled_warm_kernel"), (chunk_bwd_roles, "compiled_kernel")):
        monkeypatch.setattr(module, name, lambda *a, name=f"{module.__name__}.{name}", **kw:
                            (name, a, tuple(sorted(kw.items()))))
    for module in (chunk_fwd, prepass, chunk_bwd, chunk_bwd_roles):
        monkeypatch.setattr(module, "launcher", rec.executable)
    for module, name, label in ((reverse_maps, "reverse_map_scan_kernel", "scan"),
                                (partial_sum, "partial_sums_kernel", "sums")):
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


def traced_call(rec: Recorder, x: dict) -> list:
    """One backward call's launches and returned tensors, each tensor named by its storage (the inputs by their
    names)."""
    rec.trace.clear()
    rec.labels = {t.untyped_storage().data_ptr(): n for n, t in x.items() if isinstance(t, torch.Tensor)}
    grads = backward.chunk_gated_delta_rule_bwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                       x["q"].shape[-1] ** -0.5, x["h0"], x["do"], x["dht"])
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
    kernels = [kernel[0] for kernel, _ in plain[:-6]]
    maps = case.startswith("maps")
    assert kernels.count("scan") == maps and kernels.count("sums") == 1
    assert len(kernels) == 4 + (case != "unsegmented") + 2 * maps      # pre-pass, (warm-ups, maps, scan,) states, walk


def test_unprepared_paths_keep_the_plain_backward(recorder):
    """The states in five launches (B = 1, T = 32768, 16 heads), the walk in GVA batches (B = 4, T = 8192, H = 16,
    HV = 32) and a stage stood in for (a benchmark's timed wrapper) are not prepared: each call runs the plain
    backward, whose launches are the same every time."""
    for shape in ((1, 32768, 16, 16, 128), (4, 8192, 16, 32, 128)):
        x = inputs(*shape)
        first = traced_call(recorder, x)
        assert list(backward_prepared._prepared.values()) == [None] and traced_call(recorder, x) == first
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
