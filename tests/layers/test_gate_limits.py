"""The layers at the edge of the gate's range: ``A_log = 89`` makes exp(A_log) overflow fp32, so the log decay of
that head is −inf (a full forget, a valid decay). The chunked mode must give the finite answer of the recurrent
mode and of the float64 token-by-token reference, on every head (issue 46, item 1)."""
import pytest
import torch

from linattn.layers import GatedDeltaNet, GatedLinearAttention

# fp32 layers: chunked vs recurrent / reference differ by summation order only
TOL = dict(atol=2e-5, rtol=2e-5)
D, T = 32, 70          # T over one chunk (64), so the −inf decays meet the chunk boundary


def _layer(cls, **kw):
    torch.manual_seed(0)
    layer = cls(D, num_heads=2, head_dim=8, num_v_heads=4, **kw).eval()
    with torch.no_grad():
        layer.A_log[1] = 89.0        # one head with gate −inf; the others keep their usual decays
    return layer


def _x():
    return torch.randn(2, T, D, generator=torch.Generator().manual_seed(1))


def test_gate_is_minus_inf_at_a_log_89():
    layer = _layer(GatedDeltaNet)
    a = layer.a_proj(_x())
    g = -layer.A_log.float().exp() * torch.nn.functional.softplus(a + layer.dt_bias)
    assert torch.isneginf(g[..., 1]).all() and torch.isfinite(g[..., [0, 2, 3]]).all()


@pytest.mark.parametrize("output_state", [False, True], ids=["no-state", "state"])
def test_gdn_chunk_mode_finite_and_equal_to_recurrent(output_state):
    chunk, recurrent, reference = (_layer(GatedDeltaNet, mode=m, backend=b) for m, b in
                                   (("chunk", None), ("recurrent", None), ("chunk", "reference")))
    x = _x()
    with torch.no_grad():
        o_c, s_c = chunk(x, output_state=output_state)
        o_r, s_r = recurrent(x, output_state=output_state)
        o_ref, s_ref = reference(x, output_state=output_state)
    assert torch.isfinite(o_r).all() and torch.isfinite(o_ref).all()
    torch.testing.assert_close(o_r, o_ref, **TOL)
    assert torch.isfinite(o_c).all(), f"{(~torch.isfinite(o_c)).sum().item()} non-finite outputs in chunk mode"
    torch.testing.assert_close(o_c, o_ref, **TOL)
    if output_state:
        torch.testing.assert_close(s_c.recurrent, s_ref.recurrent, **TOL)
        torch.testing.assert_close(s_r.recurrent, s_ref.recurrent, **TOL)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gdn_gradients_finite_at_a_log_89(mode):
    # where the gate is −inf its derivative is 0 (the decay is exactly 0 around it), never 0·inf
    layer = _layer(GatedDeltaNet, mode=mode).train()
    x = _x().requires_grad_()
    layer(x)[0].square().sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in layer.named_parameters():
        assert torch.isfinite(p.grad).all(), name


def test_gla_chunk_mode_finite_and_equal_to_reference():
    layer, reference = _layer(GatedLinearAttention), _layer(GatedLinearAttention, backend="reference")
    x = _x()
    with torch.no_grad():
        o, o_ref = layer(x)[0], reference(x)[0]
    assert torch.isfinite(o_ref).all()
    assert torch.isfinite(o).all(), f"{(~torch.isfinite(o)).sum().item()} non-finite outputs"
    torch.testing.assert_close(o, o_ref, **TOL)
