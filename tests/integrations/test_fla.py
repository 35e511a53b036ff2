"""linattn inside fla (flash-linear-attention 0.6): the op adapters behind ``patch_fla``, fla's own GatedDeltaNet layer
routed to linattn, and fla's layer weights loaded into linattn's layer. Skips without fla.

fla's GDN kernels do not run on a CPU (not even under the Triton interpreter), so on the CPU "unpatched fla" is fla's
layer with its two op names bound to :func:`fla_reference`: fla's own token loop (``naive_recurrent_gated_delta_rule``)
and gate (``naive_gdn_gate``) with the pre-processing fla's docstrings define (L2 norm, sigmoid, 2·sigmoid, state
layout, grouped heads, packed sequences). fla's convolution and gated norm kernels do run under the interpreter, so
everything else in fla's layer is fla's code. On a GPU, :func:`test_patched_fla_matches_unpatched_fla_on_gpu`
compares with fla's real kernels.
"""
import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fla.ops.gated_delta_rule", reason="fla is not installed (pip install flash-linear-attention)")

import fla.ops.gated_delta_rule as fla_ops  # noqa: E402
from fla.ops.gated_delta_rule import naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.gated_delta_rule.gate import naive_gdn_gate  # noqa: E402

from linattn.integrations import fla as linattn_fla  # noqa: E402

# fp32 everywhere: linattn's chunked / recurrent ops against fla's fp32 token loop
TOL = dict(atol=3e-5, rtol=3e-5)


