"""How a call's kernels overlap, from the chrome traces ``gate_sensitivity.py --phases --trace`` writes: for each
profiled call (a call starts at each launch of ``--first``, the pre-pass by default), every kernel's start after the
call's first kernel, its duration and its stream, in µs; then the medians over the calls. Where two launches of
one call share a stream and a name (never in today's forward), they are told apart by their order.

    python benchmarks/trace_summary.py trace-2-16384-32-32-mixed.json [more.json ...] [--first SUBSTRING]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def kernels(path: Path) -> list[dict]:
    """The trace's GPU kernels (start ``ts`` and duration ``dur`` in µs, ``stream``, ``name``), by start."""
    events = json.loads(path.read_text())["traceEvents"]
    found = [dict(name=e["name"], ts=float(e["ts"]), dur=float(e["dur"]),
                  stream=e.get("args", {}).get("stream", e["tid"]))
             for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted(found, key=lambda e: e["ts"])


def calls(found: list[dict], first: str) -> list[list[dict]]:
    """The kernels split into calls, each starting at a kernel whose name contains ``first``."""
    out: list[list[dict]] = []
    for e in found:
        if first in e["name"] or not out:
            out.append([])
        out[-1].append(e)
    return out


def summary(path: Path, first: str) -> None:
    per_call = calls(kernels(path), first)
    rows: dict[tuple, list[tuple[float, float]]] = {}
    spans = []
    for call in per_call:
        t0 = call[0]["ts"]
        spans.append(max(e["ts"] + e["dur"] for e in call) - t0)
        seen: dict[tuple, int] = {}
        for e in call:
            key = (e["name"][:60], e["stream"])
            n = seen[key] = seen.get(key, -1) + 1
            rows.setdefault((*key, n), []).append((e["ts"] - t0, e["dur"]))
    print(f"\n{path.name}: {len(per_call)} calls, span median {statistics.median(spans):.1f} µs "
          f"(min {min(spans):.1f}, max {max(spans):.1f})")
    print(f"  {'start':>8} {'dur':>8} {'end':>8}  stream  kernel (median over calls; start min–max)")
    for (name, stream, n), times in sorted(rows.items(), key=lambda r: statistics.median(t for t, _ in r[1])):
        starts = [t for t, _ in times]
        start, dur = statistics.median(starts), statistics.median(d for _, d in times)
        print(f"  {start:8.1f} {dur:8.1f} {start + dur:8.1f}  {stream!s:>6}  {name}"
              f"{f' #{n}' if n else ''} ({min(starts):.1f}–{max(starts):.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--first", default="prepass", help="a substring of the name of each call's first kernel")
    a = ap.parse_args()
    for path in a.traces:
        summary(path, a.first)


if __name__ == "__main__":
    main()
