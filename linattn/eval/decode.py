"""Decode (the real-time scenario): per-step latency of the recurrent decode paths, their bandwidth, and drift.

Serving a GDN model is a stream of tiny steps, each reading and writing the K×V state of every (sequence, value
head). This section measures that step for every implementation with a decode path:

* ``decode``: linattn's ``gated_delta_rule_decode``, a state pool ``[P, HV, K, V]`` (fp32 or bf16) addressed by slot
  (the slots have gaps and no order, as in continuous batching), updated in place; gate, β sigmoid and q/k L2 norm
  fused.
* ``recurrent``: linattn's ``fused_recurrent_gated_delta_rule`` called on Tq tokens at a time, the fp32 state passed
  as ``initial_state`` and replaced by ``final_state`` (no pool: the API has no slots).
* ``fla``: fla's ``fused_recurrent_gated_delta_rule`` the same way (CUDA, when importable). Its call takes the
  decay and β already activated, so the gate and sigmoid run in PyTorch inside the timed step (the eval's
  convention: a feature an implementation lacks is paid for in PyTorch, see impls.py); q/k L2 norm is its own.

Per (path, batch B, tokens per step Tq, pool dtype): the first call timed alone (JIT compile), ``dec_warmup`` steps
discarded, then ``dec_steps`` steps (≥ 1000 on a GPU) timed one by one, each ending with a synchronize as in a
generation loop whose next input depends on this step's output: CUDA events around the eager call on a GPU
(host launch overhead + kernel), the context's clock (:attr:`Context.clock`: ``time.monotonic``) on a CPU. Reported:
P50/P95/P99/max and every sample.
On a GPU also the step under CUDA-graph replay (``dec_graph_calls`` steps captured in one graph, median over
replays: the kernel time without the host), the bytes a step must move (state read + written once, plus q, k, v,
g, β in and o out), the bandwidth that implies, and the bandwidth of a torch device copy of the same bytes timed
the same way in the same run (``pct_of_copy``: 100 % = the step runs at the copy's speed, its floor).

Drift: prefill a prompt with the implementation's chunked op, put its final state in the pool (fp32 and bf16), then
``dec_drift_steps`` one-token steps; outputs and the final state against the float64 token-by-token reference over
the whole sequence, on the same rounded inputs. Rows of the pool the step does not own must stay untouched.

On a CPU the section runs PyTorch with one intra-op thread (restored afterwards): a step is a few µs-sized ops, and
OpenMP fork/join across threads costs more than it saves (on a busy machine, ten times more).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..ops.gated_delta.reference import gated_delta_rule_reference
from ..ops.utils import gate_from_raw, l2norm
from .cases import DTYPES, Shape
from .context import Context, compile_time, empty_cache, error_record, is_oom, shape_classes
from .correctness import compare
from .perf import device_peaks, summarize

# relative L2 of o (and of the final state) over the drift steps, by the coarsest of (q/k/v dtype, pool dtype).
# fp32: the kernels' fp32 rounding, nothing else; bf16 adds the output's rounding (~2e-3) and, for a bf16 pool, the
# state rounded once per step (contractive recurrence: the error settles instead of growing).
DRIFT_TOL = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 3e-2}
_PRECISION = ("fp32", "fp16", "bf16")  # finest first
DRIFT_B = 2
DRIFT_WINDOWS = 8


@dataclass(frozen=True)
class DecodePath:
    impl: str  # the --impl name it belongs to
    path: str  # "decode", "recurrent" or "fla"
    pools: tuple  # state dtypes it can keep ("fp32" only for paths whose state is an fp32 initial/final state)
    backend: Optional[str] = None  # linattn's backend (None: the device's default)

    @property
    def name(self) -> str:
        return f"{self.impl}/{self.path}"


def paths_for(ctx: Context) -> tuple[list, list]:
    """(decode paths of the available implementations, [{impl, reason}] for those without one)."""
    paths, none = [], []
    for impl in ctx.available():
        if impl.name.startswith("linattn"):
            backend = None if impl.name == "linattn" else impl.name.split("-")[1]
            paths.append(DecodePath(impl.name, "decode", ("fp32", "bf16", "fp16"), backend))
            paths.append(DecodePath(impl.name, "recurrent", ("fp32",), backend))
        elif impl.name == "fla":
            try:
                from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule  # noqa: F401
                paths.append(DecodePath("fla", "fla", ("fp32",)))
            except Exception as e:  # installed without the recurrent op, or broken: say so
                none.append({"impl": "fla", "reason": f"fused_recurrent not importable ({type(e).__name__}: {e})"})
        elif impl.kind == "softmax":
            none.append({"impl": impl.name, "reason": "softmax baseline: a KV-cache decode is not measured"})
        else:
            none.append({"impl": impl.name, "reason": "no recurrent decode entry point wired into linattn eval"})
    return paths, none


# --------------------------------------------------------------------------------------------------------------
# inputs and one step
# --------------------------------------------------------------------------------------------------------------
def step_inputs(shape: Shape, B: int, T: int, dtype: torch.dtype, device, seed: int) -> dict:
    """Raw serving inputs for T tokens of B sequences: q, k, v (``dtype``), gate logits g (fp32), β logits
    (``dtype``), and the gate parameters A_log, dt_bias (fp32). Drawn in float64, then rounded."""
    gen = torch.Generator(device=device).manual_seed(seed)
    f64 = dict(device=device, dtype=torch.float64, generator=gen)
    H, HV, K, V = shape.H, shape.HV, shape.K, shape.V
    return dict(q=torch.randn(B, T, H, K, **f64).to(dtype), k=torch.randn(B, T, H, K, **f64).to(dtype),
                v=torch.randn(B, T, HV, V, **f64).to(dtype), g=torch.randn(B, T, HV, **f64).float(),
                beta=torch.randn(B, T, HV, **f64).to(dtype),
                A_log=torch.log(torch.rand(HV, **f64) * 4 + 1).float(), dt_bias=(torch.rand(HV, **f64) - 0.5).float())


def _slice(x: dict, t0: int, t1: int) -> dict:
    return {n: (v[:, t0:t1] if v.dim() > 1 else v) for n, v in x.items()}


class State:
    """The recurrent state a path keeps between steps: a pool with slots (``decode``) or a dense fp32 tensor."""

    def __init__(self, path: DecodePath, h0: torch.Tensor, pool_dtype: torch.dtype, seed: int):
        B = h0.shape[0]
        self.pooled = path.path == "decode"
        if self.pooled:
            # 2B + 1 rows, the sequences in a random subset of them: gaps and no order, as a serving engine has
            P = 2 * B + 1
            gen = torch.Generator(device="cpu").manual_seed(seed)
            self.slots = torch.randperm(P, generator=gen)[:B].to(h0.device)
            dgen = torch.Generator(device=h0.device).manual_seed(seed)
            self.pool = (torch.randn(P, *h0.shape[1:], device=h0.device, generator=dgen) * 0.05).to(pool_dtype)
            self.pool[self.slots] = h0.to(pool_dtype)
            self.others = sorted(set(range(P)) - set(self.slots.tolist()))
            self.others_before = self.pool[self.others].clone()
        else:
            self.h = h0.float().contiguous()

    def current(self) -> torch.Tensor:
        return self.pool[self.slots] if self.pooled else self.h

    def others_untouched(self) -> Optional[bool]:
        return bool(torch.equal(self.pool[self.others], self.others_before)) if self.pooled else None


def make_step(path: DecodePath, st: State) -> Callable[[dict], torch.Tensor]:
    """A function doing one decode step of ``path`` on raw inputs x (:func:`step_inputs`, T = Tq); returns o."""
    if path.path == "decode":
        from .. import gated_delta_rule_decode

        def step(x):
            # the slots were checked when the State was built; a serving loop skips the host-side check (a sync)
            return gated_delta_rule_decode(x["q"], x["k"], x["v"], x["g"], x["beta"], state_pool=st.pool,
                                           state_indices=st.slots, A_log=x["A_log"], dt_bias=x["dt_bias"],
                                           use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                           check_indices=False, backend=path.backend)[0]
        return step
    if path.path == "recurrent":
        from .. import fused_recurrent_gated_delta_rule

        def step(x):
            o, st.h = fused_recurrent_gated_delta_rule(
                x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=st.h, output_final_state=True,
                A_log=x["A_log"], dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, backend=path.backend)
            return o
        return step
    if path.path == "fla":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

        def step(x):
            g = gate_from_raw(x["g"], x["A_log"], x["dt_bias"])
            o, st.h = fla_recurrent(q=x["q"], k=x["k"], v=x["v"], g=g, beta=x["beta"].sigmoid(),
                                    scale=x["q"].shape[-1] ** -0.5, initial_state=st.h, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
            return o
        return step
    raise ValueError(f"unknown decode path {path.path!r}")


def step_bytes(shape: Shape, B: int, Tq: int, io_dtype: str, state_dtype: str) -> dict:
    """Bytes one step must move: the state read and written once (whatever Tq), q, k, v, β in and o out at the
    input dtype, g in fp32."""
    e, es = DTYPES[io_dtype].itemsize, DTYPES[state_dtype].itemsize
    H, HV, K, V = shape.H, shape.HV, shape.K, shape.V
    state = 2 * B * HV * K * V * es
    io = B * Tq * (2 * H * K * e + HV * (2 * V * e + 4 + e))
    return {"state_bytes": state, "io_bytes": io, "bytes": state + io}


# --------------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------------
def time_steps(ctx: Context, fn: Callable[[], object], warmup: int, steps: int, budget_s: float,
               min_steps: int) -> dict:
    """First-call time (s), then per-step samples (ms) after warm-up, a synchronize after every step."""
    ctx.sync()
    t0 = ctx.clock()
    fn()
    ctx.sync()
    first_s = ctx.clock() - t0
    for _ in range(warmup):
        fn()
    ctx.sync()
    samples = []
    start = ctx.clock()
    for i in range(steps):
        if i >= min_steps and ctx.clock() - start > budget_s:
            break
        if ctx.gpu:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        else:
            t = ctx.clock()
            fn()
            samples.append((ctx.clock() - t) * 1e3)
    return {"first_call_s": first_s, "samples_ms": samples}


def graph_ms(fn: Callable[[], object], calls: int, replays: int) -> float:
    """Median ms per call with ``calls`` calls of fn captured in one CUDA graph (no host work between them)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as graph capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    del graph
    return sorted(times)[len(times) // 2]


# where the copy's destination starts relative to its source, in fp32 elements past a fresh allocation. On the H200
# copies of ~260 MB read 2.7 TB/s for the first size of each batch and 4.1 TB/s for the next ones (placement or
# warm-up, not isolated), and a 2 × 268 MB copy reads 2.75 TB/s while the decode step moves the same bytes in place
# at 3.65 TB/s: the reference is the best of a few placements of the copy and of an in-place pass (negate) over the
# same bytes — the access pattern of the step itself, which reads and writes its state where it lies
COPY_PLACEMENTS = (0, (1 << 18) + 1024, (3 << 18) + 3 * 1024)


def copy_gbs(device: torch.device, nbytes: int, calls: int = 20, replays: int = 30) -> float:
    """GB/s of a device-to-device stream moving ``nbytes`` (half read, half written), graph-timed like a step: the
    best of a torch copy into each of :data:`COPY_PLACEMENTS` and an in-place negate of the source."""
    n = max(nbytes // 8, 1 << 16)  # fp32 elements in the source
    src = torch.randn(n, device=device)
    best = 0.0
    for pad in (*COPY_PLACEMENTS, None):
        if pad is None:
            ms = graph_ms(lambda: src.neg_(), calls, replays)
        else:
            dst = torch.empty(n + pad, device=device)[pad:]
            ms = graph_ms(lambda dst=dst: dst.copy_(src), calls, replays)
            del dst
        best = max(best, 2 * n * 4 / (ms * 1e-3) / 1e9)
    return best


def record_id(path: DecodePath, shape: Shape, B: int, Tq: int, pool: str) -> str:
    """A latency record's id: path, batch, tokens per step, head and state dimensions, pool dtype."""
    return f"{path.name}/B{B}-Tq{Tq}-H{shape.H}x{shape.HV}-K{shape.K}V{shape.V}/{pool}"


def skip_label(path_name: str, B: int, Tq: int, pool: str) -> str:
    """How ``skipped_for_time`` names a latency row that did not fit (``DecodePath.name``, batch, tokens, pool)."""
    return f"{path_name}/B{B}-Tq{Tq}/{pool}"


def measure(ctx: Context, path: DecodePath, B: int, Tq: int, pool: str, budget_s: float, copy_cache: dict) -> dict:
    """One latency record of ``path`` at (B, Tq, pool dtype); ``error`` set if it failed."""
    p = ctx.profile
    shape = p.dec_shape
    rec = {"id": record_id(path, shape, B, Tq, pool), "impl": path.impl, "path": path.path, "B": B, "Tq": Tq,
           "pool": pool, "io_dtype": p.dec_dtype, "shape": {"H": shape.H, "HV": shape.HV, "K": shape.K, "V": shape.V}}
    rec.update(step_bytes(shape, B, Tq, p.dec_dtype, pool))
    try:
        x = step_inputs(shape, B, Tq, DTYPES[p.dec_dtype], ctx.device, ctx.seed + B * 31 + Tq)
        h0 = torch.randn(B, shape.HV, shape.K, shape.V, device=ctx.device) * 0.05
        st = State(path, h0, DTYPES[pool], ctx.seed)
        step = make_step(path, st)
        t = time_steps(ctx, lambda: step(x), p.dec_warmup, p.dec_steps, budget_s,
                       min_steps=p.dec_steps if ctx.gpu else min(p.dec_steps, 100))
        rec["first_call_s"] = t["first_call_s"]
        rec.update(summarize(t["samples_ms"]))
        rec["samples_ms"] = t["samples_ms"]
        rec["truncated"] = len(t["samples_ms"]) < p.dec_steps
        rec["ms_per_token"] = rec["p50_ms"] / Tq
        rec["finite"] = bool(torch.isfinite(st.current()).all())
        rec.update({"graph_ms": None, "gbs": None, "copy_gbs": None, "pct_of_copy": None, "pct_of_peak_bw": None})
        if ctx.gpu:
            try:
                rec["graph_ms"] = graph_ms(lambda: step(x), p.dec_graph_calls, p.dec_graph_replays)
                rec["graph_ms_per_token"] = rec["graph_ms"] / Tq
                rec["gbs"] = rec["bytes"] / (rec["graph_ms"] * 1e-3) / 1e9
                if rec["bytes"] not in copy_cache:
                    copy_cache[rec["bytes"]] = copy_gbs(ctx.device, rec["bytes"], p.dec_graph_calls,
                                                        p.dec_graph_replays)
                rec["copy_gbs"] = copy_cache[rec["bytes"]]
                rec["pct_of_copy"] = 100 * rec["gbs"] / rec["copy_gbs"]
                # a second reference: the device's bandwidth ceiling (perf.DEVICE_PEAKS or --peak-gbs). A single
                # torch copy measured 2.7 instead of 4.1 TB/s at some sizes on the H200 (2026-11-29), below the
                # decode kernel itself; copy_gbs now takes the best of several placements
                peak_gbs = device_peaks(ctx, "fp32")[1]
                rec["pct_of_peak_bw"] = 100 * rec["gbs"] / peak_gbs if peak_gbs else None
            except Exception as e:  # capture can fail where eager works (a host sync inside the call): report it
                rec["graph_error"] = error_record(e)
    except Exception as e:
        rec["error"] = error_record(e)
        rec["oom"] = is_oom(e)
    empty_cache(ctx)
    return rec


# --------------------------------------------------------------------------------------------------------------
# drift against float64
# --------------------------------------------------------------------------------------------------------------
def reference(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 token-by-token reference of the whole sequence, the pre-processing done in float64 too."""
    q, k = l2norm(x["q"].double()), l2norm(x["k"].double())
    g = gate_from_raw(x["g"].double(), x["A_log"].double(), x["dt_bias"].double())
    return gated_delta_rule_reference(q, k, x["v"].double(), g, x["beta"].double().sigmoid(), q.shape[-1] ** -0.5)


def _prefill(ctx: Context, path: DecodePath, x: dict) -> torch.Tensor:
    """The prompt's final state from the implementation's own chunked op (what a serving engine does first)."""
    impl = next(i for i in ctx.available() if i.name == path.impl)
    inputs = dict(x, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True)
    with torch.no_grad():
        return impl(inputs)[1].float()


def drift_tolerance(io_dtype: str, pool: str) -> float:
    return DRIFT_TOL[max(io_dtype, pool, key=_PRECISION.index)]


def drift(ctx: Context, path: DecodePath, pool: str, refs: dict) -> dict:
    """Prefill, then ``dec_drift_steps`` one-token steps; errors against float64 (``refs`` caches inputs/refs)."""
    p = ctx.profile
    shape, T0, N = p.dec_shape, p.dec_prompt_T, p.dec_drift_steps
    rec = {"id": f"{path.name}/{pool}", "impl": path.impl, "path": path.path, "pool": pool, "io_dtype": p.dec_dtype,
           "B": DRIFT_B, "prompt_T": T0, "steps": N, "tolerance": drift_tolerance(p.dec_dtype, pool)}
    try:
        if "x" not in refs:
            refs["x"] = step_inputs(shape, DRIFT_B, T0 + N, DTYPES[p.dec_dtype], ctx.device, ctx.seed + 7)
            refs["ref"] = reference(refs["x"])
        x, (ro, rht) = refs["x"], refs["ref"]
        h0 = (_prefill(ctx, path, _slice(x, 0, T0)) if T0 else
              torch.zeros(DRIFT_B, shape.HV, shape.K, shape.V, device=ctx.device))
        st = State(path, h0, DTYPES[pool], ctx.seed)
        step = make_step(path, st)
        with torch.no_grad():
            o = torch.cat([step(_slice(x, T0 + t, T0 + t + 1)) for t in range(N)], 1)
        ctx.sync()
    except Exception as e:
        rec["error"] = error_record(e)
        rec["passed"] = False
        return rec
    ref_o = ro[:, T0:]
    m_o, m_h = compare(o, ref_o), compare(st.current(), rht)
    edges = [round(N * i / DRIFT_WINDOWS) for i in range(DRIFT_WINDOWS + 1)]
    edges = sorted(set(edges))
    rec["window_end_steps"] = edges[1:]
    rec["rel_l2_o_windows"] = [compare(o[:, a:b], ref_o[:, a:b])["rel_l2"] for a, b in zip(edges[:-1], edges[1:])]
    rec.update(rel_l2_o=m_o["rel_l2"], max_abs_o=m_o["max_abs"], rel_l2_state=m_h["rel_l2"],
               max_abs_state=m_h["max_abs"], nonfinite=m_o["nonfinite"] + m_h["nonfinite"],
               others_untouched=st.others_untouched())
    rec["passed"] = (rec["nonfinite"] == 0 and rec["rel_l2_o"] <= rec["tolerance"]
                     and rec["rel_l2_state"] <= rec["tolerance"] and rec["others_untouched"] is not False)
    return rec


# --------------------------------------------------------------------------------------------------------------
# the section
# --------------------------------------------------------------------------------------------------------------
def _impl(ctx: Context, path: DecodePath):
    return next(i for i in ctx.available() if i.name == path.impl)


def step_classes(impl, path: DecodePath, shape: Shape, Tq: int, pool: str, io_dtype: str) -> tuple:
    """Compile classes of a decode step: its own kernel, per path, tokens per step and state dtype."""
    return shape_classes(impl, shape.with_(T=Tq), io_dtype, "fwd", step=(path.path, pool))


def run(ctx: Context) -> dict:
    p = ctx.profile
    paths, none = paths_for(ctx)
    threads = torch.get_num_threads()
    if not ctx.gpu:
        torch.set_num_threads(1)
    drifts, records, skipped = [], [], []
    try:
        jobs = [(path, pool) for path in paths for pool in p.dec_drift_pools if pool in path.pools]
        refs: dict = {}
        ctx.partial.update(drift=drifts, records=records, skipped_for_time=skipped)
        with ctx.share(2):  # correctness first, with at most half of the section's time
            for path, pool in jobs:
                impl = _impl(ctx, path)
                # the prefill compiles the implementation's chunked forward; the steps its recurrent kernel
                classes = (shape_classes(impl, p.dec_shape.with_(T=p.dec_prompt_T), p.dec_dtype, "fwd", l2norm=True,
                                         gate=True, beta_sigmoid=True)
                           + step_classes(impl, path, p.dec_shape, 1, pool, p.dec_dtype))
                desc = f"decode drift {path.name} {pool}"
                if ctx.carry(f"drift/{path.name}/{pool}", drifts):  # drift()'s record id
                    continue
                if not ctx.fits(path.impl, classes, desc):
                    skipped.append(f"drift {path.name}/{pool}")
                    continue
                ctx.step(desc, path.impl, classes)
                d = drift(ctx, path, pool, refs)
                drifts.append(d)
                ctx.done(f"error {d['error']['type']}: {d['error']['message'][:80]}" if "error" in d else
                         f"{'ok' if d['passed'] else 'FAIL'} rel L2 o {d['rel_l2_o']:.1e}, state "
                         f"{d['rel_l2_state']:.1e}")
        del refs
        rows = [(path, B, Tq, pool) for B in p.dec_batch for Tq in p.dec_Tq for pool in p.dec_pools
                for path in paths if pool in path.pools]
        copy_cache: dict = {}
        earlier = ctx.earlier.get(ctx.section, {})
        todo = [record_id(path, p.dec_shape, B, Tq, pool) not in earlier for path, B, Tq, pool in rows]
        for i, (path, B, Tq, pool) in enumerate(rows):
            if ctx.carry(record_id(path, p.dec_shape, B, Tq, pool), records):
                continue
            classes = step_classes(_impl(ctx, path), path, p.dec_shape, Tq, pool, p.dec_dtype)
            desc = f"decode {path.name} B={B} Tq={Tq} {pool}"
            if not ctx.fits(path.impl, classes, desc):
                skipped.append(skip_label(path.name, B, Tq, pool))
                continue
            ctx.step(desc, path.impl, classes)
            rec = measure(ctx, path, B, Tq, pool, ctx.unit_budget(sum(todo[i:])), copy_cache)
            records.append(rec)
            ctx.done(f"error {rec['error']['type']}: {rec['error']['message'][:80]}" if "error" in rec else
                     f"P50 {rec['p50_ms'] * 1e3:.3g} us, P99 {rec['p99_ms'] * 1e3:.3g} us, n={rec['n']}"
                     + (f", graph {rec['graph_ms'] * 1e3:.3g} us" if rec.get("graph_ms") else ""),
                     compile_time(rec))
    finally:
        torch.set_num_threads(threads)
    s = p.dec_shape
    return {"timer": "cuda_events" if ctx.gpu else "monotonic", "graph": ctx.gpu,
            "cpu_threads": None if ctx.gpu else 1, "steps": p.dec_steps, "warmup": p.dec_warmup,
            "graph_calls": p.dec_graph_calls if ctx.gpu else None, "io_dtype": p.dec_dtype,
            "shape": {"H": s.H, "HV": s.HV, "K": s.K, "V": s.V}, "paths": [x.name for x in paths],
            "not_measured": none, "drift": drifts, "records": records, "skipped_for_time": skipped}


def best_step(decode: dict, impl: str) -> Optional[dict]:
    """The impl's fastest path (lowest P99) at the smallest batch, one token per step, fp32 state: the number the
    real-time scorecard and the summary use."""
    recs = [r for r in (decode or {}).get("records", []) if r["impl"] == impl and "p99_ms" in r
            and r["Tq"] == 1 and r["pool"] == "fp32"]
    if not recs:
        return None
    b = min(r["B"] for r in recs)
    return min((r for r in recs if r["B"] == b), key=lambda r: r["p99_ms"])
