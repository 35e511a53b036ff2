"""Writers: ``report.json`` (numbers), ``report.md`` (tables, plots as PNG beside it) and a self-contained
``report.html`` (the same tables, plots embedded as base64 PNG, no external file or network access).

Both human-readable reports are rendered from one list of blocks (heading, paragraph, table, figure) built by
:func:`blocks`, so the Markdown and the HTML never disagree.

Every file is written atomically (a temporary file in the same directory, then ``os.replace``): a run killed while
writing leaves the previous complete file, never half of one. ``linattn eval`` writes the reports after every
section (``"partial": true``) and once more at the end.
"""
from __future__ import annotations

import base64
import html
import json
import math
import os
from typing import Optional

from . import SECTIONS, stopped_during
from .decode import best_step
from .resume import describe as describe_resume
from .verdict import verdict
from .warm import describe


# --------------------------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------------------------
def clean(x):
    """JSON-safe copy: NaN/Inf → None (strict JSON has no NaN), tuples → lists, other objects → str."""
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def atomic_write(path: str, data) -> None:
    """Write ``data`` (str or bytes) to ``path`` through a temporary file and ``os.replace``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as fh:
            fh.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def prepare_out_dir(path: str) -> str:
    """Create the output directory ``path`` (and its missing parents) and check that it can be written; a
    ValueError with one line saying what is wrong otherwise (so a run finds out before it starts, not at the end)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out {path}: exists and is not a directory; name a directory (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"--out {path}: a parent of it is a file, not a directory") from None
    except PermissionError:
        raise ValueError(f"--out {path}: no permission to create it") from None
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create it ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: the directory is not writable")
    return path


def write_json(results: dict, path: str) -> None:
    missing = [s for s in SECTIONS if s not in results]
    if missing:
        raise ValueError(f"report is missing sections {missing}")
    atomic_write(path, json.dumps(clean(results), indent=1, allow_nan=False))


# --------------------------------------------------------------------------------------------------------------
# formatting helpers
# --------------------------------------------------------------------------------------------------------------
def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x == 0:
            return "0"
        if abs(x) >= 1e5 or abs(x) < 1e-3:
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:,.{max(0, digits - len(str(int(abs(x)))))}f}"
    return str(x)


def mb(x) -> str:
    return "–" if x is None else f"{x / 2**20:,.1f}"


def _status(r: dict) -> str:
    # records written before every section set a status (a merged older report) say it with their keys
    status = r.get("status") or ("skipped" if "skipped" in r else "error" if "error" in r else
                                 "pass" if r.get("passed") else "fail")
    return {"pass": "PASS", "fail": "FAIL", "error": "ERROR", "hang": "HANG", "unsupported": "n/a"}.get(status, status)


def _why(r: dict) -> str:
    """What a record that has no result says about it: the error's message, the reason, or the hang's timeout."""
    if "error" in r:
        return r["error"]["message"]
    if r.get("status") == "hang":
        return f"no return after {fmt(r.get('timeout_s'))} s"
    return str(r.get("reason") or r.get("skipped") or "")


# --------------------------------------------------------------------------------------------------------------
# blocks
# --------------------------------------------------------------------------------------------------------------
def _who(x: dict, name: Optional[str] = None) -> str:
    """A table row's implementation (or ``name``), marked ⁺ when the record was carried from an earlier run
    (``--resume``: its ``carried_from`` names that run)."""
    return (name or x["impl"]) + (" ⁺" if "carried_from" in x else "")


def _h(level, text):
    return ("h", level, text)


def _p(text):
    return ("p", text)


def _t(headers, rows):
    return ("t", headers, rows)


def _fig(name, caption):
    return ("fig", name, caption)


