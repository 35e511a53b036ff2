"""Train byte-level LMs of one size side by side on the GPU: linattn's hybrid (GDN + sliding window), the same
hybrid with fla's GatedDeltaNet layer (if fla is installed), sliding-window-only and full-attention-only models.

Equal steps, equal data order, bf16 autocast. Reports tokens/s (after warm-up), peak memory, the train loss at the
end and the held-out loss (nats/byte), then prints a table.

    python benchmarks/train_hybrid_compare.py                  # ~10 min on one H200
    python benchmarks/train_hybrid_compare.py --steps 50       # smoke run
"""
from __future__ import annotations

import argparse
import time

import torch

from linattn.apps.data import VOCAB_SIZE, ByteBatches, load_corpus
from linattn.apps.train import evaluate, lr_at, param_groups
from linattn.models import HybridConfig, HybridLM


class FlaMixer(torch.nn.Module):
    """fla's GatedDeltaNet behind linattn's mixer interface (training only: no state)."""

    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__()
        from fla.layers import GatedDeltaNet as FlaGDN
        self.inner = FlaGDN(hidden_size=config.hidden_size, expand_v=config.gdn_expand_v,
                            head_dim=config.gdn_head_dim, num_heads=config.gdn_num_heads,
                            num_v_heads=config.gdn_num_v_heads, mode="chunk", use_gate=True, use_short_conv=True,
                            conv_size=config.gdn_conv_size, layer_idx=layer_idx, norm_eps=config.norm_eps)

    def forward(self, x, state=None, output_state=False, cu_seqlens=None):
        return self.inner(x)[0], None


def build(variant: str, a) -> HybridLM:
    pattern = {"linattn-GGGS": "GGGS", "fla-GGGS": "GGGS", "swa-only": "S", "full-attn": "A"}[variant]
    cfg = HybridConfig(vocab_size=VOCAB_SIZE, hidden_size=a.hidden, num_layers=a.layers, layer_pattern=pattern,
                       gdn_num_heads=a.hidden // 128, gdn_head_dim=128, attn_num_heads=a.hidden // 64,
                       attn_num_kv_heads=max(1, a.hidden // 256), window_size=a.window)
    model = HybridLM(cfg)
    if variant.startswith("fla"):
        for i, block in enumerate(model.layers):
            if block.kind == "G":
                block.mixer = FlaMixer(cfg, i)
        model.reset_parameters()
    return model


def run_variant(variant: str, a, data) -> dict:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = build(variant, a).to(dev).train()
    model.set_gradient_checkpointing(a.grad_checkpointing)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=a.lr, betas=(0.9, 0.95), fused=True)
    batches = ByteBatches(data, a.seq_len, a.batch_size, seed=0)
    torch.cuda.reset_peak_memory_stats()
    losses, t_start, warm = [], None, min(10, a.steps // 5)
    for step in range(a.steps):
        if step == warm:
            torch.cuda.synchronize()
            t_start = time.perf_counter()
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, a.lr, a.steps // 10, a.steps)
        x, y = (t.to(dev, non_blocking=True) for t in batches.next())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    secs = time.perf_counter() - t_start
    return {"variant": variant, "params_M": model.num_parameters() / 1e6,
            "tok_s": (a.steps - warm) * a.batch_size * a.seq_len / secs,
            "peak_GiB": torch.cuda.max_memory_allocated() / 2 ** 30,
            "train_loss": float(torch.stack(losses[-20:]).mean()),
            "val_loss": evaluate(model, batches, 16, dev, torch.bfloat16)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--variants", default="linattn-GGGS,fla-GGGS,swa-only,full-attn")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    data = load_corpus(None, None)
    rows = []
    for v in a.variants.split(","):
        if v.startswith("fla"):
            try:
                import fla  # noqa: F401
            except ImportError:
                rows.append({"variant": v, "note": "fla not installed"})
                continue
        try:
            rows.append(run_variant(v, a, data))
        except Exception as e:  # one failing variant must not hide the others' numbers
            rows.append({"variant": v, "note": f"{type(e).__name__}: {e}"[:100]})
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.steps} steps of "
          f"{a.batch_size}x{a.seq_len} bytes, hidden {a.hidden}, {a.layers} layers, window {a.window}, bf16")
    print(f"{'variant':14s} {'params(M)':>9s} {'tok/s':>10s} {'peak GiB':>9s} {'train':>7s} {'val':>7s}")
    for r in rows:
        if "note" in r:
            print(f"{r['variant']:14s} {r['note']}")
        else:
            print(f"{r['variant']:14s} {r['params_M']:9.1f} {r['tok_s']:10,.0f} {r['peak_GiB']:9.2f} "
                  f"{r['train_loss']:7.3f} {r['val_loss']:7.3f}")


if __name__ == "__main__":
    main()
