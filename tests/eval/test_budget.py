"""`linattn eval` under a deadline: partial reports on SIGTERM, log lines, the per-unit budget, compile-class order."""
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from linattn.cli import main
from linattn.eval import SECTIONS, correctness
from linattn.eval.cases import Shape, correctness_cases, profile
from linattn.eval.cli import RUNNERS
from linattn.eval.context import (
    FIRST_CALL_PRIOR_S,
    HANG_COMPILE_ALLOWANCE,
    INCREMENTAL_FRACTION,
    Compile,
    Context,
    ImplCost,
    shape_classes,
)
from linattn.eval.impls import Impl, build

from .virtual_clock import OP_S, Costed, SlowCompiler, VirtualClock, run_eval

CPU = torch.device("cpu")
CASES = {c.id: c for c in correctness_cases(T=19, H=1, D=16)}
LINE = re.compile(r"^\[\s*\d+\.\ds\] ", re.M)


def test_sigterm_leaves_a_valid_partial_report(tmp_path):
    out = tmp_path / "eval"
    proc = subprocess.Popen(
        [sys.executable, "-m", "linattn.cli", "eval", "--profile", "tiny", "--impl", "linattn,sdpa", "--device", "cpu",
         "--out", str(out), "--no-progress", "--time-budget", "300"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    seen, deadline = [], time.monotonic() + 120
    # Signal once the section after correctness has logged its start: a fixed sleep after "correctness: done"
    # could land in the checkpoint between the two sections on a slow machine (CI did, once).
    while not any("s] performance: start" in x for x in seen):
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("no 'performance: start' line on stderr:\n" + "".join(seen))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    r = json.loads((out / "report.json").read_text())
    assert r["partial"] is True and r["meta"]["partial"] is True
    assert r["sections_done"][:2] == ["environment", "correctness"] and "mixed_precision" not in r["sections_done"]
    assert set(SECTIONS) <= set(r)
    assert r["correctness"]["summary"]["linattn"]["passed"] == r["correctness"]["summary"]["linattn"]["cases"] > 0
    stop = r["meta"]["interrupted"]
    assert stop["signal"] == "SIGTERM" and stop["section"] == stop["during"] == "performance"
    assert stop["section"] not in r["sections_done"]
    assert r[stop["section"]]["interrupted"] is True
    assert r["mixed_precision"]["skipped"].startswith("not run")
    assert "Partial report" in (out / "report.md").read_text()
    assert not list(out.glob("*.tmp-*"))  # atomic writes leave no temporary file behind


def test_a_signal_between_two_sections_names_the_gap_not_the_setup(tmp_path, monkeypatch):
    """A signal that lands while the checkpoint after a section is written: no section is running, and the report
    says which section had just finished (it once said "during setup")."""
    from linattn.eval import cli as eval_cli
    checkpoint = eval_cli.Evaluation.checkpoint

    def checkpoint_then_signal(self):
        checkpoint(self)
        if self.done == ["correctness"] and self.running is None and self.interrupted is None:
            raise eval_cli.Interrupted(signal.SIGTERM)

    monkeypatch.setattr(eval_cli.Evaluation, "checkpoint", checkpoint_then_signal)
    rc = main(["eval", "--profile", "tiny", "--impl", "linattn", "--device", "cpu", "--out", str(tmp_path),
               "--no-progress", "--time-budget", "120", "--sections", "correctness,performance"])
    assert rc == 128 + signal.SIGTERM
    r = json.loads((tmp_path / "report.json").read_text())
    stop = r["meta"]["interrupted"]
    assert stop["section"] is None and stop["during"] == "the gap after correctness"
    assert r["sections_done"] == ["environment", "correctness"]
    assert "during the gap after correctness" in (tmp_path / "report.md").read_text()


def test_no_progress_prints_one_line_per_unit_on_stderr(tmp_path, capsys, monkeypatch):
    assert run_eval(monkeypatch, VirtualClock(), ["--profile", "tiny", "--impl", "linattn,sdpa", "--device", "cpu",
                                                  "--out", str(tmp_path), "--no-progress", "--time-budget", "120",
                                                  "--sections", "correctness,performance,decode"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^\[\s*\d+\.\ds\] correctness linattn fp32 case prefill: ok fwd \S+ bwd \S+ "
                     r"\(\d+\.\d s, new shape class: first call \d+\.\d s\)$", err, re.M), err
    assert re.search(r"^\[\s*\d+\.\ds\] perf sdpa \S+ fp32 fwd: P50 .* ms, P99 .* ms, n=\d+ \(", err, re.M), err
    assert re.search(r"^\[\s*\d+\.\ds\] decode linattn/decode B=1 Tq=1 fp32: P50 .* us", err, re.M), err
    for name in ("correctness", "performance", "decode"):
        assert re.search(rf"^\[\s*\d+\.\ds\] {name}: start .*\n(.*\n)*\[\s*\d+\.\ds\] {name}: done in", err, re.M)
    assert "scaling: start" not in err
    assert all(LINE.match(x) for x in err.splitlines()), err  # every stderr line is a log line
    n_units = len(re.findall(r"^\[\s*\d+\.\ds\] (correctness|perf|decode) .*\(\d+\.\d s", err, re.M))
    r = json.loads((tmp_path / "report.json").read_text())
    assert n_units == len(r["correctness"]["records"]) + len(r["correctness"]["reproducibility"]) + len(
        r["performance"]["records"]) + len(r["decode"]["records"]) + len(r["decode"]["drift"])


def test_the_budget_holds_and_what_it_cut_is_recorded(tmp_path, capsys, monkeypatch):
    budget, clock = 6.0, VirtualClock()
    t = clock()
    # 0.1 s a call: more work than the sections' 3 s hold, so that the budget cuts units of nearly every section
    assert run_eval(monkeypatch, clock, ["--profile", "tiny", "--impl", "linattn,sdpa", "--device", "cpu", "--out",
                                         str(tmp_path), "--no-progress", "--time-budget", str(budget)], op_s=0.1) == 0
    total = clock() - t
    assert total <= budget + 3, total  # sections stop at budget - reserve (the reports take none of this clock)
    err = capsys.readouterr().err
    r = json.loads((tmp_path / "report.json").read_text())
    assert r["partial"] is False and r["sections_done"][-1] == "scorecard" and r["meta"]["wall_s"] <= budget
    assert r["sections_done"] == ["environment", *RUNNERS, "scorecard"]
    for name in RUNNERS:
        assert re.search(rf"^\[\s*\d+\.\ds\] {name}: done in \d+\.\d s", err, re.M), name
        cut = len(r[name].get("skipped_for_time", []))
        counted = sum(v["skipped_for_time"] for v in r[name]["budget"]["impls"].values())
        assert cut <= counted, name  # every unit a section lists as skipped was refused by the budget
        if cut:
            assert re.search(rf"{name}: done in .*, {counted} units skipped for time", err), name


def _sigs(impl, dtype="fp32", direction="fwdbwd", T=32, K=16, V=16, **options):
    return shape_classes(impl, Shape(1, T, 2, 2, K, V), dtype, direction, **options)


def test_compile_estimates_per_signature_family_and_flags():
    lin, fla = build("linattn", CPU), Impl("fla", "gdn", None, native={"l2norm", "varlen", "h0"})
    clock = VirtualClock()
    ctx = Context(CPU, profile("tiny", CPU), [lin], deadline=clock() + 100, clock=clock)
    ctx.begin_section("correctness")
    base = _sigs(lin)  # forward and backward kernels, fp32, K = V = 16
    assert [s.kernel for s in base] == [("fwd",), ("bwd",)] and all(s.family == "chunk" for s in base)
    # the first compile of a family: 0 on a CPU (as measured), the unit's time split by kernel weight (fwd 1, bwd 2)
    assert ctx.estimate("linattn", base) == (0.0, "prior")
    ctx.step("first", "linattn", base)
    ctx.done("ok", first_call_s=3.0)
    c = ctx.costs["linattn"]
    assert [(e.seconds, e.incremental) for e in c.compiles] == [(1.0, False), (2.0, False)]
    assert ctx.estimate("linattn", base) == (pytest.approx(0.0, abs=0.05), "steady")
    # a flag-only change (T = 1, an initial state, an in-op gate): INCREMENTAL_FRACTION of the base's compile
    flag = _sigs(lin, h0=True)
    assert ctx.estimate("linattn", flag)[0] == pytest.approx(INCREMENTAL_FRACTION * 3.0, abs=0.05)
    assert ctx.estimate("linattn", flag)[1] == "new flags"
    ctx.step("flag", "linattn", flag)
    ctx.done("ok", first_call_s=0.6)  # measured: the incremental compile decides from now on (mean, per weight)
    assert [e.incremental for e in c.compiles[2:]] == [True, True]
    assert ctx.estimate("linattn", _sigs(lin, varlen=True))[0] == pytest.approx(0.6, abs=0.05)
    assert ctx.estimate("linattn", _sigs(lin, varlen=True, direction="fwd"))[0] == pytest.approx(0.2, abs=0.05)
    # T is no flag for linattn (its kernels take lengths unspecialised); for fla T == 1 and T % 16 == 0 are
    assert _sigs(lin, T=1) == _sigs(lin, T=33) == base and ctx.estimate("linattn", _sigs(lin, T=1))[1] == "steady"
    assert len({_sigs(fla, T=1), _sigs(fla, T=32), _sigs(fla, T=33)}) == 3
    # a new dtype or K/V: the most similar first compile (forward from forward), not the sum of everything seen
    assert ctx.estimate("linattn", _sigs(lin, "bf16", "fwd")) == (pytest.approx(1.0, abs=0.05), "new kernel")
    assert ctx.estimate("linattn", _sigs(lin, "bf16"))[0] == pytest.approx(3.0, abs=0.05)
    assert ctx.estimate("linattn", _sigs(lin, V=32))[0] == pytest.approx(3.0, abs=0.05)
    # a decode step is another kernel family: never the chunked op's compile; its own once measured
    step = _sigs(lin, direction="fwd", T=1, step=("decode", "fp32"))
    assert step[0].family == "step" and ctx.estimate("linattn", step) == (0.0, "prior")
    ctx.begin_section("decode")
    ctx.step("decode step", "linattn", step)
    ctx.done("ok", first_call_s=0.5)
    assert ctx.estimate("linattn", _sigs(lin, direction="fwd", T=1, step=("recurrent", "fp32")))[0] == \
        pytest.approx(0.5, abs=0.05)
    assert ctx.estimate("linattn", _sigs(lin, direction="fwd", T=4, step=("decode", "fp32")))[0] == \
        pytest.approx(INCREMENTAL_FRACTION * 0.5, abs=0.05)
    # on a GPU: the family's prior until measured (decode: linattn 10 s, fla 15 s; fla's chunked op 40 s)
    g = Context(torch.device("cuda"), profile("tiny", CPU), [], deadline=clock() + 1000, clock=clock)
    g.begin_section("decode")
    assert g.estimate("linattn", step) == (FIRST_CALL_PRIOR_S["step"]["linattn"], "prior") == (10.0, "prior")
    assert g.estimate("fla", step)[0] == FIRST_CALL_PRIOR_S["step"]["fla"] == 15.0
    assert g.estimate("fla", _sigs(fla)) == (2 * FIRST_CALL_PRIOR_S["chunk"]["fla"], "prior")  # per direction
    g.costs["fla"] = ImplCost(classes=set(_sigs(fla)), compiles=[Compile(s, 10.0 * s.weight, False)
                                                                 for s in _sigs(fla)])
    assert g.estimate("fla", step) == (15.0, "prior")  # fla's chunked compile says nothing about its decode
    g.costs["fla"].compiles += [Compile(_sigs(fla, T=1)[0], 2.0, True), Compile(_sigs(fla, h0=True)[0], 8.0, True)]
    assert g.estimate("fla", _sigs(fla, varlen=True, direction="fwd"))[0] == 8.0  # third party: the largest
    # robustness's hard timeout: the hang limit plus HANG_COMPILE_ALLOWANCE x the compile estimate (30 s), cut by
    # what the budget lets it use
    assert g.first_call_compile_s("fla", _sigs(fla, V=32)) == 30.0
    assert g.hard_timeout("fla", _sigs(fla, V=32), 30.0) == (30.0 + HANG_COMPILE_ALLOWANCE * 30.0, False)
    g.deadline = g.run_deadline = clock() + 1
    assert g.hard_timeout("fla", _sigs(fla, V=32), 30.0, grace_s=1.0)[1] is True


def test_a_first_call_stopped_by_the_hang_limit_is_no_hang(monkeypatch):
    """A call that compiles first and outlasts its limit (hang limit + the compile allowance) is recorded as a
    first-call timeout (a slow compile and a hang look the same); a call with nothing to compile as a hang."""
    ctx = Context(CPU, profile("tiny", CPU), [], deadline=time.monotonic() + 1000)
    ctx.begin_section("robustness")
    monkeypatch.setattr(ctx, "hard_timeout", lambda impl, classes, limit_s: (0.05, False))
    gate = threading.Event()
    try:
        for compile_s, want in ((40.0, "first-call timeout"), (0.0, None)):
            monkeypatch.setattr(ctx, "first_call_compile_s", lambda impl, classes, s=compile_s: s)
            status, result, stopped = ctx.call_with_timeout(lambda: gate.wait(60), "fla", (), 30.0)
            if want:
                assert (status, stopped["status"], stopped["skipped"]) == ("skipped", "skipped", want)
                assert stopped["passed"] is None and "40.0 s" in stopped["reason"]
            else:
                assert (status, stopped["status"], stopped["passed"]) == ("hang", "hang", False)
    finally:
        gate.set()


def test_a_unit_over_its_share_borrows_the_runs_spare_time():
    lin, clock = build("linattn", CPU), VirtualClock()
    now = clock()
    ctx = Context(CPU, profile("tiny", CPU), [lin], deadline=now + 5, run_deadline=now + 100, budget_s=100,
                  clock=clock)
    ctx.begin_section("correctness")
    ctx.costs["linattn"] = ImplCost(compiles=[Compile(s, 20.0 * s.weight, False) for s in _sigs(lin)],
                                    classes=set(_sigs(lin)))
    assert ctx.fits("linattn", _sigs(lin))  # steady: fits the share
    assert ctx.estimate("linattn", _sigs(lin, "bf16"))[0] == pytest.approx(60.0)
    assert ctx.fits("linattn", _sigs(lin, "bf16"), "bf16 unit")  # over the 5 s share, within the spare time
    ctx.step("bf16 unit", "linattn", _sigs(lin, "bf16"))
    ctx.done("ok", first_call_s=0.0)
    assert ctx.section_stats["linattn"]["borrowed"] == 1
    # a row of a time-sized loop: its part of the share, or of the spare time when it borrows
    ctx.step("steady unit", "linattn", _sigs(lin))
    assert ctx.unit_budget(5) == pytest.approx(ctx.remaining() / 5, abs=0.01) and ctx.unit_budget(5) > 0
    ctx.deadline = clock() - 1  # the share is spent: a unit still inside it would get nothing
    assert ctx.unit_budget(5) == 0.0
    assert ctx.fits("linattn", _sigs(lin), "borrowing unit")  # borrows
    ctx.step("borrowing unit", "linattn", _sigs(lin))
    assert ctx.unit_budget(4) == pytest.approx(ctx.spare() / 4, abs=0.01) and ctx.unit_budget(4) > 20
    ctx.done("ok")
    ctx.deadline = clock() + 5
    ctx.later_reserve_s = 50.0  # the later sections' minimal work is not lent
    assert not ctx.fits("linattn", _sigs(lin, V=32), "new V")
    assert ctx.section_stats["linattn"]["skipped_for_time"] == 1
    ctx.later_reserve_s = 0.0
    assert ctx.fits("linattn", _sigs(lin, V=32))  # 60 s
    ctx.deadline = clock() + 90
    with ctx.share(3):  # nor are the fair shares of the later parts of this section (30 s each)
        assert ctx.remaining() == pytest.approx(30, abs=0.1) and ctx.spare() == pytest.approx(40, abs=0.1)
        assert not ctx.fits("linattn", _sigs(lin, V=32))
        assert ctx.fits("linattn", _sigs(lin, h0=True))  # a flag-only change: 0.3 x 60 s
        ctx.deadline -= 35  # this part overran its share by 5 s: given back to the later parts when it ends
    assert ctx.remaining() == pytest.approx(95, abs=0.1)


def test_sections_rebalance_what_is_left():
    clock = VirtualClock()
    now = clock()
    ctx = Context(CPU, profile("tiny", CPU), [], deadline=now, run_deadline=now + 100, budget_s=100, clock=clock)
    weights = [0.1, 0.2, 0.07]
    ctx.plan_section(weights, 0)  # on schedule: a minimum each (10 % of the budget) plus a share by weight
    share, spare = ctx.remaining(), ctx.spare()
    assert share == pytest.approx(10 + 70 * 0.1 / 0.37, abs=0.1) and spare == pytest.approx(80, abs=0.1)
    ctx.run_deadline = clock() + 30  # the first section borrowed: the second gets what is left over it
    ctx.plan_section(weights, 1)
    assert ctx.remaining() == pytest.approx(10 + 10 * 0.2 / 0.27, abs=0.1) and ctx.later_reserve_s == 10
    ctx.run_deadline = clock() + 10  # behind schedule: the minima shrink in proportion
    ctx.plan_section(weights, 1)
    assert ctx.remaining() == pytest.approx(5, abs=0.1) and ctx.spare() == pytest.approx(5, abs=0.1)
    ctx.plan_section(weights, 2)  # the last section: all that is left, nothing reserved
    assert ctx.remaining() == pytest.approx(10, abs=0.1) and ctx.later_reserve_s == 0


def test_a_slow_first_compile_does_not_starve_the_run(tmp_path, capsys, monkeypatch):
    """The H200 log scaled to seconds: linattn's first call compiles for half the run. Afterwards its cheap units
    (known signatures, flag-only changes) still run, borrowing the run's spare time, and decode is estimated from
    its own kernels, not from that compile."""
    from linattn.eval import impls

    real, clock = impls.build, VirtualClock()

    def build_slow(name, device):
        impl = real(name, device)
        if name == "linattn":
            impl.fn = SlowCompiler(impl.fn, clock, first=5.0, inc=0.2)
        return impl

    monkeypatch.setattr(impls, "build", build_slow)
    budget = 20.0  # 10 s for the sections: the first compile is half of it, twice correctness's share
    t = clock()
    assert run_eval(monkeypatch, clock, ["--profile", "tiny", "--impl", "linattn,sdpa", "--device", "cpu", "--out",
                                         str(tmp_path), "--no-progress", "--time-budget", str(budget), "--sections",
                                         "correctness,performance,decode"]) == 0
    assert clock() - t <= budget + 3
    err = capsys.readouterr().err
    first = re.search(r"correctness linattn fp32 case prefill: ok .* first call (\d+\.\d) s\)$", err, re.M)
    assert first and float(first.group(1)) >= 5.0, err
    r = json.loads((tmp_path / "report.json").read_text())
    ran = [x["case"] for x in r["correctness"]["records"]]
    # after the slow compile (past correctness's share), flag-only changes of its signature ran on borrowed time;
    # a new K/V (a whole compile again) did not fit
    assert ran[0] == "prefill" and {"prefill-T1", "varlen", "initial-state"} <= set(ran) and len(ran) >= 5, err
    assert r["correctness"]["budget"]["impls"]["linattn"]["borrowed"] >= 4, err
    assert any(x["impl"] == "linattn" for x in r["performance"]["records"]), err
    assert any(x["impl"] == "linattn" for x in r["decode"]["records"]), err
    for need in re.findall(r"skip (?:perf|decode) linattn.*needs ~(\d+) s", err):  # none inherited the compile
        assert float(need) < 0.5 * float(first.group(1)), err
    assert r["meta"]["wall_s"] <= budget


def test_tiers_group_compile_classes_preferred_dtype_first():
    fla = Impl("fla", "gdn", None, native={"l2norm", "varlen", "h0"})
    cases = list(CASES.values())
    tiers, how = correctness.unit_tiers(fla, cases, ("fp32", "bf16", "fp16"), gpu=True)
    units = [u for tier in tiers for u in tier]
    assert len(units) == 3 * len(cases) and "grouped" in how
    assert [d for d, _ in units[:len(cases)]] == ["bf16"] * len(cases) and units[0][1].id == "prefill"
    assert {c.id for _, c in tiers[0]} == {"prefill", "gate-in-op", "onehot-keys", "repeated-token",
                                           "alternating-gates"}  # fla's base class: gate and β sigmoid in PyTorch
    for tier in tiers:  # one dtype and one compile class per tier, each class in one tier
        assert len({(d, correctness.case_classes(fla, c, d)) for d, c in tier}) == 1
    assert len({(t[0][0], correctness.case_classes(fla, t[0][1], t[0][0])) for t in tiers}) == len(tiers)
    lin = build("linattn", CPU)  # linattn: bf16 first on a GPU, the profile's order (fp32 first) on a CPU
    assert [t[0][0] for t in correctness.unit_tiers(lin, cases, ("fp32", "bf16"), gpu=True)[0]][0] == "bf16"
    tiers, how = correctness.unit_tiers(lin, cases, ("fp32", "bf16"), gpu=False)
    assert tiers[0][0][0] == "fp32" and how.startswith("dtypes fp32, bf16")
    # T = 1 shares linattn's base class (its kernels do not specialise on T; fla's T = 1 is a class of its own)
    assert {c.id for _, c in tiers[0]} == {"prefill", "prefill-T1", "onehot-keys", "repeated-token",
                                           "alternating-gates"}


def test_a_slow_compiler_does_not_starve_the_next_implementations_base_case(monkeypatch):
    """The H200 log scaled down: linattn compiles 70-90 s per flag class (3 s here) where 0.3x its first compile
    was estimated; fla's first forward + backward is estimated from a prior per direction (40 s, 0.8 s here), and the
    section may borrow the later sections' time. linattn's second class used to run on that borrowed time and
    overrun its estimate before fla started, leaving fla no time for its first compile (no fla case at all: checked
    at these sizes); now fla's base-shape cases run right after linattn's."""
    lin, clock = build("linattn", CPU), VirtualClock()
    op = Costed(lin.fn, clock, OP_S)
    slow = Impl("linattn", "gdn", SlowCompiler(op, clock, first=3.0, inc=3.0), native=lin.native)
    fla = Impl("fla", "gdn", op, native={"l2norm", "varlen", "h0"})
    monkeypatch.setattr(Context, "prior", lambda self, impl, family: 0.8 if impl == "fla" else 0.0)
    now = clock()
    ctx = Context(CPU, profile("tiny", CPU), [slow, fla], deadline=now + 4.4, run_deadline=now + 7.5, budget_s=7.5,
                  clock=clock)
    ctx.begin_section("correctness")
    r = correctness.run(ctx)
    ran = [(x["impl"], x["case"]) for x in r["records"]]
    assert ran[0] == ("linattn", "prefill") and ("fla", "prefill") in ran, ran
    first_fla = ran.index(("fla", "prefill"))
    assert {c for i, c in ran[:first_fla]} <= {"prefill", "onehot-keys", "repeated-token", "alternating-gates"}
    assert r["summary"]["fla"]["passed"] >= 5 and "round-robin" in r["order"]


def test_short_budget_keeps_a_compiling_impl_to_the_classes_it_has():
    lin = build("linattn", CPU)
    fla = Impl("fla", "gdn", lin.fn, native={"l2norm", "varlen", "h0"})  # linattn's op under fla's name and options
    clock = VirtualClock()  # the units take no time: only the compile estimate can keep a unit out
    ctx = Context(CPU, profile("tiny", CPU), [fla], deadline=clock() + 120, clock=clock)
    ctx.begin_section("correctness")
    sigs = correctness.case_classes(fla, CASES["prefill"], "fp32")  # a 1000 s compile, fwd + bwd
    ctx.costs["fla"] = ImplCost(classes=set(sigs), first_call_max_s=1000.0,
                                compiles=[Compile(s, 1000.0 * s.weight / 3, False) for s in sigs])
    r = correctness.run(ctx)
    ran = {x["case"] for x in r["records"]}
    assert ran == {"prefill", "gate-in-op", "onehot-keys", "repeated-token", "alternating-gates"}
    s = r["summary"]["fla"]
    assert s["passed"] == 5 and len(s["skipped_for_time"]) == len(CASES) - 5 and "grouped" in s["order"]
    assert r["reproducibility"] and ctx.section_stats["fla"]["skipped_for_time"] == len(CASES) - 5


def _defer_new_fla_classes(self, impl, classes):
    """Context.defers as on a fresh H200: fla's units on a class it has not compiled are slow."""
    return impl == "fla" and not set(classes) <= self.costs.get("fla", ImplCost()).classes


def test_slow_units_run_after_every_cheap_one(monkeypatch):
    """Correctness and performance time the units Context.defers marks slow (a third party's new compile) after
    all the others: on the H200 (run 14) FlashQLA's and fla's compiles, taken in turn, used the budget while 28 of
    linattn's correctness units and 42 of its performance rows (seconds each) were skipped."""
    from linattn.eval import perf
    clock = VirtualClock()  # each call costs OP_S of it: none is skipped, whatever the machine's speed
    lin = build("linattn", CPU)
    lin.fn = Costed(lin.fn, clock, OP_S)
    fla = Impl("fla", "gdn", lin.fn, native={"l2norm", "varlen", "h0"})  # linattn's op under fla's name
    monkeypatch.setattr(Context, "defers", _defer_new_fla_classes)
    ctx = Context(CPU, profile("tiny", CPU), [lin, fla], deadline=clock() + 300, clock=clock)
    ctx.begin_section("correctness")
    impl_order = [x["impl"] for x in correctness.run(ctx)["records"] if x["status"] != "unsupported"]
    n_lin = impl_order.count("linattn")
    # without the second pass fla's base case would run in round 0, right after linattn's first tier
    assert n_lin > 5 and impl_order[:n_lin] == ["linattn"] * n_lin and "fla" in impl_order[n_lin:], impl_order
    ctx.end_section()
    ctx.begin_section("performance")
    ctx.costs.pop("fla", None)  # a new process for fla's perf classes: every one of them slow again
    order, measure = [], perf.measure
    monkeypatch.setattr(perf, "measure", lambda ctx, impl, *a, **kw: order.append(impl.name) or measure(ctx, impl, *a,
                                                                                                     **kw))
    r = perf.run(ctx)
    assert "fla" in order and all(i == "fla" for i in order[order.index("fla"):]), order
    assert order.count("linattn") > 1
    ids = [x["id"] for x in r["records"]]  # reported in the grid's order (implementations within a shape)
    assert ids.index("fla/" + ids[0].split("/", 1)[1]) == 1, ids


def test_defers_only_slow_units_on_a_gpu(monkeypatch):
    from linattn.eval.context import SLOW_UNIT_S
    ctx = Context(CPU, profile("tiny", CPU), [build("linattn", CPU)], deadline=time.monotonic() + 10)
    monkeypatch.setattr(Context, "estimate", lambda self, impl, classes=(): (SLOW_UNIT_S + 1, "prior"))
    assert not ctx.defers("fla")  # a CPU has no compiler to wait for: the profile's order stays
    monkeypatch.setattr(Context, "gpu", property(lambda self: True))
    assert ctx.defers("fla") and not ctx.defers(None)
    monkeypatch.setattr(Context, "estimate", lambda self, impl, classes=(): (SLOW_UNIT_S - 1, "new flags"))
    assert not ctx.defers("fla")


def test_flashqla_intra_card_parallel_shapes_are_a_compile_class_of_their_own():
    """Run 14: FlashQLA compiled for 67 s at B=1 T=32768 after T=4096 (its intra-card sequence-parallel kernels);
    the estimator took it for a known class. B=1 from 128 chunks is now its own class; batches are not."""
    from linattn.eval.impls import _flashqla_modes
    fq = Impl("flashqla", "gdn", None, native={"h0", "varlen"}, modes=_flashqla_modes)
    sig = lambda B, T: shape_classes(fq, Shape(B, T, 16, 16, 128, 128), "bf16", "fwd")  # noqa: E731
    assert sig(1, 4096) == sig(1, 8000) != sig(1, 32768) == sig(1, 131072)
    assert sig(4, 32768) == sig(1, 4096) and sig(1, 8192)[0].flags[-1] == "intra_cp"  # 128 chunks
    lin = build("linattn", CPU)  # no modes: linattn's classes ignore B and T
    assert shape_classes(lin, Shape(1, 32768, 16, 16, 128, 128), "bf16", "fwd") == \
        shape_classes(lin, Shape(1, 4096, 16, 16, 128, 128), "bf16", "fwd")
