"""The GatedDeltaNet layer on packed sequences (``cu_seqlens``) under ``torch.compile(fullgraph=True)``: traced
without a graph break, equal to eager, and bad offsets still rejected. aot_eager keeps the compile fast on a CPU
while tracing forward and backward as inductor would."""
import pytest
import torch

from linattn.layers import GatedDeltaNet, GatedDeltaNetState, GatedLinearAttention

CU = [0, 7, 7, 20]     # an empty sequence in the middle


def _layer(cls, mode):
    torch.manual_seed(0)
    return cls(32, num_heads=2, head_dim=8, num_v_heads=4, mode=mode).to(torch.float64)


@pytest.mark.parametrize("cls", [GatedDeltaNet, GatedLinearAttention], ids=["gdn", "gla"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_packed_layer_compiles_fullgraph_and_matches_eager(cls, mode):
    torch._dynamo.reset()
    layer = _layer(cls, mode)
    x = torch.randn(1, 20, 32, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor(CU)
    state = GatedDeltaNetState(conv=torch.randn(3, 2 * 16 + 32, 3, dtype=torch.float64),
                               recurrent=torch.randn(3, 4, 8, 8, dtype=torch.float64))
    ref, ref_state = layer(x, state=state, output_state=True, cu_seqlens=cu)
    ref_grad, = torch.autograd.grad(ref.square().sum(), x)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out, out_state = compiled(x, state=state, output_state=True, cu_seqlens=cu)
    out_grad, = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out_state.recurrent, ref_state.recurrent, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out_state.conv, ref_state.conv, rtol=0, atol=0)
    torch.testing.assert_close(out_grad, ref_grad, rtol=1e-10, atol=1e-10)


def test_compiled_layer_rejects_bad_offsets():
    torch._dynamo.reset()
    compiled = torch.compile(_layer(GatedDeltaNet, "chunk"), fullgraph=True, backend="aot_eager")
    x = torch.randn(1, 20, 32, dtype=torch.float64)
    compiled(x, cu_seqlens=torch.tensor([0, 7, 20]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        compiled(x, cu_seqlens=torch.tensor([0, 9, 19]))
