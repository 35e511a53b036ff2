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
from linattn.eval.cases import correctness_cases, profile
from linattn.eval.cli import RUNNERS
from linattn.eval.context import FIRST_CALL_PRIOR_S, Context, ImplCost
from linattn.eval.impls import Impl, build

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
    while not any("s] correctness: done in" in x for x in seen):
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("no 'correctness: done' line on stderr:\n" + "".join(seen))
    time.sleep(0.3)  # into the next section
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    r = json.loads((out / "report.json").read_text())
    assert r["partial"] is True and r["meta"]["partial"] is True
    assert r["sections_done"][:2] == ["environment", "correctness"] and "mixed_precision" not in r["sections_done"]
    assert set(SECTIONS) <= set(r)
    assert r["correctness"]["summary"]["linattn"]["passed"] == r["correctness"]["summary"]["linattn"]["cases"] > 0
    stop = r["meta"]["interrupted"]
    assert stop["signal"] == "SIGTERM" and stop["section"] in RUNNERS and stop["section"] not in r["sections_done"]
    assert r[stop["section"]]["interrupted"] is True
    assert r["mixed_precision"]["skipped"].startswith("not run")
    assert "Partial report" in (out / "report.md").read_text()
    assert not list(out.glob("*.tmp-*"))  # atomic writes leave no temporary file behind


def test_no_progress_prints_one_line_per_unit_on_stderr(tmp_path, capsys):
    assert main(["eval", "--profile", "tiny", "--impl", "linattn,sdpa", "--device", "cpu", "--out", str(tmp_path),
                 "--no-progress", "--time-budget", "120", "--sections", "correctness,performance,decode"]) == 0
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


def test_the_budget_holds_and_what_it_cut_is_recorded(tmp_path, capsys):
    budget = 6.0
    t = time.monotonic()
    assert main(["eval", "--profile", "tiny", "--impl", "linattn,sdpa", "--device", "cpu", "--out", str(tmp_path),
                 "--no-progress", "--time-budget", str(budget)]) == 0
    total = time.monotonic() - t
    assert total <= budget + 3, total  # sections stop at budget - reserve; the reports fit in the reserve
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


def test_budget_estimates_from_first_calls_and_shape_classes():
    now = time.monotonic()
    ctx = Context(CPU, profile("tiny", CPU), [build("linattn", CPU)], deadline=now + 10)
    ctx.run_deadline = now + 20
    ctx.begin_section("correctness")
    ctx.costs["fla"] = ImplCost(classes={("a",)}, first_call_max_s=30.0, section_first_s={"correctness": (30.0, 2.0)},
                                steady_s={"correctness": 0.5})
    assert ctx.estimate("fla", (("a",),)) == (0.5, "last unit") and ctx.fits("fla", (("a",),))
    # fla (compiled third party): the section's largest first call stands for every new class, against the share
    assert ctx.estimate("fla", (("a",), ("b",))) == (30.5, "new shape class")
    assert not ctx.fits("fla", (("b",),), "unit b") and ctx.section_stats["fla"]["skipped_for_time"] == 1
    # linattn: the section's latest first call (its first one carries the one-off start-up)
    ctx.costs["linattn"] = ImplCost(section_first_s={"correctness": (20.0, 0.5)})
    assert ctx.estimate("linattn", (("new",),)) == (0.5, "new shape class")
    # the first new class of a section (another kernel family): the run's largest first call, against the run
    ctx.begin_section("decode")
    assert ctx.estimate("fla", (("step",),)) == (30.0, "first in section")
    assert not ctx.fits("fla", (("step",),))  # 20 s left in the run
    ctx.run_deadline = time.monotonic() + 100
    assert ctx.fits("fla", (("step",),))  # although the share has only 10 s
    ctx.later_s = 150  # but not when it would take more than half of the later sections' time
    assert not ctx.fits("fla", (("step",),))
    ctx.later_s = 0
    ctx.step("unit step", "fla", (("step",),))
    ctx.done("ok", first_call_s=2.0)  # measured: decode's own first calls decide from now on
    assert ctx.estimate("fla", (("step2",),))[0] == pytest.approx(2.0, abs=0.5)
    assert ("step",) in ctx.costs["fla"].classes and ctx.costs["fla"].first_call_max_s == 30.0
    assert ctx.section_stats["fla"]["new_shape_classes"] == 1
    # robustness: the hard timeout is the hang limit unless the budget is shorter
    ctx.deadline = time.monotonic() + 1
    assert ctx.hard_timeout("fla", (("a",),), 30.0, grace_s=1.0)[1] is True
    ctx.deadline = time.monotonic() + 1000
    assert ctx.hard_timeout("fla", (("a",),), 30.0) == (30.0, False)
    # an implementation never timed on a GPU: its first compile is judged against the whole run, not the share
    g = Context(torch.device("cuda"), profile("tiny", CPU), [], deadline=time.monotonic() + 5)
    g.run_deadline = time.monotonic() + FIRST_CALL_PRIOR_S["flashqla"] / 2
    assert not g.fits("flashqla", (("a",),))
    g.run_deadline = time.monotonic() + 10 * FIRST_CALL_PRIOR_S["flashqla"]
    assert g.fits("flashqla", (("a",),))


def test_third_party_order_groups_compile_classes_linattn_keeps_the_table():
    fla = Impl("fla", "gdn", None, native={"l2norm", "varlen", "h0"})
    cases = list(CASES.values())
    units, how = correctness.unit_order(fla, cases, ("fp32", "bf16", "fp16"))
    assert len(units) == 3 * len(cases) and "grouped" in how
    assert [d for d, _ in units[:len(cases)]] == ["bf16"] * len(cases) and units[0][1].id == "prefill"
    classes = [correctness.case_classes(fla, c, d) for d, c in units]
    runs = [k for i, k in enumerate(classes) if i == 0 or classes[i - 1] != k]
    assert len(runs) == len(set(classes)) < len(units)  # each class once, in one block
    lin = build("linattn", CPU)
    units, _ = correctness.unit_order(lin, cases, ("fp32", "bf16"))
    assert [(d, c.id) for d, c in units] == [(d, c.id) for d in ("fp32", "bf16") for c in cases]


def test_short_budget_keeps_a_compiling_impl_to_the_classes_it_has():
    lin = build("linattn", CPU)
    fla = Impl("fla", "gdn", lin.fn, native={"l2norm", "varlen", "h0"})  # linattn's op under fla's name and options
    ctx = Context(CPU, profile("tiny", CPU), [fla], deadline=time.monotonic() + 120)
    ctx.begin_section("correctness")
    ctx.costs["fla"] = ImplCost(classes=set(correctness.case_classes(fla, CASES["prefill"], "fp32")),
                                first_call_max_s=1000.0, section_first_s={"correctness": (1000.0, 1000.0)})
    r = correctness.run(ctx)
    ran = {x["case"] for x in r["records"]}
    assert ran == {"prefill", "gate-in-op", "onehot-keys", "repeated-token", "alternating-gates"}
    s = r["summary"]["fla"]
    assert s["passed"] == 5 and len(s["skipped_for_time"]) == len(CASES) - 5 and "grouped" in s["order"]
    assert r["reproducibility"] and ctx.section_stats["fla"]["skipped_for_time"] == len(CASES) - 5
