"""Memory: peak bytes a call adds, how that grows as T doubles, and allocator fragmentation across the sweep.

Per implementation and T (the scaling section's T list), one forward and one forward + backward call on fresh
inputs; the figure is the peak *above* what was allocated before the call (inputs excluded), so it is the
operator's own workspace plus its outputs (and, for fwd+bwd, the saved activations and the gradients).

* GPU: the CUDA caching allocator's counters (exact). After each call, active and reserved bytes give the
  fragmentation ``1 − active / reserved`` (memory the allocator holds but cannot hand out as one block).
* CPU: the PyTorch profiler's allocation and free events for the call, replayed in order: the exact peak of live
  tensor bytes (no caching allocator on CPU, so fragmentation needs a GPU and is reported as such).

``growth_exponent`` is the fitted p in peak ∝ T^p: about 1 for a linear-memory operator (2 for attention that
materialises the T × T scores). ``linear`` is true when p ≤ 1.15.
"""
from __future__ import annotations

from .cases import DTYPES, make_inputs
from .context import Context, empty_cache, error_record, is_oom, measure_peak, shape_classes
from .perf import loglog_slope, make_call

LINEAR_EXPONENT = 1.15


def _sweep(ctx: Context, impl, direction: str) -> dict:
    p = ctx.profile
    dtype = p.scale_dtype
    points, stop = [], None
    for T in p.scale_T:
        shape = p.scale_base.with_(T=T)
        classes = shape_classes(impl, shape, dtype, direction)
        desc = f"memory {impl.name} T={T} {direction}"
        if not ctx.fits(impl.name, classes, desc):
            stop = "time budget"
            break
        ctx.step(desc, impl.name, classes)
        rec = {"T": T, "shape_id": shape.id}
        try:
            inputs = make_inputs(shape, DTYPES[dtype], ctx.device, ctx.seed, requires_grad=direction == "fwdbwd",
                                 gates=ctx.gates)
            rec["input_bytes"] = sum(t.numel() * t.element_size() for t in inputs.values()
                                     if hasattr(t, "element_size"))
            rec.update(measure_peak(ctx, make_call(impl, inputs, direction)))
            del inputs
        except Exception as e:
            rec["error"] = error_record(e)
            stop = "out of memory" if is_oom(e) else f"error: {type(e).__name__}"
            points.append(rec)
            empty_cache(ctx)
            ctx.done(stop)
            break
        if rec.get("reserved_bytes"):
            rec["fragmentation"] = 1 - rec["active_bytes"] / rec["reserved_bytes"]
        if rec.get("peak_bytes") is not None:
            rec["bytes_per_token"] = rec["peak_bytes"] / shape.tokens
        points.append(rec)
        empty_cache(ctx)
        ctx.done(f"peak {rec['peak_bytes'] / 2**20:.1f} MB" if rec.get("peak_bytes") is not None else "no peak")
    ok = [r for r in points if r.get("peak_bytes")]
    Ts = [r["T"] for r in ok]
    peaks = [r["peak_bytes"] for r in ok]
    expo = loglog_slope(Ts, peaks)
    frag = [r["fragmentation"] for r in points if "fragmentation" in r]
    return {"id": f"{impl.name}/{direction}", "impl": impl.name, "direction": direction, "dtype": dtype,
            "T": Ts, "peak_bytes": peaks, "growth_per_doubling": [b / a for a, b in zip(peaks[:-1], peaks[1:])],
            "growth_exponent": expo, "linear": None if expo is None else expo <= LINEAR_EXPONENT,
            "max_fragmentation": max(frag) if frag else None, "stopped": stop, "points": points}


def run(ctx: Context) -> dict:
    p = ctx.profile
    sweeps, unsupported = [], []
    ctx.partial.update(sweeps=sweeps, unsupported=unsupported)
    # asked once per implementation: the sweep's points differ from the base shape only in T
    impls = [i for i in ctx.available()
             if not ctx.unsupported(i, p.scale_base, f"{i.name}/{p.scale_base.id}/{p.scale_dtype}", unsupported,
                                    dtype=p.scale_dtype)]
    jobs = [(impl, d) for impl in impls for d in ("fwd", "fwdbwd")]
    for i, (impl, direction) in enumerate(jobs):
        with ctx.share(len(jobs) - i):
            sweeps.append(_sweep(ctx, impl, direction))
    return {"method": "cuda_allocator" if ctx.gpu else "cpu_profiler",
            "fragmentation": None if ctx.gpu else "needs a GPU (CUDA caching allocator statistics)",
            "linear_exponent_max": LINEAR_EXPONENT, "sweeps": sweeps, "unsupported": unsupported}