def fla_reference(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                  state_v_first=False, cu_seqlens=None, use_gate_in_kernel=False, A_log=None, dt_bias=None, **_):
    """fla's ops as its docstrings define them, on fla's torch reference (a token loop in fp32)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt(x.float().square().sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    g = torch.zeros(B, T, HV) if g is None else g
    if use_gate_in_kernel:
        g = naive_gdn_gate(g, A_log, dt_bias)
    beta = torch.ones(B, T, HV) if beta is None else beta
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid() * (2 if allow_neg_eigval else 1)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    h0 = initial_state
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2)
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, s, e) for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    outs, states = [], []
    for n, (b, s, e) in enumerate(bounds):
        o, ht = naive_recurrent_gated_delta_rule(
            q[b:b + 1, s:e], k[b:b + 1, s:e], v[b:b + 1, s:e], beta[b:b + 1, s:e], g[b:b + 1, s:e], scale=scale,
            initial_state=None if h0 is None else h0[n:n + 1], output_final_state=True)
        outs.append(o)
        states.append(ht)
    o = torch.cat(outs, dim=0 if cu_seqlens is None else 1)
    ht = torch.cat(states)
    if state_v_first:
        ht = ht.transpose(-1, -2)
    return o, (ht if output_final_state else None)


@pytest.fixture
def patched():
    linattn_fla.patch_fla()
    yield
    linattn_fla.unpatch_fla()


def _inputs(B=2, T=37, H=2, HV=4, K=16, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    # unit keys, as fla's examples use them: with β up to 2 (allow_neg_eigval) the recurrence stays bounded
    return dict(q=r(B, T, H, K), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, HV, V), g=r(B, T, HV),
                beta=r(B, T, HV), A_log=r(HV) * 0.5, dt_bias=r(HV), h0=r(B, HV, K, V), h0_vk=r(B, HV, V, K))


# id -> (fla keyword arguments built from _inputs(), B). One row per keyword family fla's layers and users pass.
def _case(name, x):
    gate = F.logsigmoid(x["g"])
    return {
        "plain": dict(g=gate, beta=x["beta"].sigmoid()),
        "state": dict(g=gate, beta=x["beta"].sigmoid(), initial_state=x["h0"], output_final_state=True),
        "fla-layer": dict(g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                          use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], state_v_first=True,
                          initial_state=x["h0_vk"], output_final_state=True),
        "neg-eigval": dict(g=gate, beta=x["beta"], use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                           output_final_state=True),
        "A_log-no-dt_bias": dict(g=x["g"], beta=x["beta"].sigmoid(), use_gate_in_kernel=True, A_log=x["A_log"]),
        "transpose_state_layout": dict(g=gate, beta=x["beta"].sigmoid(), transpose_state_layout=True,
                                       initial_state=x["h0_vk"], output_final_state=True),
    }[name]


CASES = ["plain", "state", "fla-layer", "neg-eigval", "A_log-no-dt_bias", "transpose_state_layout"]


@pytest.mark.parametrize("op_name", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("case", CASES)
def test_patched_op_matches_fla_reference(op_name, case, patched):
    x = _inputs()
    kw = _case(case, x)
    kind = "chunk" if op_name.startswith("chunk") else "recurrent"
    calls = linattn_fla.CALLS[kind]
    o, ht = getattr(fla_ops, op_name)(x["q"], x["k"], x["v"], **kw)
    assert linattn_fla.CALLS[kind] == calls + 1
    kw.pop("transpose_state_layout", None) and kw.update(state_v_first=True)
    o_ref, ht_ref = fla_reference(x["q"], x["k"], x["v"], **kw)
    torch.testing.assert_close(o, o_ref, **TOL)
    if kw.get("output_final_state"):
        assert ht.is_contiguous()
        torch.testing.assert_close(ht, ht_ref, **TOL)
    else:
        assert ht is None


@pytest.mark.parametrize("op_name", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_patched_op_packed_sequences(op_name, patched):
    x = _inputs(B=1, T=40)
    cu = torch.tensor([0, 9, 9, 40])
    h0 = torch.randn(3, 4, 8, 16)
    extra = dict(cu_seqlens_cpu=cu.clone(), chunk_indices=torch.zeros(1, 2, dtype=torch.long)) \
        if op_name.startswith("chunk") else {}
    kw = dict(g=F.logsigmoid(x["g"]), beta=x["beta"], use_beta_sigmoid_in_kernel=True, initial_state=h0,
              output_final_state=True, state_v_first=True, cu_seqlens=cu)
    o, ht = getattr(fla_ops, op_name)(x["q"], x["k"], x["v"], **kw, **extra)
    o_ref, ht_ref = fla_reference(x["q"], x["k"], x["v"], **kw)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


def test_patched_recurrent_without_g_and_beta(patched):
    x = _inputs(T=5)
    o, ht = fla_ops.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], output_final_state=True)
    o_ref, ht_ref = fla_reference(x["q"], x["k"], x["v"], output_final_state=True)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)


@pytest.mark.parametrize("op_name, kw, match", [
    ("chunk_gated_delta_rule", dict(head_first=True), "transpose"),
    ("chunk_gated_delta_rule", dict(chunk_size=48), "16, 32 or 64"),
    ("chunk_gated_delta_rule", dict(cp_context=object()), "linattn.parallel"),
    ("chunk_gated_delta_rule", dict(allow_neg_eigval=True), "use_beta_sigmoid_in_kernel"),
    ("fused_recurrent_gated_delta_rule", dict(gk=torch.zeros(2, 37, 4, 16)), "per-channel"),
    ("fused_recurrent_gated_delta_rule", dict(gv=torch.zeros(2, 37, 4, 8)), "per-channel"),
    ("fused_recurrent_gated_delta_rule", dict(use_gate_in_kernel=True), "A_log"),
], ids=["head_first", "chunk_size", "cp_context", "neg-eigval-without-sigmoid", "gk", "gv", "gate-without-A_log"])
def test_patched_op_rejects_what_it_cannot_honour(op_name, kw, match, patched):
    x = _inputs()
    with pytest.raises(ValueError, match=match):
        getattr(fla_ops, op_name)(x["q"], x["k"], x["v"], g=F.logsigmoid(x["g"]), beta=x["beta"].sigmoid(), **kw)


def test_chunk_size_does_not_change_the_result(patched):
    x = _inputs()
    kw = _case("plain", x)
    base, _ = fla_ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], **kw)
    for c in (16, 32, 64):
        o, _ = fla_ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], chunk_size=c, **kw)
        torch.testing.assert_close(o, base, rtol=0, atol=0)


def test_patch_and_unpatch_swap_every_binding():
    originals = fla_ops.chunk_gated_delta_rule, fla_ops.fused_recurrent_gated_delta_rule
    n = linattn_fla.patch_fla()
    assert n >= 4
    try:
        assert linattn_fla.is_patched()
        assert fla_ops.chunk_gated_delta_rule.__wrapped__ is linattn_fla.chunk_gated_delta_rule
        assert fla_ops.chunk_gdn is fla_ops.chunk_gated_delta_rule
        assert fla_ops.fused_recurrent_gated_delta_rule.__wrapped__ is linattn_fla.fused_recurrent_gated_delta_rule
        for name, mod in list(sys.modules.items()):
            if name.startswith("fla.") and mod is not None:
                assert getattr(mod, "chunk_gated_delta_rule", None) is not originals[0], name
        assert linattn_fla.patch_fla(backend="reference") == n    # a second call rebinds the same names
        assert fla_ops.chunk_gated_delta_rule._linattn_fla_original is originals[0]
        # a module that imports the ops after the patch binds the adapters; unpatch_fla restores it too
        late = type(sys)("fla.late_import_for_test")
        late.chunk_gated_delta_rule = fla_ops.chunk_gated_delta_rule
        sys.modules[late.__name__] = late
    finally:
        assert linattn_fla.unpatch_fla() == n + 1
        sys.modules.pop("fla.late_import_for_test", None)
    assert not linattn_fla.is_patched()
    assert late.chunk_gated_delta_rule is originals[0]
    assert (fla_ops.chunk_gated_delta_rule, fla_ops.fused_recurrent_gated_delta_rule) == originals


# ----------------------------------------------------------------------------------------------- fla's layer
@pytest.fixture
def fla_layers(monkeypatch):
    """fla's layer module. The interpreter has no benchmarker, so fla's autotuned convolution / norm kernels take
    their first config (all compute the same values)."""
    gdn = pytest.importorskip("fla.layers.gated_deltanet", reason="fla's layers need flash-linear-attention")
    import triton.runtime.autotuner as autotuner
    monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *a, config=None, **k: [0.0, 0.0, 0.0])
    return gdn


@contextlib.contextmanager
def unpatched_fla():
    """fla's layer with its GDN ops bound to fla_reference: "unpatched fla" on a CPU."""
    gdn = sys.modules["fla.layers.gated_deltanet"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gdn, "chunk_gated_delta_rule", fla_reference)
        mp.setattr(gdn, "fused_recurrent_gated_delta_rule", fla_reference)
        yield