def _env_blocks(r: dict) -> list:
    env = r["environment"]
    gpu = env.get("gpu") or {}
    commit = env.get("commit") or {}
    rows = [["date (UTC)", env.get("date_utc")], ["device", env.get("device")],
            ["GPU", gpu.get("name", "none (CPU run)")], ["driver", env.get("driver") or "–"],
            ["CUDA", env.get("cuda") or "–"], ["torch", env.get("torch")], ["triton", env.get("triton") or "–"],
            ["linattn", env.get("linattn")],
            ["commit", (commit.get("sha", "–")[:12] + (" (dirty)" if commit.get("dirty") else "")) if commit else "–"],
            ["CPU", f"{env.get('cpu')} ({env.get('cpu_count')} cores, {env.get('torch_threads')} torch threads)"],
            ["load average (start, end)", f"{fmt(env.get('load_avg_start'))}, {fmt(env.get('load_avg_end'))}"],
            ["environment variables", ", ".join(f"{k}={v}" for k, v in (env.get("env") or {}).items()) or "–"],
            ["linattn Triton settings", ", ".join(f"{k}={v}" for k, v in (env.get("linattn_settings") or {}).items())
             or "–"],
            ["profile", r["meta"]["profile"]], ["gates (speed sections)", r["meta"].get("gates", "default")],
            ["wall time", f"{r['meta']['wall_s']:.0f} s"]]
    runs = env.get("runs") or []
    if runs:
        rows[0][0] = "date (UTC, first run)"
        rows[-1] = [f"wall time (sum of {len(runs)} runs)", f"{r['meta']['wall_s']:.0f} s"]
    # --warm-from: what the budget took as already compiled (a merged report: per run)
    warm = [("warm from", r["meta"].get("warm_from"))] + [
        (f"run {i + 1} warm from", m.get("warm_from")) for i, m in enumerate(r["meta"].get("merged_from") or [])]
    rows += [[label, describe(w)] for label, w in warm if w]
    # --resume: the units taken from earlier runs (each such record names its run in ``carried_from``)
    resumed = [("resumed from", r["meta"].get("resumed_from"))] + [
        (f"run {i + 1} resumed from", m.get("resumed_from")) for i, m in enumerate(r["meta"].get("merged_from") or [])]
    rows += [[label, describe_resume(w) + " (their rows are marked ⁺)"] for label, w in resumed if w]
    for impl in r["meta"]["impls"]:
        rows.append([f"impl {impl['name']}", impl["version"] if impl["available"] else f"skipped: {impl['reason']}"])
    out = [_h(2, "Environment"), _t(["item", "value"], rows)]
    if runs:
        out.append(_p(f"Merged from {len(runs)} runs (the table above is the first run's; `environment.runs` in "
                      "report.json has each run's whole environment)"
                      + (": they differ in " + ", ".join(env["differences"]) if env.get("differences") else "")
                      + "."))
        out.append(_t(["run", "report", "date (UTC)", "commit", "GPU", "driver", "torch", "triton", "linattn",
                       "wall time", "sections"],
                      [[str(i + 1), e.get("path"), e.get("date_utc"),
                        ((e.get("commit") or {}).get("sha", "–")[:12]
                         + (" (dirty)" if (e.get("commit") or {}).get("dirty") else "")),
                        (e.get("gpu") or {}).get("name", "none (CPU run)"), e.get("driver") or "–", e.get("torch"),
                        e.get("triton") or "–", e.get("linattn"),
                        f"{e['wall_s']:.0f} s" if e.get("wall_s") is not None else "–",
                        ", ".join(x for x in e.get("sections", []) if x != "scorecard")
                        + (" (partial)" if e.get("partial") else "")] for i, e in enumerate(runs)]))
    nv = env.get("nvml", {})
    if nv.get("available"):
        out.append(_t(["section", "GPU util mean %", "GPU util max %", "memory used max (MB)"],
                      [[s, fmt(v["gpu_util_mean_pct"]), fmt(v["gpu_util_max_pct"]), mb(v["memory_used_max_bytes"])]
                       for s, v in nv["per_section"].items()]))
    else:
        out.append(_p(f"GPU utilisation (NVML): {nv.get('reason', 'not sampled')}."))
    return out


def _corr_blocks(r: dict) -> list:
    c = r["correctness"]
    out = [_h(2, "Correctness"), _p(
        f"Against the {c['reference']} reference, forward and backward; relative L2 tolerances per dtype: "
        + ", ".join(f"{d} fwd {fmt(t['fwd'])} / bwd {fmt(t['bwd'])}" for d, t in c["tolerances"].items()) + ".")]
    rows = []
    for name, s in c["summary"].items():
        rows.append([name, f"{s['passed']}/{s['cases']}",
                     ", ".join(f"{d}: {fmt(v)}" for d, v in s["worst_rel_l2_fwd"].items()),
                     ", ".join(f"{d}: {fmt(v)}" for d, v in s["worst_rel_l2_bwd"].items()),
                     ", ".join(s["failed"]) or "–"])
    out.append(_t(["impl", "passed", "worst rel L2 fwd", "worst rel L2 bwd", "failed"], rows))
    rows = [[_who(x), x["case"], x["dtype"], _status(x), fmt(x.get("max_rel_l2_fwd")),
             fmt(x.get("max_rel_l2_bwd")), fmt(x.get("nonfinite")),
             (x.get("error") or {}).get("message", x.get("reason", ""))] for x in c["records"]]
    out.append(_t(["impl", "case", "dtype", "status", "rel L2 fwd", "rel L2 bwd", "NaN/Inf", "note"], rows))
    if c["reproducibility"]:
        out.append(_t(["impl", "case", "dtype", "bitwise identical", "max |diff|"],
                      [[_who(x), x.get("case"), x.get("dtype"), fmt(x.get("bitwise")), fmt(x.get("max_abs_diff"))]
                       for x in c["reproducibility"]]))
    for x in c["not_checked"]:
        out.append(_p(f"{x['impl']}: not checked ({x['reason']})."))
    return out


