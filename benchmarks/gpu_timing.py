"""Timing helpers the GPU benchmarks share: do_bench medians, CUDA-graph replay, host µs per call, a cProfile of
back-to-back calls, and the Mamba-style per-head gate draw. Not a script (this folder is on sys.path for the
benchmarks that import it)."""
from __future__ import annotations

import functools
import math
import time

import torch
import torch.nn.functional as F
import triton

from linattn import chunk_gated_delta_rule


def bench(fn):
    """do_bench median ms (25 warm-ups, 100 ms), as bench_anchors times."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def make_inputs(B, T, H, HV, K=128, V=128, seed=0, decay=1 / 16):
    """bf16 q, k (unit rows), v; fp32 gates (logsigmoid(randn) · decay) and β on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    return dict(q=F.normalize(r(B, T, H, K), dim=-1).bfloat16(), k=F.normalize(r(B, T, H, K), dim=-1).bfloat16(),
                v=r(B, T, HV, V).bfloat16(), g=F.logsigmoid(r(B, T, HV)) * decay,
                beta=torch.rand(B, T, HV, device="cuda", generator=gen))


def mixed_gates(g: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """``g`` [B, T, HV] rescaled per head to rates drawn as a Mamba-style initialisation draws them (A from 1 to 16,
    dt from 0.001 to 0.1, both log-uniform; each head's mean decay −A·dt), the tokens' variation kept: some heads
    forget within a chunk, others not within a segment ."""
    gen = torch.Generator().manual_seed(seed)
    HV = g.shape[-1]
    A = torch.exp(torch.rand(HV, generator=gen) * math.log(16))
    dt = torch.exp(math.log(1e-3) + torch.rand(HV, generator=gen) * math.log(100))
    return g * ((A * dt).to(g.device) / -g.mean())

def host_us(fn, calls=200):
    """µs of host time per call: ``calls`` calls issued back to back, one sync (the rate the CPU can feed the GPU;
    above the GPU time, the call is host-bound)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6

def graph_ms(fn):
    """do_bench median ms of ``fn`` captured in a CUDA graph and replayed (the GPU's time alone), after one call on a
    side stream (the warm-up a capture needs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)

def host_profile(B=1, T=32768, H=2, HV=8, calls=300, fn=None, grad=False):
    """cProfile of ``calls`` back-to-back calls of the public op where "auto" plans the segmented Hopper forward
    (row 7: a host-bound row), or of ``fn``: the Python functions by their own time, then by cumulative time,
    to find the host cost per call (the times are totals over the calls). ``grad``: ``fn`` runs with autograd on
    (a forward + backward), else under no_grad."""
    import cProfile
    import io
    import pstats
    if fn is None:
        x = make_inputs(B, T, H, HV)
        fn = functools.partial(chunk_gated_delta_rule, **x, scale=128 ** -0.5, output_final_state=True)
    with torch.enable_grad() if grad else torch.no_grad():
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
    return out.getvalue()
