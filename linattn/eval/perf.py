"""Performance: latency distribution, throughput and the FLOP/byte (roofline) model.

For each (implementation, shape, dtype, direction) the first call is timed alone (it includes JIT compilation and
autotuning: the forward's in the fwd row, which runs first, the backward's in the fwd+bwd row), then ``warmup``
calls are discarded and up to ``reps`` calls are timed one by one: CUDA events on a GPU, the context's clock
(:attr:`Context.clock`: ``time.monotonic``) around the (synchronous) call on a CPU. The report keeps every sample and
gives median, P50/P95/P99 (linear interpolation between order statistics, numpy's default), min, max, mean and std.

FLOP/byte model of the chunked gated delta rule (chunk C, per value head, K = q/k head dim, V = value head dim).
A fused kernel needs, per chunk of C tokens, these matrix products (multiply-adds):

    K Kᵀ (C²K), Q Kᵀ (C²K), T·(βV − βΓ K S) (C²V), (QKᵀ ⊙ D) V_new (C²V), K S, Q S, Kᵀ V_new (3·CKV)

so FLOPs per token per value head = 2·(2C(K + V) + 3KV) = 4C(K + V) + 6KV (= 8Cd + 6d² for K = V = d: the
anchors' model). The triangular solve (C³/3 per chunk) and the elementwise gate work are left out: the model is a
floor. Bytes are the compulsory traffic: read q, k (per q/k head), v, g, β (per value head), write o, plus the
initial/final state when present; each at its own element size. The backward is counted as 2.5× the forward's
FLOPs (two gradient products per forward product, plus recomputing the state) and 2× its bytes (read the inputs
and dO, write a gradient per input), so fwd+bwd = 3.5× FLOPs and 3× bytes.

The softmax baseline (SDPA, causal) does QKᵀ (2T²K FLOPs per head) and PV (2T²V), halved by the causal mask:
FLOPs = B·HV·T²·(K + V); bytes = q, k, v read and o written once (the flash-attention floor). Units: latencies in
ms, first_call_s in s, throughput in tokens/s, tflops in TFLOP/s, gbs in GB/s.

The roofline floor is max(FLOPs / peak FLOP/s, bytes / peak bandwidth); "roofline_fraction" = floor / measured
median (1.0 = at the roofline). Peaks come from :data:`DEVICE_PEAKS` (or ``--peak-tflops/--peak-gbs``); with no
known peak (CPUs) the fraction is null, and TFLOP/s and GB/s are still reported.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from .cases import DTYPES, Shape, make_inputs
from .context import Context, compile_time, empty_cache, error_record, is_oom, shape_classes

CHUNK = 64
BWD_FLOP_FACTOR, BWD_BYTE_FACTOR = 2.5, 2.0

# Dense peaks used for the roofline: (TFLOP/s by dtype, GB/s). H200: bf16 and bandwidth measured (anchors), fp32 is
# the non-tensor-core spec figure (TF32 off). Others: vendor spec sheets (dense, no sparsity).
DEVICE_PEAKS = {
    "H200": ({"bf16": 790.0, "fp16": 790.0, "fp32": 67.0}, 4300.0, "measured bf16/bandwidth (anchors), fp32 spec"),
    "H100": ({"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}, 3350.0, "spec sheet (SXM)"),
    "A100": ({"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, 2039.0, "spec sheet (SXM 80GB)"),
    "L40S": ({"bf16": 362.0, "fp16": 362.0, "fp32": 91.6}, 864.0, "spec sheet"),
}


# --------------------------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------------------------
def percentile(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (0 ≤ p ≤ 100) with linear interpolation between order statistics (numpy's default)."""
    if not xs:
        raise ValueError("percentile of an empty sample")
    if not 0 <= p <= 100:
        raise ValueError(f"p must be in [0, 100], got {p}")
    s = sorted(xs)
    pos = (len(s) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float]) -> dict:
    n = len(samples_ms)
    mean = sum(samples_ms) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in samples_ms) / (n - 1)) if n > 1 else 0.0
    return {"n": n, "median_ms": percentile(samples_ms, 50), "p50_ms": percentile(samples_ms, 50),
            "p95_ms": percentile(samples_ms, 95), "p99_ms": percentile(samples_ms, 99), "min_ms": min(samples_ms),
            "max_ms": max(samples_ms), "mean_ms": mean, "std_ms": std}


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares slope of log(y) against log(x): the exponent p in y ∝ x^p (1 = linear growth)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0 and math.isfinite(y)]
    if len(pts) < 2:
        return None
    mx = sum(a for a, _ in pts) / len(pts)
    my = sum(b for _, b in pts) / len(pts)
    sxx = sum((a - mx) ** 2 for a, _ in pts)
    return sum((a - mx) * (b - my) for a, b in pts) / sxx if sxx > 0 else None


