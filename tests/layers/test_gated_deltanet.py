"""GatedDeltaNet layer: chunked vs token-by-token decode, packed vs separate sequences, gradients, references."""
import pytest
import torch

from linattn.layers import GatedDeltaNet, GatedDeltaNetState

# (atol, rtol) per comparison; fp32 layers on the torch backend
TOL = {
    "modes": (2e-5, 2e-5),       # chunked vs recurrent decode: same math, different summation order
    "varlen": (2e-5, 2e-5),      # packed vs separate sequences
    "reference": (1e-10, 1e-10),  # fp64 chunked backend vs the fp64 token-by-token reference backend
}

# id -> layer kwargs, T. Odd sizes on purpose: T=1, T not a multiple of the chunk (64), grouped value heads,
# V != K, no conv, no gate, β ∈ (0, 2).
CASES = {
    "H2-K16-T37": (dict(num_heads=2, head_dim=16), 37),
    "T1": (dict(num_heads=2, head_dim=16), 1),
    "gva-H2-HV4-V24-T70": (dict(num_heads=2, head_dim=16, num_v_heads=4, expand_v=1.5), 70),
    "negeig-noconv-T40": (dict(num_heads=2, head_dim=16, allow_neg_eigval=True, use_short_conv=False), 40),
    "nogate-conv3-bias-T33": (dict(num_heads=1, head_dim=32, use_gate=False, conv_size=3, conv_bias=True), 33),
}
D = 48


def _layer(kw, **extra):
    return GatedDeltaNet(hidden_size=D, **kw, **extra).eval()


def _close(a, b, key):
    atol, rtol = TOL[key]
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_chunk_matches_token_by_token_decode(case):
    kw, T = case
    chunk, rec = _layer(kw, mode="chunk"), _layer(kw, mode="recurrent")
    rec.load_state_dict(chunk.state_dict())
    x = torch.randn(2, T, D)
    with torch.no_grad():
        y, s = chunk(x, output_state=True)
        state, ys = None, []
        for t in range(T):
            yt, state = rec(x[:, t:t + 1], state=state, output_state=True)
            ys.append(yt)
    _close(torch.cat(ys, 1), y, "modes")
    _close(state.recurrent, s.recurrent, "modes")
    if s.conv is not None:
        _close(state.conv, s.conv, "modes")


def test_prefill_then_decode_matches_one_pass():
    kw, T = CASES["gva-H2-HV4-V24-T70"]
    layer = _layer(kw)                      # mode="auto": 65 tokens run chunked, single tokens recurrent
    x = torch.randn(2, T, D)
    with torch.no_grad():
        y, _ = layer(x)
        y1, state = layer(x[:, :65], output_state=True)
        ys = [y1]
        for t in range(65, T):
            yt, state = layer(x[:, t:t + 1], state=state, output_state=True)
            ys.append(yt)
    _close(torch.cat(ys, 1), y, "modes")


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "given-state"])
@pytest.mark.parametrize("case", [CASES["gva-H2-HV4-V24-T70"], CASES["nogate-conv3-bias-T33"]],
                         ids=["gva", "conv3"])
def test_packed_sequences_equal_separate(case, with_state):
    kw, _ = case
    layer = _layer(kw, mode="chunk")
    lens = [5, 1, 66, 2]   # a 1-token sequence is shorter than the conv window, a 66-token one spans two chunks
    xs = [torch.randn(1, n, D) for n in lens]
    states = [None] * len(lens)
    if with_state:
        with torch.no_grad():
            states = [layer(torch.randn(1, 3, D), output_state=True)[1] for _ in lens]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    packed_state = None
    if with_state:
        conv = None if states[0].conv is None else torch.cat([s.conv for s in states])
        packed_state = GatedDeltaNetState(conv=conv, recurrent=torch.cat([s.recurrent for s in states]))
    with torch.no_grad():
        y, s = layer(torch.cat(xs, 1), state=packed_state, output_state=True, cu_seqlens=cu)
        for i, (x, st) in enumerate(zip(xs, states)):
            yi, si = layer(x, state=st, output_state=True)
            _close(y[:, cu[i]:cu[i + 1]], yi, "varlen")
            _close(s.recurrent[i:i + 1], si.recurrent, "varlen")
            if si.conv is not None:
                _close(s.conv[i:i + 1], si.conv, "varlen")


