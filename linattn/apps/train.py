"""``linattn train``: train a small byte-level hybrid LM (Gated DeltaNet + sliding-window attention).

Default corpus: the Python standard library's sources (on every machine); ``--data FILE`` trains on a user's text.
Writes into ``--out``: ``config.json`` + ``model.safetensors`` (a checkpoint, every ``--save-every`` steps and at
the end), ``train_log.json`` (loss per step, held-out loss, tokens/s, peak memory) and ``loss.png``.

The optional packages a run needs (safetensors; matplotlib unless ``--no-plot``) are checked before any work starts.
A finished run is never lost: the log is written first, and if the safetensors checkpoint still cannot be written
the weights go to ``model.pt`` (``torch.save``), which :meth:`HybridLM.from_pretrained` also reads.

    linattn train --quick                   # CPU, a few minutes: a small model, a visibly falling loss
    linattn train --steps 2000 --pattern GGGS --dtype bf16 --grad-checkpointing
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import sys
import time
from pathlib import Path

import torch

from ..models import HybridConfig, HybridLM
from ..models.hybrid import FALLBACK_WEIGHTS_NAME
from .data import VOCAB_SIZE, ByteBatches, load_corpus

# --quick: sized to finish in a few minutes on a 2-core CPU and still learn visibly (bytes → common keywords)
QUICK = dict(hidden_size=128, layers=4, pattern="GGGS", gdn_heads=2, head_dim=32, attn_heads=4, window=64,
             seq_len=128, batch_size=16, steps=300, lr=3e-3, warmup=30, eval_every=50, eval_batches=4,
             max_bytes=4_000_000)
FULL = dict(hidden_size=512, layers=8, pattern="GGGS", gdn_heads=4, head_dim=64, attn_heads=8, window=512,
            seq_len=1024, batch_size=16, steps=2000, lr=1.5e-3, warmup=200, eval_every=200, eval_batches=16,
            max_bytes=None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--quick", action="store_true", help="small model and run for a CPU (a few minutes)")
    p.add_argument("--data", help="a text file to train on (default: the Python standard library's sources)")
    p.add_argument("--out", default="runs/linattn-byte-lm", help="output folder (checkpoint, log, plot)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float, help="peak learning rate (linear warmup, cosine decay to 10%%)")
    p.add_argument("--warmup", type=int, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--pattern", help="layer kinds, repeated: G = Gated DeltaNet, L = gated linear attention, "
                                     "S = sliding-window attention, A = full attention")
    p.add_argument("--gdn-heads", type=int)
    p.add_argument("--head-dim", type=int, help="GDN query/key head dim")
    p.add_argument("--attn-heads", type=int)
    p.add_argument("--window", type=int, help="sliding-window size (tokens)")
    p.add_argument("--max-bytes", type=int, help="use at most this many bytes of the corpus")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                   help="autocast dtype: auto = bf16 on GPU, fp32 on CPU; fp16 uses a GradScaler")
    p.add_argument("--grad-checkpointing", action="store_true", help="recompute blocks in the backward")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: 1 with --quick on a CPU, "
                                               "else torch's default)")
    p.add_argument("--eval-every", type=int)
    p.add_argument("--eval-batches", type=int)
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("--no-plot", action="store_true", help="skip loss.png (no matplotlib needed)")


MODEL_EXTRA = "pip install 'linattn[model]'"


def missing_dependencies(args) -> list[str]:
    """The optional packages this run needs and cannot import (rich is optional: plain log lines without it)."""
    needed = ["safetensors.torch"] + ([] if args.no_plot else ["matplotlib"])
    missing = []
    for name in needed:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name.split(".")[0])
    return missing


def _settings(args) -> dict:
    s = dict(QUICK if args.quick else FULL)
    for key in s:
        val = getattr(args, key, None)
        if val is not None:
            s[key] = val
    for key in ("steps", "batch_size", "seq_len", "hidden_size", "layers", "eval_every", "eval_batches"):
        if s[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {s[key]}")
    return s


def build_config(s: dict) -> HybridConfig:
    return HybridConfig(vocab_size=VOCAB_SIZE, hidden_size=s["hidden_size"], num_layers=s["layers"],
                        layer_pattern=s["pattern"], gdn_num_heads=s["gdn_heads"], gdn_head_dim=s["head_dim"],
                        attn_num_heads=s["attn_heads"], attn_num_kv_heads=max(1, s["attn_heads"] // 4),
                        window_size=s["window"])


def _amp(dtype_arg: str, device: torch.device):
    """(autocast dtype or None, use a GradScaler)."""
    if dtype_arg == "auto":
        dtype_arg = "bf16" if device.type == "cuda" else "fp32"
    if dtype_arg == "fp16" and device.type != "cuda":
        raise ValueError("--dtype fp16 (with a GradScaler) needs a CUDA device; use bf16 or fp32 on the CPU")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[dtype_arg], dtype_arg == "fp16"


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; none on norms, biases, embeddings' siblings marked ``_no_weight_decay``."""
    decay, no_decay = [], []
    seen = set()
    for p in model.parameters():
        if id(p) in seen:          # tied embeddings appear once
            continue
        seen.add(id(p))
        (no_decay if p.dim() < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def evaluate(model, batches: ByteBatches, n: int, device, amp_dtype) -> float:
    model.eval()
    losses = []
    for x, y in batches.val_batches(n):
        with _autocast(device, amp_dtype):
            losses.append(float(model(x.to(device), labels=y.to(device)).loss))
    model.train()
    return sum(losses) / len(losses)


def _autocast(device, amp_dtype):
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=amp_dtype)