# --------------------------------------------------------------------------------------------------------------
# FLOP / byte model
# --------------------------------------------------------------------------------------------------------------
def _esize(dtype) -> int:
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    return torch.tensor([], dtype=dtype).element_size()


def gdn_cost(shape: Shape, dtype, direction: str = "fwd", *, chunk: int = CHUNK, g_bytes: int = 4,
             beta_bytes: Optional[int] = None, state: bool = False, n_seqs: Optional[int] = None) -> dict:
    """FLOPs and compulsory bytes of one chunked gated-delta-rule call (see the module docstring)."""
    e = _esize(dtype)
    beta_bytes = e if beta_bytes is None else beta_bytes
    B, T, H, HV, K, V = shape.B, shape.T, shape.H, shape.HV, shape.K, shape.V
    flops = B * T * HV * (4 * chunk * (K + V) + 6 * K * V)
    nbytes = B * T * (2 * H * K * e + HV * (2 * V * e + g_bytes + beta_bytes))
    if state:
        nbytes += 2 * (n_seqs or B) * HV * K * V * 4  # fp32 initial state read + final state written
    return _direction(flops, nbytes, direction)


def sdpa_cost(shape: Shape, dtype, direction: str = "fwd") -> dict:
    """Causal softmax attention: QKᵀ and PV over the lower triangle; q, k, v read and o written once."""
    e = _esize(dtype)
    B, T, HV, K, V = shape.B, shape.T, shape.HV, shape.K, shape.V
    flops = B * HV * T * T * (K + V)
    nbytes = B * T * HV * (2 * K + 2 * V) * e
    return _direction(flops, nbytes, direction)


def _direction(flops: float, nbytes: float, direction: str) -> dict:
    if direction == "fwdbwd":
        flops, nbytes = flops * (1 + BWD_FLOP_FACTOR), nbytes * (1 + BWD_BYTE_FACTOR)
    elif direction != "fwd":
        raise ValueError(f"direction must be 'fwd' or 'fwdbwd', got {direction!r}")
    return {"flops": float(flops), "bytes": float(nbytes)}


def device_peaks(ctx: Context, dtype: str) -> tuple[Optional[float], Optional[float], str]:
    """(TFLOP/s, GB/s, source) for the roofline on ctx.device; user overrides win."""
    tflops, gbs, src = None, None, "unknown device: pass --peak-tflops/--peak-gbs"
    if ctx.gpu:
        name = torch.cuda.get_device_name(ctx.device)
        for key, (peaks, bw, source) in DEVICE_PEAKS.items():
            if key in name:
                tflops, gbs, src = peaks.get(dtype), bw, source
                break
    if ctx.peak_tflops is not None or ctx.peak_gbs is not None:
        tflops = ctx.peak_tflops if ctx.peak_tflops is not None else tflops
        gbs = ctx.peak_gbs if ctx.peak_gbs is not None else gbs
        src = "user (--peak-tflops/--peak-gbs)"
    return tflops, gbs, src


