"""What every section receives: device, profile, implementations, the time budget, the progress display and log.

Units of work and the time budget: a section announces each unit with :meth:`Context.fits` (may it start?), then
:meth:`Context.step` (it starts: progress bar, unit clock) and :meth:`Context.done` (one log line, and the unit's
time goes into the cost model).

The cost model (per implementation, :class:`ImplCost`) keeps the *compile signatures* the process has already run
(:class:`Sig`: kernel family, kernel, dtype, K/V, and the flags that specialise a kernel, see
:func:`shape_classes`), what each new one cost to compile (a unit's first-call time less its steady time, split
over the signatures it added), and the last steady unit time per section. A unit's estimate is its section's
steady time plus, for each signature it has not run yet:

* a flag-only change (same family, kernel, dtype and K/V as one compiled before: T = 1, varlen, initial state,
  in-op gate / L2 norm, head counts): the implementation's measured *incremental* compile in that family (the mean;
  the largest for the compiled third parties fla and FlashQLA), or before any, :data:`INCREMENTAL_FRACTION` of that
  base's first compile;
* a new kernel, dtype or K/V: the first compile of the most similar signature of the same family, scaled by the
  kernels' weight (:data:`KERNEL_WEIGHT`: a backward compiles about twice the forward's kernels);
* a family the implementation has not compiled yet (the chunked op, ``chunk``, or a decode path's step kernel,
  ``step``: different kernels, so decode never inherits the chunked op's compile): :data:`FIRST_CALL_PRIOR_S` per
  kernel set on a GPU, else 0 (a CPU has no compiler to wait for: as measured);
* a signature an earlier run on this machine compiled (``--warm-from``, :attr:`Context.cached`): loading its
  kernels from the disk caches, :data:`CACHE_LOAD_S`, or once this process has loaded one, the measured load
  (so a cache that turned out cold corrects the estimate after one unit); never more than the rules above give.
  Such first calls are recorded as ``cached`` compiles and kept out of the rules above: a 0.1 s cache load says
  nothing about what a real compile costs.

Slow units last: correctness and performance ask :meth:`Context.defers` of each unit first and put the ones
expected to take over :data:`SLOW_UNIT_S` (on a GPU: a third party's new compile) in a second pass, in their
order, after every cheaper unit of the section: FlashQLA's and fla's compiles of 67-134 s each (H200), run in turn
with the others' units, would use a whole call's budget while linattn's correctness units and performance rows
(seconds each) are skipped for time.

A unit starts when its estimate fits what is left of its share (the section's, or inside it the implementation's
or sweep's, :meth:`Context.share`) or, failing that, the run's *spare* time (:meth:`Context.spare`): what is left
of the whole run less a reserve for the minimal work of each later section (:data:`RESERVE_FRACTION` of the
budget each, at most its nominal share) and the fair shares of the later parts of this section. A unit over its
share borrows that time (later sections rebalance: the CLI divides what is left when each starts,
:meth:`Context.plan_section`); a unit that fits neither is skipped, counted and logged.

Time: every deadline, unit time and time-sized loop of the sections reads :attr:`Context.clock` (``time.monotonic``
unless told otherwise), and so do the hard timeouts of :meth:`Context.call_with_timeout`; the tests drive a virtual
clock through it, so that their scheduling does not depend on the machine's speed.

Also the device-neutral helpers the sections share: ``sync``, peak-memory measurement (the CUDA caching
allocator's counters on GPU; the PyTorch profiler's allocation events on CPU), the process's resident set (soak),
and ``run_with_timeout`` (robustness and mixed precision must survive a call that never returns).
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch

from .cases import Profile
from .impls import Impl

# Seconds the first kernel set (a direction: forward, backward, or a decode step) of a kernel family is assumed to
# compile (and autotune) before this run has timed one, per implementation; GPU only (H200 measurements). fla
# autotunes its chunked forward for ~35 s on a first shape; FlashQLA compiles 40-60 s per shape class and
# direction; a forward + backward unit pays two. A decode path's step kernel is small: linattn's recurrent kernels
# compile in 3-5 s, fla's similar. linattn's chunked op has no prior: it is the suite's subject, its first unit is
# always tried.
FIRST_CALL_PRIOR_S = {"chunk": {"fla": 40.0, "flashqla": 60.0},
                      "step": {"linattn": 10.0, "linattn-triton": 10.0, "fla": 15.0}}
# Seconds a signature's kernel set takes to load from the disk caches when an earlier process on the same machine
# compiled it (``--warm-from``), per implementation, GPU only. Measured on one H200 kept warm between four
# ``--sections`` calls (2026-11-29): linattn's Triton kernels took 0.1 s on their first call in a later process
# (6-70 s to compile), FlashQLA's TileLang kernels 2.6 s (30-90 s); the constants leave a margin. fla's autotune
# runs again in every process (35-55 s) unless Triton caches autotune results too (TRITON_CACHE_AUTOTUNING=1, in
# the earlier run and in this one: :data:`CACHE_NEEDS_ENV`); then its load is assumed to be FlashQLA's. An
# implementation not listed (no JIT, or not measured) gets no cache assumption.
CACHE_LOAD_S = {"linattn": 0.5, "linattn-triton": 0.5, "flashqla": 5.0, "fla": 5.0}
CACHE_NEEDS_ENV = {"fla": "TRITON_CACHE_AUTOTUNING"}  # a cache that only holds what this variable enables
INCREMENTAL_FRACTION = 0.3  # a flag-only new signature, before an incremental compile was measured: this x the base's
KERNEL_WEIGHT = {"bwd": 2.0}  # compile weight of a kernel set relative to a forward (1)
COMPILED_THIRD_PARTY = ("fla", "flashqla")  # autotune per signature: the largest incremental compile, not the mean
RESERVE_FRACTION = 0.10  # kept for each later section: this x the usable budget, at most its nominal share
# A call that compiles first waits out the hang limit plus this x its compile estimate before it is stopped.
# Estimates come from other signatures' compiles and miss by up to about 2x (H200: fla's first fp32 call in
# robustness compiles for 65.6 s where its fp16 ones take 36-37 s, so an fp32 class estimated at 35.9 s would be
# stopped at 65.9 s and recorded as a hang). Such a stop is recorded as a first-call timeout, not as a hang.
HANG_COMPILE_ALLOWANCE = 3.0
SKIP_LOG_LINES = 5  # skipped units logged one by one per section; the rest are counted in the section's last line
# correctness and performance run the units expected to take longer than this (a new compile of fla or FlashQLA:
# 40-130 s on a fresh H200) in a second pass, after every cheaper unit (Context.defers)
SLOW_UNIT_S = 30.0


class Sig(NamedTuple):
    """One compile signature: what selects a separately compiled kernel (set) in a JIT implementation."""
    family: str  # "chunk" (the chunked op) or "step" (a decode path's step kernel)
    kernel: tuple  # ("fwd",) / ("bwd",) for the chunked op; (path, state dtype) for a decode step
    dtype: str
    dims: tuple  # (K, V): block sizes, everything recompiles
    flags: tuple  # (H, HV, T == 1, T % 16 == 0, options): a specialisation of kernels compiled before

    @property
    def weight(self) -> float:
        return KERNEL_WEIGHT.get(self.kernel[0] if self.kernel else "", 1.0)

    def base(self) -> tuple:
        return self.family, self.kernel, self.dtype, self.dims


@dataclass
class Compile:
    sig: Sig
    seconds: float
    incremental: bool  # a flag-only change of a signature compiled before
    cached: bool = False  # an earlier run compiled it (--warm-from): a load from the disk caches, not a compile


@dataclass
class ImplCost:
    """What the run has learnt about one implementation's cost (see the module docstring)."""
    classes: set = field(default_factory=set)  # signatures already run in this process
    compiles: list = field(default_factory=list)  # [Compile], in the order measured
    first_call_max_s: float = 0.0  # over the run (the report's meta)
    steady_s: dict = field(default_factory=dict)  # section -> last unit time without a first call