def _fla_layer(gdn, **kw):
    torch.manual_seed(0)
    # fla's defaults (expand_v=2, norm_eps=1e-5, swish gate) at a small size, grouped value heads
    return gdn.GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, layer_idx=0, **kw)


LAYER_CASES = {"default": {}, "conv-bias-neg-eigval": dict(conv_bias=True, allow_neg_eigval=True),
               "no-gate": dict(use_gate=False)}


@pytest.mark.parametrize("case", LAYER_CASES.values(), ids=LAYER_CASES.keys())
def test_fla_layer_patched_equals_unpatched(case, fla_layers):
    layer = _fla_layer(fla_layers, **case)
    x = torch.randn(2, 70, 32)
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, :9] = 0                                   # left padding: fla unpads to packed sequences
    with unpatched_fla():
        ref_train = layer(x, attention_mask=mask)[0]  # grad enabled: chunk mode
        with torch.no_grad():
            ref_eval = layer.eval()(x[:, :20])[0]     # short, eval: fused_recurrent mode
    layer.train()
    linattn_fla.patch_fla()
    try:
        calls = dict(linattn_fla.CALLS)
        out_train = layer(x, attention_mask=mask)[0]
        with torch.no_grad():
            out_eval = layer.eval()(x[:, :20])[0]
        assert linattn_fla.CALLS["chunk"] == calls["chunk"] + 1
        assert linattn_fla.CALLS["recurrent"] == calls["recurrent"] + 1
    finally:
        linattn_fla.unpatch_fla()
    torch.testing.assert_close(out_train, ref_train, **TOL)
    torch.testing.assert_close(out_eval, ref_eval, **TOL)