def _perf_blocks(r: dict) -> list:
    p = r["performance"]
    out = [_h(2, "Performance"), _p(
        f"Timer: {p['timer']}; {p['warmup']} warm-up calls, up to {p['max_reps']} timed calls per row. Roofline "
        "fraction = model floor / median (see docs/eval.md); peaks: " + "; ".join(
            f"{d}: {fmt(v['tflops'])} TFLOP/s, {fmt(v['gbs'])} GB/s ({v['source']})" for d, v in p["peaks"].items())
        + ".")]
    rows = []
    for x in p["records"]:
        if "error" in x:
            rows.append([_who(x), x["shape_id"], x["dtype"], x["direction"], "error: " + x["error"]["type"]]
                        + [""] * 9)
            continue
        rows.append([_who(x), x["shape_id"], x["dtype"], x["direction"], fmt(x["p50_ms"]), fmt(x["p95_ms"]),
                     fmt(x["p99_ms"]), fmt(x["max_ms"]), fmt(x["tokens_per_s"] / 1e6), fmt(x["tflops"]),
                     fmt(x["gbs"]), fmt(x["roofline_fraction"]), fmt(x["first_call_s"]), str(x["n"])])
    out.append(_t(["impl", "shape", "dtype", "dir", "P50 ms", "P95 ms", "P99 ms", "max ms", "Mtok/s", "TFLOP/s",
                   "GB/s", "roofline frac", "first call s", "n"], rows))
    out.append(_fig("latency_dist", "Latency distribution per row (box: P25-P75, whiskers: P5-P95, dots: P99)."))
    return out


def us(x) -> str:
    return "–" if x is None else fmt(x * 1e3)


