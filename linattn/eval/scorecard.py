"""Scorecard: one weighted score per (scenario, implementation), computed from the other sections' numbers.

Each scenario names the measurements that matter for it and a weight for each (:data:`SCENARIOS`). A metric is
normalised against the best implementation in this run: ``value / best`` when higher is better, ``best / value``
when lower is better; errors are compared on a log scale (each decade worse than the best costs ``1/ERR_DECADES``).
The score is 100 × the weighted mean of the normalised metrics the implementation has (weights renormalised over
those present; the softmax baseline has no accuracy metrics, so it gets no scientific score). The raw value of every
metric sits beside the score in the report: a score ranks the implementations of *this* run, it is not portable.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .decode import best_step
from .impls import build

ERR_DECADES = 4.0

# scenario -> [(metric, weight, "higher" | "lower" | "log_lower")]
SCENARIOS = {
    "offline_long_text": [("long_tokens_per_s", 0.5, "higher"), ("long_peak_bytes", 0.3, "lower"),
                          ("max_T", 0.2, "higher")],
    "real_time": [("step_p99_ms", 0.4, "lower"), ("first_token_ms", 0.25, "lower"), ("p99_ms", 0.2, "lower"),
                  ("first_call_s", 0.15, "lower")],
    "edge": [("small_peak_bytes", 0.4, "lower"), ("cpu_path", 0.3, "higher"), ("first_token_ms", 0.3, "lower")],
    "high_concurrency": [("batch_tokens_per_s", 0.5, "higher"), ("batch_speedup", 0.3, "higher"),
                         ("knee_batch", 0.2, "higher")],
    "scientific": [("pass_rate", 0.3, "higher"), ("worst_rel_l2", 0.3, "log_lower"), ("reproducible", 0.2, "higher"),
                   ("stable_growth", 0.2, "higher")],
}
DESCRIPTIONS = {
    "offline_long_text": "throughput and memory at the longest sequence every implementation reached",
    "real_time": "P99 decode-step latency, first-token (short-prompt prefill) latency, P99 prefill latency, "
                 "cold first call",
    "edge": "memory, a CPU path, short-prompt latency",
    "high_concurrency": "throughput at the largest batch and how much batching helps",
    "scientific": "accuracy against float64, reproducibility, error growth with T",
}


def _fwd_sweeps(results: dict) -> list:
    return [s for s in results.get("scaling", {}).get("T_sweep", []) if s["direction"] == "fwd"]


def metrics(results: dict) -> tuple[dict, Optional[int]]:
    """(impl -> metric -> raw value, the longest T every implementation reached)."""
    impls = list(dict.fromkeys([r["impl"] for r in results.get("performance", {}).get("records", [])]
                               + [s["impl"] for s in _fwd_sweeps(results)]
                               + [r["impl"] for r in results.get("decode", {}).get("records", [])]))
    sweeps = {s["impl"]: s for s in _fwd_sweeps(results)}
    common = [set(s["T"]) for s in sweeps.values() if s["T"]]
    common_T = max(set.intersection(*common)) if common and set.intersection(*common) else None
    batch = {s["impl"]: s for s in results.get("scaling", {}).get("batch_sweep", [])}
    perf = [r for r in results.get("performance", {}).get("records", []) if "error" not in r]
    corr = results.get("correctness", {})
    repro = {r["impl"]: r for r in corr.get("reproducibility", []) if "error" not in r}
    stab = results.get("stability", {}).get("series", [])
    mem = {m["impl"]: m for m in results.get("memory", {}).get("sweeps", []) if m["direction"] == "fwd"}
    out = {}
    for name in impls:
        m: dict = {}
        s = sweeps.get(name)
        if s and common_T in s["T"]:
            i = s["T"].index(common_T)
            m["long_tokens_per_s"] = s["tokens_per_s"][i]
            m["long_peak_bytes"] = s["peak_bytes"][i] or None
        m["max_T"] = s["max_T"] if s else None
        m["first_token_ms"] = s["median_ms"][0] if s and s["median_ms"] else None
        mine = [r for r in perf if r["impl"] == name and r["direction"] == "fwd"]
        if mine:
            smallest = min(mine, key=lambda r: (r["shape"]["B"] * r["shape"]["T"], r["dtype"]))
            m["p99_ms"] = smallest["p99_ms"]
            m["first_call_s"] = smallest["first_call_s"]
        step = best_step(results.get("decode"), name)
        m["step_p99_ms"] = step["p99_ms"] if step else None
        mm = mem.get(name)
        m["small_peak_bytes"] = mm["peak_bytes"][0] if mm and mm["peak_bytes"] else None
        m["cpu_path"] = 1.0 if build(name, torch.device("cpu")).available else 0.0
        b = batch.get(name)
        if b and b["tokens_per_s"]:
            m["batch_tokens_per_s"] = b["tokens_per_s"][-1]
            m["batch_speedup"] = b["speedup_vs_B1"][-1]
            m["knee_batch"] = b["knee_batch"] if b["knee_batch"] is not None else b["B"][-1]
        summ = corr.get("summary", {}).get(name)
        if summ and summ["cases"]:
            m["pass_rate"] = summ["passed"] / summ["cases"]
            worst = [v for v in summ["worst_rel_l2_fwd"].values() if v is not None]
            m["worst_rel_l2"] = worst[0] if worst else None  # the first (most precise) dtype of the profile
        if name in repro:
            m["reproducible"] = 1.0 if repro[name]["bitwise"] else (0.5 if repro[name]["within_tolerance"] else 0.0)
        mine_stab = [x for x in stab if x["impl"] == name and x["passed"] is not None]
        if mine_stab:
            m["stable_growth"] = sum(bool(x["passed"]) for x in mine_stab) / len(mine_stab)
        out[name] = m
    return out, common_T


def _norm(value: Optional[float], best: Optional[float], mode: str) -> Optional[float]:
    if value is None or best is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    if mode == "higher":
        return value / best if best > 0 else (1.0 if value == best else 0.0)
    if mode == "lower":
        return best / value if value > 0 else 1.0
    if value <= 0 or best <= 0:
        return 1.0 if value <= best else 0.0
    return max(0.0, 1.0 - (math.log10(value) - math.log10(best)) / ERR_DECADES)


def score(raw: dict) -> dict:
    """scenario -> impl -> {score, metrics: {metric: {value, normalised, weight}}}."""
    out = {}
    for scen, spec in SCENARIOS.items():
        out[scen] = {}
        for metric, weight, mode in spec:
            vals = [m.get(metric) for m in raw.values() if m.get(metric) is not None]
            if mode == "higher":
                best = max(vals) if vals else None
            else:
                best = min(vals) if vals else None
            for name, m in raw.items():
                entry = out[scen].setdefault(name, {"metrics": {}})
                entry["metrics"][metric] = {"value": m.get(metric), "weight": weight, "better": mode,
                                            "normalised": _norm(m.get(metric), best, mode)}
        for entry in out[scen].values():
            got = [(e["weight"], e["normalised"]) for e in entry["metrics"].values() if e["normalised"] is not None]
            wsum = sum(w for w, _ in got)
            entry["score"] = 100 * sum(w * v for w, v in got) / wsum if wsum > 0 else None
            entry["coverage"] = wsum
    return out


def run(results: dict) -> dict:
    raw, common_T = metrics(results)
    return {"weights": {s: {m: w for m, w, _ in spec} for s, spec in SCENARIOS.items()},
            "better": {s: {m: b for m, _, b in spec} for s, spec in SCENARIOS.items()},
            "descriptions": DESCRIPTIONS, "err_decades": ERR_DECADES, "common_T": common_T, "raw": raw,
            "scenarios": score(raw)}
