"""RMSNorm, GatedRMSNorm, ShortConvolution and SlidingWindowAttention against explicit formulas."""
import math

import pytest
import torch
import torch.nn.functional as F

from linattn.layers import GatedRMSNorm, RMSNorm, ShortConvolution, SlidingWindowAttention

TOL = {
    "norm": (1e-6, 1e-5),
    "conv": (1e-6, 1e-5),
    "attn": (2e-6, 1e-5),
    "half": (2e-3, 2e-3),
}


def _close(a, b, key):
    atol, rtol = TOL[key]
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------------- norms
def test_rmsnorm_formula():
    n = RMSNorm(40, eps=1e-5)
    n.weight.data = torch.randn(40)
    x = torch.randn(3, 7, 40)
    _close(n(x), n.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), "norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gated_rmsnorm_is_norm_then_silu_gate(dtype):
    n = GatedRMSNorm(24, eps=1e-6)
    n.weight.data = torch.randn(24)
    x, z = torch.randn(2, 5, 3, 24), torch.randn(2, 5, 3, 24)
    want = n.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * F.silu(z)
    got = n.to(dtype)(x.to(dtype), z.to(dtype))
    assert got.dtype == dtype
    _close(got.float(), want, "norm" if dtype == torch.float32 else "half")


def test_norm_shape_errors():
    with pytest.raises(ValueError, match="last dim"):
        RMSNorm(8)(torch.randn(2, 7))
    with pytest.raises(ValueError, match="one shape"):
        GatedRMSNorm(8)(torch.randn(2, 8), torch.randn(3, 8))


# ---------------------------------------------------------------------------------------------------- convolution
def _conv_loop(x, conv, state=None):
    """y_t = act(b + Σ_j w[:, j] · x_{t − (W − 1) + j}), with x before the start taken from the state (or 0)."""
    B, T, D = x.shape
    W = conv.kernel_size
    prev = torch.zeros(B, D, W - 1) if state is None else state
    xs = torch.cat([prev.transpose(1, 2), x], 1)
    ys = []
    for t in range(T):
        y = (xs[:, t:t + W] * conv.weight[:, 0].T[None]).sum(1)
        if conv.bias is not None:
            y = y + conv.bias
        ys.append(F.silu(y) if conv.activation == "silu" else y)
    return torch.stack(ys, 1), xs[:, T:].transpose(1, 2)


CONV_CASES = {"W4-silu": dict(kernel_size=4), "W2-bias-linear": dict(kernel_size=2, bias=True, activation=None),
              "W1": dict(kernel_size=1)}


@pytest.mark.parametrize("kw", CONV_CASES.values(), ids=CONV_CASES.keys())
def test_conv_matches_loop_with_and_without_state(kw):
    conv = ShortConvolution(12, **kw)
    if conv.bias is not None:
        conv.bias.data = torch.randn(12)
    x = torch.randn(2, 9, 12)
    state = torch.randn(2, 12, conv.kernel_size - 1)
    with torch.no_grad():
        for st in (None, state):
            y, s = conv(x, state=st, output_state=True)
            y_ref, s_ref = _conv_loop(x, conv, st)
            _close(y, y_ref, "conv")
            _close(s, s_ref, "conv")


@pytest.mark.parametrize("kw", CONV_CASES.values(), ids=CONV_CASES.keys())
def test_conv_packed_equals_separate(kw):
    conv = ShortConvolution(12, **kw)
    lens = [1, 2, 7, 4]
    xs = [torch.randn(1, n, 12) for n in lens]
    states = [torch.randn(1, 12, conv.kernel_size - 1) for _ in lens]
    with torch.no_grad():
        for st in (None, states):
            y, s = conv(torch.cat(xs, 1), state=None if st is None else torch.cat(st), output_state=True,
                        cu_seqlens=_cu(lens))
            cu = _cu(lens)
            for i, x in enumerate(xs):
                yi, si = conv(x, state=None if st is None else st[i], output_state=True)
                _close(y[:, cu[i]:cu[i + 1]], yi, "conv")
                _close(s[i:i + 1], si, "conv")


def test_conv_state_shape_error():
    with pytest.raises(ValueError, match="conv state"):
        ShortConvolution(12)(torch.randn(2, 5, 12), state=torch.randn(2, 12, 4))