class _Progress:
    """A rich progress bar with the running loss, or plain log lines (no rich, or --no-progress)."""

    def __init__(self, total: int, plain: bool):
        self.bar = None
        if not plain:
            try:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
                self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn())
            except ImportError:
                pass
        self.total = total
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task("train", total=total, info="")

    def update(self, step: int, info: str, log_line: bool) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
            if log_line:
                self.bar.console.log(f"step {step}/{self.total}  {info}")
        elif log_line:
            print(f"step {step}/{self.total}  {info}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def plot_losses(log: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(log["step"], log["loss"], lw=0.8, alpha=0.6, label="train (per step)")
    if log["eval_step"]:
        ax.plot(log["eval_step"], log["val_loss"], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(args) -> dict:
    """Run a training job from parsed arguments; return the summary written to train_log.json.

    Raises ImportError before any work when an optional package the run needs is missing."""
    missing = missing_dependencies(args)
    if missing:
        hint = " (or pass --no-plot to train without matplotlib)" if "matplotlib" in missing else ""
        raise ImportError(f"{' and '.join(missing)} not installed, needed to save the run: {MODEL_EXTRA}{hint}")
    threads = torch.get_num_threads()
    n = args.threads
    if n is None and args.quick and not torch.cuda.is_available():
        # the quick model's ops are tiny: a second thread buys little, and on a shared 2-core machine OpenMP
        # spinning made 2 threads 10x slower than 1 (measured); --threads overrides
        n = 1
    if n:
        torch.set_num_threads(n)
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads)


def _train(args) -> dict:
    s = _settings(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    amp_dtype, use_scaler = _amp(args.dtype, device)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    data = load_corpus(args.data, s["max_bytes"])
    batches = ByteBatches(data, s["seq_len"], s["batch_size"], seed=args.seed)
    config = build_config(s)
    model = HybridLM(config).to(device).train()
    model.set_gradient_checkpointing(args.grad_checkpointing)
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=s["lr"], betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type) if use_scaler else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    log = {"step": [], "loss": [], "eval_step": [], "val_loss": []}
    progress = _Progress(s["steps"], args.no_progress)
    tokens = 0
    t0 = time.perf_counter()
    try:
        for step in range(s["steps"]):
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step, s["lr"], s["warmup"], s["steps"])
            x, y = batches.next()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with _autocast(device, amp_dtype):
                loss = model(x, labels=y).loss
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            else:
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            tokens += x.numel()
            lv = float(loss.detach())
            if not math.isfinite(lv):
                raise FloatingPointError(f"loss became {lv} at step {step}")
            log["step"].append(step + 1)
            log["loss"].append(lv)
            info = f"loss {lv:.3f}"
            evaluated = (step + 1) % s["eval_every"] == 0 or step + 1 == s["steps"] or step == 0
            if evaluated:
                val = evaluate(model, batches, s["eval_batches"], device, amp_dtype)
                log["eval_step"].append(step + 1)
                log["val_loss"].append(val)
                info += f"  val {val:.3f}  {tokens / (time.perf_counter() - t0):,.0f} tok/s"
            progress.update(step + 1, info, evaluated)
            if args.save_every and (step + 1) % args.save_every == 0:
                model.save_pretrained(out)
    finally:
        progress.close()
    elapsed = time.perf_counter() - t0
    summary = {
        "config": config.to_dict(), "settings": s, "device": str(device), "dtype": args.dtype,
        "parameters": model.num_parameters(), "corpus_bytes": len(data), "steps": s["steps"],
        "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
        "first_loss": log["loss"][0], "final_loss": sum(log["loss"][-10:]) / len(log["loss"][-10:]),
        "first_val_loss": log["val_loss"][0], "final_val_loss": log["val_loss"][-1],
        "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None),
        "log": log,
    }
    # the log first (stdlib only), then the weights, then the plot: a failure late in saving loses nothing before it
    (out / "train_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["written"] = ["train_log.json", *save_weights(model, out)]
    if not args.no_plot:
        try:
            plot_losses(log, out / "loss.png", f"byte-level {config.layer_pattern} LM, "
                                               f"{model.num_parameters() / 1e6:.2f}M params, {device}")
            summary["written"].append("loss.png")
        except ImportError as e:
            print(f"linattn train: loss.png not written ({e}; {MODEL_EXTRA})", file=sys.stderr)
    return summary


def save_weights(model: HybridLM, out: Path) -> list[str]:
    """Write the trained model into ``out``; return the names written. Without safetensors (uninstalled after the
    start-up check) the weights go to ``model.pt`` through torch.save instead of being lost."""
    try:
        model.save_pretrained(out)
        return ["config.json", "model.safetensors"]
    except ImportError as e:
        model.config.save(out / "config.json")
        torch.save(model.state_dict(), out / FALLBACK_WEIGHTS_NAME)
        print(f"linattn train: {e}; saved the weights with torch.save to {out / FALLBACK_WEIGHTS_NAME} instead "
              f"(`linattn generate` reads it; {MODEL_EXTRA} for model.safetensors)", file=sys.stderr)
        return ["config.json", FALLBACK_WEIGHTS_NAME]


def run(args) -> int:
    try:
        summary = train(args)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        print(f"linattn train: {e}", file=sys.stderr)
        return 2
    except ImportError as e:   # raised by the start-up check, before any work
        print(f"linattn train: {e}", file=sys.stderr)
        return 2
    print(f"{summary['parameters'] / 1e6:.2f}M parameters, {summary['steps']} steps, "
          f"{summary['tokens_per_s']:,.0f} tokens/s on {summary['device']}")
    print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} (train), "
          f"{summary['first_val_loss']:.3f} -> {summary['final_val_loss']:.3f} (held-out, nats/byte)")
    print(f"wrote {args.out}/: {', '.join(summary['written'])}")
    return 0
