"""GPU check of the layers, the hybrid model and the transformers patch on the Triton backend (one H200).

Each row compares the CUDA/Triton path with the torch backend (or with itself in another mode) on the same weights
and prints the max error relative to the reference's max magnitude, with the bound it must stay under.

    python benchmarks/gpu_check_layers.py
"""
from __future__ import annotations

import time

import torch

from linattn.layers import GatedDeltaNet, GatedLinearAttention, LinearAttention
from linattn.models import HybridConfig, HybridLM

ROWS = []
T0 = time.perf_counter()
BOUND = {torch.float32: 2e-3, torch.bfloat16: 3e-2}   # tf32 dots on the GPU; bf16 operands


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def row(name: str, err: float, bound: float) -> None:
    ROWS.append((name, err, bound, "ok" if err <= bound else "FAIL"))
    print(f"[{time.perf_counter() - T0:6.1f}s] {name}: {err:.2e} (bound {bound:.1e}) {ROWS[-1][3]}", flush=True)


def check_gdn(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    kw = dict(hidden_size=512, num_heads=4, head_dim=128, num_v_heads=8, allow_neg_eigval=True)
    tri = GatedDeltaNet(**kw, mode="chunk").cuda().to(dtype)
    ref = GatedDeltaNet(**kw, mode="chunk", backend="torch").cuda().to(dtype)
    ref.load_state_dict(tri.state_dict())
    x = torch.randn(2, 1000, 512, device="cuda", dtype=dtype)
    y, s = tri(x, output_state=True)
    y_ref, s_ref = ref(x, output_state=True)
    row(f"GDN triton vs torch fwd {dtype}", rel(y, y_ref), BOUND[dtype])
    w = torch.randn_like(y)
    (y.float() * w).sum().backward()
    (y_ref.float() * w).sum().backward()
    worst = max(rel(p.grad, q.grad) for p, q in zip(tri.parameters(), ref.parameters()))
    row(f"GDN triton vs torch param grads {dtype} (worst)", worst, 5 * BOUND[dtype])
    # prefill 900 tokens chunked, then 100 recurrent decode steps
    tri.eval()
    with torch.no_grad():
        tri.mode = "auto"
        y1, st = tri(x[:, :900], output_state=True)
        ys = [y1]
        for t in range(900, 1000):
            yt, st = tri(x[:, t:t + 1], state=st, output_state=True)
            ys.append(yt)
    row(f"GDN prefill+decode vs one pass {dtype}", rel(torch.cat(ys, 1), y.detach()), BOUND[dtype])


def check_other_layers() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 300, 256, device="cuda")
    for name, layer in (("GLA layer", GatedLinearAttention(256, num_heads=2, head_dim=64)),
                        ("LinearAttention rff", LinearAttention(256, num_heads=4, feature_map="rff"))):
        layer = layer.cuda().eval()
        with torch.no_grad():
            y, _ = layer(x)
            y_cpu, _ = layer.cpu()(x.cpu())
        row(f"{name} cuda vs cpu fp32", rel(y.cpu(), y_cpu), BOUND[torch.float32])


def check_model() -> None:
    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=256, hidden_size=512, num_layers=8, layer_pattern="GGGS", window_size=128)
    m = HybridLM(cfg).cuda().eval()
    ids = torch.randint(0, 256, (4, 600), device="cuda")
    with torch.no_grad():
        full = m(ids).logits
        out = m(ids[:, :500], use_cache=True)
        logits = [out.logits]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in range(500, 600):
            out = m(ids[:, t:t + 1], cache=out.cache, use_cache=True)
            logits.append(out.logits)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 10
    row(f"HybridLM prefill+decode vs full fp32 ({ms:.2f} ms/step, B=4)", rel(torch.cat(logits, 1), full),
        BOUND[torch.float32])
    # causality at the training shape and precision (bf16 autocast, Triton kernels): changing the tokens after
    # position t must leave the logits up to t unchanged (bitwise: the kernels are deterministic)
    x = torch.randint(0, 256, (2, 2048), device="cuda")
    x2 = x.clone()
    x2[:, 1000:] = torch.randint(0, 256, (2, 1048), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = m(x).logits[:, :1000], m(x2).logits[:, :1000]
    row("HybridLM causal: logits[:1000] after changing tokens 1000: (bf16, T=2048)", rel(a, b), 0.0)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (16, 1024), device="cuda")
    for step in range(12):
        if step == 2:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(x, labels=x.roll(-1, 1)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    tok_s = 10 * x.numel() / (time.perf_counter() - t0)
    row(f"HybridLM bf16 train step finite ({tok_s:,.0f} tok/s, 16x1024)", 0.0 if torch.isfinite(loss) else 1.0, 0.0)


def check_transformers() -> None:
    try:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    except ImportError:
        ROWS.append(("transformers patch", float("nan"), float("nan"), "skipped: no transformers"))
        return
    from linattn.integrations.transformers import patch_model
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, intermediate_size=512, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                          shared_expert_intermediate_size=128,
                          layer_types=["linear_attention"] * 3 + ["full_attention"])
    m = Qwen3NextForCausalLM(cfg).cuda().eval()
    ids = torch.randint(0, 1000, (2, 500), device="cuda")
    with torch.no_grad():
        want = m(ids).logits
        patch_model(m)
        got = m(ids).logits
    row("transformers Qwen3-Next patched (triton) vs unpatched fp32", rel(got, want), BOUND[torch.float32])


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    for fn in (lambda: check_gdn(torch.float32), lambda: check_gdn(torch.bfloat16), check_other_layers, check_model,
               check_transformers):
        try:
            fn()
        except Exception as e:  # report and go on: one failure must not hide the other rows
            ROWS.append((f"{getattr(fn, '__name__', 'check')}", float("nan"), float("nan"),
                         f"ERROR {type(e).__name__}: {e}"[:150]))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'check':70s} {'rel err':>10s} {'bound':>8s}  result")
    for name, err, bound, res in ROWS:
        print(f"{name:70s} {err:10.2e} {bound:8.1e}  {res}")


if __name__ == "__main__":
    main()