def test_fla_layer_decode_with_cache_patched_equals_unpatched(fla_layers):
    from fla.models.cache_utils import FLACache
    layer = _fla_layer(fla_layers).eval()
    x = torch.randn(2, 12, 32)

    def prefill_then_decode():
        cache = FLACache()
        with torch.no_grad():
            outs = [layer(x[:, :9], past_key_values=cache, use_cache=True)[0]]
            for t in range(9, 12):
                outs.append(layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
        return torch.cat(outs, 1), cache[0]["recurrent_state"]

    with unpatched_fla():
        ref, ref_state = prefill_then_decode()
    linattn_fla.patch_fla()
    try:
        out, state = prefill_then_decode()
    finally:
        linattn_fla.unpatch_fla()
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(state, ref_state, **TOL)


@pytest.mark.parametrize("case", LAYER_CASES.values(), ids=LAYER_CASES.keys())
def test_linattn_layer_from_fla_weights_matches_fla_layer(case, fla_layers):
    fla_layer = _fla_layer(fla_layers, **case)
    layer = linattn_fla.gated_deltanet_from_fla(fla_layer)
    assert layer.head_v_dim == 16 and layer.o_norm.eps == 1e-5         # fla's expand_v=2 and norm_eps, read
    x = torch.randn(2, 70, 32)
    with unpatched_fla():
        torch.testing.assert_close(layer(x)[0], fla_layer(x)[0], **TOL)
        fla_layer.eval()
        layer.eval()
        with torch.no_grad():
            torch.testing.assert_close(layer(x[:, :20])[0], fla_layer(x[:, :20])[0], **TOL)


def test_linattn_layer_from_fla_weights_packed_and_state(fla_layers):
    from fla.models.cache_utils import FLACache
    fla_layer = _fla_layer(fla_layers).eval()
    layer = linattn_fla.gated_deltanet_from_fla(fla_layer).eval()
    x = torch.randn(1, 30, 32)
    cu = torch.tensor([0, 11, 30])
    cache = FLACache()
    with torch.no_grad(), unpatched_fla():
        ref = fla_layer(x, past_key_values=cache, use_cache=True, cu_seqlens=cu)[0]
        out, state = layer(x, output_state=True, cu_seqlens=cu)
    torch.testing.assert_close(out, ref, **TOL)
    # fla keeps the recurrent state V-first ([N, HV, V, K]) in its layer
    torch.testing.assert_close(state.recurrent, cache[0]["recurrent_state"].transpose(-1, -2), **TOL)


def test_fla_signature_layer_with_padding_mask_and_cache(fla_layers):
    from fla.models.cache_utils import FLACache
    fla_layer = _fla_layer(fla_layers).eval()
    layer = linattn_fla.gated_deltanet_from_fla(fla_layer, fla_forward=True).eval()
    x = torch.randn(2, 14, 32)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    outs = []
    for mod in (fla_layer, layer):
        cache = FLACache()
        with torch.no_grad(), unpatched_fla():
            o = [mod(x[:, :10], attention_mask=mask, past_key_values=cache, use_cache=True)[0]]
            for t in range(10, 14):
                o.append(mod(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
        outs.append((torch.cat(o, 1), cache[0]))
    (ref, ref_cache), (out, cache) = outs
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(cache["recurrent_state"], ref_cache["recurrent_state"], **TOL)
    for a, b in zip(cache["conv_state"], ref_cache["conv_state"]):
        torch.testing.assert_close(a[..., 1:], b[..., 1:], **TOL)     # the oldest column never enters an output


def test_fla_model_with_linattn_layers(fla_layers):
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    torch.manual_seed(0)
    config = GatedDeltaNetConfig(hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, vocab_size=50,
                                 fuse_cross_entropy=False, fuse_norm=False, fuse_swiglu=False)
    model = GatedDeltaNetForCausalLM(config).eval()
    fla_state = model.state_dict()
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), unpatched_fla():
        ref = model(ids).logits
        ref_tokens = model.generate(ids[:, :5], attention_mask=torch.ones(2, 5), max_new_tokens=3, do_sample=False)
    assert linattn_fla.replace_fla_layers(model) == 2
    assert all(isinstance(layer.attn, linattn_fla.FlaGatedDeltaNet) for layer in model.model.layers)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, **TOL)
        tokens = model.generate(ids[:, :5], attention_mask=torch.ones(2, 5), max_new_tokens=3, do_sample=False)
    assert torch.equal(tokens, ref_tokens)
    model.load_state_dict(fla_state)                  # fla's checkpoint names load into the swapped model


def test_convert_fla_state_dict_concatenates_the_three_convolutions():
    w = {p: torch.randn(d, 1, 4) for p, d in (("q", 6), ("k", 6), ("v", 10))}
    sd = {f"model.layers.0.attn.{p}_conv1d.weight": t for p, t in w.items()}
    sd["model.layers.0.attn.A_log"] = torch.zeros(2)
    out = linattn_fla.convert_fla_state_dict(sd)
    assert sorted(out) == ["model.layers.0.attn.A_log", "model.layers.0.attn.conv1d.weight"]
    torch.testing.assert_close(out["model.layers.0.attn.conv1d.weight"], torch.cat([w["q"], w["k"], w["v"]]))
    del sd["model.layers.0.attn.v_conv1d.weight"]
    with pytest.raises(ValueError, match="v_conv1d"):
        linattn_fla.convert_fla_state_dict(sd)


def test_gated_deltanet_from_fla_rejects_other_modules_and_sigmoid_gate(fla_layers):
    with pytest.raises(TypeError, match="GatedDeltaNet"):
        linattn_fla.gated_deltanet_from_fla(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="sigmoid"):
        linattn_fla.gated_deltanet_from_fla(_fla_layer(fla_layers, output_gate_activation="sigmoid"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need a GPU")
def test_patched_fla_matches_unpatched_fla_on_gpu():
    from fla.layers import GatedDeltaNet
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=256, head_dim=64, num_heads=2, num_v_heads=4, layer_idx=0).cuda()
    x = torch.randn(2, 300, 256, device="cuda")
    ref = layer(x)[0]
    with torch.no_grad():
        ref_eval = layer.eval()(x[:, :40])[0]
    layer.train()
    linattn_fla.patch_fla()
    try:
        out = layer(x)[0]
        with torch.no_grad():
            out_eval = layer.eval()(x[:, :40])[0]
    finally:
        linattn_fla.unpatch_fla()
    # fp32 inputs through two sets of tf32-free kernels: the chunked orders differ
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(out_eval, ref_eval, atol=2e-4, rtol=2e-4)
