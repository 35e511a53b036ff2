"""gated_linear_attention (op: chunked torch path vs float64 token loop, forward and backward), GatedLinearAttention
and LinearAttention layers (decode vs chunked, packing, feature maps with gradcheck at 1e-3)."""
import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.layers import FEATURE_MAPS, GatedDeltaNetState, GatedLinearAttention, LinearAttention, make_feature_map

TOL = {
    "fp64": (1e-11, 1e-11),     # chunked fp64 vs the token-by-token fp64 reference
    "fp32": (5e-5, 5e-5),
    "layer": (2e-5, 2e-5),      # one layer, chunked vs token by token / packed vs separate (fp32)
    "gradcheck": 1e-3,          # the method's tolerance for the feature-map gradients
}

# id -> B, T, H, HV, K, V, varlen offsets. T = 1, T not a multiple of the chunk, K != V, GVA, packed sequences.
OP_CASES = {
    "B2-T70-H2-K16-V24": (2, 70, 2, 2, 16, 24, None),
    "T1": (1, 1, 1, 1, 8, 8, None),
    "gva-H1-HV3-K60-V20-T65": (1, 65, 1, 3, 60, 20, None),
    "varlen-5-0-64-7": (1, 76, 2, 4, 16, 16, [0, 5, 5, 69, 76]),
}


def _inputs(B, T, H, HV, K, V, dtype, n_state):
    return dict(q=torch.randn(B, T, H, K, dtype=dtype), k=torch.randn(B, T, H, K, dtype=dtype),
                v=torch.randn(B, T, HV, V, dtype=dtype), g=F.logsigmoid(torch.randn(B, T, HV, dtype=dtype)) * 2,
                beta=torch.rand(B, T, HV, dtype=dtype), initial_state=torch.randn(n_state, HV, K, V, dtype=dtype))


