"""A hybrid GDN / sliding-window LM in ~40 lines: build, train a few steps on bytes, save, reload, stream text.

    python examples/hybrid_lm.py            # CPU, about a minute
"""
import sys
import tempfile

import torch

from linattn.apps.data import ByteBatches, load_corpus
from linattn.models import HybridConfig, HybridLM, stream_generate

torch.manual_seed(0)
config = HybridConfig(vocab_size=256, hidden_size=128, num_layers=4, layer_pattern="GGGS",  # 3 GDN : 1 attention
                      gdn_num_heads=2, gdn_head_dim=32, attn_num_heads=4, attn_num_kv_heads=1, window_size=64)
model = HybridLM(config)
batches = ByteBatches(load_corpus(max_bytes=1_000_000), seq_len=128, batch_size=8)   # Python stdlib sources
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for step in range(60):
    x, y = batches.next()
    loss = model(x, labels=y).loss          # chunked gated delta rule in the GDN layers, SDPA in the window layer
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 20 == 0 or step == 59:
        print(f"step {step:3d}  loss {loss.item():.3f}")

with tempfile.TemporaryDirectory() as d:
    model.save_pretrained(d)                # config.json + model.safetensors
    model = HybridLM.from_pretrained(d)

prompt = torch.tensor([list(b"import ")])
sys.stdout.write("import ")
for tok in stream_generate(model, prompt, max_new_tokens=80, temperature=0.8, top_k=40):
    sys.stdout.write(bytes([int(tok[0])]).decode("utf-8", errors="replace"))   # prefill once, then O(1) steps
    sys.stdout.flush()
print()