def _decode_blocks(r: dict) -> list:
    d = r["decode"]
    s = d["shape"]
    text = (f"Per-step latency of each decode path: {d['warmup']} warm-up steps, then up to {d['steps']} steps timed "
            f"one by one ({d['timer']}), each finished before the next starts, as in a generation loop; H={s['H']}, "
            f"HV={s['HV']}, K={s['K']}, V={s['V']}, q/k/v {d['io_dtype']}, gate, β sigmoid and q/k L2 norm in the "
            "step. Latencies in µs. ")
    if d["graph"]:
        text += (f"Graph µs: the step under CUDA-graph replay ({d['graph_calls']} steps per graph; kernel time, no "
                 "host). GB/s: the bytes a step must move (state read + written once, q/k/v/g/β in, o out) over "
                 "the graph time; % of copy: against a torch device copy of the same bytes timed the same way; "
                 "% of peak: against the device's bandwidth ceiling (the roofline's, or --peak-gbs).")
    else:
        text += (f"No CUDA: eager steps only (no graph replay or bandwidth); PyTorch ran with "
                 f"{d['cpu_threads']} intra-op thread.")
    out = [_h(2, "Decode (real time)"), _p(text)]
    # no graph or bandwidth on a CPU
    gpu = ["graph", "GB/s", "copy GB/s", "% of copy", "% of peak"] if d["graph"] else []
    hdr = ["path", "B", "Tq", "state", "steps", "P50", "P95", "P99", "max", "P50 / token"] + gpu + ["MB / step",
                                                                                                 "first call s"]
    rows = []
    for x in d["records"]:
        head = [_who(x, f"{x['impl']}/{x['path']}"), str(x["B"]), str(x["Tq"]), x["pool"]]
        if "error" in x:
            rows.append(head + ["error: " + x["error"]["type"] + ": " + x["error"]["message"][:80]]
                        + [""] * (len(hdr) - 5))
            continue
        graph = us(x.get("graph_ms")) if "graph_error" not in x else "error: " + x["graph_error"]["type"]
        bw = [graph, fmt(x.get("gbs")), fmt(x.get("copy_gbs")), fmt(x.get("pct_of_copy")),
              fmt(x.get("pct_of_peak_bw"))] if gpu else []
        rows.append(head + [str(x["n"]), us(x["p50_ms"]), us(x["p95_ms"]), us(x["p99_ms"]), us(x["max_ms"]),
                            us(x["ms_per_token"])] + bw + [fmt(x["bytes"] / 2**20), fmt(x["first_call_s"])])
    out.append(_t(hdr, rows))
    out.append(_fig("decode_latency", "Per-step latency distribution per row (box: P25-P75, whiskers: P5-P95, "
                                      "red dot: P99, black x: max)."))
    rows = []
    for x in d["drift"]:
        if "error" in x:
            rows.append([_who(x, f"{x['impl']}/{x['path']}"), x["pool"], "", "ERROR", x["error"]["message"][:100]]
                        + [""] * 5)
            continue
        rows.append([_who(x, f"{x['impl']}/{x['path']}"), x["pool"], f"{x['prompt_T']} + {x['steps']}",
                     "PASS" if x["passed"] else "FAIL", fmt(x["rel_l2_o"], 2),
                     fmt(x["rel_l2_o_windows"][-1], 2) if x["rel_l2_o_windows"] else "–", fmt(x["rel_l2_state"], 2),
                     fmt(x["max_abs_o"], 2), fmt(x["others_untouched"]), fmt(x["tolerance"])])
    out.append(_p(f"Drift: prefill with the implementation's chunked op, then one-token steps (B = "
                  f"{d['drift'][0]['B'] if d['drift'] else '–'}); outputs and the final state against the float64 "
                  "reference of the whole sequence. Passes when finite, within the tolerance (by the coarser of the "
                  "q/k/v and state dtypes) and, for a pool, the rows of other sequences are untouched."))
    out.append(_t(["path", "state", "prompt + steps", "status", "rel L2 o", "rel L2 o (last window)",
                   "rel L2 state", "max abs err o", "other rows untouched", "tolerance"], rows))
    out.append(_fig("decode_drift", "Relative L2 error of o per window of decode steps."))
    for x in d["not_measured"]:
        out.append(_p(f"{x['impl']}: not measured ({x['reason']})."))
    if d["skipped_for_time"]:
        out.append(_p("Skipped for time: " + ", ".join(d["skipped_for_time"]) + "."))
    return out


def _scaling_blocks(r: dict) -> list:
    s = r["scaling"]
    out = [_h(2, "Scaling"), _p(f"dtype {s['dtype']}, base shape {s['base_shape']}; memory by {s['memory_method']}."),
           _fig("latency_vs_T", "Latency vs T (log-log); " + (
               "solid: forward, dashed: forward + backward." if any(x["direction"] == "fwdbwd" and x["T"]
                                                                    for x in s["T_sweep"])
               else "forward only (the forward + backward sweep runs on a GPU)."))]
    rows = []
    for sw in s["T_sweep"]:
        rows.append([sw["impl"], sw["direction"], " ".join(str(t) for t in sw["T"]),
                     " ".join(fmt(v) for v in sw["median_ms"]),
                     " ".join(fmt(v, 2) for v in sw["time_ratio_per_doubling"]), fmt(sw["time_exponent"]),
                     fmt(sw["max_T"]), sw["stopped"] or "–"])
    out.append(_t(["impl", "dir", "T", "median ms", "ratio per doubling", "exponent", "max T", "stopped"], rows))
    out.append(_fig("throughput_vs_batch", "Throughput vs batch at fixed T."))
    out.append(_t(["impl", "T", "B", "Mtok/s", "speedup vs B=1", "knee (batch)"],
                  [[b["impl"], str(b["T"]), " ".join(map(str, b["B"])),
                    " ".join(fmt(v / 1e6) for v in b["tokens_per_s"]), " ".join(fmt(v, 2) for v in b["speedup_vs_B1"]),
                    fmt(b["knee_batch"]) if b["knee_batch"] is not None else "none (still scaling)"]
                   for b in s["batch_sweep"]]))
    out.append(_t(["impl", "total tokens", "B x T", "median ms", "Mtok/s"],
                  [[e["impl"], str(e["total_tokens"]), " ".join(f"{b}x{t}" for b, t in zip(e["B"], e["T"])),
                    " ".join(fmt(v) for v in e["median_ms"]), " ".join(fmt(v / 1e6) for v in e["tokens_per_s"])]
                   for e in s["equal_tokens"]]))
    return out


