"""Context parallelism: the scaling model, and the measurements that check it (docs/parallel.md).

    python benchmarks/cp_bench.py model                         # the model: 8 / 64 / 512 GPUs, T = 1M and 16M
    torchrun --nproc-per-node 8 benchmarks/cp_bench.py scan     # the map scan vs an all-gather + fold
    torchrun --nproc-per-node 2 benchmarks/cp_bench.py op --T 262144   # issue 49: exact? how fast vs one GPU?
    torchrun --nproc-per-node 2 benchmarks/cp_bench.py op --backend gloo --T 65536   # 2 ranks on one GPU

``op`` checks the split op against the unsplit one computed on every rank's own GPU (outputs, final state, every
gradient), then times forward and forward + backward of both, and the map scan alone (the communication on the
critical path), and prints speed-up, efficiency, the scan's share and the model's prediction. JSON with ``--json``.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402

# ------------------------------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class Machine:
    """What the model assumes of the hardware (H100/H200 SXM nodes of 8, InfiniBand between nodes)."""
    flops: float = 400e12          # achieved bf16 FLOP/s of the chunked kernels (about half of the dense peak)
    gpus_per_node: int = 8
    bw_intra: float = 150e9        # point-to-point bytes/s inside a node (NVLink)
    bw_inter: float = 40e9         # point-to-point bytes/s per GPU between nodes (400 Gb/s NIC per GPU)
    latency_intra: float = 10e-6   # seconds per point-to-point round inside a node
    latency_inter: float = 20e-6


@dataclass(frozen=True)
class Shape:
    """One GDN layer's shape: value heads HV, head dims K and V, chunk C, batch rows B."""
    HV: int = 16
    K: int = 128
    V: int = 128
    C: int = 64
    B: int = 1

    def flops_fwd(self, width: int) -> float:
        """Forward FLOPs per token of one pass with value width ``width`` (docs/architecture.md: ≈ 8Cd + 6d²
        per head at K = V = d; here the V-dependent and K-only parts apart)."""
        K, C = self.K, self.C
        return self.HV * (4 * C * K + 4 * C * width + 2 * K * K + 4 * K * width)

    def map_bytes(self) -> int:
        """One packed map [M | N] in fp32: what a rank sends per scan round."""
        return 4 * self.B * self.HV * self.K * (self.K + self.V)


def scan_time(R: int, shape: Shape, m: Machine) -> float:
    """⌈log₂ R⌉ point-to-point rounds of one map (round i reaches 2^i ranks away: across nodes once 2^i ≥ 8)."""
    t = 0.0
    for i in range(math.ceil(math.log2(R)) if R > 1 else 0):
        inter = 2 ** i >= m.gpus_per_node
        bw, lat = (m.bw_inter, m.latency_inter) if inter else (m.bw_intra, m.latency_intra)
        compose = 2 * shape.B * shape.HV * shape.K ** 2 * (shape.K + shape.V) * 2 / m.flops
        t += lat + shape.map_bytes() / bw + compose
    return t


def layer_times(T: int, R: int, shape: Shape, m: Machine) -> dict:
    """Per GDN layer, one sequence of T tokens on R ranks: forward and backward seconds on the critical path (a
    middle rank: the run from zero (V wide) and the v = 0 run (K wide), the scan, the correction o_M h_in;
    backward: the products for D, the reverse scan, the backward of both runs ≈ 2 forwards each)."""
    Tr = T / R
    pass_v, pass_k = Tr * shape.flops_fwd(shape.V) / m.flops, Tr * shape.flops_fwd(shape.K) / m.flops
    gemm = Tr * shape.HV * 2 * shape.K * shape.V / m.flops
    scan = scan_time(R, shape, m)
    if R == 1:
        fwd, bwd = pass_v, 2 * pass_v
    else:
        fwd = pass_v + pass_k + scan + gemm
        bwd = 2 * (pass_v + pass_k) + scan + 2 * gemm
    return dict(fwd=fwd, bwd=bwd, scan=scan)


