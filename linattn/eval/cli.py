"""``linattn eval``: run the evaluation suite and write report.json, report.md and report.html.

    linattn eval                                  # quick profile on the default device (GPU if any, else CPU)
    linattn eval --profile full --out eval-full   # the whole grid
    linattn eval --impl linattn,sdpa --device cpu --time-budget 120
    linattn eval --compare old/report.json new/report.json
    linattn eval --merge part1/report.json part2/report.json --out eval-full   # one report from --sections runs

Sections run in a fixed order; when one starts, what is left of the time budget is divided over it and the later
ones (:data:`BUDGET_SHARES`, normalised over the selected sections, above a minimum each: see
:meth:`Context.plan_section`), so time a section leaves unused, or borrows, is shared by the later ones. A
section that fails is recorded with its error and the others still run, so the report always has every section.

The reports are written after every section (and at most every :data:`CHECKPOINT_EVERY_S` inside one) with
``"partial": true`` and the list ``sections_done``; SIGTERM (what ``timeout`` sends) and SIGINT stop the run at the
next Python instruction, the running section is kept as interrupted with the records it had, and the reports are
written once more (exit status 128 + signal number). Without a progress bar (``--no-progress``, or output that is
not a terminal) every unit of work prints one line to stderr: elapsed seconds, what ran, its result and its time.
"""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from typing import Callable

import torch

from . import SECTIONS
from .cases import GATES
from .impls import DEFAULT_IMPLS, KNOWN_IMPLS

PROFILES = ("quick", "full", "tiny")
BUDGET_SHARES = {"correctness": 0.10, "performance": 0.20, "decode": 0.07, "scaling": 0.20, "memory": 0.08,
                 "stability": 0.10, "robustness": 0.08, "soak": 0.10, "mixed_precision": 0.07}
REPORT_RESERVE_S = 10.0  # kept back for the scorecard and the report writers
CHECKPOINT_EVERY_S = 30.0  # inside a long section, rewrite the partial report after a unit at most this often


def add_arguments(p: argparse.ArgumentParser) -> None:
    # rich and matplotlib are the [eval] extra: fail at parser build time so `linattn eval` names the missing extra
    import matplotlib  # noqa: F401
    import rich  # noqa: F401
    p.add_argument("--profile", default="quick", choices=PROFILES,
                   help="quick (default: <= 5 min on a CPU, <= 10 min on one GPU), full (the whole grid) or tiny "
                        "(seconds, toy shapes: checks that the suite runs, says nothing about speed)")
    p.add_argument("--impl", default=",".join(DEFAULT_IMPLS),
                   help=f"comma-separated implementations (default: %(default)s; known: {', '.join(KNOWN_IMPLS)}); "
                        "those not installed or not runnable here are skipped and listed in the report")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--out", default="eval-out", help="output directory (default: %(default)s)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="wall-clock budget for the run (default: the profile's); a unit of work starts only when its "
                        "estimated time fits its section's share or the run's spare time")
    p.add_argument("--sections", default=None,
                   help=f"comma-separated subset of sections to run (default: all of {', '.join(SECTIONS)})")
    p.add_argument("--seed", type=int, default=0, help="seed of every random input (default: 0)")
    p.add_argument("--gates", default="default", choices=GATES,
                   help="the decays of the speed sections' inputs (perf, scaling, memory, stability, soak): "
                        "'default' logsigmoid(x)/16 for every head (fla's and FlashQLA's benchmarks), 'mamba' a "
                        "rate per value head as a Mamba-style initialisation draws it, 0.001 to 1.6 per token "
                        "(default: %(default)s)"),
    p.add_argument("--peak-tflops", type=float, default=None, help="override the roofline's compute peak")
    p.add_argument("--peak-gbs", type=float, default=None, help="override the roofline's bandwidth peak (GB/s)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar: one line per unit of work on stderr instead (also when not on a terminal)")
    p.add_argument("--warm-from", nargs="+", metavar="REPORT_JSON", default=None,
                   help="earlier runs on this machine (report.json files or their directories) whose compiled "
                        "kernels the disk caches hold: the budget charges their signatures a cache load, not a "
                        "compile (same GPU, torch and Triton; fla only with TRITON_CACHE_AUTOTUNING=1 in both)")
    p.add_argument("--resume", nargs="+", metavar="REPORT_JSON", default=None,
                   help="earlier runs of this profile, device and --impl (report.json files or their directories): "
                        "their measured units of correctness, robustness, performance, decode and mixed precision "
                        "go into this report unchanged and are not run again; the budget goes to the rest")
    p.add_argument("--resume-impls", default=None, metavar="IMPLS",
                   help="--resume: carry only these implementations' records (comma-separated, e.g. "
                        "fla,flashqla,sdpa after a change to linattn); default: all")
    p.add_argument("--resume-redo", default=None, metavar="PATTERNS",
                   help="--resume: measure again the records whose id matches one of these shell-style patterns "
                        "(comma-separated, e.g. 'linattn/*/fp32,linattn/*/fp32/*' after a change to linattn's fp32 "
                        "path); default: none")
    p.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"), default=None,
                   help="print what got better or worse from report A to report B, and exit")
    p.add_argument("--threshold", type=float, default=0.05,
                   help="--compare: relative change that counts (default: %(default)s)")
    p.add_argument("--fail-on-regression", action="store_true",
                   help="--compare: exit with status 1 if anything got worse")
    p.add_argument("--merge", nargs="+", metavar="REPORT_JSON", default=None,
                   help="write one report into --out from several runs of the same profile, device and --impl made "
                        "with different --sections (report.json files or their directories), and exit")
    p.add_argument("--prefer-last", action="store_true",
                   help="--merge: a section selected by several runs is taken from the last of them (else an error)")
    p.add_argument("--allow-partial", action="store_true",
                   help="--merge: accept partial (interrupted) runs; the merged report is marked partial")


