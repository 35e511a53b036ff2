"""fused_recurrent_gated_delta_rule (torch backend and Triton kernels under the interpreter) against the float64
token-by-token reference: outputs, final state and every gradient through ``(o*do).sum() + (ht*dht).sum()``,
including dA_log / ddt_bias through the fused gate. The reference does the pre-processing with linattn.ops.utils'
l2norm / gate_from_raw / sigmoid in float64 under autograd, independently of the kernels' fused versions.

Grid pruning: the interpreter runs a Python loop per token and program, so the Triton cases are T ≤ 40; the
kernels never specialise on T (one while loop), so short sequences exercise the same code as long ones. Head
dims 60/100 hit the K and V tails; HV = 4·H the grouped heads; varlen includes an empty sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.ops.gated_delta import recurrent
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.utils import gate_from_raw, l2norm

# relative RMS error against float64, per input dtype (fp16: q/k/v/o rounded to 11 bits)
TOLERANCES = {torch.float32: 2e-5, torch.float16: 3e-3}
# kernel vs its PyTorch twin, both fp32: only summation order differs
TWIN_TOLERANCE = 1e-5


@dataclass
class Case:
    id: str
    T: int = 17
    B: int = 2
    H: int = 2
    HV: int = 2
    K: int = 32
    V: int = 32
    lengths: tuple | None = None
    h0: bool = False
    l2norm: bool = False
    gate_in_op: bool = False
    strong_decay: bool = False


CASES = [
    Case("T1", T=1),
    Case("T17_h0", h0=True),
    Case("K60_V100", K=60, V=100, T=9, B=1),
    Case("GVA_4x", H=1, HV=4, T=12),
    Case("varlen_empty_seq", lengths=(5, 0, 13, 1), h0=True),
    Case("l2norm_gate_in_op", l2norm=True, gate_in_op=True, HV=4, H=2, T=12, h0=True),
    Case("strong_decay", strong_decay=True, h0=True, T=12),
]
# the interpreter is slow: the Triton backend runs the cases that differ in code path, with small T
TRITON_CASES = [c for c in CASES if c.id != "strong_decay"]


def make_inputs(c: Case, dtype=torch.float32):
    B, T = (1, sum(c.lengths)) if c.lengths else (c.B, c.T)
    N = len(c.lengths) if c.lengths else B
    t = dict(q=torch.randn(B, T, c.H, c.K, dtype=dtype), k=torch.randn(B, T, c.H, c.K, dtype=dtype),
             v=torch.randn(B, T, c.HV, c.V, dtype=dtype))
    if not c.l2norm:  # the delta rule is stable for ‖k‖ ≤ 1: normalise as models do
        t["k"] = F.normalize(t["k"].float(), dim=-1).to(dtype)
    if c.gate_in_op:
        t["g"] = torch.randn(B, T, c.HV)
        t["beta"] = torch.randn(B, T, c.HV)
        t["A_log"] = torch.randn(c.HV) * 0.5
        t["dt_bias"] = torch.randn(c.HV)
    else:
        t["g"] = (torch.full((B, T, c.HV), -100.0) + torch.rand(B, T, c.HV) if c.strong_decay
                  else F.logsigmoid(torch.randn(B, T, c.HV)))
        t["beta"] = torch.rand(B, T, c.HV)
    if c.h0:
        t["initial_state"] = torch.randn(N, c.HV, c.K, c.V)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=c.l2norm, use_beta_sigmoid_in_kernel=c.gate_in_op)
    if c.lengths:
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(c.lengths).cumsum(0).tolist()], dtype=torch.int64)
    return t, kw


def reference(t: dict, kw: dict):
    """float64 leaves → (leaves, o, ht) through the utils' pre-processing and the token-by-token reference."""
    xs = {n: x.detach().double().requires_grad_() for n, x in t.items()}
    q, k, g, beta = xs["q"], xs["k"], xs["g"], xs["beta"]
    if kw["use_qk_l2norm_in_kernel"]:
        q, k = l2norm(q), l2norm(k)
    if "A_log" in xs:
        g = gate_from_raw(g, xs["A_log"], xs["dt_bias"])
    if kw["use_beta_sigmoid_in_kernel"]:
        beta = beta.sigmoid()
    cu = kw.get("cu_seqlens")
    o, ht = gated_delta_rule_reference(q, k, xs["v"], g, beta, q.shape[-1] ** -0.5, xs.get("initial_state"),
                                       None if cu is None else cu.tolist())
    return xs, o, ht


def rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_against_reference(c: Case, backend: str, dtype=torch.float32):
    t, kw = make_inputs(c, dtype)
    before = {n: x.clone() for n, x in t.items()}
    xs = {n: x.detach().clone().requires_grad_() for n, x in t.items()}
    o, ht = linattn.fused_recurrent_gated_delta_rule(**xs, **kw, backend=backend)
    rxs, ro, rht = reference(t, kw)
    assert o.dtype == dtype and ht.dtype == torch.float32
    tol = TOLERANCES[dtype]
    assert rel_rms(o, ro) <= tol, f"o: {rel_rms(o, ro):.2e}"
    assert rel_rms(ht, rht) <= tol, f"ht: {rel_rms(ht, rht):.2e}"
    do, dht = torch.randn_like(ro), torch.randn_like(rht)
    grads = torch.autograd.grad((o * do.to(dtype)).sum() + (ht * dht.float()).sum(), list(xs.values()))
    rgrads = torch.autograd.grad((ro * do).sum() + (rht * dht).sum(), list(rxs.values()))
    for name, gr, rg in zip(xs, grads, rgrads):
        assert gr.dtype == xs[name].dtype, f"d{name} dtype"
        assert rel_rms(gr, rg) <= tol, f"d{name}: {rel_rms(gr, rg):.2e}"
    for n in t:
        assert torch.equal(xs[n].detach(), before[n]), f"{n} was modified"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_torch_backend_matches_float64_reference(case):
    check_against_reference(case, "torch")


