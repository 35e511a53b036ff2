"""fla 0.6's keywords on linattn's public ops (issue 46, item 5): each honoured with fla's meaning (checked against
the same call in linattn's explicit arguments) or rejected with a message saying what to do instead.

``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule`` take fla's keywords as keyword-only arguments
and hand them to ``ops/gated_delta/fla_keywords.py``. The same semantics run against fla's own layer and reference in
tests/integrations/test_fla.py.
"""
import pytest
import torch
import torch.nn.functional as F

from linattn import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

OPS = {"chunk": chunk_gated_delta_rule, "recurrent": fused_recurrent_gated_delta_rule}
# float64 on the torch backend: a keyword's translation is exact, so the two calls agree to rounding
TOL = dict(atol=1e-12, rtol=1e-12)


def _inputs(B=2, T=21, H=2, HV=4, K=8, V=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(q=r(B, T, H, K), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, HV, V),
                g=F.logsigmoid(r(B, T, HV)), b=r(B, T, HV), a=r(B, T, HV), A_log=r(HV) * 0.5, dt_bias=r(HV),
                h0=r(B, HV, K, V))


def _call(op, x, **kw):
    kw.setdefault("g", x["g"])
    kw.setdefault("beta", x["b"].sigmoid())
    return OPS[op](x["q"], x["k"], x["v"], backend="torch", **kw)


def _close(a, b):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, **TOL)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ["state_v_first", "transpose_state_layout"])
def test_state_v_first_transposes_state_in_and_out(op, name):
    x = _inputs()
    o, ht = _call(op, x, initial_state=x["h0"].transpose(-1, -2).contiguous(), output_final_state=True,
                  **{name: True})
    o_ref, ht_ref = _call(op, x, initial_state=x["h0"], output_final_state=True)
    _close((o, ht), (o_ref, ht_ref.transpose(-1, -2)))
    assert ht.is_contiguous()


@pytest.mark.parametrize("op", OPS)
def test_use_gate_in_kernel_and_A_log_without_dt_bias(op):
    x = _inputs()
    gate = -x["A_log"].exp() * F.softplus(x["a"] + x["dt_bias"])
    _close(_call(op, x, g=x["a"], use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"]),
           _call(op, x, g=gate))
    no_bias = -x["A_log"].exp() * F.softplus(x["a"])
    _close(_call(op, x, g=x["a"], use_gate_in_kernel=True, A_log=x["A_log"]), _call(op, x, g=no_bias))
    _close(_call(op, x, g=x["a"], A_log=x["A_log"]), _call(op, x, g=no_bias))      # fla's A_log alone


@pytest.mark.parametrize("op", OPS)
def test_allow_neg_eigval_doubles_the_sigmoid(op):
    x = _inputs()
    _close(_call(op, x, beta=x["b"], use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                 output_final_state=True),
           _call(op, x, beta=2 * x["b"].sigmoid(), output_final_state=True))


def test_chunk_size_and_varlen_hints_accepted_without_changing_the_result():
    x = _inputs(B=1, T=40)
    cu = torch.tensor([0, 13, 13, 40])
    ref = _call("chunk", x, cu_seqlens=cu, output_final_state=True)
    for c in (16, 32, 64):
        _close(_call("chunk", x, cu_seqlens=cu, output_final_state=True, chunk_size=c), ref)
    _close(_call("chunk", x, cu_seqlens=cu, output_final_state=True, cu_seqlens_cpu=cu.clone(),
                 chunk_indices=torch.zeros(2, 2, dtype=torch.long), head_first=False), ref)


def test_recurrent_g_and_beta_optional():
    x = _inputs(T=6)
    B, T, HV = x["v"].shape[:3]
    zeros, ones = torch.zeros(B, T, HV, dtype=torch.float64), torch.ones(B, T, HV, dtype=torch.float64)
    _close(fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], backend="torch", output_final_state=True),
           _call("recurrent", x, g=zeros, beta=ones, output_final_state=True))
    _close(fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], backend="torch"),
           _call("recurrent", x, beta=ones))


REJECTED = [
    ("chunk", dict(head_first=True), "transpose"),
    ("chunk", dict(chunk_size=128), "16, 32 or 64"),
    ("chunk", dict(cp_context=object()), "linattn.parallel"),
    ("chunk", dict(chunk_indices=torch.zeros(1, 2, dtype=torch.long)), "cu_seqlens"),
    ("chunk", dict(cu_seqlens_cpu=torch.tensor([0, 21])), "cu_seqlens"),
    ("chunk", dict(state_v_first=True, transpose_state_layout=True), "not both"),
    ("chunk", dict(allow_neg_eigval=True), "use_beta_sigmoid_in_kernel"),
    ("chunk", dict(use_gate_in_kernel=True), "A_log"),
    ("chunk", dict(use_gate_in_kernel=False, A_log=torch.zeros(4, dtype=torch.float64)), "use_gate_in_kernel"),
    ("recurrent", dict(gk=torch.zeros(2, 21, 4, 8)), "per-channel"),
    ("recurrent", dict(gv=torch.zeros(2, 21, 4, 6)), "per-channel"),
    ("recurrent", dict(allow_neg_eigval=True), "use_beta_sigmoid_in_kernel"),
]


@pytest.mark.parametrize("op, kw, match", REJECTED, ids=[f"{op}-{'-'.join(kw)}" for op, kw, _ in REJECTED])
def test_keywords_linattn_cannot_honour_are_rejected_with_advice(op, kw, match):
    with pytest.raises(ValueError, match=match):
        _call(op, _inputs(), **kw)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError):
        _call("chunk", _inputs(), chunk_sizes=64)