def _device(spec) -> torch.device:
    """The run's device, with its index for CUDA (``cuda`` is the current device, ``cuda:0`` on a fresh process):
    the sections and their worker threads all select that one device."""
    from .context import indexed
    if spec is None:
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(spec)
    except RuntimeError as e:
        raise ValueError(f"--device {spec!r} is not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {spec}: linattn eval supports cpu and cuda devices")
    return indexed(dev)


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


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM / SIGINT while ``linattn eval`` runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Signals:
    """SIGTERM and SIGINT raise :class:`Interrupted` in the main thread (so the partial report gets written),
    except inside :meth:`deferred` (a report being written: the signal is raised when the block ends) and after
    :meth:`hold` (the run is over and its report being written: the signal is only remembered, in ``pending``).
    After the first one, further signals are ignored. The previous handlers come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.previous, self.mode, self.pending, self.received = {}, "raise", None, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self.previous.items():
            signal.signal(sig, old)
        self.previous = {}

    def _handler(self, signum, frame):
        if self.received is not None or self.pending is not None:
            return  # already stopping: let the report be written
        if self.mode != "raise":
            self.pending = signum
            return
        self.received = signum
        raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self):
        prev = self.mode
        self.mode = "defer" if prev == "raise" else prev
        try:
            yield
        finally:
            self.mode = prev
        if self.mode == "raise" and self.pending is not None:
            self.received, self.pending = self.pending, None
            raise Interrupted(self.received)

    def hold(self) -> None:
        self.mode = "hold"


class _Log:
    """One flushed line per unit of work on stderr, prefixed with the seconds since the run started."""

    def __init__(self, enabled: bool, clock: Callable[[], float], t0: float):
        self.enabled, self.clock, self.t0 = enabled, clock, t0

    def __call__(self, line: str) -> None:
        if self.enabled:
            print(f"[{self.clock() - self.t0:7.1f}s] {line}", file=sys.stderr, flush=True)


class Evaluation:
    """One ``linattn eval`` run: its arguments checked (``ValueError`` otherwise), then :meth:`run`. ``clock``: what
    the budget, the log and the timings read (:attr:`Context.clock`)."""

    def __init__(self, args, guard: _Signals = None, clock: Callable[[], float] = time.monotonic):
        from .cases import profile
        from .context import Context
        from .impls import parse_impls
        from .report import prepare_out_dir

        self.args, self.guard = args, guard or _Signals()
        prepare_out_dir(args.out)
        self.device = _device(args.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # kernels (Triton's included) launch on the current device
        self.prof = profile(args.profile, self.device)
        self.selected = _sections(args.sections)
        self.budget = args.time_budget if args.time_budget is not None else self.prof.time_budget_s
        if self.budget <= 0:
            raise ValueError(f"--time-budget must be positive, got {self.budget}")
        self.impls = parse_impls(args.impl, self.device)
        if not any(i.available for i in self.impls):
            raise ValueError("none of the requested implementations can run here: " + "; ".join(
                f"{i.name}: {i.reason}" for i in self.impls))
        self.bar_enabled = not args.no_progress and sys.stdout.isatty() and sys.stderr.isatty()
        self.clock = clock
        self.t0 = clock()
        self.log = _Log(not self.bar_enabled, clock, self.t0)
        self.ctx = Context(device=self.device, profile=self.prof, impls=self.impls, deadline=self.t0 + self.budget,
                           seed=args.seed, gates=args.gates, peak_tflops=args.peak_tflops, peak_gbs=args.peak_gbs,
                           clock=clock, t0=self.t0, log=self.log, on_unit=self._maybe_checkpoint)
        self.warm_from = None  # meta.warm_from: what --warm-from took as cached
        if args.warm_from:
            from .warm import load_cached
            self.ctx.cached, self.warm_from = load_cached(args.warm_from, self.device,
                                                          [i.name for i in self.impls if i.available])
        self.resumed_from = None  # meta.resumed_from: what --resume offered, and (at the end) what was carried
        if args.resume:
            from .resume import load_earlier
            carry = [s.strip() for s in args.resume_impls.split(",") if s.strip()] if args.resume_impls else None
            redo = [s.strip() for s in args.resume_redo.split(",") if s.strip()] if args.resume_redo else None
            self.ctx.earlier, self.resumed_from = load_earlier(args.resume, self.prof.name, self.device, args.seed,
                                                               [i.name for i in self.impls], carry, redo,
                                                               gates=args.gates)
        elif args.resume_impls or args.resume_redo:
            raise ValueError(f"{'--resume-impls' if args.resume_impls else '--resume-redo'} needs --resume")
        self.results: dict = {}
        self.done: list = []
        self.running = None
        self.interrupted = None
        self.env = None
        self.sampler = None
        self.last_checkpoint = self.t0

    # ---- the report, whole or partial --------------------------------------------------------------------
    def assemble(self, final: bool = False) -> dict:
        """The results dict with every section of :data:`SECTIONS`: the finished ones, the running one (in a
        partial report: its records so far), the others marked as not run (yet)."""
        from . import environment, scorecard
        out = {}
        for name in RUNNERS:
            if name in self.results:
                out[name] = self.results[name]
            elif name == self.running:
                state = "interrupted" if self.interrupted else "in progress"
                out[name] = {"skipped": f"{state} (partial: the records so far are in report.json)",
                             state.replace(" ", "_"): True, **_copy(self.ctx.partial),
                             "elapsed_s": self.clock() - self.section_start}
            elif name not in self.selected:
                out[name] = {"skipped": "not selected (--sections)"}
            else:
                out[name] = {"skipped": "not run: the run was interrupted" if self.interrupted else
                             "pending (partial report written during the run)"}
        if self.env is None:  # interrupted before it was collected
            self.env = environment.collect(self.device)
        env = dict(self.env)
        if final:
            self.sampler.stop()
            env["nvml"] = self.sampler.summary()
            env["driver"] = self.sampler.driver
            env["load_avg_end"] = environment.load_average()
        else:
            env["nvml"] = {"available": False, "reason": "summarised when the run ends"}
        env["warning"] = environment.busy_warning(env)
        out["environment"] = env
        out["scorecard"] = {"skipped": "not selected (--sections)"}
        if "scorecard" in self.selected:
            try:
                out["scorecard"] = scorecard.run(out)
            except Exception as e:  # a partial report must not fail on a score it cannot compute yet
                from .context import error_record
                out["scorecard"] = {"error": error_record(e)}
        done = ["environment"] + list(self.done) + (["scorecard"] if final and not self.interrupted
                                                    and "scorecard" in self.selected else [])
        complete = final and not self.interrupted
        out["partial"] = not complete
        out["sections_done"] = done
        out["meta"] = {
            "profile": self.prof.name, "device": str(self.device), "time_budget_s": self.budget,
            "wall_s": self.clock() - self.t0, "sections": self.selected, "seed": self.args.seed,
            "gates": self.args.gates,
            "argv": sys.argv[1:], "partial": not complete, "interrupted": self.interrupted,
            "first_call_max_s": {k: c.first_call_max_s for k, c in self.ctx.costs.items()},
            "compiles": {k: [{"family": e.sig.family, "kernel": list(e.sig.kernel), "dtype": e.sig.dtype,
                              "dims": list(e.sig.dims), "flags": list(e.sig.flags), "seconds": e.seconds,
                              "incremental": e.incremental, "cached": e.cached} for e in c.compiles]
                         for k, c in self.ctx.costs.items()},
            "warm_from": self.warm_from,
            "resumed_from": self.resumed_from and {**self.resumed_from, "carried": dict(self.ctx.carried)},
            "impls": [{"name": i.name, "kind": i.kind, "available": i.available, "reason": i.reason,
                       "version": i.version} for i in self.impls]}
        return out

    def write(self, results: dict, figures: bool) -> dict:
        from .report import write_all
        with self.guard.deferred():
            return write_all(results, self.args.out, figures=figures)

    def checkpoint(self) -> None:
        self.last_checkpoint = self.clock()
        self.write(self.assemble(), figures=False)

    def _maybe_checkpoint(self) -> None:
        if self.clock() - self.last_checkpoint >= CHECKPOINT_EVERY_S:
            self.checkpoint()

    # ---- the run -------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run the selected sections; return the final results (partial when interrupted)."""
        from . import (
            correctness,
            decode,
            environment,
            memory,
            mixed_precision,
            perf,
            robustness,
            scaling,
            soak,
            stability,
        )
        from .context import error_record

        ctx, results = self.ctx, self.results
        runners = {"correctness": correctness.run, "performance": perf.run, "decode": decode.run,
                   "scaling": lambda c: scaling.run(c, results.get("performance")), "memory": memory.run,
                   "stability": stability.run, "robustness": robustness.run,
                   "soak": lambda c: soak.run(c, results.get("scaling")), "mixed_precision": mixed_precision.run}
        chosen = [n for n in runners if n in self.selected]
        weights = [BUDGET_SHARES[n] for n in chosen]
        usable = max(self.budget - REPORT_RESERVE_S, self.budget * 0.5)
        ctx.run_deadline, ctx.budget_s = self.t0 + usable, usable
        self.sampler = environment.NvmlSampler(self.device)
        try:
            self.sampler.start()
            self.env = environment.collect(self.device)
            names = ", ".join(i.name for i in self.impls if i.available)
            self.log(f"linattn eval: profile {self.prof.name} on {self.device}, impls {names}, budget "
                     f"{self.budget:.0f} s (sections until {usable:.0f} s), out {self.args.out}")
            if self.warm_from:
                from .warm import describe
                self.log(f"warm from {describe(self.warm_from)}")
            if self.resumed_from:
                from .resume import describe as resumed
                self.log(f"resume from {resumed(self.resumed_from)}")
            self.checkpoint()
            with _Progress(self.bar_enabled, len(chosen)) as bar:
                ctx.progress = bar.step
                for i, name in enumerate(chosen):
                    bar.section(name)
                    self.sampler.section = name
                    ctx.plan_section(weights, i)  # what is left, divided over this section and the later ones
                    ctx.begin_section(name)
                    self.running, self.section_start = name, self.clock()
                    self.log(f"{name}: start ({ctx.remaining():.0f} s until its deadline at "
                             f"{ctx.deadline - self.t0:.0f} s, {max(ctx.spare(), 0):.0f} s with the run's spare "
                             "time)")
                    try:
                        results[name] = runners[name](ctx)
                    except Exception as e:  # a broken section must not lose the others; the report shows the error
                        results[name] = {"error": error_record(e)}
                        self.log(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    budget = ctx.end_section()
                    results[name]["elapsed_s"] = self.clock() - self.section_start
                    results[name]["budget"] = budget
                    self.running = None
                    self.done.append(name)
                    skips = sum(v["skipped_for_time"] for v in budget["impls"].values())
                    self.log(f"{name}: done in {results[name]['elapsed_s']:.1f} s"
                             + (f", {skips} units skipped for time" if skips else ""))
                    bar.advance()
                    self.checkpoint()
        except KeyboardInterrupt as e:
            signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
            unit = (ctx._unit or {}).get("desc") if self.running else None
            # A signal can land between two sections (while a checkpoint is written): then no section was
            # running, and the report says which one had just finished instead of blaming the setup.
            during = (self.running or (f"the gap after {self.done[-1]}" if self.done else "setup"))
            self.interrupted = {"signal": signal.Signals(signum).name, "signum": int(signum),
                                "at_s": self.clock() - self.t0, "section": self.running, "unit": unit,
                                "during": during}
            self.log(f"interrupted by {self.interrupted['signal']} during {unit or during}: "
                     "writing the partial report")
        self.guard.hold()  # from here on a signal waits for the reports
        out = self.assemble(final=True)
        self.running = None
        return out


RUNNERS = ("correctness", "performance", "decode", "scaling", "memory", "stability", "robustness", "soak",
           "mixed_precision")


def _copy(partial: dict) -> dict:
    """A shallow snapshot of a running section's lists (they keep growing after the checkpoint)."""
    return {k: (list(v) if isinstance(v, list) else v) for k, v in partial.items()}


def evaluate(args) -> dict:
    """Run the selected sections; return the results dict (every section of :data:`SECTIONS` present)."""
    with _Signals() as guard:
        return Evaluation(args, guard).run()


def _summary(results: dict, paths: dict) -> None:
    import shutil

    from .summary import PIPE_WIDTH, render
    width = min(shutil.get_terminal_size((PIPE_WIDTH, 24)).columns, 120) if sys.stdout.isatty() else PIPE_WIDTH
    print(render(results, paths, width))


def _merge(args) -> int:
    from . import merge
    if args.compare:
        raise ValueError("--merge and --compare cannot be used together")
    if args.warm_from:
        raise ValueError("--warm-from applies to a run, not to --merge (each merged run's is in meta.merged_from)")
    if args.resume or args.resume_impls or args.resume_redo:
        raise ValueError("--resume applies to a run, not to --merge (each merged run's is in meta.merged_from)")
    results, paths = merge.run(args.merge, args.out, prefer_last=args.prefer_last, allow_partial=args.allow_partial)
    for src in results["meta"]["merged_from"]:
        print(f"{src['path']}: {', '.join(src['taken']) or 'no section taken'}", file=sys.stderr)
    if results["partial"] or results["missing_sections"]:
        print(f"linattn eval: merged report {'is partial; ' if results['partial'] else ''}sections missing: "
              f"{', '.join(results['missing_sections']) or 'none'}", file=sys.stderr)
    _summary(results, paths)
    return 0


def run(args) -> int:
    try:
        if args.merge:
            return _merge(args)
        if args.compare:
            from . import compare
            d, text = compare.run(args.compare[0], args.compare[1], args.threshold)
            print(text)
            return 1 if args.fail_on_regression and d["worse"] else 0
    except ValueError as e:
        print(f"linattn eval: {e}", file=sys.stderr)
        return 2
    with _Signals() as guard:
        try:
            ev = Evaluation(args, guard)
        except ValueError as e:
            print(f"linattn eval: {e}", file=sys.stderr)
            return 2
        except Interrupted as e:  # before the run started (importing fla / FlashQLA can take a while)
            print(f"linattn eval: interrupted by {e} before the run started; no report", file=sys.stderr)
            return 128 + e.signum
        results = ev.run()
        paths = ev.write(results, figures=False)  # json, md and html without plots first
        paths = ev.write(results, figures=True)
    ev.log("reports: " + ", ".join(paths.values()))
    _summary(results, paths)
    stop = ev.interrupted
    if stop:
        return 128 + stop["signum"]
    if guard.pending is not None:  # a signal after the last section: the report is complete, still say so
        print(f"linattn eval: {signal.Signals(guard.pending).name} received while writing the reports",
              file=sys.stderr)
        return 128 + int(guard.pending)
    return 0
