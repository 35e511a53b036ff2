"""The torch backend of chunk_gated_delta_rule against the float64 token-by-token reference.

Outputs, final state and every gradient, through ``(o*do).sum() + (ht*dht).sum()``. The case table covers the
sizes where chunked code goes wrong (T = 1, one short of a chunk, one past it; head dims that are not powers of
two; K ≠ V), grouped value heads, varlen, initial state, the in-op pre-processing, and the gate/beta extremes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import linattn

# float32 computation against float64: relative RMS error bound (issue 2).
TOLERANCES = {torch.float32: 1e-5}


@dataclass
class Case:
    id: str
    T: int = 65
    H: int = 2
    HV: int = 2
    K: int = 32
    V: int = 32
    B: int = 2
    lengths: tuple | None = None     # varlen: packed sequence lengths (B becomes 1)
    h0: bool = False
    l2norm: bool = False
    gate_in_op: bool = False        # A_log / dt_bias / beta sigmoid computed in the op
    g_mode: str = "normal"          # normal | zero | strong
    beta_mode: str = "rand"         # rand | zero | one
    extra: dict = field(default_factory=dict)


CASES = [
    Case("T1", T=1),
    Case("T63", T=63),
    Case("T64", T=64),
    Case("T65", T=65),
    Case("T300", T=300, B=1),
    Case("K60_V100", K=60, V=100, T=70),
    Case("K100_V60", K=100, V=60, T=70),
    Case("K64_V128", K=64, V=128, T=66, B=1),
    Case("K128_V64", K=128, V=64, T=66, B=1),
    Case("GVA_2x", H=2, HV=4, T=70),
    Case("GVA_4x", H=1, HV=4, T=70, K=60, V=100),
    Case("varlen", lengths=(1, 64, 37, 130), h0=True),
    Case("varlen_empty_seq", lengths=(5, 0, 70)),
    Case("h0", h0=True, T=130),
    Case("l2norm", l2norm=True, T=100),
    Case("gate_in_op", gate_in_op=True, l2norm=True, T=100, HV=4, H=2),
    Case("strong_decay", g_mode="strong", T=130, h0=True),
    Case("g_zero", g_mode="zero", T=130),
    Case("beta0", beta_mode="zero", T=70, h0=True),
    Case("beta1", beta_mode="one", T=70),
]


def make_inputs(c: Case, dtype=torch.float32):
    B, T = (1, sum(c.lengths)) if c.lengths else (c.B, c.T)
    N = len(c.lengths) if c.lengths else B
    q = torch.randn(B, T, c.H, c.K, dtype=dtype)
    k = torch.randn(B, T, c.H, c.K, dtype=dtype)
    if not c.l2norm:  # the delta rule is only stable for ‖k‖ ≤ 1 (β ≤ 1): normalise as models do
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, c.HV, c.V, dtype=dtype)
    if c.gate_in_op:
        g = torch.randn(B, T, c.HV, dtype=dtype)                     # raw: the op makes −exp(A)·softplus(g + dt)
        beta = torch.randn(B, T, c.HV, dtype=dtype)                  # logits: the op applies sigmoid
    else:
        g = {"normal": F.logsigmoid(torch.randn(B, T, c.HV, dtype=dtype)),
             "zero": torch.zeros(B, T, c.HV, dtype=dtype),
             "strong": torch.full((B, T, c.HV), -100.0, dtype=dtype) + torch.rand(B, T, c.HV, dtype=dtype)}[c.g_mode]
        beta = {"rand": torch.rand(B, T, c.HV, dtype=dtype), "zero": torch.zeros(B, T, c.HV, dtype=dtype),
                "one": torch.ones(B, T, c.HV, dtype=dtype)}[c.beta_mode]
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=c.l2norm)
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta)
    if c.h0:
        tensors["initial_state"] = torch.randn(N, c.HV, c.K, c.V, dtype=dtype)
    if c.gate_in_op:
        tensors["A_log"] = torch.randn(c.HV, dtype=dtype) * 0.5
        tensors["dt_bias"] = torch.randn(c.HV, dtype=dtype)
        kw["use_beta_sigmoid_in_kernel"] = True
    if c.lengths:
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(c.lengths).cumsum(0).tolist()], dtype=torch.int64)
    return tensors, kw


def run(tensors, kw, backend, dtype=None):
    xs = {n: (t.to(dtype) if dtype else t).detach().clone().requires_grad_() for n, t in tensors.items()}
    o, ht = linattn.chunk_gated_delta_rule(**xs, **kw, backend=backend)
    return xs, o, ht


def rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_torch_backend_matches_float64_reference(case):
    tensors, kw = make_inputs(case)
    xs, o, ht = run(tensors, kw, "torch")
    rxs, ro, rht = run(tensors, kw, "reference", dtype=torch.float64)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    tol = TOLERANCES[torch.float32]
    assert rel_rms(o, ro) <= tol, "output"
    assert rel_rms(ht, rht) <= tol, "final state"

    do, dht = torch.randn_like(ro), torch.randn_like(rht)
    grads = torch.autograd.grad((o * do.float()).sum() + (ht * dht.float()).sum(), list(xs.values()))
    rgrads = torch.autograd.grad((ro * do).sum() + (rht * dht).sum(), list(rxs.values()))
    for name, g, rg in zip(xs, grads, rgrads):
        assert torch.isfinite(g).all(), f"d{name} not finite"
        if rg.norm() == 0:   # e.g. dq when beta = 0 and no state: both must be exactly zero
            assert g.abs().max() == 0, f"d{name} should be zero"
            continue
        assert rel_rms(g, rg) <= tol, f"d{name}: {rel_rms(g, rg):.2e}"


def test_gradcheck_float64():
    c = Case("tiny", T=9, H=1, HV=2, K=5, V=3, B=1, h0=True)
    tensors, kw = make_inputs(c, dtype=torch.float64)
    names = list(tensors)

    def f(*xs):
        o, ht = linattn.chunk_gated_delta_rule(**dict(zip(names, xs)), **kw, backend="torch")
        return o, ht

    inputs = tuple(t.detach().clone().requires_grad_() for t in tensors.values())
    # chunk_size 64 > T: one partial chunk; the multi-chunk path is covered by the case table above
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("one_chunk_blocks", [False, True], ids=["whole", "blocks-of-one-chunk"])
def test_gradcheck_float64_many_chunks(monkeypatch, one_chunk_blocks):
    """A chunk of 4 tokens so that 11 tokens cross two chunk boundaries inside gradcheck; and with the backend's
    blocks one chunk each, so the state and dS cross block boundaries too."""
    from linattn.ops.gated_delta import torch_chunk
    blocks = dict(block_bytes=1) if one_chunk_blocks else {}
    fwd, bwd = torch_chunk.chunk_gated_delta_rule_fwd_torch, torch_chunk.chunk_gated_delta_rule_bwd_torch
    # dispatch.run_forward and run_backward import them per call
    monkeypatch.setattr(torch_chunk, "chunk_gated_delta_rule_fwd_torch", lambda *a: fwd(*a, chunk_size=4, **blocks))
    monkeypatch.setattr(torch_chunk, "chunk_gated_delta_rule_bwd_torch", lambda *a: bwd(*a, chunk_size=4, **blocks))
    c = Case("tiny", T=11, H=1, HV=1, K=4, V=3, B=1, h0=True, lengths=(6, 5))
    tensors, kw = make_inputs(c, dtype=torch.float64)
    names = list(tensors)
    inputs = tuple(t.detach().clone().requires_grad_() for t in tensors.values())
    assert torch.autograd.gradcheck(
        lambda *xs: linattn.chunk_gated_delta_rule(**dict(zip(names, xs)), **kw, backend="torch"),
        inputs, eps=1e-6, atol=1e-7)


def test_blocked_backend_equals_whole_sequence(monkeypatch):
    """The backend's blocks of chunks (torch_chunk.block_chunks; 1, 2 and 3 chunks here, 3 not dividing the 5
    chunks) give what the stages give on the whole sequence at once: outputs, final state, every gradient."""
    from linattn.ops.gated_delta import torch_chunk
    tensors, kw = make_inputs(Case("blocks", T=300, H=2, HV=4, K=16, V=24, B=2, h0=True))
    results = {}
    fwd, bwd = torch_chunk.chunk_gated_delta_rule_fwd_torch, torch_chunk.chunk_gated_delta_rule_bwd_torch
    for per_chunk in (None, 1, 2, 3):  # None: one block (block_bytes far above the sequence's h)
        h_bytes = 4 * 16 * 24 * 4   # h of one chunk (HV·K·V fp32 values; the backend runs one sequence at a time)
        blocks = 1 << 40 if per_chunk is None else per_chunk * h_bytes
        monkeypatch.setattr(torch_chunk, "chunk_gated_delta_rule_fwd_torch",
                            lambda *a, n=blocks: fwd(*a, block_bytes=n))
        monkeypatch.setattr(torch_chunk, "chunk_gated_delta_rule_bwd_torch",
                            lambda *a, n=blocks: bwd(*a, block_bytes=n))
        xs, o, ht = run(tensors, kw, "torch")
        grads = torch.autograd.grad((o * o.detach()).sum() + (ht * ht.detach()).sum(), list(xs.values()))
        results[per_chunk] = [o, ht, *grads]
    for per_chunk in (1, 2, 3):
        for name, got, want in zip(["o", "ht", *xs], results[per_chunk], results[None]):
            assert rel_rms(got, want) <= 1e-6, f"{name} with blocks of {per_chunk} chunks"


def test_block_chunks_rule():
    from linattn.ops.gated_delta.torch_chunk import BLOCK_BYTES, block_chunks
    k, v = torch.empty(1, 16, 64, 64, 128), torch.empty(1, 16, 64, 64, 128)   # h per chunk: 1 MiB in fp32
    assert BLOCK_BYTES == 4 << 20 and block_chunks(k, v) == 4 and block_chunks(k.double(), v) == 2
    assert block_chunks(k[:, :, :3], v) == 3 and block_chunks(torch.empty(1, 64, 8, 64, 256), v) == 1
    assert block_chunks(torch.empty(1, 16, 64, 64, 128, device="meta"), v) == 64   # not a CPU: one block


def test_inputs_are_not_modified():
    tensors, kw = make_inputs(Case("x", h0=True, l2norm=True, gate_in_op=True, HV=4, H=2))
    before = {n: t.clone() for n, t in tensors.items()}
    xs, o, ht = run(tensors, kw, "torch")
    (o.sum() + ht.sum()).backward()
    for n in tensors:
        assert torch.equal(xs[n].detach(), before[n]), n


def test_non_contiguous_inputs():
    tensors, kw = make_inputs(Case("x", T=70))
    nc = {n: t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() > 1 else t for n, t in tensors.items()}
    nc["v"] = torch.stack([tensors["v"], tensors["v"]], dim=-1)[..., 0]      # strided view, same values
    assert not nc["v"].is_contiguous()
    o1, _ = linattn.chunk_gated_delta_rule(**tensors, **kw, backend="torch")
    o2, _ = linattn.chunk_gated_delta_rule(**nc, **kw, backend="torch")
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)


def test_output_dtype_follows_v_and_state_is_fp32():
    tensors, kw = make_inputs(Case("x", T=20, h0=True))
    half = {n: (t.to(torch.float16) if n in ("q", "k", "v") else t) for n, t in tensors.items()}
    o, ht = linattn.chunk_gated_delta_rule(**half, **kw, backend="torch")
    assert o.dtype == torch.float16 and ht.dtype == torch.float32
    assert torch.isfinite(o).all()


def test_output_final_state_false_returns_none():
    tensors, kw = make_inputs(Case("x", T=10))
    kw["output_final_state"] = False
    o, ht = linattn.chunk_gated_delta_rule(**tensors, **kw)
    assert ht is None and o.shape == tensors["v"].shape


def test_torch_compile_fullgraph_cpu():
    tensors, kw = make_inputs(Case("x", T=70, lengths=(30, 40), h0=True, l2norm=True))

    def f(q, k, v, g, beta, initial_state):
        o, ht = linattn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, **kw)
        return o.sum() + ht.sum()

    eager = f(**tensors)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(**tensors)
    torch.testing.assert_close(compiled, eager)