def _memory_blocks(r: dict) -> list:
    m = r["memory"]
    out = [_h(2, "Memory"), _p(f"Peak bytes above the inputs, by {m['method']}. Fragmentation: "
                               f"{m['fragmentation'] or 'max of 1 - active/reserved over the sweep'}."),
           _fig("memory_vs_T", "Peak memory per call vs T (log-log).")]
    out.append(_t(["impl", "dir", "T", "peak MB", "growth per doubling", "exponent", "linear", "max fragmentation",
                   "stopped"],
                  [[x["impl"], x["direction"], " ".join(map(str, x["T"])), " ".join(mb(v) for v in x["peak_bytes"]),
                    " ".join(fmt(v, 2) for v in x["growth_per_doubling"]), fmt(x["growth_exponent"]),
                    fmt(x["linear"]), fmt(x["max_fragmentation"]), x["stopped"] or "–"] for x in m["sweeps"]]))
    return out


def same_state_error(series: list) -> dict:
    """impl -> the dtypes whose final-state errors are identical at every T (at least two dtypes)."""
    by_impl: dict = {}
    for x in series:
        if x["rel_l2_state"]:
            by_impl.setdefault(x["impl"], {}).setdefault(tuple(x["rel_l2_state"]), []).append(x["dtype"])
    return {impl: dtypes for impl, groups in by_impl.items() for dtypes in groups.values() if len(dtypes) > 1}


def _stability_blocks(r: dict) -> list:
    s = r["stability"]
    text = (f"Forward relative L2 error against the {s['reference']} reference as T grows (shape {s['shape']}); "
            f"passes when the fitted exponent of error vs T is at most {s['max_growth_exponent']}. Every dtype "
            "sees the same input values (rounded once to numbers fp32, bf16 and fp16 all represent), and the final "
            "state is returned in fp32 whatever the dtype.")
    for impl, dtypes in same_state_error(s["series"]).items():
        text += (f" {impl}'s state error is identical for {', '.join(dtypes)}: it computes the state from those "
                 "same values at the same (fp32) precision in each, so only o, rounded to the dtype, differs.")
    return [_h(2, "Numerical stability"), _p(text),
        _fig("error_vs_T", "Relative L2 error of o vs T per dtype (log-log)."),
        _t(["impl", "dtype", "T", "rel L2 (o)", "rel L2 (state)", "exponent", "status"],
           [[x["impl"], x["dtype"], " ".join(map(str, x["T"])), " ".join(fmt(v, 2) for v in x["rel_l2_o"]),
             " ".join(fmt(v, 2) for v in x["rel_l2_state"]), fmt(x["growth_exponent"]),
             "PASS" if x["passed"] else ("–" if x["passed"] is None else "FAIL")] for x in s["series"]])]


def _robust_blocks(r: dict) -> list:
    s = r["robustness"]
    rows = []
    for x in s["records"]:
        if x.get("planted"):
            detail = (f"NaN in {x['planted']['tensor']}[b={x['planted']['b']}, t={x['planted']['t']}]: "
                      f"{x['nonfinite_in_cone']}/{x['cone_tokens']} in cone; leaked to {x['leak_earlier_tokens']} "
                      f"earlier tokens, {x['leak_other_heads_or_sequences']} other heads/sequences")
        elif "rel_l2" in x:
            detail = f"rel L2 {fmt(x['rel_l2'])}, NaN {x['o_nan']}, Inf {x['o_inf']}"
        else:
            detail = (x.get("error") or {}).get("message", x.get("reason", ""))
        rows.append([_who(x), x["case"], x["dtype"], _status(x), detail])
    out = [_h(2, "Robustness (abnormal inputs)"), _p(
        f"Each call in a worker thread with a {s['timeout_s']} s timeout. Summary: " + "; ".join(
            f"{n}: {v['passed']}/{v['cases']} pass, {v['errors']} errors, {v['hangs']} hangs, {v['nan_leaks']} NaN "
            f"leaks ({v['nan_leaks_across_heads_or_sequences']} across heads/sequences)" for n, v in
            s["summary"].items()) + ".")]
    for n, v in s["summary"].items():
        if v.get("same_error_every_case"):  # absent in reports written before it existed
            out.append(_p(f"**Warning:** every {n} case raised the same error ({v['same_error_every_case']}): "
                          "suspect the harness or the installation, not the inputs."))
    return out + [_t(["impl", "case", "dtype", "status", "detail"], rows)]


