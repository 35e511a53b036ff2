"""The verdict: the answer a user runs ``linattn eval`` for, in plain words, computed from the report's numbers.

It opens report.md, report.html and the terminal summary, one line per topic (:func:`verdict`):

* **correct**: per implementation, cases passed against the float64 reference and the worst relative error per
  dtype (forward / backward);
* **fastest**: per direction and dtype, the fastest implementation at each performance shape, with its ratio to
  the runner-up;
* **crossover**: the sequence length from which each linear-attention implementation beats softmax attention,
  interpolated (log-log) between the two scaling points where the order flips, or "none in the measured range";
* **decode**: the per-step latency of each implementation's fastest decode path;
* **skipped**: implementations that could not run, sections not run or failed, units skipped for time or
  unsupported here;
* **FAIL**: every failing row of every section (a robustness NaN that leaks only into earlier tokens of its own
  64-token chunk is named as the known limitation it is);
* **warning**: a busy machine or a partial report, which make the numbers above less trustworthy.

Each line is ``{"topic", "level", "text"}`` with level ``ok``, ``info``, ``warn`` or ``fail``.
"""
from __future__ import annotations

import math
from typing import Optional

from . import SECTIONS
from .decode import best_step
from .robustness import CHUNK

KNOWN_NAN_LIMITATION = "the known limitation README.md names (0·NaN in the masked chunk products)"
DIRECTION = {"fwd": "forward", "fwdbwd": "forward + backward"}


def _num(x: Optional[float]) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    if x == 0:
        return "0"
    return f"{x:.1e}" if abs(x) < 1e-2 else f"{x:.3g}"


def _ms(x: float) -> str:
    return f"{x * 1e3:.3g} µs" if x < 1 else f"{x:.3g} ms"


def _ratio(x: float) -> str:
    return f"{x:.1f}×" if x < 10 else f"{x:.0f}×"


def _line(topic: str, level: str, text: str) -> dict:
    return {"topic": topic, "level": level, "text": text}


def _kinds(r: dict) -> dict:
    return {i["name"]: i.get("kind", "gdn") for i in r["meta"].get("impls", [])}


def _ran(sec: dict) -> bool:
    return isinstance(sec, dict) and "skipped" not in sec and not (
        "error" in sec and isinstance(sec["error"], dict) and "records" not in sec and "series" not in sec)


# ---- correctness ------------------------------------------------------------------------------------------------
def correctness(r: dict) -> list:
    c = r.get("correctness", {})
    if not _ran(c):
        return []
    out = []
    for name, s in c.get("summary", {}).items():
        if not s["cases"]:
            continue
        dtypes = sorted(d for d in set(s["worst_rel_l2_fwd"]) | set(s["worst_rel_l2_bwd"])
                        if s["worst_rel_l2_fwd"].get(d) is not None or s["worst_rel_l2_bwd"].get(d) is not None)
        worst = ", ".join(f"{d} {_num(s['worst_rel_l2_fwd'].get(d))} fwd / {_num(s['worst_rel_l2_bwd'].get(d))} bwd"
                          for d in dtypes)
        ok = s["passed"] == s["cases"]
        text = (f"{name} {'passes' if ok else 'FAILS'} {s['passed']}/{s['cases']} cases against the float64 "
                f"reference; worst relative L2 error {worst or '–'}")
        if not ok:
            text += f"; failed: {', '.join(s['failed'])}"
        out.append(_line("correct", "ok" if ok else "fail", text))
    return out


# ---- speed --------------------------------------------------------------------------------------------------------
def fastest(r: dict) -> list:
    """Per (direction, dtype): the winner at each shape and its ratio to the runner-up, winners grouped."""
    recs = [x for x in r.get("performance", {}).get("records", []) if "p50_ms" in x]
    groups: dict = {}
    for x in recs:
        groups.setdefault((x["direction"], x["dtype"]), {}).setdefault(x["shape_id"], []).append(x)
    out = []
    for (direction, dtype), shapes in groups.items():
        wins: dict = {}
        for shape_id, rows in shapes.items():
            if len(rows) < 2:
                continue
            rows = sorted(rows, key=lambda x: x["p50_ms"])
            ratio = rows[1]["p50_ms"] / rows[0]["p50_ms"]
            wins.setdefault(rows[0]["impl"], []).append(f"{shape_id} ({_ratio(ratio)} faster than {rows[1]['impl']})")
        if wins:
            out.append(_line("fastest", "info", f"{DIRECTION[direction]} {dtype}: " + "; ".join(
                f"{impl} at {', '.join(at)}" for impl, at in wins.items())))
    return out