def model_table(shape: Shape, m: Machine, ranks=(1, 8, 64, 512), lengths=(2 ** 20, 2 ** 24)) -> list[dict]:
    rows = []
    for T in lengths:
        one = layer_times(T, 1, shape, m)
        for R in ranks:
            t = layer_times(T, R, shape, m)
            step = t["fwd"] + t["bwd"]
            speedup = (one["fwd"] + one["bwd"]) / step
            rows.append(dict(T=T, R=R, fwd_ms=1e3 * t["fwd"], bwd_ms=1e3 * t["bwd"], scan_ms=1e3 * t["scan"],
                             scan_share_fwd=t["scan"] / t["fwd"] if R > 1 else 0.0, speedup=speedup,
                             efficiency=speedup / R,
                             sent_MiB=2 * (math.ceil(math.log2(R)) if R > 1 else 0) * shape.map_bytes() / 2 ** 20))
    return rows


def print_model(shape: Shape, m: Machine) -> list[dict]:
    rows = model_table(shape, m)
    print(f"scaling model, one GDN layer: HV={shape.HV} K={shape.K} V={shape.V} B={shape.B}; "
          f"{m.flops / 1e12:.0f} TFLOP/s achieved, P2P {m.bw_intra / 1e9:.0f} GB/s in a node, "
          f"{m.bw_inter / 1e9:.0f} GB/s between nodes; map {shape.map_bytes() / 2 ** 20:.1f} MiB")
    print(f"{'T':>9} {'GPUs':>5} {'fwd ms':>9} {'bwd ms':>9} {'scan ms':>8} {'scan/fwd':>8} {'speed-up':>9} "
          f"{'effic.':>7} {'sent MiB':>9}")
    for r in rows:
        print(f"{r['T']:>9} {r['R']:>5} {r['fwd_ms']:>9.3f} {r['bwd_ms']:>9.3f} {r['scan_ms']:>8.3f} "
              f"{r['scan_share_fwd']:>8.1%} {r['speedup']:>9.1f} {r['efficiency']:>7.1%} {r['sent_MiB']:>9.1f}")
    return rows


# ------------------------------------------------------------------------------------------- measurements


def _init(backend: str = "auto"):
    """NCCL with one GPU per rank; ``backend="gloo"`` with CUDA tensors lets several ranks share one GPU (the
    single-GPU check of the per-rank kernels and the scan; gloo's CUDA support is partial: what fails is the
    finding)."""
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)
    dist.init_process_group(("nccl" if cuda else "gloo") if backend == "auto" else backend)
    return dist, torch.device("cuda") if cuda else torch.device("cpu")


