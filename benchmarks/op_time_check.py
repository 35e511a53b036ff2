"""One shape through the public op as bench_anchors times it (its own inputs: bf16 with requires_grad, seed 2; no
grad, do_bench median), with the host µs per call beside it (``hopper_fwd_check.host_us``): whether a figure is the
GPU's or the host's. Needs ``.anchors/bench_anchors.py`` (the carry of every device call):

    PYTHONPATH=/tmp/site:$PWD python benchmarks/op_time_check.py 1,32768,16,16 [1,4096,16,16 ...]

``--direct-ab``: each shape with ``chunk_fwd.DIRECT_LAUNCH`` off, then on (TileLang's Python wrapper against its
tvm_ffi executable called directly); ``--fast-launch-ab``: with ``common.launch.FAST_LAUNCH`` off, then on (Triton's
JIT launcher against the compiled kernel's runner, for the segmented forward's plan and scan); ``--async-o-ab``: with
``chunk_fwd.ASYNC_O_STORE`` off, then on (o's TMA store waited for one chunk later); ``--async-ax-ab``: with
``chunk_fwd.ASYNC_AX`` off, then on (A_inv X running while P is formed); each says whether o and the final state are
bitwise equal between the two. Several of these switch together (``--async-o-ab --async-ax-ab``: both off, then
both on); ``--repeat N``: the off/on pair N times in turn, so the spread between repeats shows the noise.
``--profile``: each shape's host time by function (cProfile over 200 calls issued back to back, one sync; the
largest by own time, then by cumulative time), to say where a host-bound call's µs go.
"""
import sys
import time
from pathlib import Path

import torch
from hopper_fwd_check import bench, host_profile, host_us  # this folder is on sys.path

from linattn import chunk_gated_delta_rule
from linattn.ops.common import launch
from linattn.ops.hopper import chunk_fwd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / ".anchors"))
from bench_anchors import make_inputs  # noqa: E402  (the anchors' inputs, so the figures compare with theirs)

SWITCHES = {"--direct-ab": (chunk_fwd, "DIRECT_LAUNCH"), "--fast-launch-ab": (launch, "FAST_LAUNCH"),
            "--async-o-ab": (chunk_fwd, "ASYNC_O_STORE"), "--async-ax-ab": (chunk_fwd, "ASYNC_AX")}


def check(B, T, H, HV, K=128, switches=(), on=None):
    for switch in switches:
        setattr(*SWITCHES[switch], on)
    chunk_fwd.launcher.cache_clear()
    xs = make_inputs(B, T, H, HV, K, K, torch.bfloat16, seed=2, requires_grad=True)
    with torch.no_grad():
        def fn():
            return chunk_gated_delta_rule(*xs, scale=K ** -0.5, output_final_state=True)
        t0 = time.time()
        fn()
        torch.cuda.synchronize()
        first = time.time() - t0
        ms = bench(fn)
        host = host_us(fn)
        o, ht = fn()
    return dict(shape=(B, T, H, HV), direct=chunk_fwd.DIRECT_LAUNCH, fast_launch=launch.FAST_LAUNCH,
                async_o=chunk_fwd.ASYNC_O_STORE, async_ax=chunk_fwd.ASYNC_AX,
                first_call_s=round(first, 1), op_ms=round(ms, 4), host_us=round(host, 1)), (o, ht)


def profile(B, T, H, HV, K=128, calls=200):
    """Print where ``calls`` calls' host time goes, by function (``hopper_fwd_check.host_profile``)."""
    xs = make_inputs(B, T, H, HV, K, K, torch.bfloat16, seed=2, requires_grad=True)
    print(f"--- host profile {B, T, H, HV}: {calls} calls ---")
    print(host_profile(calls=calls, fn=lambda: chunk_gated_delta_rule(*xs, scale=K ** -0.5, output_final_state=True)))


args = sys.argv[1:]
repeat = int(args.pop(args.index("--repeat") + 1)) if "--repeat" in args else 1
ab = [a for a in args if a in SWITCHES]
for arg in (a for a in args if not a.startswith("--")):
    shape = [int(x) for x in arg.split(",")]
    if "--profile" in args:
        profile(*shape)
        continue
    runs = [check(*shape, switches=ab, on=on) for _ in range(repeat) for on in (False, True)] if ab else [check(*shape)]
    for row, _ in runs:
        print(row, flush=True)
    if ab:
        print(dict(shape=tuple(shape), bitwise_equal=all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))),
              flush=True)
