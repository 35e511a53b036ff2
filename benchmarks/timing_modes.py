"""Why a forward's do_bench median and its profiled span differ: the op and FlashQLA timed four ways at one shape.

Run 42 (H200) found row 4's forward at 1.08–1.12 ms under do_bench (eager and graph replay) but 1.005 ms as the
profiler's span of back-to-back calls (pre-pass start to walk end, no gap over 1.6 µs). do_bench zeroes a 256 MB
buffer before each timed call (an L2 flush) and times each call alone; the profiler's calls follow each other. So:

    do_bench        triton.testing.do_bench's median (25 warm-ups, 100 ms; the L2 flushed before each call)
    back_to_back    CUDA events around ``CALLS`` calls in a row, divided by ``CALLS`` (no flush, no gap)
    flushed_each    CUDA events around each call after do_bench's flush, synchronised after each call, median: the
                    call starts on an idle GPU, so its launches' host time shows (do_bench does not synchronise)
    after_memset    as flushed_each, with a tiny kernel after the flush (before the start event)

Run 42's answer (H200): neither mode is it. In a fresh process row 4 took 0.992 (do_bench) / 1.024 (back to back),
FlashQLA 1.295 / 1.295; then the same shape repeated in that process drifted to 1.088, FlashQLA's to 1.305, while
``nvidia-smi`` showed the card at 690 W under its software power cap (clock event reason 0x4) with the SM clock
down from 1980 to 1845–1935 MHz. A shape's place in a process (how long the card has been loaded) moves ours more
than FlashQLA's. Give a shape the same place when comparing, and repeat it (list it twice).

(bench_anchors' inputs, seed 2, its gates or ``--mixed-gates``):

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python benchmarks/timing_modes.py 1,131072,16,16 [B,T,H,HV ...]
"""
from __future__ import annotations

import statistics
import sys

import torch
import triton
from gate_sensitivity import flash_qla_forward, op_at  # this folder is on sys.path
from gpu_timing import bench

CALLS = 20
REPS = 30


def back_to_back(fn):
    """ms per call of ``CALLS`` calls in a row between two events."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS


def flushed_each(fn, settle=False):
    """Median ms of single calls, each after do_bench's own L2 flush (Triton's benchmark cache, cleared as do_bench
    clears it; with ``settle``, a tiny kernel after it)."""
    driver = triton.runtime.driver.active
    flush = driver.get_empty_cache_for_benchmark()
    tiny = torch.zeros(1, device="cuda")
    times = []
    for _ in range(REPS):
        driver.clear_cache(flush)
        if settle:
            tiny.add_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    gates = "mixed" if "--mixed-gates" in sys.argv else "anchors"
    shapes = [tuple(int(x) for x in a.split(",")) for a in sys.argv[1:] if not a.startswith("--")]
    print(torch.cuda.get_device_name(), flush=True)
    qla = flash_qla_forward()
    for shape in shapes:
        call, xs, scale = op_at(*shape, gates)
        fns = {"linattn": call}
        if qla is not None:
            fns["flashqla"] = lambda xs=xs, scale=scale: qla(*xs, scale)
        with torch.no_grad():
            for name, fn in fns.items():
                fn()
                row = dict(shape=shape, gates=gates, impl=name, do_bench=bench(fn), back_to_back=back_to_back(fn),
                           flushed_each=flushed_each(fn), after_memset=flushed_each(fn, settle=True))
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


if __name__ == "__main__":
    main()
