"""Bad input gets a precise ValueError/TypeError, never a crash deep in a kernel or a silent wrong answer."""
import pytest
import torch

import linattn


def inputs(B=1, T=8, H=2, HV=4, K=16, V=8):
    return dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V),
                g=-torch.rand(B, T, HV), beta=torch.rand(B, T, HV))


BAD = [
    ("q_rank", lambda x: x.update(q=x["q"][0]), ValueError, "q must have 4 dimensions"),
    ("k_shape", lambda x: x.update(k=torch.randn(1, 8, 2, 15)), ValueError, "k must have the shape of q"),
    ("v_T", lambda x: x.update(v=torch.randn(1, 7, 4, 8)), ValueError, "v must be"),
    ("hv_not_multiple", lambda x: x.update(v=torch.randn(1, 8, 3, 8), g=torch.randn(1, 8, 3),
                                           beta=torch.rand(1, 8, 3)), ValueError, "multiple"),
    ("g_shape", lambda x: x.update(g=torch.randn(1, 8, 2)), ValueError, "g must be"),
    ("beta_shape", lambda x: x.update(beta=torch.randn(1, 8)), ValueError, "beta must have 3 dimensions"),
    ("int_q", lambda x: x.update(q=torch.ones(1, 8, 2, 16, dtype=torch.int64)), TypeError, "dtype"),
    ("mixed_dtype", lambda x: x.update(k=x["k"].double()), TypeError, "share one dtype"),
    ("not_tensor", lambda x: x.update(v=[1, 2]), TypeError, "v must be a torch.Tensor"),
    ("K_too_big", lambda x: x.update(q=torch.randn(1, 8, 2, 300), k=torch.randn(1, 8, 2, 300)), ValueError,
     "between 1 and 256"),
    ("h0_shape", lambda x: x.update(initial_state=torch.zeros(1, 4, 16, 9)), ValueError, "initial_state must be"),
    ("scale_type", lambda x: x.update(scale="0.1"), TypeError, "scale"),
    ("cu_float", lambda x: x.update(cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, "int32 or int64"),
    ("cu_start", lambda x: x.update(cu_seqlens=torch.tensor([1, 8])), ValueError, "start at 0"),
    ("cu_end", lambda x: x.update(cu_seqlens=torch.tensor([0, 7])), ValueError, "end at T=8"),
    ("cu_decreasing", lambda x: x.update(cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError, "non-decreasing"),
    ("cu_batch", lambda x: x.update(cu_seqlens=torch.tensor([0, 4, 8]), **{k: torch.cat([v, v]) for k, v in
                                                                       inputs().items()}), ValueError, "B == 1"),
    ("dt_bias_alone", lambda x: x.update(dt_bias=torch.zeros(4)), ValueError, "A_log and dt_bias go together"),
    ("A_log_shape", lambda x: x.update(A_log=torch.zeros(3), dt_bias=torch.zeros(3)), ValueError, "A_log must be"),
    ("backend_name", lambda x: x.update(backend="cuda"), ValueError, "backend must be one of"),
    ("empty_T", lambda x: x.update(**inputs(T=0)), ValueError, "at least one token"),
]


@pytest.mark.parametrize("name,mutate,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises(name, mutate, exc, msg):
    x = inputs()
    mutate(x)
    with pytest.raises(exc, match=msg):
        linattn.chunk_gated_delta_rule(**x)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        linattn.chunk_gated_delta_rule(**inputs(), backend="triton")