def crossing(Ts: list, ours: list, theirs: list) -> tuple[Optional[float], str]:
    """(T from which ``ours`` stays below ``theirs``, how): interpolated log-log between the last two points
    where the order flips; ``how`` is "always", "never", "interpolated" or "measured" (a flip exactly at a
    point)."""
    faster = [a < b for a, b in zip(ours, theirs)]
    if all(faster):
        return None, "always"
    if not faster[-1]:
        return None, "never"
    i = max(j for j, f in enumerate(faster) if not f)  # the last point where ours is not faster
    la, lb = math.log(ours[i] / theirs[i]), math.log(ours[i + 1] / theirs[i + 1])
    if la == 0:
        return float(Ts[i]), "measured"
    x0, x1 = math.log(Ts[i]), math.log(Ts[i + 1])
    return math.exp(x0 + (x1 - x0) * la / (la - lb)), "interpolated"


def crossover(r: dict) -> list:
    s = r.get("scaling", {})
    if not _ran(s):
        return []
    kinds = _kinds(r)
    sweeps = [x for x in s.get("T_sweep", []) if x["T"]]
    base = s.get("base_shape") or {}
    where = f"B{base.get('B')} H{base.get('HV')} D{base.get('K')}" if base else ""
    out = []
    for soft in (x for x in sweeps if kinds.get(x["impl"]) == "softmax"):
        for ours in (x for x in sweeps if kinds.get(x["impl"]) != "softmax" and x["direction"] == soft["direction"]):
            a = dict(zip(ours["T"], ours["median_ms"]))
            b = dict(zip(soft["T"], soft["median_ms"]))
            Ts = sorted(set(a) & set(b))
            if len(Ts) < 2:
                continue
            T0, how = crossing(Ts, [a[t] for t in Ts], [b[t] for t in Ts])
            last = Ts[-1]
            at_last = f"at T = {last}: {_ms(a[last])} vs {_ms(b[last])}"
            head = (f"{ours['impl']} vs {soft['impl']} ({DIRECTION[ours['direction']]} {s.get('dtype')}, {where}, "
                    f"T {Ts[0]}-{last}): ")
            if how == "always":
                text = f"{ours['impl']} is faster at every measured T ({at_last})"
            elif how == "never":
                text = f"no crossover in the measured range: {soft['impl']} is faster up to T = {last} ({at_last})"
            else:
                text = (f"{ours['impl']} is faster from T ≈ {T0:,.0f}"
                        + (" (interpolated between the measured points)" if how == "interpolated" else "")
                        + f"; {at_last}")
            beyond = [t for t in ours["T"] if t > last]
            if beyond and soft.get("stopped"):
                text += (f"; {soft['impl']} stopped at T = {last} ({soft['stopped']}), {ours['impl']} reached "
                         f"{beyond[-1]}")
            out.append(_line("crossover", "info", head + text))
    return out


def decode(r: dict) -> list:
    d = r.get("decode", {})
    if not _ran(d):
        return []
    out = []
    kinds = _kinds(r)
    for name in dict.fromkeys(x["impl"] for x in d.get("records", [])):
        step = best_step(d, name)
        if step is None or kinds.get(name) == "softmax":
            continue
        graph = f", {_ms(step['graph_ms'])} under CUDA-graph replay" if step.get("graph_ms") else ""
        out.append(_line("decode", "info", f"{name} one-token step ({step['path']} path, B = {step['B']}, fp32 "
                                           f"state): P50 {_ms(step['p50_ms'])}, P99 {_ms(step['p99_ms'])}{graph}"))
    return out


# ---- what did not run ---------------------------------------------------------------------------------------------
def skipped(r: dict) -> list:
    out = []
    gone = [i for i in r["meta"].get("impls", []) if not i["available"]]
    by_reason: dict = {}
    for i in gone:
        by_reason.setdefault(i["reason"], []).append(i["name"])
    for reason, names in by_reason.items():
        out.append(_line("skipped", "info", f"{', '.join(names)} not run: {reason}"))
    not_selected = [n for n in SECTIONS if "not selected" in str(r.get(n, {}).get("skipped", ""))]
    if not_selected:
        out.append(_line("skipped", "info", f"sections not selected (--sections): {', '.join(not_selected)}"))
    for n in SECTIONS:
        sec = r.get(n, {})
        if isinstance(sec.get("error"), dict):
            out.append(_line("FAIL", "fail", f"section {n} failed: {sec['error']['type']}: {sec['error']['message']}"))
        elif "skipped" in sec and "not selected" not in str(sec["skipped"]):
            out.append(_line("skipped", "warn", f"section {n}: {sec['skipped']}"))
        elif sec.get("skipped_for_time"):
            out.append(_line("skipped", "warn", f"{n}: {len(sec['skipped_for_time'])} unit(s) skipped for time "
                                                "(a larger --time-budget, or --resume, runs them)"))
        if sec.get("unsupported") and isinstance(sec["unsupported"], list):
            reasons = sorted({str(x.get("reason")) for x in sec["unsupported"]})
            out.append(_line("skipped", "info", f"{n}: {len(sec['unsupported'])} unit(s) unsupported here "
                                                f"({'; '.join(reasons)})"))
    return out