def roofline(cost: dict, median_ms: float, tokens: int, peaks: tuple) -> dict:
    tflops, gbs, _ = peaks
    s = median_ms / 1e3
    out = {"flops": cost["flops"], "bytes": cost["bytes"], "tokens_per_s": tokens / s,
           "tflops": cost["flops"] / s / 1e12, "gbs": cost["bytes"] / s / 1e9, "floor_ms": None,
           "roofline_fraction": None, "bound": None}
    if tflops and gbs:
        t_c, t_m = cost["flops"] / (tflops * 1e12), cost["bytes"] / (gbs * 1e9)
        out["floor_ms"] = max(t_c, t_m) * 1e3
        out["roofline_fraction"] = out["floor_ms"] / median_ms
        out["bound"] = "compute" if t_c >= t_m else "memory"
    return out


# --------------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------------
def planned_calls(steady_s: float, warmup: int, reps: int, budget_s: float, min_reps: int = 3) -> tuple[int, int]:
    """(warm-up calls, timed calls) that fit ``budget_s`` for calls of ``steady_s`` each: warm-up gets a third of
    the budget, the timed calls the whole budget (at least ``min_reps``). On a GPU this is what bounds a row: the
    host enqueues calls far faster than the device runs them, so a clock read between enqueues says nothing: a
    fixed count of slow calls (SDPA forward + backward at T = 131072, 0.45 s each) would overrun the row's budget."""
    per = max(steady_s, 1e-6)
    return min(warmup, int(budget_s / 3 / per)), min(reps, max(min_reps, int(budget_s / per)))


def time_calls(ctx: Context, fn: Callable[[], object], warmup: int, reps: int, budget_s: float,
               min_reps: int = 3) -> dict:
    """First-call time, then per-call samples (ms) after warm-up; the number of calls is planned from a second,
    synchronised call so that the row fits ``budget_s`` (:func:`planned_calls`)."""
    ctx.sync()
    t0 = ctx.clock()
    fn()
    ctx.sync()
    first_s = ctx.clock() - t0
    t0 = ctx.clock()
    fn()
    ctx.sync()
    warmup, reps = planned_calls(ctx.clock() - t0, max(0, warmup - 1), reps, budget_s, min_reps)
    for _ in range(warmup):
        fn()
    ctx.sync()
    samples = []
    start = ctx.clock()
    if ctx.gpu:
        # one event pair per call, read after a single sync: no host sync between calls distorts the timings
        evs = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            evs.append((a, b))
        ctx.sync()
        samples = [a.elapsed_time(b) for a, b in evs]
    else:
        for i in range(reps):
            if i >= min_reps and ctx.clock() - start > budget_s:
                break
            t = ctx.clock()
            fn()
            samples.append((ctx.clock() - t) * 1e3)
    return {"first_call_s": first_s, "samples_ms": samples}


def make_call(impl, inputs: dict, direction: str) -> Callable[[], object]:
    """A closure doing one forward (no autograd graph) or one forward + backward of ``impl`` on ``inputs``."""
    if direction == "fwd":
        def fwd():
            with torch.no_grad():
                return impl(inputs)
        return fwd
    grads_of = impl.grad_inputs(inputs)
    o = impl(inputs)[0]
    do = torch.randn_like(o)
    del o

    def fwdbwd():
        o = impl(inputs)[0]
        return torch.autograd.grad(o, grads_of, do)
    return fwdbwd