def shape_classes(impl, shape, dtype: str, direction: str, step: Optional[tuple] = None, **options) -> tuple:
    """The compile signatures (:class:`Sig`) a call of ``impl`` needs: the forward's, and the backward's for
    "fwdbwd"; with ``step=(path, state dtype)`` the one of a decode path's step kernel instead.

    Flags: head counts, T == 1 and T % 16 == 0 (Triton specialises integer arguments equal to 1 or divisible by
    16; for the chunked op not when the implementation's ``length_specialised`` is False: linattn's chunked
    kernels take T unspecialised, its decode kernels do specialise on T == 1),
    and the options that switch kernels (varlen, initial state, and the pre-processing the implementation does
    natively; pre-processing done in PyTorch for it compiles nothing), and the kernel sets the implementation picks
    from the shape (``impl.modes``: FlashQLA's intra-card sequence parallelism). B and T otherwise do not matter.
    """
    native = getattr(impl, "native", set()) or set()
    opts = tuple(sorted(k for k, v in options.items() if v and (k in ("varlen", "h0") or k in native)))
    specialised = step is not None or getattr(impl, "length_specialised", True)
    length = (shape.T == 1, shape.T % 16 == 0) if specialised else ()
    modes = getattr(impl, "modes", None)
    flags = (shape.H, shape.HV) + length + opts + (tuple(modes(shape)) if modes is not None and step is None else ())
    dims = (shape.K, shape.V)
    if step is not None:
        return (Sig("step", tuple(step), dtype, dims, flags),)
    kernels = ("fwd", "bwd") if direction == "fwdbwd" else ("fwd",)
    return tuple(Sig("chunk", (k,), dtype, dims, flags) for k in kernels)


