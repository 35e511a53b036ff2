"""Scaling: latency, throughput and memory as the sequence grows and as the batch grows.

Three sweeps per implementation, each point timed like the performance section (median of ``scale_reps`` calls):

* **T doubling** at fixed batch (``scale_T``): the ratio of consecutive medians (≈ 2 for a linear-time operator,
  ≈ 4 for quadratic attention once it is compute-bound) and the fitted exponent of latency ∝ T^p. A sweep stops for
  an implementation at its first out-of-memory point ("where memory allows") or when one call exceeds the point
  budget (the next doubling would too).
* **Batch growth** at fixed T (``scale_batch``): throughput in tokens/s and its *knee*, the first batch at which
  doubling the batch raises throughput by less than 10 % (the device is full; more batch only adds latency).
* **Equal total tokens**: the same B·T split from one long sequence to many short ones ("small batch, long
  sequence" against "large batch, short sequence").

One shape has one figure: a point whose implementation, shape, dtype and direction the performance section of
this run already timed takes that row's latency (``timed_in: "performance"``; its memory is still measured here)
instead of timing the shape again. Timed twice, the same shape gave two figures (12 ms and 5.75 ms on a 2-core
CPU): the sections' sample counts differ (``reps`` against ``scale_reps``), and on a CPU whose cores are shared
two intra-op threads make single calls vary several-fold, so two small samples' medians disagree.
"""
from __future__ import annotations

import copy
from typing import Optional

from .cases import DTYPES, Shape, make_inputs
from .context import Context, compile_time, empty_cache, measure_peak, shape_classes
from .perf import loglog_slope, make_call, measure, result_line

KNEE_GAIN = 1.10  # throughput must grow by at least 10 % per batch doubling to count as still scaling


def _point(ctx: Context, impl, shape: Shape, dtype: str, direction: str, with_memory: bool,
           timed: Optional[dict] = None) -> dict:
    """One sweep point: ``timed`` (the performance section's row of the same shape) or a new measurement."""
    p = ctx.profile
    if timed is not None:
        rec = {**copy.deepcopy(timed), "timed_in": "performance"}
    else:
        rec = measure(ctx, impl, shape, dtype, direction, warmup=p.warmup, reps=p.scale_reps,
                      budget_s=p.point_budget_s, seed=ctx.seed)
    rec.pop("samples_ms", None)
    if with_memory and "error" not in rec:
        try:
            inputs = make_inputs(shape, DTYPES[dtype], ctx.device, ctx.seed, requires_grad=direction == "fwdbwd",
                                 gates=ctx.gates)
            rec["memory"] = measure_peak(ctx, make_call(impl, inputs, direction))
            del inputs
        except Exception as e:  # memory is a bonus here; the memory section reports it properly
            rec["memory"] = {"peak_bytes": None, "error": str(e)[:200]}
        empty_cache(ctx)
    return rec


def _unit(ctx: Context, impl, shape: Shape, dtype: str, direction: str, desc: str, with_memory: bool,
          timed: dict):
    """One sweep point as a unit of work: None when the budget refuses it. ``timed``: the performance section's
    rows by id."""
    classes = shape_classes(impl, shape, dtype, direction)
    if not ctx.fits(impl.name, classes, desc):
        return None
    ctx.step(desc, impl.name, classes)
    same = timed.get(f"{impl.name}/{shape.id}/{dtype}/{direction}")
    rec = _point(ctx, impl, shape, dtype, direction, with_memory, same)
    ctx.done(result_line(rec) + (" (the performance section's row)" if same else ""),
             None if same else compile_time(rec))
    return rec


def knee(batches: list, tokens_per_s: list):
    """First batch after which the next batch size does not raise throughput by ``KNEE_GAIN``; None if it never
    stops growing within the sweep."""
    for i in range(len(batches) - 1):
        if tokens_per_s[i + 1] < tokens_per_s[i] * KNEE_GAIN:
            return batches[i]
    return None


def _t_sweep(ctx: Context, impl, dtype: str, direction: str, timed: dict) -> dict:
    p = ctx.profile
    points, stop = [], None
    for T in p.scale_T:
        rec = _unit(ctx, impl, p.scale_base.with_(T=T), dtype, direction, f"scaling {impl.name} T={T} {direction}",
                    with_memory=True, timed=timed)
        if rec is None:
            stop = "time budget"
            break
        points.append(rec)
        if "error" in rec:
            stop = "out of memory" if rec.get("oom") else f"error: {rec['error']['type']}"
            break
        if rec["max_ms"] / 1e3 > p.point_budget_s:
            stop = f"one call took {rec['max_ms'] / 1e3:.1f} s > point budget {p.point_budget_s} s"
            break
    ok = [r for r in points if "error" not in r]
    Ts = [r["shape"]["T"] for r in ok]
    med = [r["median_ms"] for r in ok]
    mem = [r.get("memory", {}).get("peak_bytes") for r in ok]
    return {
        "impl": impl.name, "dtype": dtype, "direction": direction, "id": f"{impl.name}/T/{dtype}/{direction}",
        "T": Ts, "median_ms": med, "tokens_per_s": [r["tokens_per_s"] for r in ok], "peak_bytes": mem,
        "time_ratio_per_doubling": [b / a for a, b in zip(med[:-1], med[1:])],
        "memory_ratio_per_doubling": [b / a if a and b else None for a, b in zip(mem[:-1], mem[1:])],
        "time_exponent": loglog_slope(Ts, med), "max_T": max(Ts) if Ts else None, "stopped": stop,
        "points": points}


