"""Train the hybrid GDN / sliding-window LM on several processes: context parallelism (each sequence split along T
across ``--cp`` ranks, exact: linattn.parallel) and data parallelism (DDP over the remaining factor), on one
torch.distributed process-group API.

    torchrun --nproc-per-node 2 examples/train_cp.py --cp 2            # 2-way context parallel
    torchrun --nproc-per-node 4 examples/train_cp.py --cp 2            # 2 (DDP) x 2 (context parallel)
    torchrun --nproc-per-node 4 examples/train_cp.py --cp 1            # plain DDP on 4 ranks

CUDA ranks use NCCL (one GPU per rank, NVLink multicast off), CPU ranks gloo. ``--check`` compares the first
step's loss and gradient norm with the same batch run unsplit on one rank (the split is exact: they agree to
rounding). Prints one line per ``--log-every`` steps and a summary with tokens/s (all ranks together).
"""
from __future__ import annotations

import argparse
import json
import os
import time

# NVLink multicast (NVLS) off before NCCL initialises: the multi-GPU hosts this runs on are shared
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from linattn.apps.data import VOCAB_SIZE, ByteBatches, load_corpus  # noqa: E402
from linattn.models import HybridConfig, HybridLM  # noqa: E402
from linattn.parallel import ShardPlan  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=None, help="context-parallel ranks per sequence (default: all ranks)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (split across the cp ranks)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per data-parallel replica")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pattern", default="GGGS")
    p.add_argument("--gdn-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="autocast (default: bf16 on CUDA)")
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--check", action="store_true", help="first step: compare with the unsplit batch on rank 0")
    p.add_argument("--json", help="rank 0 writes a summary here (world, dp, cp, tokens/s, last loss, device)")
    return p.parse_args(argv)


def make_groups(world: int, cp: int):
    """cp groups: consecutive ranks; dp groups: one rank of each cp group. Every rank creates every group."""
    if cp < 1 or world % cp:
        raise ValueError(f"--cp {cp} must divide the world size {world}")
    rank = dist.get_rank()
    cp_group = dp_group = None
    for d in range(world // cp):
        g = dist.new_group(list(range(d * cp, (d + 1) * cp)))
        if rank // cp == d:
            cp_group = g
    for c in range(cp):
        g = dist.new_group(list(range(c, world, cp)))
        if rank % cp == c:
            dp_group = g
    return cp_group, dp_group


def check_unsplit(model: HybridLM, x, y, loss_share, cp_group, amp, compare_grads: bool):
    """On cp rank 0 of each replica: the unsplit batch's loss beside the split step's, and the gradient norms
    when there is one replica (DDP averages the gradients over replicas)."""
    loss = loss_share.detach().clone()
    dist.all_reduce(loss, group=cp_group)
    grad_sq = sum(float(p.grad.float().square().sum()) for p in model.parameters() if p.grad is not None)
    if dist.get_rank(cp_group) != 0:
        return
    ref = HybridLM(model.config).to(x.device)
    ref.load_state_dict(model.state_dict())
    ref.zero_grad()
    with amp():
        ref_loss = ref(x, labels=y).loss
    ref_loss.backward()
    ref_gn = sum(float(p.grad.float().square().sum()) for p in ref.parameters() if p.grad is not None) ** 0.5
    grads = f"; grad norm split {grad_sq ** 0.5:.6f} unsplit {ref_gn:.6f}" if compare_grads else ""
    print(f"check (rank {dist.get_rank()}): loss split {float(loss):.6f} unsplit {ref_loss.item():.6f}{grads}",
          flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world if args.cp is None else args.cp
    cp_group, dp_group = make_groups(world, cp)
    dp, dp_rank = world // cp, rank // cp
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    amp_dtype = {"bf16": torch.bfloat16, "fp32": None, None: torch.bfloat16 if use_cuda else None}[args.dtype]

    def amp():
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    torch.manual_seed(0)                       # the same initial weights on every rank
    config = HybridConfig(vocab_size=VOCAB_SIZE, hidden_size=args.hidden_size, num_layers=args.layers,
                          layer_pattern=args.pattern, gdn_num_heads=args.gdn_heads, gdn_head_dim=args.head_dim,
                          attn_num_heads=4, attn_num_kv_heads=1, window_size=args.window)
    model = HybridLM(config).to(device).train()
    ddp = DDP(model, process_group=dp_group) if dp > 1 else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = ByteBatches(load_corpus(max_bytes=args.max_bytes), args.seq_len, args.batch_size, seed=dp_rank)

    T = args.seq_len
    lengths = [T // cp + (1 if i < T % cp else 0) for i in range(cp)]
    # build() all-gathers the shard lengths over the cp group: a collective before the halos' first point-to-point
    # exchange, which NCCL needs on every rank of the group
    plan = ShardPlan.build(lengths[dist.get_rank(cp_group)], group=cp_group) if cp > 1 else None
    a, b = (plan.start, plan.end) if plan is not None else (0, T)
    if rank == 0:
        print(f"{world} ranks: {dp} data-parallel x {cp} context-parallel; {model.num_parameters() / 1e6:.2f}M "
              f"params; {args.batch_size} x {T} tokens per replica, shards {lengths}", flush=True)

    tokens, t0 = 0, None
    for step in range(args.steps):
        if step == 1:              # the first step compiles and warms up: time from the second
            if use_cuda:
                torch.cuda.synchronize()
            t0, tokens = time.perf_counter(), 0
        x, y = batches.next()
        x, y = x.to(device), y.to(device)
        with amp():
            loss = (ddp or model)(x[:, a:b], labels=y[:, a:b], cp=plan).loss if plan is not None else \
                (ddp or model)(x, labels=y).loss
        loss.backward()
        if plan is not None:
            # each rank's loss is its share of the sequence's mean: the shares' gradients sum to the unsplit one
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=cp_group)
        if args.check and step == 0:
            check_unsplit(model, x, y, loss, cp_group, amp, compare_grads=dp == 1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += dp * x.numel()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            shown = loss.detach().clone()
            dist.all_reduce(shown)                 # sum of shares over cp, summed over dp replicas
            if rank == 0:
                print(f"step {step + 1}/{args.steps}  loss {float(shown) / dp:.4f}", flush=True)
    if use_cuda:
        torch.cuda.synchronize()
    if rank == 0 and t0 is not None:
        tps = tokens / (time.perf_counter() - t0)
        print(f"{tps:,.0f} tokens/s on {world} ranks ({device.type})", flush=True)
        if args.json:
            summary = dict(world=world, dp=dp, cp=cp, seq_len=T, batch_size=args.batch_size, steps=args.steps,
                           tokens_per_s=tps, last_loss=float(shown) / dp, dtype=str(amp_dtype),
                           device=torch.cuda.get_device_name() if use_cuda else "cpu")
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
