"""What every section receives: device, profile, implementations, the time budget, the progress display and log.

Units of work and the time budget: a section announces each unit with :meth:`Context.fits` (may it start?), then
:meth:`Context.step` (it starts: progress bar, unit clock) and :meth:`Context.done` (one log line, and the unit's
time goes into the cost model). The cost model keeps, per implementation, the *shape classes* it has already run
(dtype, direction, head counts and dims, the options that select other kernels: see :func:`shape_classes`), its
first-call times (JIT compile / autotune: a unit's own measurement, else the whole unit when its class was new) and
its last steady unit time per section. :meth:`Context.fits` estimates a unit and refuses it when the estimate
exceeds the time it may use:

* class already run: the last steady unit time, against what is left of the current share;
* new class, the implementation already paid a first call in this section: that section's first-call time (the
  largest for the compiled third-party implementations fla and FlashQLA, tens of seconds per class; the latest
  for the others) plus the steady time, against what is left of the share;
* new class, first one of the implementation in this section (kernel families differ: fla's recurrent decode
  kernel compiles in seconds, its chunked kernels autotune for half a minute): the largest first call seen in the
  run, or :data:`FIRST_CALL_PRIOR_S` if there is none yet (GPU, third-party compilers), against what is left of the
  *whole run* less half the nominal time of the sections after this one (:attr:`Context.later_s`): a first
  compile is tried where later sections can absorb it, not at the very end, and never takes all of their time.

Also the device-neutral helpers the sections share: ``sync``, peak-memory measurement (the CUDA caching
allocator's counters on GPU; the PyTorch profiler's allocation events on CPU), the process's resident set (soak),
and ``run_with_timeout`` (robustness must survive a call that never returns).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .cases import Profile
from .impls import Impl

# Seconds a first call (compile + autotune) is assumed to take before this run has timed one, per implementation;
# GPU only. fla autotunes for ~35 s on its first shape; FlashQLA's TileLang compiles take 10-25 s per kernel, and a
# forward + backward unit compiles several.
FIRST_CALL_PRIOR_S = {"fla": 40.0, "flashqla": 60.0}
SKIP_LOG_LINES = 5  # skipped units logged one by one per section; the rest are counted in the section's last line


@dataclass
class ImplCost:
    """What the run has learnt about one implementation's cost (see the module docstring)."""
    classes: set = field(default_factory=set)
    first_call_max_s: float = 0.0  # over the run
    section_first_s: dict = field(default_factory=dict)  # section -> (largest, latest) first call there
    steady_s: dict = field(default_factory=dict)  # section -> last unit time without a first call


def shape_classes(impl, shape, dtype: str, direction: str, **options) -> tuple:
    """The compile classes a call of ``impl`` needs: one per direction it runs (fwd+bwd runs the forward too).

    A class is what selects a different compiled kernel in a JIT implementation: dtype, direction, head counts and
    dims, T == 1 and T % 16 == 0 (Triton specialises integer arguments equal to 1 or divisible by 16), and the
    options that switch kernels (varlen, initial state, and the pre-processing the implementation does natively;
    pre-processing done in PyTorch for it compiles nothing). B and T otherwise do not matter.
    """
    native = getattr(impl, "native", set()) or set()
    opts = tuple(sorted(k for k, v in options.items() if v and (k in ("varlen", "h0", "step") or k in native)))
    base = (dtype, shape.H, shape.HV, shape.K, shape.V, shape.T == 1, shape.T % 16 == 0) + opts
    dirs = ("fwd", "fwdbwd") if direction == "fwdbwd" else (direction,)
    return tuple((d,) + base for d in dirs)