def _batch_sweep(ctx: Context, impl, dtype: str, timed: dict) -> dict:
    p = ctx.profile
    points = []
    for B in p.scale_batch:
        rec = _unit(ctx, impl, p.scale_base.with_(B=B, T=p.scale_batch_T), dtype, "fwd",
                    f"scaling {impl.name} B={B}", with_memory=False, timed=timed)
        if rec is None:
            break
        points.append(rec)
        if "error" in rec:
            break
    ok = [r for r in points if "error" not in r]
    Bs = [r["shape"]["B"] for r in ok]
    tps = [r["tokens_per_s"] for r in ok]
    return {"impl": impl.name, "dtype": dtype, "id": f"{impl.name}/batch/{dtype}", "T": p.scale_batch_T, "B": Bs,
            "median_ms": [r["median_ms"] for r in ok], "tokens_per_s": tps,
            "speedup_vs_B1": [t / tps[0] for t in tps] if tps else [], "knee_batch": knee(Bs, tps) if tps else None,
            "points": points}


def equal_token_splits(total: int, min_T: int = 128, max_points: int = 5) -> list[tuple[int, int]]:
    """(B, T) pairs with B·T = total, B = 1, 4, 16, ... while T ≥ min_T."""
    out, B = [], 1
    while total // B >= min_T and len(out) < max_points:
        out.append((B, total // B))
        B *= 4
    return out


def _equal_tokens(ctx: Context, impl, dtype: str, timed: dict) -> dict:
    p = ctx.profile
    points = []
    for B, T in equal_token_splits(p.equal_tokens):
        rec = _unit(ctx, impl, p.scale_base.with_(B=B, T=T), dtype, "fwd", f"scaling {impl.name} {B}x{T}",
                    with_memory=False, timed=timed)
        if rec is None:
            break
        points.append(rec)
    ok = [r for r in points if "error" not in r]
    return {"impl": impl.name, "dtype": dtype, "id": f"{impl.name}/equal/{dtype}", "total_tokens": p.equal_tokens,
            "B": [r["shape"]["B"] for r in ok], "T": [r["shape"]["T"] for r in ok],
            "median_ms": [r["median_ms"] for r in ok], "tokens_per_s": [r["tokens_per_s"] for r in ok],
            "points": points}


def run(ctx: Context, performance: Optional[dict] = None) -> dict:
    """The three sweeps; ``performance``: this run's performance section, whose rows of the same shapes are
    taken, not timed again."""
    p = ctx.profile
    timed = {r["id"]: r for r in (performance or {}).get("records", []) if "error" not in r and "median_ms" in r}
    dtype = p.scale_dtype
    directions = ("fwd", "fwdbwd") if ctx.gpu else ("fwd",)
    t_sweeps, batch, equal, unsupported = [], [], [], []
    ctx.partial.update(T_sweep=t_sweeps, batch_sweep=batch, equal_tokens=equal, unsupported=unsupported)
    # asked once per implementation: the sweeps' points differ from the base shape only in B and T
    impls = [i for i in ctx.available()
             if not ctx.unsupported(i, p.scale_base, f"{i.name}/{p.scale_base.id}/{dtype}", unsupported,
                                    dtype=dtype)]
    jobs = [(t_sweeps, _t_sweep, (impl, dtype, d, timed)) for impl in impls for d in directions]
    jobs += [(batch, _batch_sweep, (impl, dtype, timed)) for impl in impls]
    jobs += [(equal, _equal_tokens, (impl, dtype, timed)) for impl in impls]
    for i, (out, fn, fn_args) in enumerate(jobs):
        with ctx.share(len(jobs) - i):
            out.append(fn(ctx, *fn_args))
    return {"dtype": dtype, "base_shape": vars(p.scale_base).copy(), "knee_gain": KNEE_GAIN,
            "memory_method": "cuda_allocator" if ctx.gpu else "cpu_profiler",
            "T_sweep": t_sweeps, "batch_sweep": batch, "equal_tokens": equal, "unsupported": unsupported}
