"""Soak: many forward + backward calls on fixed inputs near the largest length that fits, bounded by time.

Per implementation, T is the largest length its scaling sweep completed (capped by the profile's ``soak_T``); the
calls repeat until the soak time (``soak_s``, never more than the run's remaining budget) is spent. Reported:

* memory drift: allocated bytes after each call (CUDA allocator; resident set on CPU), from the end of warm-up
  (the first ``WARM`` calls fill caches) to the last call. A leak is suspected when it grows by more than
  ``LEAK_BYTES`` (GPU) or ``LEAK_BYTES_CPU`` (the resident set is noisier).
* latency drift: median of the last 10 % of calls over median of the first 10 %, minus one (throttling, a growing
  cache, fragmentation).
* output drift: max |o − o_first| and max |dq − dq_first| over all calls; ``bitwise_stable`` if always zero (a
  deterministic kernel on fixed inputs must return the same bits every time).

The soak runs in the main thread (a worker thread measured 2-3x slower per call on a CPU, which would be the
soak's own finding) and starts only when the budget's estimate for it (:meth:`Context.fits`, a compile when its
shape is a new signature) fits the implementation's share or the run's spare time (its soak time is sized from the
same); the loop stops at its time.
"""
from __future__ import annotations

import torch

from .cases import DTYPES, make_inputs
from .context import Context, allocated_bytes, compile_time, empty_cache, error_record, shape_classes
from .perf import percentile

WARM = 3
LEAK_BYTES = 1 << 20
LEAK_BYTES_CPU = 64 << 20


def _soak_T(ctx: Context, impl, scaling: dict) -> int:
    p = ctx.profile
    done = [s["max_T"] for s in (scaling or {}).get("T_sweep", []) if s["impl"] == impl.name and s.get("max_T")]
    return min([p.soak_T] + done) if done else min(p.soak_T, max(p.scale_T))


def soak_one(ctx: Context, impl, T: int, seconds: float) -> dict:
    p = ctx.profile
    shape = p.scale_base.with_(T=T)
    rec = {"id": f"{impl.name}/{shape.id}", "impl": impl.name, "shape": vars(shape).copy(), "dtype": p.scale_dtype,
           "direction": "fwdbwd", "budget_s": seconds}
    inputs = make_inputs(shape, DTYPES[p.scale_dtype], ctx.device, ctx.seed, requires_grad=True, gates=ctx.gates)
    wrt = impl.grad_inputs(inputs)
    lat, mem = [], []
    o_drift = g_drift = 0.0
    first = None
    start = ctx.clock()
    try:
        do = None
        while len(lat) < WARM + 4 or ctx.clock() - start < seconds:
            t = ctx.clock()
            o = impl(inputs)[0]
            if do is None:
                do = torch.randn_like(o)
            grads = torch.autograd.grad(o, wrt, do)
            ctx.sync()
            lat.append((ctx.clock() - t) * 1e3)
            o, g0 = o.detach(), grads[0]
            if first is None:
                first = (o.clone(), g0.clone())
            else:
                o_drift = max(o_drift, (o.double() - first[0].double()).abs().max().item())
                g_drift = max(g_drift, (g0.double() - first[1].double()).abs().max().item())
            del o, grads, g0
            mem.append(allocated_bytes(ctx))
    except Exception as e:
        rec["error"] = error_record(e)
    finally:
        del inputs
        empty_cache(ctx)
    n = len(lat)
    rec["calls"] = n
    rec["duration_s"] = ctx.clock() - start
    rec["first_call_s"] = lat[0] / 1e3 if lat else None
    if n <= WARM:
        return rec
    tenth = max(1, (n - WARM) // 10)
    steady = lat[WARM:]
    rec["latency_first_ms"] = percentile(steady[:tenth], 50)
    rec["latency_last_ms"] = percentile(steady[-tenth:], 50)
    rec["latency_drift"] = rec["latency_last_ms"] / rec["latency_first_ms"] - 1
    rec["latency_p50_ms"] = percentile(steady, 50)
    rec["latency_p99_ms"] = percentile(steady, 99)
    if mem[WARM] is not None:
        rec["memory_start_bytes"] = mem[WARM]
        rec["memory_end_bytes"] = mem[-1]
        rec["memory_max_bytes"] = max(mem[WARM:])
        rec["memory_drift_bytes"] = mem[-1] - mem[WARM]
        rec["leak_suspected"] = rec["memory_drift_bytes"] > (LEAK_BYTES if ctx.gpu else LEAK_BYTES_CPU)
    rec["output_drift_max_abs"] = o_drift
    rec["grad_drift_max_abs"] = g_drift
    rec["bitwise_stable"] = o_drift == 0.0 and g_drift == 0.0
    rec["memory_trace_bytes"] = mem[:: max(1, n // 200)]
    rec["latency_trace_ms"] = lat[:: max(1, n // 200)]
    return rec


def run(ctx: Context, scaling: dict = None) -> dict:
    p = ctx.profile
    impls = ctx.available()
    records = []
    ctx.partial.update(records=records)
    for i, impl in enumerate(impls):
        part = max(ctx.remaining(), ctx.spare()) / (len(impls) - i)  # its share, or the run's spare time
        seconds = min(p.soak_s, part * 0.5)  # leave room for the sections after this one
        T = _soak_T(ctx, impl, scaling)
        if ctx.unsupported(impl, p.scale_base.with_(T=T), impl.name, records, dtype=p.scale_dtype):
            continue
        classes = shape_classes(impl, p.scale_base.with_(T=T), p.scale_dtype, "fwdbwd")
        desc = f"soak {impl.name} T={T} for {max(seconds, 0):.1f} s"
        if seconds <= 0.2 or not ctx.fits(impl.name, classes, desc):
            records.append({"id": impl.name, "impl": impl.name, "skipped": "time budget"})
            continue
        ctx.step(desc, impl.name, classes)
        rec = soak_one(ctx, impl, T, seconds)
        records.append(rec)
        ctx.done((f"error {rec['error']['type']} after " if "error" in rec else "")
                 + f"{rec['calls']} calls" + (f", P50 {rec['latency_p50_ms']:.3g} ms" if "latency_p50_ms" in rec
                                              else ""), compile_time(rec))
    return {"memory_counter": "cuda memory_allocated" if ctx.gpu else "process resident set (RSS)",
            "warm_calls": WARM, "leak_threshold_bytes": LEAK_BYTES if ctx.gpu else LEAK_BYTES_CPU,
            "soak_s": p.soak_s, "records": records}
