"""The public op's routes to a prepared Hopper forward (``gated_delta/prepared_route.py``).

On the CPU the kernels are stubbed by the recorder of ``test_hopper_prepared.py``, and ``hopper_plan`` is replaced
by the plan it would make on a 132-SM card (its device gates cannot pass here). The tests check:
* a recorded route issues the launches of the plain op call (and skips its checks);
* a route is recorded only where a prepared call served the plain one;
* bad inputs still raise, calls needing a gradient take the plain route, and inputs off a 16-byte boundary do too;
* a flipped switch keys anew, and no setting the route reads is left out of its key.
On the GPU the op's outputs through a route are bitwise the plain op's."""
from __future__ import annotations

import pytest
import torch

import linattn
from linattn.ops.gated_delta import chunk as chunk_op
from linattn.ops.gated_delta import prepared_route, triton_chunk
from linattn.ops.hopper import chunk_fwd, prepared
from linattn.ops.hopper import forward as hopper_fwd

from .test_hopper_fwd import ON_HOPPER, gpu_inputs, off_boundary
from .test_hopper_prepared import HV, inputs, recorder  # noqa: F401  (recorder: a fixture)

PLANS = {"unsegmented": dict(hopper_fwd.LAUNCH, BV=64),
         "five_launch": dict(hopper_fwd.LAUNCH, BV=64, segments=4),
         "two_launch": dict(hopper_fwd.LAUNCH, BV=64, segments=4, plan_in_walk=True)}


@pytest.fixture
def routed(recorder, monkeypatch):  # noqa: F811
    """Routes on, none recorded, and the op sent to the Hopper forward with ``routed.plan`` as hopper_plan's."""
    monkeypatch.setattr(prepared_route, "ROUTES", True)
    monkeypatch.setattr(prepared_route, "_routes", {})
    monkeypatch.setattr(triton_chunk, "hopper_plan", lambda *a, **kw: dict(recorder.plan))
    recorder.plan = PLANS["unsegmented"]
    return recorder


def op_call(rec, x, **kw) -> list:
    """One public op call's launches and outputs (test_hopper_prepared.traced_call's record, through the op)."""
    rec.trace.clear()
    rec.labels = {t.untyped_storage().data_ptr(): name for name, t in zip("q k v g beta scale h0".split(), x)
                  if isinstance(t, torch.Tensor)}
    q, k, v, g, beta, scale, h0 = x
    o, ht = linattn.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                           output_final_state=True, backend="triton", **kw)
    return [(kernel, described) for kernel, described, _ in rec.trace] + [rec.describe(o), rec.describe(ht)]


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_a_route_issues_the_plain_calls_launches(routed, monkeypatch, plan, with_state):
    """The first call is plain and prepares the Hopper signature, the second is served by the prepared call and
    records the route, the third takes the route: the same launches all three times, and the third runs no check
    of the op's (they are made to fail)."""
    routed.plan = PLANS[plan]
    x = inputs(with_state)
    first = op_call(routed, x)
    assert not prepared_route._routes
    assert op_call(routed, x) == first and len(prepared_route._routes) == 1
    monkeypatch.setattr(chunk_op, "check_gated_delta_inputs", None)      # a route must not need them
    monkeypatch.setattr(hopper_fwd, "_forward_hopper_plain", None)
    assert op_call(routed, x) == first


def test_only_a_prepared_call_records_a_route(routed, monkeypatch):
    """With prepared calls off, or the route switch off, no route is recorded; a route holds the prepared call."""
    x = inputs(False)
    monkeypatch.setattr(prepared, "PREPARED", False)
    for _ in range(3):
        op_call(routed, x)
    assert not prepared_route._routes
    monkeypatch.setattr(prepared, "PREPARED", True)
    monkeypatch.setattr(prepared_route, "ROUTES", False)
    for _ in range(3):
        op_call(routed, x)
    assert not prepared_route._routes
    monkeypatch.setattr(prepared_route, "ROUTES", True)
    op_call(routed, x)
    assert list(prepared_route._routes.values()) == [c for c in prepared._prepared.values()]


def test_bad_inputs_and_gradients_take_the_plain_route(routed):
    """With a route recorded: a bool scale, a wrong dtype or shape still raise as before; inputs needing a gradient
    (grad enabled) and inputs off a 16-byte boundary take the plain route; the pre-processing keywords too."""
    x = inputs(False)[:5] + (1.0, None)       # scale 1.0: a bool scale would be equal to it as a key
    for _ in range(2):
        op_call(routed, x)
    assert len(prepared_route._routes) == 1
    q, k, v, g, beta, scale, _ = x
    with pytest.raises(TypeError, match="scale"):
        linattn.chunk_gated_delta_rule(q, k, v, g, beta, scale=True, backend="triton")
    with pytest.raises(TypeError, match="dtype"):
        linattn.chunk_gated_delta_rule(q, k.float(), v, g, beta, scale=scale, backend="triton")
    with pytest.raises(ValueError, match="beta"):
        linattn.chunk_gated_delta_rule(q, k, v, g, beta[:, :-1], scale=scale, backend="triton")
    args = (q, k, v, g, beta, scale, None, "triton")
    assert prepared_route.lookup(*args) is not None
    needs_grad = (q.clone().requires_grad_(),) + args[1:]
    assert prepared_route.lookup(*needs_grad) is None
    with torch.no_grad():
        assert prepared_route.lookup(*needs_grad) is not None
    moved = (q, off_boundary(k)) + args[2:]
    assert prepared_route.lookup(*moved) is not None
    assert prepared_route.run(prepared_route.lookup(*moved), *moved[:5], None) is None
    # the pre-processing keywords and packed sequences never look a route up: the plain route, its checks included
    with pytest.raises(ValueError, match="A_log"):
        linattn.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, A_log=torch.zeros(HV), backend="triton")


