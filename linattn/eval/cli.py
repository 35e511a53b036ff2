"""``linattn eval``: run the evaluation suite and write report.json, report.md and report.html.

    linattn eval                                  # quick profile on the default device (GPU if any, else CPU)
    linattn eval --profile full --out eval-full   # the whole grid
    linattn eval --impl linattn,sdpa --device cpu --time-budget 120
    linattn eval --compare old/report.json new/report.json

Sections run in a fixed order; each gets a share of the time budget (:data:`BUDGET_SHARES`, cumulative, so time a
section leaves unused passes to the next). A section that fails is recorded with its error and the others still
run, so the report always has every section.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from . import SECTIONS
from .impls import DEFAULT_IMPLS, KNOWN_IMPLS

PROFILES = ("quick", "full", "tiny")  # "tiny": a seconds-long run for tests, not advertised in --help
BUDGET_SHARES = {"correctness": 0.10, "performance": 0.20, "decode": 0.07, "scaling": 0.20, "memory": 0.08,
                 "stability": 0.10, "robustness": 0.08, "soak": 0.10, "mixed_precision": 0.07}
REPORT_RESERVE_S = 10.0  # kept back for the scorecard and the report writers


def add_arguments(p: argparse.ArgumentParser) -> None:
    # rich and matplotlib are the [eval] extra: fail at parser build time so `linattn eval` names the missing extra
    import matplotlib  # noqa: F401
    import rich  # noqa: F401
    p.add_argument("--profile", default="quick", choices=PROFILES, metavar="{quick,full}",
                   help="quick (default: <= 5 min on a CPU, <= 10 min on one GPU) or full (the whole grid)")
    p.add_argument("--impl", default=",".join(DEFAULT_IMPLS),
                   help=f"comma-separated implementations (default: %(default)s; known: {', '.join(KNOWN_IMPLS)}); "
                        "those not installed or not runnable here are skipped and listed in the report")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--out", default="eval-out", help="output directory (default: %(default)s)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="wall-clock budget for the run (default: the profile's); sections stop starting work when "
                        "their share is spent")
    p.add_argument("--sections", default=None,
                   help=f"comma-separated subset of sections to run (default: all of {', '.join(SECTIONS)})")
    p.add_argument("--seed", type=int, default=0, help="seed of every random input (default: 0)")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the roofline's compute peak")
    p.add_argument("--peak-gbs", type=float, default=None, help="override the roofline's bandwidth peak (GB/s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs and CI)")
    p.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"), default=None,
                   help="print what got better or worse from report A to report B, and exit")
    p.add_argument("--threshold", type=float, default=0.05,
                   help="--compare: relative change that counts (default: %(default)s)")
    p.add_argument("--fail-on-regression", action="store_true",
                   help="--compare: exit with status 1 if anything got worse")


def _device(spec) -> torch.device:
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError as e:
        raise ValueError(f"--device {spec!r} is not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec}: linattn eval supports cpu and cuda devices")
    return dev


def _sections(spec) -> list:
    if spec is None:
        return list(SECTIONS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in SECTIONS]
    if bad:
        raise ValueError(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
    return names


class _Progress:
    """A rich progress display: one bar over the sections, the current step as text."""

    def __init__(self, enabled: bool, total: int):
        self.enabled = enabled
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        self.bar = Progress(SpinnerColumn(), TextColumn("[bold]{task.fields[section]:<15}"), BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"),
                            transient=False)
        self.task = self.bar.add_task("", total=total, section="")

    def __enter__(self):
        if self.enabled:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)

    def section(self, name: str):
        if self.enabled:
            self.bar.update(self.task, section=name, description="")

    def step(self, desc: str):
        if self.enabled:
            self.bar.update(self.task, description=desc[:70])

    def advance(self):
        if self.enabled:
            self.bar.advance(self.task)


def evaluate(args) -> dict:
    """Run the selected sections; return the results dict (every section of :data:`SECTIONS` present)."""
    from . import (
        correctness,
        decode,
        environment,
        memory,
        mixed_precision,
        perf,
        robustness,
        scaling,
        scorecard,
        soak,
        stability,
    )
    from .cases import profile
    from .context import Context, error_record
    from .impls import parse_impls

    device = _device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # kernels (Triton's included) launch on the current device
    prof = profile(args.profile, device)
    selected = _sections(args.sections)
    budget = args.time_budget if args.time_budget is not None else prof.time_budget_s
    if budget <= 0:
        raise ValueError(f"--time-budget must be positive, got {budget}")
    impls = parse_impls(args.impl, device)
    if not any(i.available for i in impls):
        raise ValueError("none of the requested implementations can run here: " + "; ".join(
            f"{i.name}: {i.reason}" for i in impls))
    t0 = time.monotonic()
    ctx = Context(device=device, profile=prof, impls=impls, deadline=t0 + budget, seed=args.seed,
                  peak_tflops=args.peak_tflops, peak_gbs=args.peak_gbs)
    sampler = environment.NvmlSampler(device).start()
    runners = {"correctness": correctness.run, "performance": perf.run, "decode": decode.run,
               "scaling": scaling.run, "memory": memory.run, "stability": stability.run, "robustness": robustness.run,
               "soak": lambda c: soak.run(c, results.get("scaling")), "mixed_precision": mixed_precision.run}
    results: dict = {}
    env = environment.collect(device)
    share = 0.0
    usable = max(budget - REPORT_RESERVE_S, budget * 0.5)
    with _Progress(not args.no_progress and sys.stderr.isatty(), len(runners)) as bar:
        ctx.progress = bar.step
        for name, fn in runners.items():
            share += BUDGET_SHARES[name]
            if name not in selected:
                results[name] = {"skipped": "not selected (--sections)"}
                continue
            bar.section(name)
            sampler.section = name
            ctx.deadline = t0 + usable * share
            start = time.monotonic()
            try:
                results[name] = fn(ctx)
            except Exception as e:  # a broken section must not lose the others; the report shows the error
                results[name] = {"error": error_record(e)}
            results[name]["elapsed_s"] = time.monotonic() - start
            bar.advance()
    sampler.stop()
    env["nvml"] = sampler.summary()
    env["driver"] = sampler.driver
    env["load_avg_end"] = environment.load_average()
    env["warning"] = environment.busy_warning(env)
    results["environment"] = env
    results["scorecard"] = scorecard.run(results) if "scorecard" in selected else {
        "skipped": "not selected (--sections)"}
    results["meta"] = {
        "profile": prof.name, "device": str(device), "time_budget_s": budget, "wall_s": time.monotonic() - t0,
        "sections": selected, "seed": args.seed, "argv": sys.argv[1:],
        "impls": [{"name": i.name, "kind": i.kind, "available": i.available, "reason": i.reason,
                   "version": i.version} for i in impls]}
    return results


def _summary(results: dict, paths: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from .report import headline
    hdr, rows = headline(results)
    table = Table(title=f"linattn eval — {results['meta']['profile']} on {results['meta']['device']} "
                        f"({results['meta']['wall_s']:.0f} s)")
    for h in hdr:
        table.add_column(h, overflow="fold")
    for row in rows:
        table.add_row(*[str(c) for c in row])
    console = Console()
    console.print(table)
    if results["environment"].get("warning"):
        console.print(f"[yellow]warning: {results['environment']['warning']}")
    for name in SECTIONS:
        sec = results.get(name, {})
        if "error" in sec and isinstance(sec["error"], dict):
            console.print(f"[red]section {name} failed: {sec['error']['type']}: {sec['error']['message']}")
    console.print("reports: " + ", ".join(paths.values()))


def run(args) -> int:
    from .report import write_all
    try:
        if args.compare:
            from . import compare
            d, text = compare.run(args.compare[0], args.compare[1], args.threshold)
            print(text)
            return 1 if args.fail_on_regression and d["worse"] else 0
        results = evaluate(args)
    except ValueError as e:
        print(f"linattn eval: {e}", file=sys.stderr)
        return 2
    paths = write_all(results, args.out)
    _summary(results, paths)
    return 0