def compile_time(rec: dict) -> Optional[float]:
    """A timed record's first call less one steady call (its median / P50): what the first call paid to compile,
    for :meth:`Context.done`; None when the record has no first call."""
    first = rec.get("first_call_s")
    if first is None:
        return None
    steady_ms = next((rec[k] for k in ("median_ms", "p50_ms", "latency_p50_ms") if rec.get(k) is not None), 0.0)
    return max(0.0, first - steady_ms / 1e3)


def _similarity(a: Sig, b: Sig) -> tuple:
    return (a.kernel == b.kernel, a.dtype == b.dtype, a.dims == b.dims, sum(x == y for x, y in zip(a.flags, b.flags)))


@dataclass
class Context:
    device: torch.device
    profile: Profile
    impls: list[Impl]
    deadline: float  # a ``clock`` reading: the end of the running share (section, or a part of it)
    seed: int = 0
    gates: str = "default"  # the speed sections' decay draw (cases.GATES: --gates)
    progress: Optional[Callable[[str], None]] = None  # called with a short description when a unit starts
    peak_tflops: Optional[float] = None  # user overrides of the roofline ceilings
    peak_gbs: Optional[float] = None
    notes: list = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic  # seconds, monotonic: what every deadline and unit time reads
    t0: Optional[float] = None  # start of the run: the log lines' clock (default: ``clock()`` now)
    run_deadline: Optional[float] = None  # end of the whole run's usable time (default: ``deadline``)
    budget_s: Optional[float] = None  # the run's usable seconds (reserves are fractions of it; default from t0)
    later_reserve_s: float = 0.0  # kept for the minimal work of the sections after the running one
    log: Optional[Callable[[str], None]] = None  # one line per unit of work (no progress bar)
    on_unit: Optional[Callable[[], None]] = None  # after each unit (the CLI checkpoints the report)
    partial: dict = field(default_factory=dict)  # the running section's results so far, kept if it is interrupted
    costs: dict = field(default_factory=dict)  # impl name -> ImplCost, across the run
    cached: dict = field(default_factory=dict)  # impl name -> {Sig} earlier runs compiled (--warm-from: warm.py)
    earlier: dict = field(default_factory=dict)  # section -> {unit key: record} earlier runs measured (--resume)
    carried: dict = field(default_factory=dict)  # section -> units this run took from ``earlier``
    section: str = ""
    section_stats: dict = field(default_factory=dict)  # impl name -> units, seconds, first calls, skips (section)
    _unit: Optional[dict] = None
    _skip_lines: int = 0
    _part_reserves: list = field(default_factory=list)  # per nested share: kept for its later parts
    _borrow: bool = False  # the unit fits() just let start runs on spare time

    def __post_init__(self):
        if self.t0 is None:
            self.t0 = self.clock()
        if self.run_deadline is None:
            self.run_deadline = self.deadline
        if self.budget_s is None:
            self.budget_s = max(0.0, self.run_deadline - self.t0)

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    def available(self, kind: Optional[str] = None) -> list[Impl]:
        return [i for i in self.impls if i.available and (kind is None or i.kind == kind)]

    def remaining(self) -> float:
        """Seconds left of the running share (what time-sized loops divide), never past what the run keeps for
        the later sections."""
        return min(self.deadline, self.run_deadline - self.later_reserve_s) - self.clock()

    def spare(self) -> float:
        """Seconds a unit may borrow beyond its share: the run's remaining time less the reserves for the later
        sections and the later parts of this one."""
        return self.run_deadline - self.clock() - self.later_reserve_s - sum(self._part_reserves)

    def out_of_time(self, reserve_s: float = 0.0) -> bool:
        return self.remaining() <= reserve_s

    def _reserve(self, nominal_s: float) -> float:
        return min(RESERVE_FRACTION * self.budget_s, max(0.0, nominal_s))

    def plan_section(self, weights: list, i: int) -> None:
        """Section ``i`` of the selected ones (``weights``: their budget shares, in run order) starts now: set its
        deadline and the reserve kept for the later ones. Each section gets a minimum (:data:`RESERVE_FRACTION` of
        the budget, at most its nominal share) plus its share by weight of what is left beyond the minima of it and
        the later sections; when even the minima no longer fit, they shrink in proportion."""
        now = self.clock()
        left = max(0.0, self.run_deadline - now)
        total = sum(weights) or 1.0
        mins = [self._reserve(self.budget_s * w / total) for w in weights[i:]]
        floor = sum(mins)
        if left >= floor:
            share = mins[0] + (left - floor) * weights[i] / (sum(weights[i:]) or 1.0)
            self.later_reserve_s = floor - mins[0]
        else:
            share = left * mins[0] / floor if floor > 0 else left
            self.later_reserve_s = left - share
        self.deadline = now + share

    @contextlib.contextmanager
    def share(self, parts_left: int):
        """Run the block with a fair share of the running share's remaining time, ``1 / parts_left`` of it; the
        rest is kept for the ``parts_left - 1`` parts after it: a unit of this block over its share borrows only
        the run's spare time (:meth:`spare`), and the time the block overran is given back to the enclosing share
        when it ends, so the later parts keep theirs (within what the run has left); time the block leaves unused
        stays for them. (Without this, the first implementation of a section could starve the rest.)"""
        old, n = self.deadline, max(1, parts_left)
        now = self.clock()
        left = max(0.0, old - now)
        self.deadline = now + left / n
        self._part_reserves.append(left - left / n)
        try:
            yield
        finally:
            self._part_reserves.pop()
            over = max(0.0, self.clock() - self.deadline)
            self.deadline = old + over

    # ---- the cost model and the per-unit budget ------------------------------------------------------------
    def _stats(self, impl: str) -> dict:
        return self.section_stats.setdefault(impl, {"units": 0, "seconds": 0.0, "new_shape_classes": 0,
                                                    "first_call_max_s": None, "borrowed": 0,
                                                    "skipped_for_time": 0})

    def prior(self, impl: str, family: str) -> float:
        return FIRST_CALL_PRIOR_S.get(family, {}).get(impl, 0.0) if self.gpu else 0.0

    def cache_load(self, impl: str) -> float:
        """Seconds a signature of ``impl`` that an earlier run compiled takes to load from the caches: the loads
        this process measured (the mean; the largest for fla and FlashQLA), else :data:`CACHE_LOAD_S`."""
        loads = [e.seconds for e in (self.costs.get(impl) or ImplCost()).compiles if e.cached]
        if loads:
            return max(loads) if impl in COMPILED_THIRD_PARTY else sum(loads) / len(loads)
        return CACHE_LOAD_S.get(impl, 0.0) if self.gpu else 0.0

    def _compile_estimate(self, impl: str, c: ImplCost, s: Sig) -> tuple[float, str]:
        """(seconds, rule) of compiling ``s`` with no cache assumption, from what this process compiled."""
        fam = [e for e in c.compiles if e.sig.family == s.family and not e.cached]
        full = [e for e in fam if not e.incremental]
        if not full:  # the family's first compile: the prior, per kernel set (direction)
            return self.prior(impl, s.family), "prior"
        same = [e for e in full if e.sig.base() == s.base()]
        if same:
            inc = [e.seconds / e.sig.weight for e in fam if e.incremental]
            if inc:
                per = max(inc) if impl in COMPILED_THIRD_PARTY else sum(inc) / len(inc)
                return per * s.weight, "new flags"
            e = same[-1]
            return INCREMENTAL_FRACTION * e.seconds * s.weight / e.sig.weight, "new flags"
        e = max(reversed(full), key=lambda e: _similarity(e.sig, s))  # ties: the latest measured
        return e.seconds * s.weight / e.sig.weight, "new kernel"

    def compile_estimates(self, impl: Optional[str], classes: tuple = (), trust_cache: bool = True) -> list:
        """[(signature, seconds, rule)] for each signature of ``classes`` ``impl`` has not run yet (see the module
        docstring; rule: "prior", "new flags", "new kernel" or "cached"). ``trust_cache=False``: as if no earlier
        run had compiled anything (a timeout must allow for a cache that turned out cold)."""
        if impl is None:
            return []
        c = self.costs.get(impl) or ImplCost()
        cached = self.cached.get(impl, ()) if trust_cache else ()
        load = self.cache_load(impl) if cached else None
        out = []
        for s in dict.fromkeys(classes):
            if s in c.classes:
                continue
            sec, rule = self._compile_estimate(impl, c, s)
            if s in cached and load < sec:
                sec, rule = load, "cached"
            out.append((s, sec, rule))
        return out

    def estimate(self, impl: Optional[str], classes: tuple = ()) -> tuple[float, str]:
        """(seconds a unit of ``impl`` on ``classes`` is expected to take, the rule that dominated it: "steady",
        or the compile rule of :meth:`compile_estimates` that weighs most)."""
        if impl is None:
            return 0.0, "none"
        c = self.costs.get(impl)
        steady = c.steady_s.get(self.section, 0.0) if c is not None else 0.0
        comp = self.compile_estimates(impl, classes)
        if not comp:
            return steady, "steady"
        rules: dict = {}
        for _, sec, rule in comp:
            rules[rule] = rules.get(rule, 0.0) + sec
        return steady + sum(rules.values()), max(rules, key=rules.get)

    def fits(self, impl: Optional[str] = None, classes: tuple = (), desc: str = "") -> bool:
        """May a unit of ``impl`` (on these signatures) start? Yes when its estimate fits what is left of the share,
        or else of the run's spare time (it borrows: :meth:`spare`); otherwise the unit is counted (and logged) as
        skipped for time."""
        est, rule = self.estimate(impl, classes)
        share, spare = self.remaining(), self.spare()
        self._borrow = False
        if share > 0 and est <= share:
            return True
        if spare > 0 and est <= spare:
            self._borrow = True
            return True
        if impl is not None:
            self._stats(impl)["skipped_for_time"] += 1
        self._skip_lines += 1
        if self._skip_lines <= SKIP_LOG_LINES and desc:
            self.emit(f"skip {desc}: time budget (needs ~{est:.0f} s ({rule}), {max(share, spare, 0):.0f} s left "
                      "with the run's spare time)")
        return False

    def defers(self, impl: Optional[str], classes: tuple = ()) -> bool:
        """Whether a unit of ``impl`` on ``classes`` waits for its section's second pass: on a GPU, when its
        estimate is over :data:`SLOW_UNIT_S` (a new compile of a slow compiler). The units of one compile class
        share the estimate, so they wait together, and in the second pass the first compiles for the rest. On a
        CPU nothing waits (no compiler: the run order stays the profile's)."""
        return self.gpu and impl is not None and self.estimate(impl, classes)[0] > SLOW_UNIT_S

    def unsupported(self, impl: Impl, shape, uid: str, out: list, **options) -> bool:
        """Whether ``impl`` cannot run ``shape`` with ``options`` (:meth:`Impl.supports_shape`); if so, the record
        ``{id: uid, impl, status: "unsupported", reason}`` goes to ``out`` and the log says why. Asked before
        :meth:`fits`: an unsupported unit is neither run nor budgeted (its compile estimate could otherwise have it
        skipped "for time")."""
        reason = impl.supports_shape(shape, **options)
        if reason:
            out.append({"id": uid, "impl": impl.name, "status": "unsupported", "reason": reason, "passed": None})
            self.emit(f"{self.section} {uid}: unsupported ({reason})")
        return reason is not None

    def unit_budget(self, units_left: int) -> float:
        """Seconds the running unit of a time-sized loop (performance rows, decode rows), one of ``units_left``
        (itself included), may spend timing: its part of what is left of the share or, for a unit that borrows
        (:meth:`fits` let it start on spare time), of the spare time. Without the second a borrowing row (the share
        spent, e.g. by a slow third-party compile) timed with a budget of 0 s: its minimum of 3 calls."""
        borrowed = self._unit is not None and self._unit["borrowed"]
        return max(0.0, self.spare() if borrowed else self.remaining()) / max(1, units_left)

    def carry(self, key: str, out: list) -> bool:
        """Whether an earlier run (``--resume``: resume.py) measured the running section's unit ``key`` (a record
        id, or resume.py's key for a record without one); if so its record goes to ``out`` and the unit is neither
        budgeted nor run. Asked before :meth:`fits`."""
        rec = self.earlier.get(self.section, {}).get(key)
        if rec is None:
            return False
        out.append(copy.deepcopy(rec))
        self.carried[self.section] = self.carried.get(self.section, 0) + 1
        return True

    def step(self, desc: str, impl: Optional[str] = None, classes: tuple = ()) -> None:
        """A unit of work starts (the previous one, if not closed with :meth:`done`, is closed as "done")."""
        if self._unit is not None:
            self.done("done")
        new = self.compile_estimates(impl, classes)
        self._unit = {"desc": desc, "impl": impl, "classes": tuple(classes), "new": new, "t": self.clock(),
                      "borrowed": self._borrow}
        self._borrow = False
        if self.progress is not None:
            self.progress(desc)

    def done(self, result: str = "done", first_call_s: Optional[float] = None) -> None:
        """The current unit ended: log one line and feed its time to the cost model. ``first_call_s``: the
        unit's own measurement of its first call; else a unit on new signatures counts as first call its time
        less the section's steady unit time (the whole unit before there is one)."""
        u, self._unit = self._unit, None
        if u is None:
            return
        unit_s = self.clock() - u["t"]
        note = f"{unit_s:.1f} s"
        if u["impl"] is not None:
            c = self.costs.setdefault(u["impl"], ImplCost())
            st = self._stats(u["impl"])
            st["units"] += 1
            st["seconds"] += unit_s
            st["borrowed"] += bool(u["borrowed"])
            if u["new"]:
                steady = c.steady_s.get(self.section)
                fc = first_call_s if first_call_s is not None else max(0.0, unit_s - (steady or 0.0))
                c.first_call_max_s = max(c.first_call_max_s, fc)
                weights = [e for _, e, _ in u["new"]]
                if sum(weights) <= 0:
                    weights = [s.weight for s, _, _ in u["new"]]
                cached = self.cached.get(u["impl"], ())
                for (s, _, rule), w in zip(u["new"], weights):
                    # by membership, not rule: a load the estimate charged as a compile (cheaper) is still a load
                    c.compiles.append(Compile(s, fc * w / sum(weights), rule == "new flags" and s not in cached,
                                              s in cached))
                st["new_shape_classes"] += len(u["new"])
                st["first_call_max_s"] = max(st["first_call_max_s"] or 0.0, fc)
                if first_call_s is not None:
                    c.steady_s[self.section] = max(0.0, unit_s - fc)
                note += f", new shape class: first call {fc:.1f} s"
                n_cached = sum(s in cached for s, _, _ in u["new"])
                if n_cached:  # a fast first call explained (or a slow one flagged: the cache was cold)
                    note += f" ({n_cached} of {len(u['new'])} signatures compiled by an earlier run)"
            else:
                c.steady_s[self.section] = unit_s
            c.classes.update(u["classes"])
        if u["borrowed"]:
            note += ", borrowed time"
        self.emit(f"{u['desc']}: {result} ({note})")
        if self.on_unit is not None:
            self.on_unit()

    def begin_section(self, name: str) -> None:
        self.section, self.section_stats, self.partial, self._unit, self._skip_lines = name, {}, {}, None, 0

    def end_section(self) -> dict:
        """Close the section's last unit; return its budget record (per implementation: units, seconds, new shape
        classes, largest first call, units run on borrowed time, units skipped for time; units carried, --resume)."""
        if self._unit is not None:
            self.done("done")
        if self.carried.get(self.section):
            self.emit(f"{self.section}: {self.carried[self.section]} unit(s) carried from earlier runs (--resume)")
        return {"impls": self.section_stats, "carried": self.carried.get(self.section, 0),
                "skip_lines_not_logged": max(0, self._skip_lines - SKIP_LOG_LINES)}

    def emit(self, line: str) -> None:
        if self.log is not None:
            self.log(line)

    def hard_timeout(self, impl: Optional[str], classes: tuple, limit_s: float, grace_s: float = 5.0) -> tuple:
        """(timeout for a call run with :func:`run_with_timeout`, whether the budget set it). ``limit_s`` (a hang)
        plus :data:`HANG_COMPILE_ALLOWANCE` times the compile estimate of its new signatures (as if uncached: a cache
        that turned out cold must not read as a hang), cut to what :meth:`fits` let the unit use (its share, or the
        run's spare time) plus ``grace_s``."""
        want = limit_s + HANG_COMPILE_ALLOWANCE * self.first_call_compile_s(impl, classes)
        cut = max(self.remaining(), self.spare(), 0.0) + grace_s
        return (cut, True) if cut < want else (want, False)

    def first_call_compile_s(self, impl: Optional[str], classes: tuple) -> float:
        """Seconds of compiling a unit on ``classes`` is estimated to need, as if nothing were cached (0: none)."""
        return sum(sec for _, sec, _ in self.compile_estimates(impl, classes, trust_cache=False))

    def call_with_timeout(self, fn: Callable[[], object], impl: Optional[str], classes: tuple,
                          limit_s: float) -> tuple[str, object, dict]:
        """Run a unit's call ``fn`` in a worker thread (:func:`run_with_timeout`), bounded by :meth:`hard_timeout`.

        Returns ``(status, result, stopped)``: "ok" with ``fn``'s result or "error" with its exception, and
        ``stopped`` empty; or, for a call that did not return in time, "skipped" (the budget's cut stopped it) or
        "hang" (``limit_s``, the profile's own limit, did), with ``stopped`` the record fields that say so. A stopped
        call may still be running in the abandoned thread: the caller skips the implementation's later units."""
        timeout, by_budget = self.hard_timeout(impl, classes, limit_s)
        compile_s = self.first_call_compile_s(impl, classes)
        status, result = run_with_timeout(fn, timeout, self.device, self.clock)
        if status != "hang":
            return status, result, {}
        if by_budget:
            return "skipped", None, {"status": "skipped", "skipped": "time budget", "passed": None,
                                     "reason": f"time budget: still running after {timeout:.1f} s (left in a "
                                               "worker thread)"}
        if compile_s > 0:
            # the call compiled first: a compile slower than the allowance and a hang look the same from here
            return "skipped", None, {"status": "skipped", "skipped": "first-call timeout", "passed": None,
                                     "timeout_s": timeout,
                                     "reason": f"still running after {timeout:.1f} s on its first call (compile "
                                               f"estimated at {compile_s:.1f} s): a slow compile or a hang, not "
                                               "told apart (left in a worker thread)"}
        return "hang", None, {"status": "hang", "timeout_s": timeout, "passed": False}

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
def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: an index-less CUDA device is the calling thread's current one. ``set_device``
    refuses a device without an index, and a new thread starts on device 0, so a worker must be told the index its
    caller runs on."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


