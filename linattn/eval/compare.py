"""``linattn eval --compare a.json b.json``: what got better or worse between two runs.

Both reports are flattened to ``section/record-id/metric`` keys (a record's ``id`` names it across runs, e.g.
``performance/linattn/B1-T1024-H4-D64/fp32/fwd/p50_ms``; a sweep's points are keyed by their T or B). Only the
metrics in :data:`METRICS` are compared, each with its direction; a change counts when it exceeds the relative
``threshold`` (default 5 %), and a pass/fail flag that flips always counts.
"""
from __future__ import annotations

import json
import math

# metric name -> "lower" or "higher" is better ("flag": a boolean where True is good)
METRICS = {
    "median_ms": "lower", "p50_ms": "lower", "p95_ms": "lower", "p99_ms": "lower", "first_call_s": "lower",
    "tokens_per_s": "higher", "tflops": "higher", "gbs": "higher", "roofline_fraction": "higher",
    "max_rel_l2_fwd": "lower", "max_rel_l2_bwd": "lower", "rel_l2_o": "lower", "rel_l2": "lower",
    "peak_bytes": "lower", "growth_exponent": "lower", "time_exponent": "lower", "knee_batch": "higher",
    "max_T": "higher", "overflow_steps": "lower", "memory_drift_bytes": "lower", "latency_drift": "lower",
    "score": "higher", "graph_ms": "lower", "pct_of_copy": "higher", "pct_of_peak_bw": "higher",
    "rel_l2_state": "lower",
    "passed": "flag", "linear": "flag", "confined": "flag", "bitwise": "flag",
}
_SWEEP_AXES = ("T", "B")


def flatten(node, prefix: str = "") -> dict:
    """``{key: value}`` for every compared metric in a report (or any sub-tree of it)."""
    out = {}
    if isinstance(node, dict):
        axis = next((a for a in _SWEEP_AXES if isinstance(node.get(a), list)), None)
        for k, v in node.items():
            key = f"{prefix}/{k}" if prefix else k
            if k in METRICS and isinstance(v, (bool, int, float)) and v is not None:
                out[key] = v
            elif k in METRICS and axis and isinstance(v, list) and len(v) == len(node[axis]):
                for x, y in zip(node[axis], v):
                    if isinstance(y, (int, float)):
                        out[f"{key}[{axis}={x}]"] = y
            elif isinstance(v, (dict, list)) and k not in ("points", "samples_ms", "trace"):
                out.update(flatten(v, key))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if isinstance(v, dict):
                name = v.get("id") or v.get("impl") or str(i)
                out.update(flatten(v, f"{prefix}/{name}"))
    return out


def diff(a: dict, b: dict, threshold: float = 0.05) -> dict:
    fa, fb = flatten(a), flatten(b)
    better, worse, same = [], [], 0
    for key in sorted(set(fa) & set(fb)):
        va, vb = fa[key], fb[key]
        metric = key.rsplit("/", 1)[-1].split("[")[0]
        mode = METRICS[metric]
        row = {"key": key, "a": va, "b": vb}
        if isinstance(va, bool) or isinstance(vb, bool):
            if bool(va) == bool(vb):
                same += 1
                continue
            (better if vb else worse).append(row)
            continue
        if not (math.isfinite(va) and math.isfinite(vb)):
            same += 1
            continue
        if va == vb or (va == 0 and abs(vb) < 1e-30):
            same += 1
            continue
        change = (vb - va) / abs(va) if va != 0 else math.inf
        row["change"] = change
        if abs(change) <= threshold:
            same += 1
            continue
        improved = change < 0 if mode == "lower" else change > 0  # a count of passes ("flag" as int): higher
        (better if improved else worse).append(row)
    key = lambda r: -abs(r.get("change", math.inf))
    return {"threshold": threshold, "better": sorted(better, key=key), "worse": sorted(worse, key=key),
            "unchanged": same, "only_in_a": sorted(set(fa) - set(fb)), "only_in_b": sorted(set(fb) - set(fa))}


def load(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"--compare: no such file {path!r}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--compare: {path!r} is not JSON ({e})") from None


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render(d: dict, a_name: str, b_name: str, limit: int = 40) -> str:
    lines = [f"compare {a_name} -> {b_name} (threshold {d['threshold']:.0%}): {len(d['better'])} better, "
             f"{len(d['worse'])} worse, {d['unchanged']} unchanged, {len(d['only_in_a'])} only in a, "
             f"{len(d['only_in_b'])} only in b"]
    for title, rows in (("WORSE", d["worse"]), ("BETTER", d["better"])):
        if not rows:
            continue
        lines.append(f"\n{title}")
        width = min(90, max(len(r["key"]) for r in rows[:limit]))
        for r in rows[:limit]:
            ch = f"{r['change']:+.1%}" if "change" in r and math.isfinite(r["change"]) else ""
            lines.append(f"  {r['key'][:width]:{width}s}  {_fmt(r['a']):>11s} -> {_fmt(r['b']):<11s} {ch}")
        if len(rows) > limit:
            lines.append(f"  ... and {len(rows) - limit} more")
    return "\n".join(lines)


def run(path_a: str, path_b: str, threshold: float = 0.05) -> tuple[dict, str]:
    d = diff(load(path_a), load(path_b), threshold)
    return d, render(d, path_a, path_b)