def _soak_blocks(r: dict) -> list:
    s = r["soak"]
    rows = []
    for x in s["records"]:
        if "calls" not in x:
            rows.append([x["impl"], "–", "–", _status(x) + ": " + _why(x), "", "", "", "", ""])
            continue
        rows.append([x["impl"], x["id"].split("/", 1)[1], str(x["calls"]), fmt(x.get("duration_s")),
                     fmt(x.get("latency_p50_ms")), fmt(x.get("latency_drift")), mb(x.get("memory_drift_bytes")),
                     fmt(x.get("leak_suspected")), fmt(x.get("output_drift_max_abs"))
                     + (" (bitwise)" if x.get("bitwise_stable") else "")])
    return [_h(2, "Soak"), _p(f"Repeated forward + backward on fixed inputs; memory counter: {s['memory_counter']}; "
                              f"leak threshold {mb(s['leak_threshold_bytes'])} MB."),
            _t(["impl", "shape", "calls", "seconds", "P50 ms", "latency drift", "memory drift MB", "leak?",
                "output drift"], rows), _fig("soak", "Latency and memory over the soak.")]


def _amp_blocks(r: dict) -> list:
    s = r["mixed_precision"]
    rows = []
    for x in s["records"]:
        if "overflow_steps" not in x:  # the fp16 run did not finish: say why
            rows.append([_who(x), _status(x) + ": " + _why(x)] + [""] * 5)
            continue
        ref = x.get("fp32_reference")
        rows.append([_who(x), _status(x), f"{x['overflow_steps']}/{x['steps']}", fmt(x["final_scale"]),
                     fmt(x["final_loss_fp16"]), fmt(x["final_loss_fp32"]) if not ref else
                     f"{_status(ref)}: {_why(ref)}", fmt(x["final_loss_rel_gap"])])
    return [_h(2, "Mixed precision"), _p(f"fp16 autocast + {s['scaler']} on {s['device']}, shape {s['shape']}; "
                                         "each training run in a worker thread with a timeout."),
            _t(["impl", "status", "overflow steps", "final scale", "loss fp16", "loss fp32", "rel gap"], rows)]


def _score_blocks(r: dict) -> list:
    s = r["scorecard"]
    impls = list(s["raw"])
    rows = []
    for scen, per in s["scenarios"].items():
        row = [scen.replace("_", " ")]
        for name in impls:
            e = per.get(name, {})
            raw = ", ".join(f"{m[:-6]} {mb(v['value'])} MB" if m.endswith("_bytes") else f"{m} {fmt(v['value'])}"
                            for m, v in e.get("metrics", {}).items() if v["value"] is not None)
            row.append(f"**{fmt(e.get('score'), 2)}** ({raw})" if e.get("score") is not None else "–")
        rows.append(row)
    weights = "; ".join(f"{k.replace('_', ' ')}: " + ", ".join(f"{m} {w}" for m, w in v.items())
                        for k, v in s["weights"].items())
    about = "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in s.get("descriptions", {}).items())
    return [_h(2, "Scorecard"), _p("Score 0-100 per scenario, relative to the best implementation in this run "
                                   f"(raw values in brackets). What each scenario weighs: {about}. "
                                   f"Weights: {weights}."),
            _t(["scenario"] + impls, rows)]


def _correct_cell(r: dict, impl: dict, corr: Optional[dict]) -> str:
    """The summary's "correct" column: cases passed, or why there is no count."""
    if impl.get("kind") == "softmax":
        return "n/a (softmax)"
    if "skipped" in r["correctness"]:
        return "not run"
    return f"{corr['passed']}/{corr['cases']}" if corr else "–"


def scores_note(r: dict) -> Optional[str]:
    """What the summary's five scores are (None when the scorecard was not computed)."""
    sc = r.get("scorecard", {})
    if not sc.get("scenarios"):
        return None
    return ("Scores (0-100 per scenario, 100 = the best implementation of this run, not comparable across runs): "
            + "; ".join(f"{k[:4]} = {k.replace('_', ' ')}: {sc.get('descriptions', {}).get(k, '')}"
                        for k in sc["scenarios"]) + ". The Scorecard section has the weights and raw values.")


def safe_verdict(r: dict) -> list:
    """The verdict's lines; a report (a partial one above all) is written even if one cannot be computed."""
    try:
        return verdict(r)
    except Exception as e:
        return [{"topic": "verdict", "level": "fail", "text": f"could not be computed: {type(e).__name__}: {e}"}]