JOIN_SLICE_S = 0.05  # run_with_timeout reads its clock this often while the call runs

# Worker threads whose call did not return in time (run_with_timeout): still running, perhaps inside CUDA or a JIT
# compiler. The `linattn` command checks them before it exits (:func:`linattn.cli.entry`).
_ABANDONED: list = []


def abandoned_threads() -> list:
    """The worker threads :func:`run_with_timeout` gave up on that are still running."""
    return [th for th in _ABANDONED if th.is_alive()]


def run_with_timeout(fn: Callable[[], object], timeout_s: float, device: Optional[torch.device] = None,
                     clock: Callable[[], float] = time.monotonic) -> tuple[str, object]:
    """Run ``fn`` in a worker thread; return ``("ok", result)``, ``("error", exception)`` or ``("hang", None)``:
    still running after ``timeout_s`` seconds of ``clock`` (the context's: :attr:`Context.clock`).

    A thread cannot be killed: a hung call is left running as a daemon and reported; the suite moves on. (A process
    would be killable but cannot share the caller's CUDA context and tensors, which is what is being tested.)

    ``("error", ...)`` is only ever what ``fn`` raised: when the harness cannot set the worker up (select the CUDA
    device), the exception is raised here, in the caller, so it fails the section loudly instead of being recorded
    as every case's result.
    """
    box: dict = {}
    if device is not None and device.type == "cuda":
        device = indexed(device)  # resolved in the caller's thread: the worker's current device is 0

    def target():
        try:
            if device is not None and device.type == "cuda":
                # a new thread starts on CUDA device 0; kernels launch on the current device
                torch.cuda.set_device(device)
        except BaseException as e:
            box["setup"] = e
            return
        try:
            box["result"] = fn()
        except BaseException as e:  # recorded, not raised: the report says which inputs raise what
            box["error"] = e

    th = threading.Thread(target=target, daemon=True)
    end = clock() + timeout_s
    th.start()
    # joined in slices, so that the timeout is measured on ``clock`` (a join returns as soon as the call does)
    while th.is_alive() and (left := end - clock()) > 0:
        th.join(min(left, JOIN_SLICE_S))
    if th.is_alive():
        _ABANDONED.append(th)
        return "hang", None
    if "setup" in box:
        raise RuntimeError(f"run_with_timeout: the worker thread could not select {device} "
                           f"({type(box['setup']).__name__}: {box['setup']})") from box["setup"]
    if "error" in box:
        return "error", box["error"]
    return "ok", box.get("result")
