"""The public op's routes to a prepared Hopper forward (``hopper/route.py``).

On the CPU the kernels are stubbed by the recorder of ``test_hopper_prepared.py``, and the dispatch's choice is
replaced by the Hopper plan it would make on a 132-SM card (its device gates cannot pass here). The tests check:
* a recorded route issues the launches of the plain op call (and skips its checks);
* a route is recorded only where a prepared call served the plain one;
* bad inputs still raise, calls needing a gradient take the plain route, and inputs off a 16-byte boundary do too;
* another backend or forward path keys anew.
On the GPU the op's outputs through a route are bitwise the plain op's."""
from __future__ import annotations

import pytest
import torch

import linattn
from linattn.ops.gated_delta import chunk as chunk_op
from linattn.ops.gated_delta import dispatch
from linattn.ops.hopper import forward as hopper_fwd
from linattn.ops.hopper import prepared, route

from .test_hopper_fwd import ON_HOPPER, gpu_inputs, off_boundary
from .test_hopper_prepared import CASES, HV, inputs, recorder  # noqa: F401  (recorder: a fixture)


@pytest.fixture
def routed(recorder, monkeypatch):  # noqa: F811
    """No route recorded, and the op sent to the Hopper forward with ``routed.plan``."""
    monkeypatch.setattr(dispatch, "choose_forward_path",
                        lambda *a, **kw: dispatch.ForwardChoice("hopper", "test", recorder.plan))
    recorder.plan = CASES["unsegmented"]
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
@pytest.mark.parametrize("plan", list(CASES))
def test_a_route_issues_the_plain_calls_launches(routed, monkeypatch, plan, with_state):
    """The first call is plain and prepares the Hopper signature, the second is served by the prepared call and
    records the route, the third takes the route: the same launches all three times, and the third runs no check
    of the op's (they are made to fail)."""
    routed.plan = CASES[plan]
    x = inputs(with_state)
    first = op_call(routed, x)
    assert not route._routes
    assert op_call(routed, x) == first and len(route._routes) == 1
    assert list(route._routes.values()) == list(prepared._prepared.values())      # a route is the prepared call
    monkeypatch.setattr(chunk_op, "check_gated_delta_inputs", None)      # a route must not need them
    monkeypatch.setattr(hopper_fwd, "forward_plain", None)
    assert op_call(routed, x) == first


def test_only_a_prepared_call_records_a_route(routed, monkeypatch):
    """Calls the forward does not prepare (its kernels swapped, as tests and timing wrappers do) record no route."""
    x = inputs(False)
    monkeypatch.setattr(hopper_fwd, "segment_plan", lambda *a, **kw: None)     # not the kernel prepared.py repeats
    for _ in range(3):
        op_call(routed, x)
    assert not route._routes and not prepared._prepared


def test_bad_inputs_and_gradients_take_the_plain_route(routed):
    """With a route recorded: a bool scale, a wrong dtype or shape still raise as before; inputs needing a gradient
    (grad enabled) and inputs off a 16-byte boundary take the plain route; the pre-processing keywords too; another
    backend or forward path finds no route."""
    x = inputs(False)[:5] + (1.0, None)       # scale 1.0: a bool scale would be equal to it as a key
    for _ in range(2):
        op_call(routed, x)
    assert len(route._routes) == 1
    q, k, v, g, beta, scale, _ = x
    with pytest.raises(TypeError, match="scale"):
        linattn.chunk_gated_delta_rule(q, k, v, g, beta, scale=True, backend="triton")
    with pytest.raises(TypeError, match="dtype"):
        linattn.chunk_gated_delta_rule(q, k.float(), v, g, beta, scale=scale, backend="triton")
    with pytest.raises(ValueError, match="beta"):
        linattn.chunk_gated_delta_rule(q, k, v, g, beta[:, :-1], scale=scale, backend="triton")
    args = (q, k, v, g, beta, scale, None, "triton", "auto")
    assert route.lookup(*args) is not None
    assert route.lookup(*args[:7], None, "auto") is None and route.lookup(*args[:8], "hopper") is None
    needs_grad = (q.clone().requires_grad_(),) + args[1:]
    assert route.lookup(*needs_grad) is None
    with torch.no_grad():
        assert route.lookup(*needs_grad) is not None
    moved = (q, off_boundary(k)) + args[2:]
    assert route.lookup(*moved) is not None
    assert route.run(route.lookup(*moved), *moved[:5], None) is None
    # the pre-processing keywords and packed sequences never look a route up: the plain route, its checks included
    with pytest.raises(ValueError, match="A_log"):
        linattn.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, A_log=torch.zeros(HV + 1),
                                       dt_bias=torch.zeros(HV), backend="triton")


def test_a_routable_call_traces_without_a_graph_break():
    """torch.compile(fullgraph=True) of the op with the arguments a route could serve (the lookup, start and remember
    run on every such call): no graph break, the eager result."""
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
def test_routes_are_bitwise_the_plain_op_on_the_gpu(shape):
    """Through the public op (the three plans at these shapes): the plain Hopper forward, then three op calls
    (plain, prepared, routed): o and the final state bitwise equal, and the route recorded."""
    from linattn.ops.hopper.plan import plan_inputs
    x = gpu_inputs(*shape, 128, 128)
    found, why = plan_inputs(x["q"], x["v"], (x["k"], x["g"], x["beta"], x["initial_state"]), None, None)
    assert found is not None, why
    with torch.no_grad():
        plain = hopper_fwd.forward_plain(found, *(x[n] for n in ("q", "k", "v", "g", "beta")), 128 ** -0.5,
                                         x["initial_state"])
        outs = [linattn.chunk_gated_delta_rule(**x, output_final_state=True) for _ in range(3)]
    assert len(route._routes) == 1
    for o, ht in outs:
        assert torch.equal(o, plain[0]) and torch.equal(ht, plain[1])
