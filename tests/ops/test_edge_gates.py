"""Gates at the edge of their range, on every CPU-testable path: a −inf log decay (a full forget) and huge finite
ones (−3e38: the chunk-local sums overflow to −inf) must give the float64 reference's finite answer, forward and
backward (issue 46, item 1). Every path floors each gate at ``utils.MIN_LOG_DECAY`` where it first reads it.

Paths: the torch backend, the Triton split and walk forwards and the Triton backward (fp32 under the interpreter),
the recurrent op (both backends), the decode step (both backends) and gated linear attention. The reference
(token by token in float64) handles −inf exactly; its gradient is compared where it is finite, and dg at a gate
below the floor is 0 (the true derivative e^g·(…) is 0 there). The bf16/fp16 GPU cases are in
benchmarks/gpu_check_edges.py.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.gated_linear.reference import gated_linear_attention_reference
from linattn.ops.utils import MIN_LOG_DECAY, gate_from_raw

# relative RMS against float64: fp32 forward and gradients (the kernels' own fp32 bounds elsewhere in tests/ops)
TOL = {"o": 1e-5, "grad": 1e-4}
B, T, H, HV, K, V = 1, 37, 1, 2, 16, 16
# gate edits: (token, value head, value); −3e38 twice in one head makes its chunk-local sum overflow to −inf
GATES = {"neg-inf": [(20, 0, float("-inf"))], "huge-twice": [(5, 1, -3e38), (30, 1, -3e38)]}


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(gates, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2.0)
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    for t, hv, value in gates:
        g[0, t, hv] = value
    do, dht = torch.randn(B, T, HV, V, generator=gen), torch.randn(B, HV, K, V, generator=gen)
    return [q, k, v, g, beta], h0, do, dht


def grads(fn, xs, h0, do, dht, dtype=None):
    """(o, final state, [dq, dk, dv, dg, dbeta, dh0]) of ``fn`` on copies of the inputs (in ``dtype``)."""
    leaves = [x.to(dtype or x.dtype).clone().requires_grad_() for x in (*xs, h0)]
    o, ht = fn(*leaves[:5], initial_state=leaves[5])
    loss = (o * do.to(o.dtype)).sum() + (ht * dht.to(ht.dtype)).sum()
    return o.detach(), ht.detach(), torch.autograd.grad(loss, leaves)


def check(fn, reference, gates, backward=True):
    xs, h0, do, dht = make(gates)
    o, ht, dx = grads(fn, xs, h0, do, dht) if backward else (*fn(*xs, initial_state=h0), None)
    ro, rht, rdx = grads(reference, xs, h0, do, dht, torch.float64)
    first = min(t for t, _, _ in gates)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_rms(o[:, :first], ro[:, :first]) <= TOL["o"], "tokens before the edge gate"
    assert rel_rms(o, ro) <= TOL["o"] and rel_rms(ht, rht) <= TOL["o"]
    if not backward:
        return
    for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), dx, rdx):
        assert torch.isfinite(got).all(), name
        finite = torch.isfinite(want)
        if name == "dg":
            for t, hv, _ in gates:
                assert got[0, t, hv] == 0, "dg at a gate below the floor"
                finite[0, t, hv] = False
        assert rel_rms(got[finite], want[finite]) <= TOL["grad"], f"{name}: {rel_rms(got[finite], want[finite]):.2e}"


def gdn_reference(q, k, v, g, beta, initial_state):
    return gated_delta_rule_reference(q, k, v, g, beta, K ** -0.5, initial_state)


def gla_reference(q, k, v, g, beta, initial_state):
    return gated_linear_attention_reference(q, k, v, g, beta, K ** -0.5, initial_state)


def op(fn, **kw):
    return lambda *x, initial_state: fn(*x, scale=K ** -0.5, initial_state=initial_state, output_final_state=True,
                                        **kw)


@pytest.mark.parametrize("gates", GATES.values(), ids=GATES.keys())
def test_torch_backend(gates):
    check(op(linattn.chunk_gated_delta_rule, backend="torch"), gdn_reference, gates)


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["split", "walk"])
@pytest.mark.parametrize("gates", GATES.values(), ids=GATES.keys())
def test_triton_chunked(path, gates):
    check(op(functools.partial(chunk_gated_delta_rule_on_path, path), backend="triton"), gdn_reference, gates,
          backward=path == "split")


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("gates", GATES.values(), ids=GATES.keys())
def test_recurrent(backend, gates):
    check(op(linattn.fused_recurrent_gated_delta_rule, backend=backend), gdn_reference, gates)


@pytest.mark.parametrize("gates", GATES.values(), ids=GATES.keys())
def test_gated_linear_attention(gates):
    check(op(linattn.gated_linear_attention), gla_reference, gates)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_step(backend):
    """Four decode steps of one token each over a pool, a −inf gate at the second and −3e38 at the third."""
    xs, h0, _, _ = make([(1, 0, float("-inf")), (2, 1, -3e38)])
    q, k, v, g, beta = (x[:, :4] for x in xs)
    pool = h0.clone()
    outs = [linattn.gated_delta_rule_decode(*(x[:, t:t + 1] for x in (q, k, v, g, beta)), pool, backend=backend)[0]
            for t in range(4)]
    ro, rht = gated_delta_rule_reference(q, k, v, g, beta, K ** -0.5, h0)
    o = torch.cat(outs, 1)
    assert torch.isfinite(o).all() and torch.isfinite(pool).all()
    assert rel_rms(o, ro) <= TOL["o"] and rel_rms(pool, rht) <= TOL["o"]


def test_raw_gate_is_floored():
    """−exp(A_log)·softplus(g + dt_bias) overflows to −inf from A_log ≈ 88.7 in fp32: floored, finite gates kept."""
    g_raw = torch.randn(2, 5, 2)
    gate = gate_from_raw(g_raw, torch.tensor([89.0, 0.5]), torch.zeros(2))
    assert torch.isfinite(gate).all() and (gate[..., 0] == MIN_LOG_DECAY).all()
    assert torch.equal(gate[..., 1], -torch.tensor(0.5).exp() * F.softplus(g_raw[..., 1]))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf"), 0.0, -0.25])
def test_non_finite_or_non_positive_scale_is_refused(scale):
    """Every op refuses a scale that is not a finite number > 0 (issue 46, item 3), before any work."""
    xs, h0, _, _ = make([])
    q, k, v, g, beta = xs
    calls = [lambda: linattn.chunk_gated_delta_rule(*xs, scale=scale, backend="torch"),
             lambda: linattn.fused_recurrent_gated_delta_rule(*xs, scale=scale, backend="torch"),
             lambda: linattn.gated_linear_attention(*xs, scale=scale),
             lambda: linattn.gated_delta_rule_decode(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], h0.clone(),
                                                     scale=scale, backend="torch")]
    for call in calls:
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            call()


@pytest.mark.interpreter
def test_fused_preprocess_floors_the_raw_gate():
    """The Triton pre-processing (common/preprocess.py) computes the floored gate utils.gate_from_raw does, and
    its gradient is 0 where the gate is floored (A_log = 89: exp(A_log) is inf in fp32), finite elsewhere."""
    from linattn.ops.common.preprocess import preprocess
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 9, 1, 16, generator=gen), torch.randn(1, 9, 1, 16, generator=gen)
    g_raw, beta = torch.randn(1, 9, 2, generator=gen).requires_grad_(), torch.rand(1, 9, 2, generator=gen)
    A_log, dt_bias = torch.tensor([89.0, 0.5]).requires_grad_(), torch.zeros(2).requires_grad_()
    _, _, gate, _ = preprocess(q, k, g_raw, beta, A_log, dt_bias, False, False)
    assert torch.allclose(gate, gate_from_raw(g_raw, A_log, dt_bias), rtol=1e-6, atol=0)
    assert (gate[..., 0] == MIN_LOG_DECAY).all()
    dg_raw, dA_log, ddt_bias = torch.autograd.grad(gate.sum(), (g_raw, A_log, dt_bias))
    want = torch.autograd.grad(gate_from_raw(g_raw, A_log, dt_bias).sum(), (g_raw, A_log, dt_bias))
    assert (dg_raw[..., 0] == 0).all() and dA_log[0] == 0 and ddt_bias[0] == 0
    for got, ref in zip((dg_raw, dA_log, ddt_bias), want):
        assert torch.isfinite(got).all() and torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_recurrent_in_op_gate_at_a_huge_a_log(backend):
    """The recurrent op with the gate computed in the op (A_log = 89: exp(A_log) is inf in fp32) gives the chunked
    torch backend's answer, finite gradients, and no gradient to the floored head's A_log and dt_bias."""
    xs, h0, do, dht = make([])
    q, k, v, g_raw, beta = xs
    gate = dict(A_log=torch.tensor([89.0, 0.5]), dt_bias=torch.zeros(HV))
    runs = {}
    for name, fn, be in (("recurrent", linattn.fused_recurrent_gated_delta_rule, backend),
                         ("chunk", linattn.chunk_gated_delta_rule, "torch")):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g_raw, beta, gate["A_log"], gate["dt_bias"])]
        o, ht = fn(*leaves[:5], A_log=leaves[5], dt_bias=leaves[6], initial_state=h0, output_final_state=True,
                   use_qk_l2norm_in_kernel=True, backend=be)
        runs[name] = (o, ht, torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves))
    (o, ht, grads), (ro, rht, rgrads) = runs["recurrent"], runs["chunk"]
    assert rel_rms(o, ro) <= TOL["o"] and rel_rms(ht, rht) <= TOL["o"]
    assert all(torch.isfinite(d).all() for d in grads)
    assert grads[5][0] == 0 and grads[6][0] == 0 and (grads[3][..., 0] == 0).all()
    for got, want in zip(grads, rgrads):
        assert rel_rms(got, want) <= TOL["grad"]
