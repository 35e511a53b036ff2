"""One shape through the public op as bench_anchors times it (bf16 inputs with requires_grad, no grad, do_bench
median), with the host µs per call beside it: whether a figure is the GPU's or the host's.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/op_time_check.py 1,32768,16,16 [1,4096,16,16 ...]
"""
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from linattn import chunk_gated_delta_rule


def inputs(B, T, H, HV, K=128):
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k = (F.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1).bfloat16() for _ in range(2))
    v = torch.randn(B, T, HV, K, device="cuda", generator=g).bfloat16()
    gg = F.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=g)) / 16
    beta = torch.rand(B, T, HV, device="cuda", generator=g).bfloat16()
    return [x.requires_grad_() for x in (q, k, v, gg, beta)]


def check(B, T, H, HV):
    xs = inputs(B, T, H, HV)
    with torch.no_grad():
        def fn():
            return chunk_gated_delta_rule(*xs, scale=128 ** -0.5, output_final_state=True)
        t0 = time.time()
        fn()
        torch.cuda.synchronize()
        first = time.time() - t0
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
    return dict(shape=(B, T, H, HV), first_call_s=round(first, 1), op_ms=round(ms, 4), host_us=round(host, 1))


for arg in sys.argv[1:]:
    print(check(*(int(x) for x in arg.split(","))), flush=True)
