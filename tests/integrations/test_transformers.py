"""transformers' Qwen3-Next / Qwen3.5 with linattn's kernels patched in agree with the unpatched models.

Tiny randomly initialised configs built in code (no download). Skipped, with the reason, without transformers.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from linattn.integrations import transformers as lt  # noqa: E402

# fp32 models: linattn's chunked/recurrent ops vs transformers' own torch loops differ by summation order only
TOL = {"logits": (2e-5, 2e-5)}

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    cfg = Qwen3NextConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32)
    return Qwen3NextForCausalLM(cfg)


def _qwen3_5():
    mod = pytest.importorskip("transformers.models.qwen3_5", reason="this transformers has no Qwen3.5")
    return mod.Qwen3_5ForCausalLM(mod.Qwen3_5TextConfig(**COMMON))


MODELS = {"qwen3-next": _qwen3_next, "qwen3.5": _qwen3_5}


def _model(make):
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():  # transformers initialises A_log, dt_bias and the norms to constants: randomise them
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")) or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_patched_logits_and_greedy_generation_agree(make):
    model = _model(make)
    ids = torch.randint(0, 96, (2, 70))          # 70 > one chunk of 64
    with torch.no_grad():
        want = model(ids).logits
        want_gen = model.generate(ids[:, :9], max_new_tokens=6, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
    calls = dict(lt.CALLS)
    assert lt.patch_model(model, backend="torch") == 3 and lt.is_patched(model)
    with torch.no_grad():
        got = model(ids).logits
        got_gen = model.generate(ids[:, :9], max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    assert lt.CALLS["chunk"] > calls["chunk"], "the patched model never called linattn's chunked op"
    assert lt.CALLS["recurrent"] > calls["recurrent"], "cached decoding never called linattn's recurrent op"
    torch.testing.assert_close(got, want, atol=TOL["logits"][0], rtol=TOL["logits"][1])
    assert torch.equal(got_gen.sequences, want_gen.sequences)
    for a, b in zip(got_gen.logits, want_gen.logits):
        torch.testing.assert_close(a, b, atol=TOL["logits"][0], rtol=TOL["logits"][1])
    # unpatching restores transformers' own kernels
    assert lt.unpatch_model(model) == 3 and not lt.is_patched(model)
    before = dict(lt.CALLS)
    with torch.no_grad():
        model(ids[:, :5])
    assert lt.CALLS == before


def test_patch_is_per_model_and_gradients_flow():
    a, b = _model(_qwen3_next), _model(_qwen3_next)
    lt.patch_model(a, backend="torch")
    before = dict(lt.CALLS)
    with torch.no_grad():
        b(torch.randint(0, 96, (1, 8)))
    assert lt.CALLS == before, "patching one model must leave another model of the same class alone"
    a.train()
    ids = torch.randint(0, 96, (1, 20))
    a(ids, labels=ids).loss.backward()
    for name, p in a.named_parameters():
        if "linear_attn" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_patch_rejects_models_without_gdn_layers():
    with pytest.raises(ValueError, match="no GatedDeltaNet"):
        lt.patch_model(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nn.Module"):
        lt.patch_model("model")


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_linattn_layer_built_from_transformers_weights_matches(make):
    model = _model(make)
    gdn = next(lt._gdn_modules(model))
    layer = lt.gated_deltanet_from_transformers(gdn, backend="torch").eval()
    x = torch.randn(2, 70, gdn.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], gdn(x), atol=TOL["logits"][0], rtol=TOL["logits"][1])
    with pytest.raises(TypeError, match="GatedDeltaNet"):
        lt.gated_deltanet_from_transformers(torch.nn.Linear(2, 2))
