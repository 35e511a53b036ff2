"""HybridLM: cached decode equals one full pass, packing, save/load, tied weights, checkpointing, sampling."""
import pytest
import torch

from linattn.models import HybridConfig, HybridLM, generate, sample_next, stream_generate

TOL = {
    "decode": (2e-5, 2e-5),      # prefill + token-by-token decode vs one pass over the whole sequence (fp32)
    "packed": (2e-5, 2e-5),
    "ckpt": (1e-6, 1e-5),        # gradient checkpointing recomputes the same ops
    "compiled": (1e-5, 1e-5),    # torch.compile (aot_eager) runs the same ops, traced
}

SMALL = dict(vocab_size=50, hidden_size=64, num_layers=4, gdn_num_heads=2, gdn_head_dim=16, attn_num_heads=4,
             attn_num_kv_heads=2, window_size=6)
# id -> config overrides; the softmax-only models are the baselines `linattn train` compares against
CONFIGS = {
    "hybrid-GGS": dict(layer_pattern="GGS"),
    "gdn-gva-negeig-untied": dict(layer_pattern="G", gdn_num_v_heads=4, gdn_allow_neg_eigval=True,
                                  tie_embeddings=False),
    "gla-and-full-attn-LA": dict(layer_pattern="LA"),
    "swa-only": dict(layer_pattern="S"),
    "full-attn": dict(layer_pattern="A"),
}


def _model(**over):
    return HybridLM(HybridConfig(**{**SMALL, **over})).eval()


def _close(a, b, key):
    torch.testing.assert_close(a, b, atol=TOL[key][0], rtol=TOL[key][1])


@pytest.mark.parametrize("over", CONFIGS.values(), ids=CONFIGS.keys())
def test_cached_decode_equals_full_pass(over):
    m = _model(**over)
    x = torch.randint(0, 50, (2, 75))
    with torch.no_grad():
        full = m(x).logits
        out = m(x[:, :66], use_cache=True)       # 66 > 64: the GDN prefill runs chunked, the steps recurrent
        logits = [out.logits]
        for t in range(66, 75):
            out = m(x[:, t:t + 1], cache=out.cache, use_cache=True)
            logits.append(out.logits)
    _close(torch.cat(logits, 1), full, "decode")
    assert out.cache.seen_tokens == 75


def test_packed_batch_equals_separate():
    m = _model(layer_pattern="GGS")
    lens = [7, 1, 20]
    xs = [torch.randint(0, 50, (1, n)) for n in lens]
    cu = torch.tensor([0, 7, 8, 28])
    with torch.no_grad():
        y = m(torch.cat(xs, 1), cu_seqlens=cu).logits
        for i, x in enumerate(xs):
            _close(y[:, cu[i]:cu[i + 1]], m(x).logits, "packed")


def test_save_load_roundtrip(tmp_path):
    pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'linattn[model]')")
    for tied in (True, False):
        m = _model(layer_pattern="GS", tie_embeddings=tied)
        m.save_pretrained(tmp_path / str(tied))
        m2 = HybridLM.from_pretrained(tmp_path / str(tied)).eval()
        assert m2.config == m.config
        x = torch.randint(0, 50, (1, 9))
        with torch.no_grad():
            assert torch.equal(m(x).logits, m2(x).logits)
        assert (m2.lm_head.weight is m2.embed.weight) == tied


def test_from_pretrained_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        HybridLM.from_pretrained(tmp_path)


def test_gradient_checkpointing_gives_the_same_gradients():
    m = _model(layer_pattern="GGS").train()
    x = torch.randint(0, 50, (2, 33))
    y = torch.randint(0, 50, (2, 33))
    m(x, labels=y).loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m.set_gradient_checkpointing(True)
    m(x, labels=y).loss.backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reached {n}"
        torch.testing.assert_close(p.grad, grads[n], atol=TOL["ckpt"][0], rtol=TOL["ckpt"][1], msg=n)


def test_loss_ignores_minus_100():
    m = _model(layer_pattern="G")
    x = torch.randint(0, 50, (1, 10))
    y = x.roll(-1, 1)
    y[:, -1] = -100
    with torch.no_grad():
        out = m(x, labels=y)
        want = torch.nn.functional.cross_entropy(out.logits[0, :-1], y[0, :-1])
    _close(out.loss, want, "ckpt")


def test_greedy_generation_follows_full_pass_argmax():
    m = _model(layer_pattern="GGS")
    prompt = torch.randint(0, 50, (2, 5))
    seq = generate(m, prompt, 12, temperature=0)
    assert seq.shape == (2, 17) and torch.equal(seq[:, :5], prompt)
    with torch.no_grad():
        assert torch.equal(m(seq).logits[:, 4:-1].argmax(-1), seq[:, 5:])


def test_stream_stops_at_eos_and_restores_train_mode():
    m = _model(layer_pattern="GS").train()
    g = torch.Generator().manual_seed(1)
    first = next(stream_generate(m, torch.randint(0, 50, (1, 4)), 5, generator=g))
    toks = list(stream_generate(m, torch.randint(0, 50, (1, 4)), 50, temperature=0, eos_token_id=int(first)))
    assert len(toks) <= 50 and m.training


def test_sampling_filters():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    g = torch.Generator().manual_seed(0)
    picks = {int(sample_next(logits, 1.0, top_k=2, generator=g)) for _ in range(50)}
    assert picks == {1, 2}
    assert {int(sample_next(logits, 1.0, top_p=0.1, generator=g)) for _ in range(20)} == {1}
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0)


@pytest.mark.parametrize("bad, match", [
    (dict(layer_pattern="GX"), "layer_pattern"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_layers=True), "num_layers"),
], ids=["pattern", "width", "bool-layers"])
def test_bad_config(bad, match):
    with pytest.raises(ValueError, match=match):
        HybridConfig(**{**SMALL, **bad})


def test_compiles_without_graph_breaks():
    # fullgraph=True fails on any graph break; aot_eager traces forward and backward without a C++ compiler
    m = _model(layer_pattern="GS", num_layers=2).train()
    ids = torch.randint(0, 50, (2, 20))
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    got = compiled(ids, labels=ids)
    want = m(ids, labels=ids)
    _close(got.logits, want.logits, "ckpt")
    got.loss.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_packed_model_compiles_fullgraph():
    """Packed sequences through every layer kind under torch.compile(fullgraph=True): no graph break, same logits."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = HybridConfig(vocab_size=64, hidden_size=32, num_layers=3, layer_pattern="GLS", gdn_num_heads=2,
                          gdn_head_dim=8, attn_num_heads=2, attn_num_kv_heads=1, window_size=8)
    model = HybridLM(config)
    ids = torch.randint(0, 64, (1, 20))
    cu = torch.tensor([0, 7, 20])
    ref = model(ids, cu_seqlens=cu).logits
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    atol, rtol = TOL["compiled"]
    torch.testing.assert_close(compiled(ids, cu_seqlens=cu).logits, ref, atol=atol, rtol=rtol)