@pytest.mark.parametrize("module,name", [(triton_chunk, "FORWARD_PATH"), (hopper_fwd, "WIDE_SEGMENTS"),
                                         (hopper_fwd, "SEGMENTED_AUTO"), (hopper_fwd, "MIN_SEGMENTED_HEAD_TOKENS"),
                                         (hopper_fwd, "LEAN_SEGMENTS"), (chunk_fwd, "ASYNC_O_STORE"),
                                         (prepared, "PREPARED")])
def test_a_flipped_switch_keys_anew(routed, monkeypatch, module, name):
    """A recorded route, then a setting the plain route reads flipped: the same arguments find no route."""
    x = inputs(False)
    for _ in range(2):
        op_call(routed, x)
    args = x[:6] + (None, "triton")
    assert prepared_route.lookup(*args) is not None
    value = getattr(module, name)
    monkeypatch.setattr(module, name, "split" if isinstance(value, str) else
                        (not value if isinstance(value, bool) else value * 2))
    assert prepared_route.lookup(*args) is None


# The upper-case settings of the route's modules it does not read before forward_hopper: constants, the Triton
# paths' (read only where the route does not lead), and forward_hopper's (in hopper.prepared.SWITCHES)
NOT_READ = {
    "triton_chunk": {"TRITON_DTYPES", "PRECOMPUTE_QK", "FORWARD_PATHS", "WALK_MIN_PAIRS", "CHUNK"},
    "chunk_fwd": set(prepared.SWITCHES["chunk_fwd"]) | {"BT", "WARM_SUBSETS", "HEAD_SPLITS", "ROUTE_UNROLL"},
    "forward": set(prepared.SWITCHES["forward"]) | {"BT", "PREPASSES"},
}


def test_every_setting_the_route_reads_is_in_its_key():
    """Each upper-case setting of triton_chunk, hopper.chunk_fwd and hopper.forward is in prepared_route.SWITCHES
    or in NOT_READ (with its reason above): a new switch must be placed in one of them."""
    modules = {"triton_chunk": triton_chunk, "chunk_fwd": chunk_fwd, "forward": hopper_fwd}
    for name, module in modules.items():
        settings = {n for n, value in vars(module).items() if n.isupper() and not n.startswith("_") and
                    isinstance(value, (bool, int, float, str, type(None), torch.dtype, dict, tuple))}
        listed = set(prepared_route.SWITCHES[name]) | NOT_READ[name]
        assert settings == listed, (name, settings ^ listed)


@pytest.mark.parametrize("routes", [False, True], ids=["routes_off", "routes_on"])
def test_a_routable_call_traces_without_a_graph_break(monkeypatch, routes):
    """torch.compile(fullgraph=True) of the op with the arguments a route could serve (the lookup, start and remember
    run on every such call): no graph break, the eager result."""
    monkeypatch.setattr(prepared_route, "ROUTES", routes)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 16, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, 64, 2, generator=gen) * 0.1, torch.rand(1, 64, 2, generator=gen)

    def f(q, k, v, g, beta):
        o, ht = linattn.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
        return o.sum() + ht.sum()
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, g, beta),
                               f(q, k, v, g, beta))


@ON_HOPPER
@pytest.mark.parametrize("shape", [(8, 4096, 16, 16), (1, 32768, 16, 16), (1, 4096, 16, 16)],
                         ids=["unsegmented", "five_launch", "two_launch"])
def test_routes_are_bitwise_the_plain_op_on_the_gpu(monkeypatch, shape):
    """Through the public op on the H200 ("auto": the three plans at these shapes): routes off, then on for three
    calls (plain, prepared, routed): o and the final state bitwise equal, and the route recorded."""
    monkeypatch.setattr(triton_chunk, "FORWARD_PATH", "auto")
    monkeypatch.setattr(prepared_route, "_routes", {})
    x = gpu_inputs(*shape, 128, 128)
    outs = []
    for on in (False, True, True, True):
        monkeypatch.setattr(prepared_route, "ROUTES", on)
        with torch.no_grad():
            outs.append(linattn.chunk_gated_delta_rule(**x, output_final_state=True))
    assert len(prepared_route._routes) == 1
    for o, ht in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(ht, outs[0][1])
