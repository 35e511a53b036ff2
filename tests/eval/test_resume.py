"""`linattn eval --resume`: units an earlier run measured are carried into the new report unchanged and not run
again; units it skipped run; refusals name the file and what differs (CPU runs of the tiny profile)."""
import json

import pytest

from linattn.cli import main
from linattn.eval import merge, resume

SECTIONS = "correctness,performance,robustness,decode,mixed_precision,scorecard"
COMMON = ["eval", "--profile", "tiny", "--impl", "linattn,sdpa", "--device", "cpu", "--no-progress",
          "--time-budget", "300"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "first"
    assert main(COMMON + ["--sections", SECTIONS, "--out", str(out)]) == 0
    return out


def _load(d):
    return json.loads((d / "report.json").read_text())


def _without_measurement(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k != "carried_from"}


def test_has_result():
    assert resume.has_result({"status": "pass"}) and resume.has_result({"status": "hang"})
    assert resume.has_result({"id": "x", "p50_ms": 1.0}) and resume.has_result({"status": "error"})
    assert not resume.has_result({"status": "skipped"})
    assert not resume.has_result({"id": "fla", "skipped": "time budget"})


def test_everything_measured_is_carried_and_nothing_runs(first_run, tmp_path, capsys):
    second = tmp_path / "second"
    assert main(COMMON + ["--sections", SECTIONS, "--out", str(second), "--resume", str(first_run)]) == 0
    err = capsys.readouterr().err
    a, b = _load(first_run), _load(second)
    for section in resume.RESUMABLE:
        assert f"{section}: " in err and "carried from earlier runs (--resume)" in err
        assert len(b[section]["records"]) == len(a[section]["records"])
        measured = [r for r in a[section]["records"] if r.get("status") != "unsupported"]
        carried = [r for r in b[section]["records"] if "carried_from" in r]
        assert len(carried) == len(measured) > 0
        # unchanged, down to the timing samples
        by_id = {r["id"]: r for r in measured}
        assert all(_without_measurement(r) == by_id[r["id"]] for r in carried)
        assert all(r["carried_from"]["report"] == str(first_run / "report.json") for r in carried)
    assert b["correctness"]["reproducibility"] == [dict(x, carried_from=b["correctness"]["reproducibility"][0]
                                                        ["carried_from"]) for x in a["correctness"]["reproducibility"]]
    assert len(b["decode"]["drift"]) == len(a["decode"]["drift"]) and all("carried_from" in d
                                                                          for d in b["decode"]["drift"])
    # nothing compiled or ran a unit: no unit line but the carried counts
    assert "correctness linattn" not in err and "perf linattn" not in err
    carried = b["meta"]["resumed_from"]["carried"]
    assert carried["performance"] == len(a["performance"]["records"])
    assert "| resumed from |" in (second / "report.md").read_text() and " ⁺ |" in (second / "report.md").read_text()
    # carried twice: the record keeps the run that measured it
    third = tmp_path / "third"
    assert main(COMMON + ["--sections", "performance,scorecard", "--out", str(third), "--resume", str(second)]) == 0
    assert {r["carried_from"]["report"] for r in _load(third)["performance"]["records"]} == {
        str(first_run / "report.json")}


def test_skipped_units_run_and_resume_impls_limits_the_carry(first_run, tmp_path, capsys):
    r = _load(first_run)
    perf = r["performance"]["records"]
    dropped = perf.pop(0)  # as if skipped for time: no record, its id in skipped_for_time
    r["performance"]["skipped_for_time"].append(dropped["id"])
    case = next(x for x in r["correctness"]["records"] if x["status"] == "pass")
    case.update(status="skipped", skipped="time budget", passed=None)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "report.json").write_text(json.dumps(r))
    out = tmp_path / "resumed"
    assert main(COMMON + ["--sections", "correctness,performance,scorecard", "--out", str(out),
                          "--resume", str(earlier)]) == 0
    err = capsys.readouterr().err
    b = _load(out)
    fresh = [x for x in b["performance"]["records"] if "carried_from" not in x]
    assert [x["id"] for x in fresh] == [dropped["id"]] and b["performance"]["skipped_for_time"] == []
    fresh = [x for x in b["correctness"]["records"] if "carried_from" not in x and x["status"] != "unsupported"]
    assert [x["id"] for x in fresh] == [case["id"]] and fresh[0]["status"] == "pass"
    assert f"correctness {case['impl']} {case['dtype']} case {case['case']}: ok" in err
    # only sdpa's records carried: linattn's are measured again
    out2 = tmp_path / "sdpa-only"
    assert main(COMMON + ["--sections", "performance,scorecard", "--out", str(out2), "--resume", str(first_run),
                          "--resume-impls", "sdpa"]) == 0
    recs = _load(out2)["performance"]["records"]
    assert {x["impl"] for x in recs if "carried_from" in x} == {"sdpa"}
    assert {x["impl"] for x in recs if "carried_from" not in x} == {"linattn"}
    assert _load(out2)["meta"]["resumed_from"]["impls"] == ["sdpa"]
    # --resume-redo: linattn's fp32 records measured again, every other carried
    out3 = tmp_path / "redo"
    assert main(COMMON + ["--sections", "performance,scorecard", "--out", str(out3), "--resume", str(first_run),
                          "--resume-redo", "linattn/*/fp32/*"]) == 0
    recs, before = _load(out3)["performance"]["records"], _load(first_run)["performance"]["records"]
    fresh = {x["id"] for x in recs if "carried_from" not in x}
    assert fresh and fresh == {x["id"] for x in before if x["impl"] == "linattn" and x["dtype"] == "fp32"}
    assert len(recs) == len(before) and _load(out3)["meta"]["resumed_from"]["redo"] == ["linattn/*/fp32/*"]