# ------------------------------------------------------------------------------------------------------ attention
def _attention_loop(layer, x):
    """softmax(q·k/√d) over keys s with t − window < s ≤ t, token by token, GQA by explicit head mapping."""
    B, T, _ = x.shape
    H, Hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = layer.q_proj(x).unflatten(-1, (H, d))
    k = layer.k_proj(x).unflatten(-1, (Hkv, d))
    v = layer.v_proj(x).unflatten(-1, (Hkv, d))
    if layer.q_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    inv = [1.0 / layer.rope_theta ** (2 * i / d) for i in range(d // 2)]

    def rope(u, p):
        out = u.clone()
        for i, f in enumerate(inv):
            c, s = math.cos(p * f), math.sin(p * f)
            out[..., i] = u[..., i] * c - u[..., i + d // 2] * s
            out[..., i + d // 2] = u[..., i + d // 2] * c + u[..., i] * s
        return out

    q = torch.stack([rope(q[:, t], t) for t in range(T)], 1)
    k = torch.stack([rope(k[:, t], t) for t in range(T)], 1)
    o = torch.zeros(B, T, H, d)
    for t in range(T):
        lo = 0 if layer.window_size is None else max(0, t - layer.window_size + 1)
        for h in range(H):
            kh = k[:, lo:t + 1, h // (H // Hkv)]
            p = torch.softmax((kh @ q[:, t, h, :, None])[..., 0] / math.sqrt(d), -1)
            o[:, t, h] = (p[..., None] * v[:, lo:t + 1, h // (H // Hkv)]).sum(1)
    return layer.o_proj(o.flatten(-2))


ATTN_CASES = {
    "window5-gqa": dict(num_heads=4, num_kv_heads=2, window_size=5),
    "full-mha-noqknorm": dict(num_heads=2, window_size=None, qk_norm=False),
    "window1": dict(num_heads=2, num_kv_heads=1, window_size=1),
}


@pytest.mark.parametrize("kw", ATTN_CASES.values(), ids=ATTN_CASES.keys())
def test_attention_matches_loop_and_decode(kw):
    layer = SlidingWindowAttention(32, **kw).eval()
    x = torch.randn(2, 13, 32)
    with torch.no_grad():
        y, _ = layer(x)
        _close(y, _attention_loop(layer, x), "attn")
        # prefill 6, then one token at a time
        y0, st = layer(x[:, :6], output_state=True)
        ys = [y0]
        for t in range(6, 13):
            yt, st = layer(x[:, t:t + 1], state=st, output_state=True)
            ys.append(yt)
    _close(torch.cat(ys, 1), y, "attn")
    if layer.window_size is not None:
        assert st.key.shape[2] == layer.window_size - 1, "the sliding-window cache must stay at window − 1 keys"


def test_attention_packed_equals_separate():
    layer = SlidingWindowAttention(32, num_heads=4, num_kv_heads=2, window_size=4).eval()
    lens = [3, 1, 9]
    xs = [torch.randn(1, n, 32) for n in lens]
    with torch.no_grad():
        y, _ = layer(torch.cat(xs, 1), cu_seqlens=_cu(lens))
        cu = _cu(lens)
        for i, x in enumerate(xs):
            _close(y[:, cu[i]:cu[i + 1]], layer(x)[0], "attn")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_matches_sdpa():
    a = SlidingWindowAttention(32, num_heads=4, num_kv_heads=2, window_size=5).eval()
    b = SlidingWindowAttention(32, num_heads=4, num_kv_heads=2, window_size=5, attn_backend="flex").eval()
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 20, 32)
    cu = _cu([7, 13])
    with torch.no_grad():
        _close(b(x)[0], a(x)[0], "attn")
        _close(b(x, cu_seqlens=cu)[0], a(x, cu_seqlens=cu)[0], "attn")


def test_attention_bad_arguments():
    with pytest.raises(ValueError, match="num_kv_heads"):
        SlidingWindowAttention(32, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="window_size"):
        SlidingWindowAttention(32, num_heads=4, window_size=0)
    with pytest.raises(ValueError, match="packed"):
        SlidingWindowAttention(32, num_heads=4)(torch.randn(1, 4, 32), output_state=True, cu_seqlens=_cu([4]))