@dataclass
class Context:
    device: torch.device
    profile: Profile
    impls: list[Impl]
    deadline: float  # time.monotonic() value after which sections stop starting new work
    seed: int = 0
    progress: Optional[Callable[[str], None]] = None  # called with a short description when a unit starts
    peak_tflops: Optional[float] = None  # user overrides of the roofline ceilings
    peak_gbs: Optional[float] = None
    notes: list = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)  # start of the run: the log lines' clock
    run_deadline: float = math.inf  # end of the whole run's usable time (the last section's deadline)
    later_s: float = 0.0  # nominal seconds of the sections after the running one (half is kept from first compiles)
    log: Optional[Callable[[str], None]] = None  # one line per unit of work (no progress bar)
    on_unit: Optional[Callable[[], None]] = None  # after each unit (the CLI checkpoints the report)
    partial: dict = field(default_factory=dict)  # the running section's results so far, kept if it is interrupted
    costs: dict = field(default_factory=dict)  # impl name -> ImplCost, across the run
    section: str = ""
    section_stats: dict = field(default_factory=dict)  # impl name -> units, seconds, first calls, skips (section)
    _unit: Optional[dict] = None
    _skip_lines: int = 0

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    def available(self, kind: Optional[str] = None) -> list[Impl]:
        return [i for i in self.impls if i.available and (kind is None or i.kind == kind)]

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def out_of_time(self, reserve_s: float = 0.0) -> bool:
        return self.remaining() <= reserve_s

    @contextlib.contextmanager
    def share(self, parts_left: int):
        """Run the block with a fair share of the remaining time, ``1 / parts_left`` of it; time the block leaves
        unused stays for the parts after it. (Without this, the first sweep of a section could starve the rest.)"""
        old = self.deadline
        self.deadline = time.monotonic() + max(0.0, self.remaining()) / max(1, parts_left)
        try:
            yield
        finally:
            self.deadline = old

    # ---- the cost model and the per-unit budget ------------------------------------------------------------
    def _stats(self, impl: str) -> dict:
        return self.section_stats.setdefault(impl, {"units": 0, "seconds": 0.0, "new_shape_classes": 0,
                                                    "first_call_max_s": None, "skipped_for_time": 0})

    def estimate(self, impl: Optional[str], classes: tuple = ()) -> tuple[float, str]:
        """(seconds a unit of ``impl`` on ``classes`` is expected to take, the rule that gave it: "last unit" and
        "new shape class" are judged against the share, "first in section" and "prior" against the whole run)."""
        if impl is None:
            return 0.0, "none"
        c = self.costs.get(impl)
        if c is None:
            return (FIRST_CALL_PRIOR_S.get(impl, 0.0) if self.gpu else 0.0), "prior"
        steady = c.steady_s.get(self.section, 0.0)
        if all(k in c.classes for k in classes):
            return steady, "last unit"
        if self.section in c.section_first_s:
            largest, latest = c.section_first_s[self.section]
            return (largest if impl in FIRST_CALL_PRIOR_S else latest) + steady, "new shape class"
        return c.first_call_max_s + steady, "first in section"

    def _left(self, rule: str) -> float:
        if rule in ("prior", "first in section"):
            return self.run_deadline - 0.5 * self.later_s - time.monotonic()
        return self.deadline - time.monotonic()

    def fits(self, impl: Optional[str] = None, classes: tuple = (), desc: str = "") -> bool:
        """May a unit of ``impl`` (on these shape classes) start? False when the share is spent or the unit's
        estimate exceeds the time it may use (see the module docstring); a refused unit is counted (and logged) as
        skipped for time."""
        left = self.remaining()
        est, rule = self.estimate(impl, classes)
        if left > 0 and est <= self._left(rule):
            return True
        if impl is not None:
            self._stats(impl)["skipped_for_time"] += 1
        self._skip_lines += 1
        if self._skip_lines <= SKIP_LOG_LINES and desc:
            why = (f"needs ~{est:.0f} s ({rule}), {max(self._left(rule), 0):.0f} s left" if left > 0
                   else "share spent")
            self.emit(f"skip {desc}: time budget ({why})")
        return False

    def step(self, desc: str, impl: Optional[str] = None, classes: tuple = ()) -> None:
        """A unit of work starts (the previous one, if not closed with :meth:`done`, is closed as "done")."""
        if self._unit is not None:
            self.done("done")
        c = self.costs.get(impl) if impl is not None else None
        new = impl is not None and (c is None or any(k not in c.classes for k in classes))
        self._unit = {"desc": desc, "impl": impl, "classes": tuple(classes), "new": new, "t": time.monotonic()}
        if self.progress is not None:
            self.progress(desc)

    def done(self, result: str = "done", first_call_s: Optional[float] = None) -> None:
        """The current unit ended: log one line and feed its time to the cost model. ``first_call_s``: the
        unit's own measurement of its first call (else a unit on a new shape class counts whole as a first call)."""
        u, self._unit = self._unit, None
        if u is None:
            return
        unit_s = time.monotonic() - u["t"]
        note = f"{unit_s:.1f} s"
        if u["impl"] is not None:
            c = self.costs.setdefault(u["impl"], ImplCost())
            st = self._stats(u["impl"])
            st["units"] += 1
            st["seconds"] += unit_s
            if u["new"]:
                fc = first_call_s if first_call_s is not None else unit_s
                c.first_call_max_s = max(c.first_call_max_s, fc)
                largest, _ = c.section_first_s.get(self.section, (0.0, 0.0))
                c.section_first_s[self.section] = (max(largest, fc), fc)
                st["new_shape_classes"] += 1
                st["first_call_max_s"] = max(st["first_call_max_s"] or 0.0, fc)
                if first_call_s is not None:
                    c.steady_s[self.section] = max(0.0, unit_s - fc)
                note += f", new shape class: first call {fc:.1f} s"
            else:
                c.steady_s[self.section] = unit_s
            c.classes.update(u["classes"])
        self.emit(f"{u['desc']}: {result} ({note})")
        if self.on_unit is not None:
            self.on_unit()

    def begin_section(self, name: str) -> None:
        self.section, self.section_stats, self.partial, self._unit, self._skip_lines = name, {}, {}, None, 0

    def end_section(self) -> dict:
        """Close the section's last unit; return its budget record (per implementation: units, seconds, new shape
        classes, largest first call, units skipped for time)."""
        if self._unit is not None:
            self.done("done")
        return {"impls": self.section_stats, "skip_lines_not_logged": max(0, self._skip_lines - SKIP_LOG_LINES)}

    def emit(self, line: str) -> None:
        if self.log is not None:
            self.log(line)

    def hard_timeout(self, impl: Optional[str], classes: tuple, limit_s: float, grace_s: float = 5.0) -> tuple:
        """(timeout for a call run with :func:`run_with_timeout`, whether the budget set it). ``limit_s`` (a hang)
        plus the first-call estimate when the class is new, cut to what :meth:`fits` let the unit use plus
        ``grace_s``."""
        est, rule = self.estimate(impl, classes)
        want = limit_s + (est if rule != "last unit" else 0.0)
        cut = max(self._left(rule), 0.0) + grace_s
        return (cut, True) if cut < want else (want, False)

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)