def test_resumed_runs_merge(first_run, tmp_path):
    second = tmp_path / "second"
    assert main(COMMON + ["--sections", "performance,scorecard", "--out", str(second), "--resume", str(first_run)]) == 0
    m, _ = merge.run([str(first_run), str(second)], str(tmp_path / "merged"), prefer_last=True)
    assert m["meta"]["merged_from"][1]["resumed_from"]["carried"]["performance"] > 0
    assert m["meta"]["merged_from"][0]["resumed_from"] is None
    assert all("carried_from" in x for x in m["performance"]["records"])
    assert "| run 2 resumed from |" in (tmp_path / "merged" / "report.md").read_text()


def test_merge_prefer_last_keeps_what_only_an_earlier_run_measured(first_run, tmp_path):
    """A later run that skipped units (e.g. resumed with --resume-impls, so it measured them again and ran out of
    time) must not drop the earlier run's measurement of them in a --prefer-last merge; where both measured a
    unit, the later record wins."""
    a = _load(first_run)
    b = json.loads(json.dumps(a))
    gone = b["performance"]["records"].pop(0)
    b["performance"]["skipped_for_time"].append(gone["id"])
    newer = b["performance"]["records"][0]
    newer["p50_ms"] = -1.0  # marks the later run's record
    drift = b["decode"]["drift"].pop(0)
    b["decode"]["skipped_for_time"].append(f"drift {drift['id']}")
    step = b["decode"]["records"].pop(0)
    b["decode"]["skipped_for_time"].append(f"{step['impl']}/{step['path']}/B{step['B']}-Tq{step['Tq']}/{step['pool']}")
    mp = b["mixed_precision"]["records"][0]
    mp.update(status="skipped", skipped="time budget")
    later = tmp_path / "later"
    later.mkdir()
    (later / "report.json").write_text(json.dumps(b))
    m = merge.merge([str(first_run), str(later)], prefer_last=True)
    perf = {x["id"]: x for x in m["performance"]["records"]}
    assert perf[gone["id"]]["carried_from"]["report"] == str(first_run / "report.json")
    assert perf[newer["id"]]["p50_ms"] == -1.0 and "carried_from" not in perf[newer["id"]]
    assert len(perf) == len(a["performance"]["records"]) and m["performance"]["skipped_for_time"] == []
    assert {d["id"] for d in m["decode"]["drift"]} == {d["id"] for d in a["decode"]["drift"]}
    assert step["id"] in {x["id"] for x in m["decode"]["records"]} and m["decode"]["skipped_for_time"] == []
    assert m["mixed_precision"]["records"][0]["status"] == a["mixed_precision"]["records"][0]["status"] != "skipped"
    assert m["meta"]["filled_in"] == {"performance": 1, "decode": 2, "mixed_precision": 1}


