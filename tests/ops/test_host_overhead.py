"""The eager fast path of the public ops (docs/performance.md, "Host overhead").

In eager mode the ops call their implementations directly instead of their ``torch.library`` custom ops (an
``autograd.Function`` carries the gradient); while tracing they go through the custom ops. Here: both paths give
bitwise identical outputs and gradients on both backends; the eager path really skips the custom op and the
traced path (fake tensors, dispatch modes) really uses it; decode bumps the pool's version counter on both; and
the host helpers that replaced per-call work (cdiv / next_power_of_2, cached decode tiles, cached chunk tables)
agree with what they replaced.

Shapes: K = 20, V = 36 (not powers of two), HV = 2·H; T = 70 for the chunked op (two chunks, a tail), 9 for the
recurrent one (its interpreted backward walks token by token).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import linattn
from linattn.ops import utils
from linattn.ops.common.varlen import chunk_tables, chunk_tables_ref
from linattn.ops.gated_delta import chunk as chunk_mod
from linattn.ops.gated_delta import decode as decode_mod
from linattn.ops.gated_delta import recurrent as rec_mod

# the two paths run the same kernels on the same inputs: results must match bit for bit
TOLERANCES = {"paths": dict(rtol=0, atol=0)}

H, HV, K, V = 1, 2, 20, 36
LENGTHS = {"chunk": 70, "recurrent": 9}
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]
OPS = {"chunk": (chunk_mod, linattn.chunk_gated_delta_rule),
       "recurrent": (rec_mod, linattn.fused_recurrent_gated_delta_rule)}


def make_inputs(B: int, T: int, requires_grad: bool):
    x = dict(q=torch.randn(B, T, H, K), k=F.normalize(torch.randn(B, T, H, K), dim=-1), v=torch.randn(B, T, HV, V),
             g=F.logsigmoid(torch.randn(B, T, HV)), beta=torch.rand(B, T, HV),
             initial_state=torch.randn(B, HV, K, V))
    for t in x.values():
        t.requires_grad_(requires_grad)
    return x


def run(fn, x, backend, through_custom_op: bool, monkeypatch):
    """Forward (and backward when x requires grad) with the eager path on or forced through the custom op."""
    with monkeypatch.context() as m:
        if through_custom_op:
            for mod in (chunk_mod, rec_mod, decode_mod):
                m.setattr(mod, "eager_call", lambda *tensors: False)
        o, ht = fn(**x, output_final_state=True, backend=backend)
        if not o.requires_grad:
            return o, ht
        (o.square().sum() + ht.square().sum()).backward()
    grads = [t.grad.clone() for t in x.values()]
    for t in x.values():
        t.grad = None
    return o, ht, *grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("op", list(OPS))
def test_eager_path_equals_custom_op_path(op, requires_grad, backend, monkeypatch):
    x = make_inputs(2, LENGTHS[op], requires_grad)
    fn = OPS[op][1]
    eager = run(fn, x, backend, False, monkeypatch)
    traced = run(fn, x, backend, True, monkeypatch)
    for a, b in zip(eager, traced):
        torch.testing.assert_close(a, b, **TOLERANCES["paths"])


def _forbid(*args, **kwargs):
    raise AssertionError("the eager path went through the custom op")


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("op", list(OPS))
def test_eager_call_skips_the_custom_op(op, requires_grad, monkeypatch):
    mod, fn = OPS[op]
    monkeypatch.setattr(mod, "_fwd_op", _forbid)
    monkeypatch.setattr(mod, "_bwd_op", _forbid)
    x = make_inputs(1, 5, requires_grad)
    o, _ = fn(**x, backend="torch")
    if requires_grad:
        o.sum().backward()
        assert x["q"].grad is not None


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", list(OPS) + ["decode"])
def test_dispatch_modes_and_fake_tensors_see_the_custom_op(op):
    x = make_inputs(1, 5, False)
    pool, slots = torch.randn(3, HV, K, V), torch.tensor([2])
    call = ((lambda: linattn.gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots,
                                                     check_indices=False, backend="torch"))
            if op == "decode" else (lambda: OPS[op][1](**x, backend="torch")))
    with _CountOps() as mode:
        call()
    assert any(n.startswith("linattn.") for n in mode.names), mode.names[:5]
    with FakeTensorMode() as fake_mode:
        x = {n: fake_mode.from_tensor(t) for n, t in x.items()}
        pool, slots = fake_mode.from_tensor(pool), fake_mode.from_tensor(slots)
        o = call()[0]
    assert type(o).__name__ == "FakeTensor" and o.shape == (1, 5, HV, V)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_eager_path_bumps_pool_version_like_the_custom_op(backend, monkeypatch):
    x = make_inputs(2, 1, False)
    del x["initial_state"]
    slots = torch.tensor([2, 0])
    pools, versions = [], []
    for through_custom_op in (False, True):
        pool = torch.randn(3, HV, K, V, generator=torch.Generator().manual_seed(0))
        with monkeypatch.context() as m:
            if through_custom_op:
                m.setattr(decode_mod, "eager_call", lambda *tensors: False)
            v0 = pool._version
            o, _ = linattn.gated_delta_rule_decode(**x, state_pool=pool, state_indices=slots, backend=backend)
            versions.append(pool._version > v0)
        pools.append((o, pool))
    assert versions == [True, True]
    for a, b in zip(*pools):
        torch.testing.assert_close(a, b, **TOLERANCES["paths"])


@pytest.mark.parametrize("n", [1, 2, 3, 15, 16, 17, 64, 100, 255, 256, 257])
def test_host_integer_helpers_match_triton(n):
    assert utils.next_power_of_2(n) == triton.next_power_of_2(n)
    for d in (1, 16, 64):
        assert utils.cdiv(n, d) == triton.cdiv(n, d)


@pytest.mark.parametrize("offsets", [[0, 70], [0, 0, 64, 65, 200], [0, 1, 1, 130, 131]],
                         ids=["one", "empty_and_tails", "short"])
def test_chunk_tables_cache_returns_the_twins_values(offsets):
    first = chunk_tables(offsets, 64, "cpu")
    again = chunk_tables(list(offsets), 64, "cpu")
    assert again[0] is first[0] and again[1] is first[1]
    ref_idx, ref_firsts = chunk_tables_ref(offsets, 64)
    assert first[0].tolist() == [list(p) for p in ref_idx] and first[1].tolist() == ref_firsts
    assert first[0].dtype == first[1].dtype == torch.int32 and first[0].shape == (len(ref_idx), 2)
    other = chunk_tables(offsets[:-1] + [offsets[-1] + 64], 64, "cpu")
    assert other[1].tolist() != ref_firsts