def test_gradients_reach_every_parameter():
    kw, T = CASES["gva-H2-HV4-V24-T70"]
    layer = GatedDeltaNet(hidden_size=D, **kw, allow_neg_eigval=True, conv_bias=True).train()
    x = torch.randn(2, T, D, requires_grad=True)
    state0 = GatedDeltaNetState(conv=torch.randn(2, layer.conv1d.hidden_size, 3),
                                recurrent=torch.randn(2, 4, 16, 24))
    y, s = layer(x, state=state0, output_state=True)
    (y * torch.randn_like(y)).sum().add((s.recurrent * torch.randn_like(s.recurrent)).sum()).backward()
    for name, p in [("input", x), *layer.named_parameters()]:
        assert p.grad is not None, f"no gradient reached {name}"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"gradient of {name} is zero or not finite"


def test_parameter_gradients_match_float64_reference():
    # the torch backend's hand-written backward vs plain autograd through the token-by-token fp64 reference
    kw, T = CASES["gva-H2-HV4-V24-T70"]
    a = GatedDeltaNet(hidden_size=D, **kw, mode="chunk", backend="torch").double()
    b = GatedDeltaNet(hidden_size=D, **kw, mode="chunk", backend="reference").double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, T, D, dtype=torch.float64)
    w = torch.randn(1, T, D, dtype=torch.float64)
    (a(x)[0] * w).sum().backward()
    (b(x)[0] * w).sum().backward()
    _close(a(x)[0], b(x)[0], "reference")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=TOL["reference"][0], rtol=TOL["reference"][1], msg=name)


def test_inputs_are_not_modified():
    kw, T = CASES["H2-K16-T37"]
    layer = _layer(kw)
    x = torch.randn(2, T, D)
    state = GatedDeltaNetState(conv=torch.randn(2, layer.conv1d.hidden_size, 3), recurrent=torch.randn(2, 2, 16, 16))
    copies = [t.clone() for t in (x, state.conv, state.recurrent)]
    with torch.no_grad():
        layer(x, state=state, output_state=True)
    for before, after in zip(copies, (x, state.conv, state.recurrent)):
        assert torch.equal(before, after)


def test_half_precision_runs():
    layer = _layer(CASES["H2-K16-T37"][0]).to(torch.float16)
    with torch.no_grad():
        y, s = layer(torch.randn(1, 20, D, dtype=torch.float16), output_state=True)
    assert y.dtype == torch.float16 and s.recurrent.dtype == torch.float32 and torch.isfinite(y).all()


@pytest.mark.parametrize("make, call, err, match", [
    (dict(num_heads=3, num_v_heads=4), None, ValueError, "multiple"),
    (dict(expand_v=0.3), None, ValueError, "expand_v"),
    (dict(mode="fast"), None, ValueError, "mode"),
    ({}, dict(x=(2, 5, 7)), ValueError, "hidden_size"),
    ({}, dict(x=(2, 5, D), state="s"), TypeError, "GatedDeltaNetState"),
    ({}, dict(x=(2, 5, D), cu=[0, 5]), ValueError, "batch size 1"),
], ids=["v-heads", "expand-v", "mode", "width", "state-type", "varlen-batch"])
def test_bad_arguments_raise(make, call, err, match):
    with pytest.raises(err, match=match):
        layer = GatedDeltaNet(hidden_size=D, head_dim=16, **{"num_heads": 2, **make})
        state = call.get("state")
        cu = None if call.get("cu") is None else torch.tensor(call["cu"], dtype=torch.int32)
        layer(torch.randn(*call["x"]), state=state, cu_seqlens=cu)
