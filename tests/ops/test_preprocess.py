"""The fused in-op pre-processing (linattn/ops/common/preprocess.py) under the interpreter on the CPU.

* Kernel vs twin: forward outputs and every gradient (q, k, g_raw, b, A_log, dt_bias) of :func:`preprocess` against
  :func:`preprocess_ref`, both bounded by a float64 evaluation of the twin: the kernel's error may be at most twice
  the twin's own error at the same precision plus a small slack (FlashAttention's bound: it scales with the dtype).
* Through the public op: backend="triton" (fused pre-processing + Triton core) against backend="torch" (PyTorch
  pre-processing + chunked PyTorch core), both in fp32 and bounded by the torch backend in float64 the same way;
  outputs and every gradient, and a spy that proves the fused path ran.
* Traced calls (fake tensors) keep the PyTorch pre-processing; the A_log / dt_bias reductions are deterministic;
  inputs are never modified; the kernels compile for an H200 (sm_90) with triton's own ptxas.

fp32 and fp16 only: the interpreter's bf16 is not trustworthy (tests/ops/test_triton_fwd.py). Grid pruning: the
kernel-level table crosses K ∈ {32, 60, 128} with the flag subsets once each instead of all 3 × 8 combinations;
every flag subset appears, every K appears with all flags on.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import linattn
from linattn.ops.common import preprocess as pp
from tests.ops.sm90_compile import compile_for_h200

pytestmark = pytest.mark.interpreter

# kernel vs twin: slack relative to max|float64 value|, on top of twice the twin's own error
# public op in fp32 against the float64 torch backend: relative RMS slack on top of twice the fp32 torch backend's
# own error (dA_log / ddt_bias are token sums with cancellation: both backends sit near 1e-5 there)
TOLERANCES = {torch.float32: 1e-6, torch.float16: 1e-3, "public_op": 1e-6}


@dataclass
class Case:
    id: str
    K: int = 60
    H: int = 2
    HV: int = 4
    T: int = 37
    B: int = 2
    l2norm: bool = True
    gate: bool = True
    sigmoid: bool = True


CASES = [
    Case("all_K32", K=32),
    Case("all_K60", K=60, T=65),
    Case("all_K128_B1_T1", K=128, B=1, T=1),
    Case("all_K128_HV6", K=128, H=3, HV=6, T=20),
    Case("l2norm_only", K=60, gate=False, sigmoid=False),
    Case("gate_only", l2norm=False, sigmoid=False, T=130, B=1),
    Case("sigmoid_only", l2norm=False, gate=False),
    Case("gate_sigmoid", K=32, l2norm=False),
    Case("l2norm_gate", K=32, sigmoid=False),
    Case("l2norm_sigmoid", K=128, gate=False, T=9),
]


def make_inputs(c: Case, dtype: torch.dtype) -> dict:
    """Raw inputs as a model passes them: q/k unnormalised, raw gate logits (fp32, as Qwen3-Next), beta logits."""
    x = dict(q=torch.randn(c.B, c.T, c.H, c.K, dtype=dtype) * 2, k=torch.randn(c.B, c.T, c.H, c.K, dtype=dtype),
             g=torch.randn(c.B, c.T, c.HV) * 3, beta=torch.randn(c.B, c.T, c.HV, dtype=dtype) * 2,
             A_log=torch.randn(c.HV) * 0.5 if c.gate else None, dt_bias=torch.randn(c.HV) if c.gate else None)
    if c.gate:
        x["g"][..., 0] = torch.tensor([-30.0, 25.0]).repeat(c.B * c.T)[:c.B * c.T].view(c.B, c.T)  # softplus tails
    return x


def forward_backward(fn, x: dict, c: Case, cotangents: list) -> tuple[list, list]:
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items() if t is not None}
    args = {n: leaves.get(n) for n in x}
    outs = fn(**args, use_qk_l2norm=c.l2norm, use_beta_sigmoid=c.sigmoid)
    grads = torch.autograd.grad(outs, list(leaves.values()), [d.to(o.dtype) for d, o in zip(cotangents, outs)])
    return [o.detach() for o in outs], list(grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_preprocess_matches_twin(c, dtype):
    x = make_inputs(c, dtype)
    before = {n: t.clone() for n, t in x.items() if t is not None}
    cotangents = [torch.randn(c.B, c.T, c.H, c.K), torch.randn(c.B, c.T, c.H, c.K), torch.randn(c.B, c.T, c.HV),
                  torch.randn(c.B, c.T, c.HV)]
    out, grads = forward_backward(pp.preprocess, x, c, cotangents)
    twin_out, twin_grads = forward_backward(pp.preprocess_ref, x, c, cotangents)
    x64 = {n: (t.double() if t is not None else None) for n, t in x.items()}
    ref_out, ref_grads = forward_backward(pp.preprocess_ref, x64, c, [d.double() for d in cotangents])
    names = ["q̂", "k̂", "g", "β"] + [f"d{n}" for n, t in x.items() if t is not None]
    for name, a, b, r in zip(names, out + grads, twin_out + twin_grads, ref_out + ref_grads):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        err, twin_err = (a.double() - r).abs().max().item(), (b.double() - r).abs().max().item()
        bound = 2 * twin_err + TOLERANCES[dtype] * r.abs().max().item()
        assert err <= bound, f"{name}: kernel error {err:.3g} > {bound:.3g} (twin {twin_err:.3g})"
    for n, t in before.items():
        torch.testing.assert_close(x[n], t, rtol=0, atol=0, msg=f"{n} was modified")


def test_gate_is_relatively_exact_in_the_softplus_tails():
    """Element by element, g and dg_raw keep their relative precision where softplus(u) underflows toward 0 (u ≪ 0)
    or equals u (u > 20): the max-abs bound of test_preprocess_matches_twin cannot see a log(1 + tiny) that
    rounds to 0."""
    u = torch.linspace(-80, 40, 241).view(1, 241, 1).repeat(1, 1, 2)
    A_log, dt_bias = torch.tensor([0.3, -0.7]), torch.zeros(2)
    g = u.clone().requires_grad_()
    out = pp.preprocess(torch.randn(1, 241, 1, 16), torch.randn(1, 241, 1, 16), g, torch.rand(1, 241, 2), A_log,
                        dt_bias, False, False)[2]
    (dg,) = torch.autograd.grad(out, g, torch.ones_like(out))
    ref = -A_log.double().exp() * F.softplus(u.double())
    dref = -A_log.double().exp() * torch.sigmoid(u.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(dg.double(), dref, rtol=1e-5, atol=0)


def test_parameter_gradients_are_deterministic():
    c = Case("x", K=32, T=130, B=1, HV=8, H=4)
    x = make_inputs(c, torch.float32)
    cotangents = [torch.randn(c.B, c.T, c.H, c.K)] * 2 + [torch.randn(c.B, c.T, c.HV)] * 2
    first = forward_backward(pp.preprocess, x, c, cotangents)[1]
    second = forward_backward(pp.preprocess, x, c, cotangents)[1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@dataclass
class OpCase:
    id: str
    K: int
    l2norm: bool
    gate: bool
    sigmoid: bool
    lengths: tuple | None = None


OP_CASES = [
    OpCase("all_K60_varlen", K=60, l2norm=True, gate=True, sigmoid=True, lengths=(33, 37)),
    OpCase("l2norm_K32", K=32, l2norm=True, gate=False, sigmoid=False),
    OpCase("gate_sigmoid_K32", K=32, l2norm=False, gate=True, sigmoid=True),
]


@pytest.mark.parametrize("c", OP_CASES, ids=[c.id for c in OP_CASES])
def test_public_op_triton_matches_torch(c, monkeypatch):
    H, HV, V, T = 1, 2, 20, 70
    B = 1 if c.lengths else 2
    q, k = torch.randn(B, T, H, c.K), torch.randn(B, T, H, c.K)
    if not c.l2norm:  # the delta rule needs ‖k‖ ≤ 1
        k = F.normalize(k, dim=-1)
    x = dict(q=q, k=k, v=torch.randn(B, T, HV, V),
             g=torch.randn(B, T, HV) if c.gate else F.logsigmoid(torch.randn(B, T, HV)),
             beta=torch.randn(B, T, HV) if c.sigmoid else torch.rand(B, T, HV))
    kw = dict(use_qk_l2norm_in_kernel=c.l2norm, use_beta_sigmoid_in_kernel=c.sigmoid, output_final_state=True)
    if c.gate:
        x.update(A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV))
    if c.lengths:
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(c.lengths).cumsum(0).tolist()])
    do, dht = torch.randn(B, T, HV, V), torch.randn(len(c.lengths) if c.lengths else B, HV, c.K, V)
    calls = []
    for name in ("preprocess_fwd", "preprocess_bwd"):
        real = getattr(pp, name)
        monkeypatch.setattr(pp, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    results = {}
    for backend, dtype in (("triton", torch.float32), ("torch", torch.float32), ("torch", torch.float64)):
        leaves = {n: t.to(dtype, copy=True).requires_grad_() for n, t in x.items()}
        o, ht = linattn.chunk_gated_delta_rule(**leaves, **kw, backend=backend)
        ((o * do.to(dtype)).sum() + (ht * dht.to(dtype)).sum()).backward()
        results[backend, dtype] = [o, ht] + [t.grad for t in leaves.values()]
    assert calls == ["preprocess_fwd", "preprocess_bwd"], calls
    for name, a, b, r in zip(["o", "ht", *x], *results.values()):
        err, torch_err = rel_rms(a, r), rel_rms(b, r)
        bound = 2 * torch_err + TOLERANCES["public_op"]
        assert err <= bound, f"{name}: relative RMS {err:.3g} > {bound:.3g} (torch backend {torch_err:.3g})"


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def test_traced_call_keeps_the_pytorch_preprocessing(monkeypatch):
    def forbid(*args, **kwargs):
        raise AssertionError("a traced call reached the fused pre-processing")

    monkeypatch.setattr(pp, "preprocess", forbid)
    B, T, H, HV, K, V = 1, 5, 1, 2, 32, 16
    with FakeTensorMode() as mode:
        x = [mode.from_tensor(t) for t in (torch.randn(B, T, H, K), torch.randn(B, T, H, K),
                                           torch.randn(B, T, HV, V), torch.randn(B, T, HV), torch.randn(B, T, HV),
                                           torch.randn(HV), torch.randn(HV))]
        o, _ = linattn.chunk_gated_delta_rule(*x[:5], A_log=x[5], dt_bias=x[6], use_qk_l2norm_in_kernel=True,
                                              use_beta_sigmoid_in_kernel=True, backend="triton")
    assert type(o).__name__ == "FakeTensor" and o.shape == (B, T, HV, V)


def test_kernels_compile_for_h200():
    """Compile both kernels for sm_90 in a process without the interpreter; ptxas must report no spills."""
    resources = compile_for_h200("import sm90 as c; from linattn.ops.common import preprocess as P",
                                 "[tuple(c.compile_preprocess_kernel(kern, 'bf16', 60, 8))[:4] for kern in "
                                 "(P.preprocess_fwd_kernel, P.preprocess_bwd_kernel)]")
    for regs, spills, _, _ in resources:
        assert regs <= 255 and spills == 0, resources