@pytest.mark.parametrize("argv, message", [
    (["--profile", "quick"], "profile 'tiny' there, 'quick' here"),
    (["--seed", "3"], "seed 0 there, 3 here"),
    (["--gates", "mamba"], "--gates default there, mamba here"),
    (["--impl", "linattn"], "--impl linattn,sdpa there, linattn here"),
])
def test_another_configuration_is_refused(first_run, tmp_path, capsys, argv, message):
    args = COMMON + ["--out", str(tmp_path / "x"), "--resume", str(first_run)] + argv
    assert main(args) == 2  # later options win over COMMON's
    err = capsys.readouterr().err
    assert f"--resume {first_run / 'report.json'}: another configuration" in err and message in err


def test_resume_option_errors(first_run, tmp_path, capsys):
    assert main(COMMON + ["--out", str(tmp_path / "a"), "--resume-impls", "sdpa"]) == 2
    assert "--resume-impls needs --resume" in capsys.readouterr().err
    assert main(COMMON + ["--out", str(tmp_path / "a2"), "--resume-redo", "linattn/*"]) == 2
    assert "--resume-redo needs --resume" in capsys.readouterr().err
    assert main(COMMON + ["--out", str(tmp_path / "b"), "--resume", str(first_run), "--resume-impls", "fla"]) == 2
    assert "--resume-impls fla: not in this run's --impl (linattn,sdpa)" in capsys.readouterr().err
    assert main(COMMON + ["--out", str(tmp_path / "c"), "--resume", str(tmp_path / "nowhere")]) == 2
    assert "no such report" in capsys.readouterr().err
    assert main(["eval", "--merge", str(first_run), str(first_run), "--out", str(tmp_path / "m"),
                 "--resume", str(first_run)]) == 2
    assert "--resume applies to a run" in capsys.readouterr().err


def test_a_merged_reports_records_name_the_run_that_measured_them(first_run, tmp_path):
    """Resumed from a merged report, a carried record names the run of the merge that measured it (the merge stamps
    ``measured_in``), not the merge's first run."""
    second = tmp_path / "second"
    assert main(COMMON + ["--sections", "performance,scorecard", "--out", str(second), "--resume", str(first_run),
                          "--resume-redo", "linattn/*/fp32/*"]) == 0
    merged = tmp_path / "merged"
    m, _ = merge.run([str(first_run), str(second)], str(merged), prefer_last=True)
    recs = m["performance"]["records"]
    fresh = {x["id"] for x in recs if "measured_in" in x}
    assert fresh and all(x["measured_in"]["report"] == str(second / "report.json") for x in recs if "measured_in" in x)
    assert all("carried_from" in x for x in recs if "measured_in" not in x)
    third = tmp_path / "third"
    assert main(COMMON + ["--sections", "performance,scorecard", "--out", str(third), "--resume", str(merged)]) == 0
    origin = {x["id"]: x["carried_from"]["report"] for x in _load(third)["performance"]["records"]}
    assert {i for i, o in origin.items() if o == str(second / "report.json")} == fresh
    assert {o for i, o in origin.items() if i not in fresh} == {str(first_run / "report.json")}
