"""The terminal summary ``linattn eval`` prints at the end: the verdict, then one row per implementation.

Plain text sized to the terminal (80 columns when the output is not a terminal, e.g. piped into a file or a CI
log): the verdict's lines wrap with a hanging indent, and when the table would be wider than the width it is
printed in a compact form, one wrapped paragraph per implementation, instead of wrapping cell by cell.
"""
from __future__ import annotations

import textwrap

from . import SECTIONS, stopped_during
from .report import headline
from .report import safe_verdict as verdict

PIPE_WIDTH = 80
SCORE_KEYS = ("offl", "real", "edge", "high", "scie")


def _wrap(text: str, width: int, head: str) -> list:
    return textwrap.wrap(text, width=width, initial_indent=head, subsequent_indent=" " * len(head),
                         break_on_hyphens=False) or [head.rstrip()]


def _table(hdr: list, rows: list) -> list:
    widths = [max(len(str(c)) for c in col) for col in zip(hdr, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*hdr).rstrip(), fmt.format(*["-" * w for w in widths])] + [
        fmt.format(*map(str, row)).rstrip() for row in rows]


def _compact(hdr: list, rows: list, width: int) -> list:
    """One wrapped paragraph per implementation: "correct 12/12; largest perf row B1-T64-H2-D16 fp32 fwd; ..."."""
    out = []
    for row in rows:
        name, rest = row[0], [f"{h} {c}" for h, c in zip(hdr[1:], row[1:]) if str(c).strip() not in ("", "–")]
        out += _wrap("; ".join(rest), width, f"{name:<9s} ")
    return out


def render(r: dict, paths: dict, width: int = PIPE_WIDTH) -> str:
    """The whole summary as text no line of which is wider than ``width`` (but for an unbreakable word)."""
    meta = r["meta"]
    lines = _wrap(f"linattn eval — profile {meta['profile']} on {meta['device']}, {meta['wall_s']:.0f} s", width, "")
    lines.append("")
    topic_w = max([len(x["topic"]) for x in verdict(r)] + [0]) + 2
    for x in verdict(r):
        lines += _wrap(x["text"], width, f"{x['topic'] + ':':<{topic_w}s}")
    hdr, rows = headline(r)
    rows = [row for row in rows if row[1] != "skipped"]  # the verdict says why those did not run
    table = _table(hdr, rows)
    lines.append("")
    lines += table if max(len(x) for x in table) <= width else _compact(hdr, rows, width)
    if any(k in " ".join(map(str, row)) for row in rows for k in SCORE_KEYS):
        lines += [""] + _wrap("scores: 0-100 per scenario against the best implementation of this run — offl(ine long "
                              "text), real(-time), edge, high (concurrency), scie(ntific); weights and raw values in "
                              "the report's Scorecard section", width, "")
    for name in SECTIONS:
        sec = r.get(name, {})
        if isinstance(sec.get("error"), dict):
            lines += _wrap(f"section {name} failed: {sec['error']['type']}: {sec['error']['message']}", width, "")
    stop = meta.get("interrupted")
    if stop:
        lines += _wrap(f"partial report: interrupted by {stop['signal']} at {stop['at_s']:.0f} s during "
                       f"{stopped_during(stop)}; sections done: {', '.join(r['sections_done'])}", width, "")
    lines += [""] + _wrap("reports: " + ", ".join(paths.values()), width, "")
    return "\n".join(lines)