@pytest.mark.interpreter
@pytest.mark.parametrize("case", TRITON_CASES, ids=[c.id for c in TRITON_CASES])
def test_triton_matches_float64_reference(case):
    check_against_reference(case, "triton")


@pytest.mark.interpreter
def test_triton_fp16_inputs():
    check_against_reference(Case("fp16", T=9, HV=4, H=2, K=60, V=36, h0=True), "triton", torch.float16)


@pytest.mark.interpreter
def test_kernels_match_torch_twins():
    """Each kernel against its twin on prepared inputs: the forward (with per-token states) and the reverse walk
    (gradients of the prepared inputs, before the chain rule), so a bug cannot hide behind the other stage."""
    from linattn.ops.gated_delta import recurrent_kernels as rk
    c = Case("twin", T=11, B=2, H=1, HV=2, K=20, V=36, h0=True)
    t, _ = make_inputs(c)
    q, k, v, g, beta, h0 = (t[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    scale = 0.3
    hs = torch.empty(c.B, c.T, c.HV, c.K, c.V)
    ht = torch.empty(c.B, c.HV, c.K, c.V)
    o = rk.fused_recurrent_fwd(q, k, v, g, beta, scale, h0, ht, hs, None, None, None, None, False, False)
    qe, ke = q.repeat_interleave(2, 2), k.repeat_interleave(2, 2)
    ro, rht, rhs = recurrent.fused_recurrent_fwd_ref(qe, ke, v, g, beta, scale, h0, store_intermediate=True)
    for name, a, b in (("o", o, ro), ("ht", ht, rht), ("hs", hs, rhs)):
        assert rel_rms(a, b) <= TWIN_TOLERANCE, name
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    grads = rk.fused_recurrent_bwd(q, k, v, g, beta, scale, h0, None, None, None, False, False, do, dht)
    rgrads = recurrent.fused_recurrent_bwd_ref(qe, ke, v, g, beta, scale, h0, do, dht)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, rgrads):
        assert rel_rms(a, b) <= TWIN_TOLERANCE, name


def test_gradcheck_float64_with_fused_preprocessing():
    c = Case("tiny", T=5, B=1, H=1, HV=2, K=4, V=3, h0=True, l2norm=True, gate_in_op=True, lengths=(3, 2))
    t, kw = make_inputs(c, torch.float64)
    names = list(t)
    inputs = tuple(x.double().requires_grad_() for x in t.values())
    assert torch.autograd.gradcheck(
        lambda *xs: linattn.fused_recurrent_gated_delta_rule(**dict(zip(names, xs)), **kw, backend="torch"),
        inputs, eps=1e-6, atol=1e-7)


def test_matches_chunked_op():
    """Same conventions and results as chunk_gated_delta_rule (the torch backends of both)."""
    t, kw = make_inputs(Case("x", T=70, HV=4, H=2, h0=True, l2norm=True, gate_in_op=True))
    o1, h1 = linattn.fused_recurrent_gated_delta_rule(**t, **kw, backend="torch")
    o2, h2 = linattn.chunk_gated_delta_rule(**t, **kw, backend="torch")
    assert rel_rms(o1, o2) <= TOLERANCES[torch.float32] and rel_rms(h1, h2) <= TOLERANCES[torch.float32]


def test_output_final_state_false_and_bad_input():
    t, kw = make_inputs(Case("x", T=4))
    kw["output_final_state"] = False
    o, ht = linattn.fused_recurrent_gated_delta_rule(**t, **kw)
    assert ht is None and o.shape == t["v"].shape
    with pytest.raises(ValueError, match="beta"):
        linattn.fused_recurrent_gated_delta_rule(**{**t, "beta": t["beta"][:, :2]}, **kw)
    with pytest.raises(ValueError, match="backend"):
        linattn.fused_recurrent_gated_delta_rule(**t, **kw, backend="cuda")


def test_torch_compile_fullgraph_cpu():
    t, kw = make_inputs(Case("x", T=6, lengths=(2, 4), h0=True, l2norm=True, gate_in_op=True))

    def f(**xs):
        o, ht = linattn.fused_recurrent_gated_delta_rule(**xs, **kw)
        return o.sum() + ht.sum()

    xs = {n: x.clone().requires_grad_() for n, x in t.items()}
    eager = f(**xs)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(**xs)
    torch.testing.assert_close(compiled, eager)
    g_eager = torch.autograd.grad(eager, list(xs.values()))
    g_comp = torch.autograd.grad(compiled, list(xs.values()))
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b)
