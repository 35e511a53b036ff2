"""``linattn eval --compare a.json b.json``: what got better or worse between two runs.

Both reports are flattened to ``section/record-id/metric`` keys (a record's ``id`` names it across runs, e.g.
``performance/linattn/B1-T1024-H4-D64/fp32/fwd/p50_ms``; a sweep's points are keyed by their T or B). Only the
metrics in :data:`METRICS` are compared, each with its direction; a change counts when it exceeds the relative
``threshold`` (default 5 %), and a pass/fail flag that flips always counts.

Only like is compared with like (:func:`conditions`): a section one report did not finish (partial, interrupted,
not selected) is left out; timings (:data:`TIMINGS`) are left out when the reports ran on different devices or
GPUs, or drew different gates (the same record id, other inputs). A report measured on a busy machine, or partial,
is compared but named in a warning at the top: its timings can be off by a large factor.
"""
from __future__ import annotations

import math

from . import SECTIONS
from .saved import load_report

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
# metrics that depend on the machine and its load (left out across devices or gates)
TIMINGS = ("median_ms", "p50_ms", "p95_ms", "p99_ms", "first_call_s", "tokens_per_s", "tflops", "gbs",
           "roofline_fraction", "time_exponent", "knee_batch", "max_T", "latency_drift", "score", "graph_ms",
           "pct_of_copy", "pct_of_peak_bw")


def _done(r: dict) -> set:
    """The sections a report finished (a report written before ``sections_done`` existed: all, unless partial)."""
    if "sections_done" in r:
        return set(r["sections_done"])
    return set() if r.get("partial") else set(SECTIONS)


def _where(r: dict) -> str:
    gpu = (r.get("environment", {}).get("gpu") or {}).get("name")
    return f"{r['meta']['device'].split(':')[0]}{f' ({gpu})' if gpu else ''}"


def conditions(a: dict, b: dict) -> dict:
    """What makes the two reports unlike: ``warnings`` (lines), ``sections`` left out, and ``timings`` (False when
    timings must not be compared)."""
    warn, timings = [], True
    for tag, r in (("A", a), ("B", b)):
        if r.get("partial"):
            stop = r["meta"].get("interrupted")
            warn.append(f"report {tag} is partial ({'interrupted by ' + stop['signal'] if stop else 'not finished'}"
                        f"; sections done: {', '.join(sorted(_done(r))) or 'none'})")
        if r.get("environment", {}).get("warning"):
            warn.append(f"report {tag}: {r['environment']['warning']}")
    if _where(a) != _where(b):
        warn.append(f"the reports ran on different devices ({_where(a)} vs {_where(b)}): timings not compared")
        timings = False
    gates = a["meta"].get("gates", "default"), b["meta"].get("gates", "default")
    if gates[0] != gates[1]:
        warn.append(f"the reports drew different gates (--gates {gates[0]} vs {gates[1]}): timings not compared")
        timings = False
    if a["meta"]["profile"] != b["meta"]["profile"]:
        warn.append(f"different profiles ({a['meta']['profile']} vs {b['meta']['profile']}): only the records "
                    "both measured are compared")
    both = _done(a) & _done(b)
    left_out = [n for n in SECTIONS if n not in both and n != "environment"]
    if left_out:
        warn.append(f"sections not finished in both reports, not compared: {', '.join(left_out)}")
    return {"warnings": warn, "sections": left_out, "timings": timings}


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


def _comparable(key: str, like: dict) -> bool:
    section, metric = key.split("/", 1)[0], key.rsplit("/", 1)[-1].split("[")[0]
    return section not in like["sections"] and (like["timings"] or metric not in TIMINGS)


def diff(a: dict, b: dict, threshold: float = 0.05) -> dict:
    like = conditions(a, b) if "meta" in a and "meta" in b else {"warnings": [], "sections": [], "timings": True}
    fa = {k: v for k, v in flatten(a).items() if _comparable(k, like)}
    fb = {k: v for k, v in flatten(b).items() if _comparable(k, like)}
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
    return {"threshold": threshold, "warnings": like["warnings"], "left_out_sections": like["sections"],
            "timings_compared": like["timings"], "better": sorted(better, key=key), "worse": sorted(worse, key=key),
            "unchanged": same, "only_in_a": sorted(set(fa) - set(fb)), "only_in_b": sorted(set(fb) - set(fa))}


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
    lines += [f"warning: {w}" for w in d.get("warnings", [])]
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
    d = diff(load_report(path_a), load_report(path_b), threshold)
    return d, render(d, path_a, path_b)