def error_record(e: BaseException) -> dict:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return {"type": type(e).__name__, "message": msg[:300]}


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


# --------------------------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def rss_supported() -> bool:
    try:
        _rss_bytes()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _quiet_stderr():
    """Silence fd 2 (the profiler's C++ side prints start/stop lines there) and restore it afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of live CPU tensor bytes allocated by ``fn`` (exact: the profiler's allocation events, replayed)."""
    from torch.profiler import ProfilerActivity, profile
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.profiler.DeviceType.CPU)
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


def measure_peak(ctx: Context, fn: Callable[[], object]) -> dict:
    """Run ``fn`` once; return the peak memory it added above what was allocated before it.

    GPU: ``max_memory_allocated`` minus ``memory_allocated`` before (the caching allocator's counters), plus
    active/reserved bytes after (fragmentation). CPU: the allocation and free events the PyTorch profiler records,
    replayed in order (exact for tensor memory; the profiler slows the call, so it is never timed at the same time).
    """
    if ctx.gpu:
        ctx.sync()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        base = torch.cuda.memory_allocated(ctx.device)
        out = fn()
        ctx.sync()
        peak = torch.cuda.max_memory_allocated(ctx.device) - base
        del out
        stats = torch.cuda.memory_stats(ctx.device)
        return {"peak_bytes": int(peak), "method": "cuda_allocator",
                "active_bytes": int(stats.get("active_bytes.all.current", 0)),
                "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0))}
    return {"peak_bytes": int(cpu_peak_bytes(fn)), "method": "cpu_profiler"}


def allocated_bytes(ctx: Context) -> Optional[int]:
    if ctx.gpu:
        return int(torch.cuda.memory_allocated(ctx.device))
    return _rss_bytes() if rss_supported() else None


def empty_cache(ctx: Context) -> None:
    if ctx.gpu:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------
# calls that may hang
# --------------------------------------------------------------------------------------------------------------
def run_with_timeout(fn: Callable[[], object], timeout_s: float,
                     device: Optional[torch.device] = None) -> tuple[str, object]:
    """Run ``fn`` in a worker thread; return ``("ok", result)``, ``("error", exception)`` or ``("hang", None)``.

    A thread cannot be killed: a hung call is left running as a daemon and reported; the suite moves on. (A process
    would be killable but cannot share the caller's CUDA context and tensors, which is what is being tested.)
    """
    box: dict = {}

    def target():
        try:
            if device is not None and device.type == "cuda":
                # a new thread starts on CUDA device 0; kernels launch on the current device
                torch.cuda.set_device(device)
            box["result"] = fn()
        except BaseException as e:  # recorded, not raised: the report says which inputs raise what
            box["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        return "hang", None
    if "error" in box:
        return "error", box["error"]
    return "ok", box.get("result")