@pytest.mark.parametrize("one_chunk_blocks", [False, True], ids=["whole", "blocks-of-one-chunk"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", OP_CASES.values(), ids=OP_CASES.keys())
def test_op_forward_backward_match_reference(case, dtype, one_chunk_blocks, monkeypatch):
    """The torch backend against the float64 reference; with its blocks one chunk each (torch_chunk.BLOCK_BYTES),
    the state and dS also cross block boundaries."""
    if one_chunk_blocks:
        from linattn.ops.gated_delta import torch_chunk
        monkeypatch.setattr(torch_chunk, "BLOCK_BYTES", 1)
    B, T, H, HV, K, V, offs = case
    cu = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    x = _inputs(B, T, H, HV, K, V, dtype, B if offs is None else len(offs) - 1)
    a = {n: t.clone().requires_grad_() for n, t in x.items()}
    r = {n: t.to(torch.float64).requires_grad_() for n, t in x.items()}
    o, ht = linattn.gated_linear_attention(**a, output_final_state=True, cu_seqlens=cu)
    o_ref, ht_ref = linattn.gated_linear_attention(**r, output_final_state=True, cu_seqlens=cu, backend="reference")
    do, dht = torch.randn_like(o_ref), torch.randn_like(ht_ref)
    ((o * do.to(dtype)).sum() + (ht * dht.to(ht.dtype)).sum()).backward()
    ((o_ref * do).sum() + (ht_ref * dht).sum()).backward()
    atol, rtol = TOL["fp64" if dtype == torch.float64 else "fp32"]
    torch.testing.assert_close(o.double(), o_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(ht.double(), ht_ref, atol=atol, rtol=rtol)
    for n in x:
        torch.testing.assert_close(a[n].grad.double(), r[n].grad, atol=atol * 10, rtol=rtol * 10, msg=n)


def test_op_beta_defaults_to_one_and_inputs_untouched():
    x = _inputs(1, 20, 1, 1, 8, 8, torch.float32, 1)
    copies = {n: t.clone() for n, t in x.items()}
    o1, _ = linattn.gated_linear_attention(x["q"], x["k"], x["v"], x["g"])
    o2, _ = linattn.gated_linear_attention(x["q"], x["k"], x["v"], x["g"], torch.ones_like(x["g"]))
    assert torch.equal(o1, o2)
    assert all(torch.equal(copies[n], x[n]) for n in x)


def test_op_rejects_bad_input():
    x = _inputs(1, 4, 1, 1, 8, 8, torch.float32, 1)
    with pytest.raises(ValueError, match="no Triton"):
        linattn.gated_linear_attention(x["q"], x["k"], x["v"], x["g"], backend="triton")
    with pytest.raises(ValueError, match="g must be"):
        linattn.gated_linear_attention(x["q"], x["k"], x["v"], x["g"][:, :3])


# ------------------------------------------------------------------------------------------------------ layers
D = 32
LAYERS = {
    "gla-gva": lambda: GatedLinearAttention(D, num_heads=2, head_dim=16, num_v_heads=4),
    "linear-elu+1-normalized": lambda: LinearAttention(D, num_heads=2, feature_map="elu+1"),
    "linear-rff": lambda: LinearAttention(D, num_heads=2, feature_map="rff", num_features=24),
    "linear-block-orthogonal": lambda: LinearAttention(D, num_heads=2, feature_map="block_orthogonal"),
}


@pytest.mark.parametrize("make", LAYERS.values(), ids=LAYERS.keys())
def test_layer_chunked_equals_token_by_token_and_packed_equals_separate(make):
    layer = make().eval()
    x = torch.randn(2, 67, D)
    with torch.no_grad():
        y, s = layer(x, output_state=True)
        state, ys = None, []
        for t in range(x.shape[1]):
            yt, state = layer(x[:, t:t + 1], state=state, output_state=True)
            ys.append(yt)
        torch.testing.assert_close(torch.cat(ys, 1), y, atol=TOL["layer"][0], rtol=TOL["layer"][1])
        torch.testing.assert_close(state.recurrent, s.recurrent, atol=TOL["layer"][0], rtol=TOL["layer"][1])
        lens = [3, 30, 1]
        xs = [torch.randn(1, n, D) for n in lens]
        yp, _ = layer(torch.cat(xs, 1), cu_seqlens=torch.tensor([0, 3, 33, 34]))
        for i, (lo, xi) in enumerate(zip([0, 3, 33], xs)):
            torch.testing.assert_close(yp[:, lo:lo + lens[i]], layer(xi)[0], atol=TOL["layer"][0],
                                       rtol=TOL["layer"][1])


@pytest.mark.parametrize("make", LAYERS.values(), ids=LAYERS.keys())
def test_layer_gradients_reach_every_parameter(make):
    layer = make().train()
    x = torch.randn(2, 20, D, requires_grad=True)
    y, s = layer(x, output_state=True)
    ((y * torch.randn_like(y)).sum() + (s.recurrent * torch.randn_like(s.recurrent)).sum()).backward()
    for name, p in [("input", x), *layer.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("name", FEATURE_MAPS)
def test_feature_map_gradcheck_through_linear_attention(name):
    # fp64 finite differences vs the op's hand-written backward, w.r.t. the input and the map's own parameters
    layer = LinearAttention(8, num_heads=1, feature_map=name, num_features=6 if name in ("rff", "learnable") else None,
                            normalize=name == "elu+1").double()
    params = dict(layer.phi.named_parameters(prefix="phi"))
    names = list(params)

    def f(x, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps)), (x,))[0]

    x = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    ps = [p.detach().clone().requires_grad_() for p in params.values()]
    tol = TOL["gradcheck"]
    assert torch.autograd.gradcheck(f, (x, *ps), eps=1e-6, atol=tol, rtol=tol)


def test_feature_map_properties():
    x = torch.randn(5, 3, 16)
    assert (make_feature_map("elu+1", 16)(x) > 0).all()
    bo = make_feature_map("block_orthogonal", 16)
    assert bo.weight.shape == (4, 4, 4)
    for blk in bo.weight:
        torch.testing.assert_close(blk @ blk.T, torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(bo(x).norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)  # orthogonal: norm kept
    rff = make_feature_map("rff", 16, num_features=4096, sigma=2.0)
    assert not any(p.requires_grad for p in rff.parameters()) and "omega" in rff.state_dict()
    # random Fourier features approximate the Gaussian kernel exp(−|x − y|² / 2σ²)
    a, b = torch.randn(16) * 0.5, torch.randn(16) * 0.5
    approx = (rff(a) * rff(b)).sum()
    torch.testing.assert_close(approx, torch.exp(-(a - b).square().sum() / 8), atol=0.06, rtol=0)
    with pytest.raises(ValueError, match="divisible"):
        make_feature_map("block_orthogonal", 10)
    with pytest.raises(ValueError, match="feature_map"):
        make_feature_map("softmax", 16)


def test_gla_layer_rejects_neg_eigval_and_state_is_gdn_state():
    with pytest.raises(ValueError, match="delta rule only"):
        GatedLinearAttention(D, num_heads=2, head_dim=16, allow_neg_eigval=True)
    _, s = LinearAttention(D, num_heads=2)(torch.randn(1, 3, D), output_state=True)
    assert isinstance(s, GatedDeltaNetState) and s.recurrent.shape == (1, 2, 16, 17)