def headline(r: dict) -> list:
    """The one-screen summary: per implementation, the numbers a reader looks at first."""
    rows = []
    perf = r["performance"].get("records", [])
    for impl in r["meta"]["impls"]:
        name = impl["name"]
        if not impl["available"]:
            rows.append([name, "skipped", impl["reason"], "", "", "", "", ""])
            continue
        corr = r["correctness"].get("summary", {}).get(name)
        mine = [x for x in perf if x["impl"] == name and "error" not in x]
        big = max(mine, key=lambda x: x["shape"]["B"] * x["shape"]["T"], default=None)
        sc = r["scorecard"].get("scenarios", {})
        step = best_step(r.get("decode"), name)
        rows.append([name, _correct_cell(r, impl, corr),
                     f"{big['shape_id']} {big['dtype']} {big['direction']}" if big else "–",
                     fmt(big["p50_ms"]) if big else "–", fmt(big["p99_ms"]) if big else "–",
                     fmt(big["tokens_per_s"] / 1e6) if big else "–",
                     us(step["p99_ms"]) if step else "–",
                     " ".join(f"{k[:4]}:{fmt(v.get(name, {}).get('score'), 2)}" for k, v in sc.items())])
    return ["impl", "correct", "largest perf row", "P50 ms", "P99 ms", "Mtok/s", "step P99 µs", "scores"], rows


def blocks(r: dict) -> list:
    hdr, rows = headline(r)
    out = [_h(1, "linattn eval report"), _p(
        f"Profile **{r['meta']['profile']}** on **{r['environment'].get('device')}**"
        f" ({(r['environment'].get('gpu') or {}).get('name', r['environment'].get('cpu'))}), "
        f"{r['environment'].get('date_utc')}."), _h(2, "Verdict"),
        ("ul", [(x["level"], f"**{x['topic']}:** {x['text']}") for x in safe_verdict(r)]),
        _h(2, "Summary"), _t(hdr, rows)]
    if scores_note(r):
        out.append(_p(scores_note(r)))
    merged = r["meta"].get("merged_from")
    if r.get("partial") and merged:
        out.insert(2, _p("**Partial report:** merged from partial runs (--allow-partial); sections missing: "
                         f"{', '.join(r.get('missing_sections', [])) or 'none'}. A section marked interrupted keeps "
                         "the records it had in report.json."))
    elif r.get("partial"):
        stop = r["meta"].get("interrupted")
        why = (f"interrupted ({stop['signal']}) at {stop['at_s']:.0f} s during {stopped_during(stop)}"
               if stop else "written while the run is still going")
        out.insert(2, _p(f"**Partial report:** {why}; sections done: {', '.join(r.get('sections_done', [])) or 'none'}"
                         ". A section marked interrupted keeps the records it had in report.json."))
    if merged:
        out.insert(2, _p(f"Merged from {len(merged)} reports (`linattn eval --merge`; the scorecard is computed from "
                         "the merged sections): " + "; ".join(
                             f"{m['path']}: {', '.join(m['taken']) or 'nothing taken'}" for m in merged)
                         + (f". Not covered by any run: {', '.join(r['missing_sections'])}"
                            if r.get("missing_sections") and not r.get("partial") else "") + "."))
    for section, title, fn in (
            ("correctness", "Correctness", _corr_blocks), ("performance", "Performance", _perf_blocks),
            ("decode", "Decode (real time)", _decode_blocks),
            ("scaling", "Scaling", _scaling_blocks), ("memory", "Memory", _memory_blocks),
            ("stability", "Numerical stability", _stability_blocks),
            ("robustness", "Robustness (abnormal inputs)", _robust_blocks), ("soak", "Soak", _soak_blocks),
            ("mixed_precision", "Mixed precision", _amp_blocks), ("scorecard", "Scorecard", _score_blocks),
            ("environment", "Environment", _env_blocks)):
        if section not in r:  # a report written before the section existed
            continue
        sec = r[section]
        if "skipped" in sec:
            out += [_h(2, title), _p(f"Skipped: {sec['skipped']}.")]
        elif "error" in sec and isinstance(sec["error"], dict) and set(sec) <= {"error", "elapsed_s", "budget"}:
            out += [_h(2, title), _p(f"FAILED: {sec['error']['type']}: {sec['error']['message']}")]
        else:
            out += fn(r)
            if sec.get("skipped_for_time") and section != "decode":  # decode lists its own
                out.append(_p(f"Skipped for time ({len(sec['skipped_for_time'])}): "
                              + ", ".join(sec["skipped_for_time"]) + "."))
            if sec.get("unsupported"):  # sections of measurements list what an implementation cannot run here
                by_reason: dict = {}
                for x in sec["unsupported"]:
                    by_reason.setdefault(x["reason"], []).append(x["id"])
                out.append(_p(f"Unsupported ({len(sec['unsupported'])}): " + "; ".join(
                    f"{', '.join(ids)}: {reason}" for reason, ids in by_reason.items()) + "."))
    return out