# ---- failures -------------------------------------------------------------------------------------------------------
def _status(x: dict) -> str:
    return x.get("status") or ("error" if "error" in x else "pass" if x.get("passed") else "fail")


def _nan_leak_in_chunk(x: dict) -> bool:
    """A planted NaN that reached only earlier tokens of its own 64-token chunk (the known limitation)."""
    return bool(x.get("planted")) and x.get("leak_earlier_tokens", 0) > 0 and x.get("leak_before_chunk") == 0 \
        and not x.get("leak_other_heads_or_sequences") and not x.get("state_nonfinite_outside_cone")


def _cases(xs: list) -> str:
    """"nan-k, nan-v in bf16, fp32": the cases and dtypes of a group of rows."""
    return (f"{', '.join(dict.fromkeys(x['case'] for x in xs))} in "
            f"{', '.join(dict.fromkeys(x['dtype'] for x in xs))}")


def robustness_failures(r: dict) -> list:
    """Every failing robustness row, grouped by implementation and by what went wrong."""
    s = r.get("robustness", {})
    if not _ran(s):
        return []
    groups: dict = {}
    for x in s.get("records", []):
        st = _status(x)
        if st not in ("fail", "error", "hang"):
            continue
        if st == "fail" and _nan_leak_in_chunk(x):
            why = (f"a NaN planted in one token reached {x['leak_earlier_tokens']} earlier output(s) of its own "
                   f"{CHUNK}-token chunk, no other head or sequence: {KNOWN_NAN_LIMITATION}")
        elif x.get("planted") and st == "fail":
            why = (f"a NaN planted in one token reached {x.get('leak_earlier_tokens')} earlier output(s) and "
                   f"{x.get('leak_other_heads_or_sequences')} of other heads or sequences")
        else:
            why = (x.get("error") or {}).get("message") or x.get("reason") or (
                f"relative L2 error {_num(x.get('rel_l2'))}, NaN {x.get('o_nan')}, Inf {x.get('o_inf')}")
        groups.setdefault((x["impl"], st.upper(), why), []).append(x)
    return [_line("FAIL", "fail", f"robustness {impl}{'' if st == 'FAIL' else ' ' + st}: {_cases(xs)}: {why}")
            for (impl, st, why), xs in groups.items()]


def failures(r: dict) -> list:
    out = []
    c = r.get("correctness", {})
    for x in c.get("records", []) if _ran(c) else []:
        if _status(x) in ("fail", "error", "hang"):
            why = (x.get("error") or {}).get("message") or (
                f"rel L2 fwd {_num(x.get('max_rel_l2_fwd'))}, bwd {_num(x.get('max_rel_l2_bwd'))}")
            out.append(_line("FAIL", "fail", f"correctness {x['impl']} {x['case']} {x['dtype']}: "
                                             f"{_status(x).upper()} ({why})"))
    for x in r.get("stability", {}).get("series", []):
        if x.get("passed") is False:
            out.append(_line("FAIL", "fail", f"stability {x['impl']} {x['dtype']}: error grows as T^"
                                             f"{_num(x.get('growth_exponent'))} or is not finite"))
    for x in r.get("decode", {}).get("drift", []):
        if "error" in x or not x.get("passed"):
            why = (x.get("error") or {}).get("message") or f"rel L2 o {_num(x.get('rel_l2_o'))}"
            out.append(_line("FAIL", "fail", f"decode drift {x['impl']}/{x['path']} {x['pool']} state: {why}"))
    for x in r.get("mixed_precision", {}).get("records", []):
        if _status(x) in ("fail", "error", "hang"):
            out.append(_line("FAIL", "fail", f"mixed precision {x['impl']}: {_status(x).upper()} "
                                             f"{(x.get('error') or {}).get('message', '')}".rstrip()))
    for x in r.get("memory", {}).get("sweeps", []):
        if x.get("linear") is False:
            out.append(_line("FAIL", "fail", f"memory {x['impl']} {x['direction']}: peak grows faster than linearly "
                                             f"in T (exponent {_num(x.get('growth_exponent'))})"))
    for x in r.get("soak", {}).get("records", []):
        if x.get("leak_suspected"):
            out.append(_line("FAIL", "fail", f"soak {x['impl']}: memory grew by {x.get('memory_drift_bytes')} bytes "
                                             "over the soak (leak suspected)"))
    return out + robustness_failures(r)


def warnings(r: dict) -> list:
    out = []
    if r.get("environment", {}).get("warning"):
        out.append(_line("warning", "warn", r["environment"]["warning"]))
    if r.get("partial"):
        out.append(_line("warning", "warn", "partial report: sections done: " + ", ".join(r.get("sections_done", []))))
    return out


def verdict(r: dict) -> list:
    """Every verdict line (the module's docstring), in reading order."""
    return (correctness(r) + fastest(r) + crossover(r) + decode(r) + failures(r) + skipped(r) + warnings(r))
