"""The report's figures (matplotlib, headless Agg backend), each returned as PNG bytes keyed by name.

latency_vs_T (log-log, per implementation, dashed fwd+bwd), throughput_vs_batch, error_vs_T (per implementation and
dtype), memory_vs_T, latency_dist (box plots of every performance row's samples), decode_latency (the same for every
decode row's per-step samples, in µs), decode_drift (error per window of decode steps) and soak (latency and memory
traces). A figure with nothing to draw is left out rather than drawn empty.
"""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_MPL = tuple(int(x) for x in matplotlib.__version__.split(".")[:2])


def _done(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _loglog(ax, title, xlabel, ylabel):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def latency_vs_T(r: dict):
    sweeps = [s for s in r["scaling"]["T_sweep"] if s["T"]]
    if not sweeps:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {}
    for s in sweeps:
        c = colors.setdefault(s["impl"], f"C{len(colors)}")
        ax.plot(s["T"], s["median_ms"], "o-" if s["direction"] == "fwd" else "s--", color=c,
                label=f"{s['impl']} {s['direction']}")
    _loglog(ax, f"Latency vs T ({r['scaling']['dtype']})", "T (tokens)", "median latency (ms)")
    ax.legend(fontsize=8)
    return _done(fig)


def throughput_vs_batch(r: dict):
    sweeps = [s for s in r["scaling"]["batch_sweep"] if s["B"]]
    if not sweeps:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in sweeps:
        ax.plot(s["B"], [t / 1e6 for t in s["tokens_per_s"]], "o-", label=s["impl"])
        if s["knee_batch"] is not None:
            i = s["B"].index(s["knee_batch"])
            ax.annotate("knee", (s["B"][i], s["tokens_per_s"][i] / 1e6), textcoords="offset points", xytext=(0, 8))
    ax.set_xscale("log", base=2)
    ax.set_title(f"Throughput vs batch (T = {sweeps[0]['T']})")
    ax.set_xlabel("batch")
    ax.set_ylabel("Mtokens/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _done(fig)


def error_vs_T(r: dict):
    series = [s for s in r["stability"]["series"] if s["T"]]
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    marks = {"fp32": "o-", "bf16": "s-", "fp16": "^-"}
    for s in series:
        ax.plot(s["T"], [max(e, 1e-12) if e is not None else None for e in s["rel_l2_o"]],
                marks.get(s["dtype"], "x-"), label=f"{s['impl']} {s['dtype']}")
    _loglog(ax, "Relative L2 error vs float64 reference", "T (tokens)", "rel L2 error of o")
    ax.legend(fontsize=8)
    return _done(fig)


def memory_vs_T(r: dict):
    sweeps = [s for s in r["memory"]["sweeps"] if s["T"]]
    if not sweeps:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {}
    for s in sweeps:
        c = colors.setdefault(s["impl"], f"C{len(colors)}")
        ax.plot(s["T"], [b / 2**20 for b in s["peak_bytes"]], "o-" if s["direction"] == "fwd" else "s--", color=c,
                label=f"{s['impl']} {s['direction']}")
    _loglog(ax, f"Peak memory per call ({r['memory']['method']})", "T (tokens)", "MB above inputs")
    ax.legend(fontsize=8)
    return _done(fig)


def latency_dist(r: dict):
    recs = [x for x in r["performance"]["records"] if x.get("samples_ms")]
    if not recs:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(recs) + 1.5))
    _boxes(ax, [x["samples_ms"] for x in recs],
           [f"{x['impl']} {x['shape_id']} {x['dtype']} {x['direction']}" for x in recs], [x["p99_ms"] for x in recs])
    ax.set_xlabel("latency (ms), log scale; red dot = P99")
    ax.set_title("Latency distributions")
    return _done(fig)


def _boxes(ax, data: list, labels: list, p99: list, mx: list = None):
    """Horizontal box plots (whiskers P5-P95, no fliers), P99 as a red dot and, if given, the max as a black x."""
    # matplotlib 3.10 renamed vert=False to orientation="horizontal" (the old name warns from 3.11)
    horizontal = {"orientation": "horizontal"} if _MPL >= (3, 10) else {"vert": False}
    ax.boxplot(data, whis=(5, 95), showfliers=False, **horizontal)
    for i, v in enumerate(p99, start=1):
        ax.plot([v], [i], "r.", markersize=6)
    for i, v in enumerate(mx or [], start=1):
        ax.plot([v], [i], "kx", markersize=4)
    ax.set_yticks(range(1, len(data) + 1), labels, fontsize=7)
    ax.set_xscale("log")
    ax.grid(True, axis="x", alpha=0.3)


def decode_latency(r: dict):
    recs = [x for x in r["decode"]["records"] if x.get("samples_ms")]
    if not recs:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(recs) + 1.5))
    _boxes(ax, [[s * 1e3 for s in x["samples_ms"]] for x in recs],
           [f"{x['impl']}/{x['path']} B{x['B']} Tq{x['Tq']} {x['pool']}" for x in recs],
           [x["p99_ms"] * 1e3 for x in recs], [x["max_ms"] * 1e3 for x in recs])
    ax.set_xlabel("step latency (µs), log scale; red dot = P99, black x = max")
    ax.set_title(f"Decode step latency ({r['decode']['timer']}, eager)")
    return _done(fig)


def decode_drift(r: dict):
    recs = [x for x in r["decode"]["drift"] if x.get("rel_l2_o_windows")]
    if not recs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for x in recs:
        ax.plot(x["window_end_steps"], [max(e, 1e-12) if e is not None else None for e in x["rel_l2_o_windows"]],
                "o-" if x["pool"] == "fp32" else "s--", label=f"{x['impl']}/{x['path']} {x['pool']} state")
    ax.set_yscale("log")
    ax.set_title(f"Decode drift against float64 (after a {recs[0]['prompt_T']}-token prefill)")
    ax.set_xlabel("decode steps (end of window)")
    ax.set_ylabel("rel L2 error of o in the window")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _done(fig)


def soak(r: dict):
    recs = [x for x in r["soak"]["records"] if x.get("latency_trace_ms")]
    if not recs:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for x in recs:
        a1.plot(x["latency_trace_ms"], label=x["impl"])
        mem = [m / 2**20 for m in x.get("memory_trace_bytes") or [] if m is not None]
        if mem:
            a2.plot(mem, label=x["impl"])
    a1.set_title("Soak: latency per call (sampled)")
    a1.set_ylabel("ms")
    a2.set_title(f"Soak: {r['soak']['memory_counter']}")
    a2.set_ylabel("MB")
    for a in (a1, a2):
        a.set_xlabel("call (sampled)")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    return _done(fig)


def make_figures(r: dict) -> dict:
    """Every figure whose section ran (a skipped or failed section has no data to draw)."""
    figs = {}
    for name, fn, section in (("latency_vs_T", latency_vs_T, "scaling"),
                              ("throughput_vs_batch", throughput_vs_batch, "scaling"),
                              ("error_vs_T", error_vs_T, "stability"), ("memory_vs_T", memory_vs_T, "memory"),
                              ("latency_dist", latency_dist, "performance"),
                              ("decode_latency", decode_latency, "decode"), ("decode_drift", decode_drift, "decode"),
                              ("soak", soak, "soak")):
        sec = r.get(section)
        if sec is None or "skipped" in sec or "error" in sec:
            continue
        png = fn(r)
        if png is not None:
            figs[name] = png
    return figs