def measure(ctx: Context, impl, shape: Shape, dtype: str, direction: str, *, warmup: int, reps: int,
            budget_s: float, seed: int = 0) -> dict:
    """One performance record (latency stats, throughput, roofline); ``error`` set if the call failed."""
    rec = {"id": f"{impl.name}/{shape.id}/{dtype}/{direction}", "impl": impl.name, "shape": vars(shape).copy(),
           "shape_id": shape.id, "dtype": dtype, "direction": direction}
    try:
        inputs = make_inputs(shape, DTYPES[dtype], ctx.device, seed, requires_grad=direction == "fwdbwd",
                             gates=ctx.gates)
        call = make_call(impl, inputs, direction)
        t = time_calls(ctx, call, warmup, reps, budget_s)
    except Exception as e:
        rec["error"] = error_record(e)
        rec["oom"] = is_oom(e)
        empty_cache(ctx)
        return rec
    rec["first_call_s"] = t["first_call_s"]
    rec.update(summarize(t["samples_ms"]))
    rec["samples_ms"] = t["samples_ms"]
    cost = sdpa_cost(shape, dtype, direction) if impl.kind == "softmax" else gdn_cost(shape, dtype, direction,
                                                                                       state=True)
    rec.update(roofline(cost, rec["median_ms"], shape.tokens, device_peaks(ctx, dtype)))
    del inputs, call
    empty_cache(ctx)
    return rec


def result_line(rec: dict) -> str:
    """A record's outcome for the log: median and P99, or the error."""
    if "error" in rec:
        return ("out of memory" if rec.get("oom") else f"error {rec['error']['type']}: "
                f"{rec['error']['message'][:80]}")
    return f"P50 {rec['p50_ms']:.3g} ms, P99 {rec['p99_ms']:.3g} ms, n={rec['n']}"


def run(ctx: Context) -> dict:
    p = ctx.profile
    records, skipped, unsupported = [], [], []
    ctx.partial.update(records=records, skipped_for_time=skipped, unsupported=unsupported)
    # dtype-major: when the budget is short, every shape is timed in the first dtype before any in the second
    rows = [(impl, shape, dtype, direction) for dtype in p.perf_dtypes for shape in p.perf_shapes
            for direction in p.perf_directions for impl in ctx.available()]
    uids = [f"{impl.name}/{shape.id}/{dtype}/{direction}" for impl, shape, dtype, direction in rows]
    earlier = ctx.earlier.get(ctx.section, {})
    # the rows this run may time: not carried from an earlier run (--resume), and supported
    todo = [uid not in earlier and not impl.supports_shape(shape, dtype=dtype)
            for (impl, shape, dtype, _), uid in zip(rows, uids)]

    def time_row(i: int, classes: tuple, units_left: int) -> None:
        (impl, shape, dtype, direction), uid = rows[i], uids[i]
        desc = f"perf {impl.name} {shape.id} {dtype} {direction}"
        if not ctx.fits(impl.name, classes, desc):
            skipped.append(uid)
            return
        ctx.step(desc, impl.name, classes)
        # each row may time for its fair share of what is left (a first call that compiles is not bounded)
        budget = min(p.point_budget_s, ctx.unit_budget(units_left))
        records.append(measure(ctx, impl, shape, dtype, direction, warmup=p.warmup, reps=p.reps, budget_s=budget,
                               seed=ctx.seed))
        ctx.done(result_line(records[-1]), compile_time(records[-1]))

    slow = []  # the second pass: rows expected to take over SLOW_UNIT_S (new compiles), in row order
    for i, ((impl, shape, dtype, direction), uid) in enumerate(zip(rows, uids)):
        if ctx.unsupported(impl, shape, uid, unsupported, dtype=dtype) or ctx.carry(uid, records):
            continue
        classes = shape_classes(impl, shape, dtype, direction)
        if ctx.defers(impl.name, classes):
            slow.append((i, classes))
            continue
        time_row(i, classes, sum(todo[i:]) + len(slow))
    for j, (i, classes) in enumerate(slow):
        time_row(i, classes, len(slow) - j)
    position = {uid: i for i, uid in enumerate(uids)}
    records.sort(key=lambda r: position.get(r["id"], len(uids)))  # the grid's order, as the tables show it
    peaks = {d: dict(zip(("tflops", "gbs", "source"), device_peaks(ctx, d))) for d in p.perf_dtypes}
    return {"timer": "cuda_events" if ctx.gpu else "monotonic", "warmup": p.warmup, "max_reps": p.reps,
            "chunk": CHUNK, "peaks": peaks, "records": records, "skipped_for_time": skipped,
            "unsupported": unsupported}