def _timed(fn, device, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, every rank the same number of calls (collectives inside), the
    slowest rank's median."""
    import torch.distributed as dist
    times = []
    for i in range(warmup + reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def measure_scan(args) -> dict:
    """The map scan (⌈log₂ R⌉ P2P rounds) against an all-gather of every map and a sequential fold."""
    from linattn.parallel import ShardPlan
    from linattn.parallel.collectives import scan_maps
    from linattn.parallel.fold import fold_affine_ref
    dist, device = _init(args.backend)
    R, rank = dist.get_world_size(), dist.get_rank()
    plan = ShardPlan.from_lengths([1] * R)
    shape = Shape(HV=args.HV, K=args.K, V=args.V)
    own = torch.randn(shape.B, shape.HV, shape.K, shape.K + shape.V, device=device) * 0.05

    def gather_fold():
        out = [torch.empty_like(own) for _ in range(R)]
        dist.all_gather(out, own)
        return fold_affine_ref(torch.stack(out)[:rank])

    want = gather_fold()
    got = scan_maps(own, plan)[..., shape.K:]
    err = float((got - want).abs().max())
    res = dict(world=R, device=device.type, map_MiB=shape.map_bytes() / 2 ** 20, max_err=err,
               scan_ms=1e3 * _timed(lambda: scan_maps(own, plan), device, args.reps),
               allgather_fold_ms=1e3 * _timed(gather_fold, device, args.reps))
    if rank == 0:
        print(json.dumps(res))
    dist.destroy_process_group()
    return res


def measure_op(args) -> dict:
    """Issue 49: the context-parallel op on R GPUs against the unsplit op on one (each rank computes the unsplit
    reference on its own GPU from the same seed and compares its shard)."""
    from linattn import chunk_gated_delta_rule
    from linattn.parallel import ShardPlan, context_parallel_gated_delta_rule
    from linattn.parallel.collectives import scan_maps
    dist, device = _init(args.backend)
    R, rank = dist.get_world_size(), dist.get_rank()
    T, HV, H, K, V = args.T, args.HV, args.H, args.K, args.V
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=dtype)
    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, HV, V)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen, device=device) + 4)
    beta = torch.rand(1, T, HV, generator=gen, device=device)
    do = rnd(1, T, HV, V)
    plan = ShardPlan.build(T // R + (rank < T % R))       # a collective before the first point-to-point exchange
    a, b = plan.start, plan.end
    kw = dict(use_qk_l2norm_in_kernel=True)

    def leaves(lo, hi):
        return [x[:, lo:hi].detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]

    full, mine = leaves(0, T), leaves(a, b)
    o_ref, ht_ref = chunk_gated_delta_rule(*full, output_final_state=True, **kw)
    (o_ref.float() * do.float()).sum().backward()
    o, ht = context_parallel_gated_delta_rule(*mine, plan=plan, output_final_state=True, **kw)
    (o.float() * do[:, a:b].float()).sum().backward()

    def rel(x, y):
        return ((x.detach().float() - y.detach().float()).norm() / y.detach().float().norm().clamp(min=1e-30))

    names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta")
    errs = torch.stack([rel(o, o_ref[:, a:b]), rel(ht, ht_ref)] +
                       [rel(x_mine.grad, x_full.grad[:, a:b]) for x_mine, x_full in zip(mine, full)])
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)          # the worst rank's relative error
    errors = dict(zip(names, errs.tolist()))

    def fwd_single():
        with torch.no_grad():
            chunk_gated_delta_rule(*full, **kw)

    def fwd_cp():
        with torch.no_grad():
            context_parallel_gated_delta_rule(*mine, plan=plan, **kw)

    def step_single():
        o1, _ = chunk_gated_delta_rule(*full, **kw)
        o1.backward(do)

    def step_cp():
        o1, _ = context_parallel_gated_delta_rule(*mine, plan=plan, **kw)
        o1.backward(do[:, a:b])

    own = torch.zeros(1, HV, K, K + V, device=device)
    res = dict(world=R, T=T, HV=HV, K=K, V=V, dtype=str(dtype), device=torch.cuda.get_device_name()
               if device.type == "cuda" else "cpu", rel_err=errors,
               fwd_single_ms=1e3 * _timed(fwd_single, device, args.reps),
               fwd_cp_ms=1e3 * _timed(fwd_cp, device, args.reps),
               step_single_ms=1e3 * _timed(step_single, device, args.reps),
               step_cp_ms=1e3 * _timed(step_cp, device, args.reps),
               scan_ms=1e3 * _timed(lambda: scan_maps(own, plan), device, args.reps))
    res["speedup_fwd"] = res["fwd_single_ms"] / res["fwd_cp_ms"]
    res["speedup_step"] = res["step_single_ms"] / res["step_cp_ms"]
    res["efficiency_step"] = res["speedup_step"] / R
    res["scan_share_fwd"] = res["scan_ms"] / res["fwd_cp_ms"]
    model = layer_times(T, R, Shape(HV=HV, K=K, V=V), Machine())
    one = layer_times(T, 1, Shape(HV=HV, K=K, V=V), Machine())
    res["model_speedup_step"] = (one["fwd"] + one["bwd"]) / (model["fwd"] + model["bwd"])
    if rank == 0:
        print(json.dumps(res, indent=1))
        if res["scan_share_fwd"] > 0.2:
            print(f"warning: the map scan is {res['scan_share_fwd']:.0%} of the forward (> 20%)")
    dist.destroy_process_group()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["model", "scan", "op"])
    p.add_argument("--T", type=int, default=2 ** 18, help="op: global tokens")
    p.add_argument("--HV", type=int, default=16)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", help="also write the result here (rank 0)")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: NCCL on GPUs, gloo on CPUs; gloo on a GPU puts several ranks on one card")
    args = p.parse_args(argv)
    if args.what == "model":
        res = print_model(Shape(HV=args.HV, K=args.K, V=args.V), Machine())
        res = dict(machine=asdict(Machine()), rows=res)
    else:
        res = (measure_scan if args.what == "scan" else measure_op)(args)
    if args.json and int(os.environ.get("RANK", 0)) == 0:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