# --------------------------------------------------------------------------------------------------------------
# renderers
# --------------------------------------------------------------------------------------------------------------
def to_markdown(bl: list, figdir: str = "plots", figs: dict = None) -> str:
    lines = []
    for b in bl:
        if b[0] == "h":
            lines += ["#" * b[1] + " " + b[2], ""]
        elif b[0] == "p":
            lines += [b[1], ""]
        elif b[0] == "ul":
            lines += [f"- {text}" for _, text in b[1]] + [""]
        elif b[0] == "t":
            lines += ["| " + " | ".join(b[1]) + " |", "|" + "---|" * len(b[1])]
            lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in b[2]]
            lines.append("")
        elif b[0] == "fig" and figs and b[1] in figs:
            lines += [f"![{b[2]}]({figdir}/{b[1]}.png)", ""]
    return "\n".join(lines)


_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1300px;
color:#222;padding:0 16px}h1{border-bottom:2px solid #333}h2{margin-top:32px;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:13px;margin:8px 0 16px}td,th{border:1px solid #ccc;padding:3px 7px;
text-align:left;vertical-align:top}th{background:#f0f0f0}tr:nth-child(even){background:#fafafa}
.pass{color:#137333;font-weight:600}.fail{color:#c5221f;font-weight:600}figure{margin:8px 0 20px}
figcaption{font-size:13px;color:#555}img{max-width:100%;border:1px solid #eee}
ul.verdict{font-size:15px;line-height:1.45;padding-left:20px}ul.verdict li{margin:3px 0}
ul.verdict li.fail{color:#c5221f}ul.verdict li.warn{color:#8a5a00}"""


def _cell(c) -> str:
    s = html.escape(str(c))
    if s in ("PASS", "FAIL", "ERROR", "HANG"):
        return f'<span class="{"pass" if s == "PASS" else "fail"}">{s}</span>'
    return s.replace("**", "")


def _bold(text: str) -> str:
    """Escaped text with Markdown's **bold** as <b>."""
    parts = html.escape(text).split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))


def to_html(bl: list, figs: dict) -> str:
    body = []
    for b in bl:
        if b[0] == "h":
            body.append(f"<h{b[1]}>{html.escape(b[2])}</h{b[1]}>")
        elif b[0] == "p":
            body.append(f"<p>{_bold(b[1])}</p>")
        elif b[0] == "ul":
            body.append("<ul class='verdict'>" + "".join(f"<li class='{level}'>{_bold(text)}</li>"
                                                         for level, text in b[1]) + "</ul>")
        elif b[0] == "t":
            head = "".join(f"<th>{html.escape(h)}</th>" for h in b[1])
            rows = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>" for row in b[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif b[0] == "fig" and b[1] in figs:
            data = base64.b64encode(figs[b[1]]).decode()
            body.append(f'<figure><img alt="{html.escape(b[2])}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{html.escape(b[2])}</figcaption></figure>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>linattn eval report</title>"
            f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>")


def write_all(results: dict, out_dir: str, figures: bool = True) -> dict:
    """Write report.json, report.md (+ plots/*.png) and report.html into ``out_dir``, in that order, each
    atomically; return their paths. ``figures=False`` (the partial reports written during a run) skips the plots,
    the only slow part (about a second)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "report.json"), "md": os.path.join(out_dir, "report.md"),
             "html": os.path.join(out_dir, "report.html")}
    write_json(results, paths["json"])
    r = clean(results)
    figs = {}
    if figures:
        from .plots import make_figures
        figs = make_figures(r)
    if figs:
        os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)
        for name, png in figs.items():
            atomic_write(os.path.join(out_dir, "plots", f"{name}.png"), png)
    bl = blocks(r)
    atomic_write(paths["md"], to_markdown(bl, figs=figs))
    atomic_write(paths["html"], to_html(bl, figs))
    return paths

