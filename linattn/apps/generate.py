"""``linattn generate``: sample text from a model written by ``linattn train``, streaming bytes as they come.

    linattn generate --model runs/linattn-byte-lm --prompt "def " --max-new-tokens 300 --temperature 0.8
"""
from __future__ import annotations

import argparse
import codecs
import os
import sys

import torch

from ..models import HybridLM, stream_generate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--model", default="runs/linattn-byte-lm", help="folder written by `linattn train`")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")


def run(args, out=None) -> int:
    out = out or sys.stdout
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not os.path.exists(os.path.join(args.model, "config.json")):
        print(f"linattn generate: no trained model in {args.model}: run `linattn train` first (it writes "
              f"runs/linattn-byte-lm), or pass --model with the folder `linattn train --out` wrote",
              file=sys.stderr)
        return 2
    try:
        model = HybridLM.from_pretrained(args.model, device=device)
    except (FileNotFoundError, ValueError) as e:
        print(f"linattn generate: {e}", file=sys.stderr)
        return 2
    except ImportError as e:   # safetensors: the optional [model] extra
        print(f"linattn generate: {e} (pip install 'linattn[model]')", file=sys.stderr)
        return 2
    if model.config.vocab_size != 256:
        print(f"linattn generate: the model's vocabulary is {model.config.vocab_size}, not bytes (256)",
              file=sys.stderr)
        return 2
    prompt = args.prompt.encode()
    if not prompt:
        print("linattn generate: --prompt must not be empty", file=sys.stderr)
        return 2
    gen = torch.Generator(device=device).manual_seed(args.seed)
    ids = torch.tensor([list(prompt)], device=device)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out.write(args.prompt)
    for tok in stream_generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                               top_p=args.top_p, generator=gen):
        out.write(decoder.decode(bytes([int(tok[0])])))
        out.flush()
    out.write(decoder.decode(b"", final=True) + "\n")
    return 0
