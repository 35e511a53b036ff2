"""`linattn eval --merge`: one report from runs made with different --sections (tiny profile, CPU)."""
import copy
import json

import pytest

from linattn.cli import main
from linattn.eval import SECTIONS, merge

COMMON = ["eval", "--profile", "tiny", "--impl", "linattn,sdpa", "--device", "cpu", "--no-progress",
          "--time-budget", "300"]
PART_A = ("correctness", "stability")
PART_B = ("performance", "decode")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    for name, sections in (("a", PART_A), ("b", PART_B)):
        rc = main(COMMON + ["--sections", ",".join(sections + ("scorecard",)), "--out", str(root / name)])
        assert rc == 0
    return root


def _load(path):
    with open(path) as fh:
        return json.load(fh)


def _write(path, report):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))
    return str(path)


def test_merge_two_section_runs(two_runs, tmp_path, capsys):
    a, b = two_runs / "a" / "report.json", two_runs / "b"  # a file and a directory are both accepted
    out = tmp_path / "merged"
    assert main(["eval", "--merge", str(a), str(b), "--out", str(out)]) == 0
    assert "reports:" in capsys.readouterr().out
    r = _load(out / "report.json")
    ra, rb = _load(a), _load(b / "report.json")
    assert set(SECTIONS) <= set(r)
    for name, run, path in [(n, ra, str(a)) for n in PART_A] + [(n, rb, str(b / "report.json")) for n in PART_B]:
        # as the run wrote it, but for each record's measured_in: the run that measured it (resume.stamp_measured_in)
        stamps = [x.pop("measured_in") for k in ("records", "drift", "reproducibility")
                  for x in (r[name].get(k) or []) if isinstance(x, dict) and "measured_in" in x]
        assert r[name] == run[name] and "skipped" not in r[name]
        assert {x["report"] for x in stamps} <= {path} and (stamps or not run[name].get("records"))
    assert r["correctness"]["summary"]["linattn"]["passed"] > 0 and r["performance"]["records"]
    for name in ("scaling", "memory", "robustness", "soak", "mixed_precision"):
        assert "skipped" in r[name]
    assert not r["partial"] and r["missing_sections"] == ["scaling", "memory", "robustness", "soak",
                                                          "mixed_precision"]
    assert r["sections_done"] == ["environment", "correctness", "performance", "decode", "stability", "scorecard"]
    # the scorecard is recomputed from both runs: neither run alone has correctness and decode together
    raw = r["scorecard"]["raw"]["linattn"]
    assert raw["pass_rate"] == 1.0 and raw["step_p99_ms"] > 0 and raw["p99_ms"] > 0 and raw["stable_growth"] == 1.0
    assert "pass_rate" not in rb["scorecard"]["raw"]["linattn"] and "step_p99_ms" not in ra["scorecard"]["raw"].get(
        "linattn", {})
    assert r["scorecard"]["scenarios"]["scientific"]["linattn"]["score"] is not None
    # meta and environment keep every run
    mf = r["meta"]["merged_from"]
    assert [m["path"] for m in mf] == [str(a), str(b / "report.json")]
    assert [tuple(m["taken"]) for m in mf] == [PART_A, PART_B]
    assert mf[0]["sections"] == list(PART_A) + ["scorecard"]
    assert r["meta"]["wall_s"] == pytest.approx(ra["meta"]["wall_s"] + rb["meta"]["wall_s"])
    runs = r["environment"]["runs"]
    assert [e["path"] for e in runs] == [m["path"] for m in mf]
    assert runs[1]["date_utc"] == rb["environment"]["date_utc"] and runs[1]["wall_s"] == rb["meta"]["wall_s"]
    assert all("torch" in e and "commit" in e for e in runs)
    assert r["environment"]["date_utc"] == ra["environment"]["date_utc"]
    # plots drawn again from both runs' data, embedded in a self-contained html
    for fig in ("error_vs_T", "latency_dist", "decode_latency"):
        assert (out / "plots" / f"{fig}.png").exists()
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 3
    assert "src=\"http" not in html and "href=" not in html and "plots/" not in html
    md = (out / "report.md").read_text()
    assert "Merged from 2 reports" in md and "## Scorecard" in md and "## Decode (real time)" in md


def test_same_section_twice_is_refused_unless_prefer_last(two_runs, tmp_path, capsys):
    a = two_runs / "a" / "report.json"
    again = _load(a)
    again["correctness"]["marker"] = "second run"
    a2 = _write(tmp_path / "a2" / "report.json", again)
    with pytest.raises(ValueError, match="more than one run selected the same section: correctness"):
        merge.merge([str(a), a2, str(two_runs / "b")])
    assert main(["eval", "--merge", str(a), a2, "--out", str(tmp_path / "m")]) == 2
    assert "--prefer-last" in capsys.readouterr().err
    r = merge.merge([str(a), a2, str(two_runs / "b")], prefer_last=True)
    assert r["correctness"]["marker"] == "second run"
    assert [m["taken"] for m in r["meta"]["merged_from"]] == [[], list(PART_A), list(PART_B)]


@pytest.mark.parametrize("edit,message", [
    (lambda r: r["meta"].update(profile="quick"), "different profiles"),
    (lambda r: r["meta"].update(gates="mamba"), "different gates"),
    (lambda r: r["environment"].update(gpu={"name": "NVIDIA H200"}), "different devices"),
    (lambda r: r["meta"].update(device="cuda"), "different devices"),
    (lambda r: r["meta"]["impls"].pop(), "different implementation lists"),
    (lambda r: r["meta"]["impls"][0].update(available=False, reason="not installed"), "skipped in"),
    (lambda r: r.update(partial=True), "partial report"),
])
def test_mismatched_runs_are_refused(two_runs, tmp_path, edit, message):
    b = _load(two_runs / "b" / "report.json")
    edit(b)
    with pytest.raises(ValueError, match=message):
        merge.merge([str(two_runs / "a"), _write(tmp_path / "b" / "report.json", b)])


def test_allow_partial_marks_the_merge_partial(two_runs, tmp_path):
    b = _load(two_runs / "b" / "report.json")
    b["partial"] = b["meta"]["partial"] = True
    b["meta"]["interrupted"] = {"signal": "SIGTERM", "signum": 15, "at_s": 3.0, "section": "decode", "unit": None}
    b["decode"] = {"skipped": "interrupted (partial: the records so far are in report.json)", "interrupted": True,
                   "records": []}
    b["sections_done"] = ["environment", "performance"]
    pb = _write(tmp_path / "b" / "report.json", b)
    out = tmp_path / "merged"
    r, _ = merge.run([str(two_runs / "a"), pb], str(out), allow_partial=True)
    assert r["partial"] and r["meta"]["partial"] and "decode" in r["missing_sections"]
    assert "scorecard" not in r["sections_done"] and "performance" in r["sections_done"]
    assert r["meta"]["merged_from"][1]["interrupted"]["signal"] == "SIGTERM"
    assert "Partial report" in (out / "report.md").read_text()


def test_bad_inputs(two_runs, tmp_path):
    with pytest.raises(ValueError, match="at least two"):
        merge.merge([str(two_runs / "a")])
    with pytest.raises(ValueError, match="no such report"):
        merge.merge([str(two_runs / "a"), str(tmp_path / "nope.json")])
    r = copy.deepcopy(_load(two_runs / "a" / "report.json"))
    del r["meta"]["sections"]
    with pytest.raises(ValueError, match="not a linattn eval report"):
        merge.merge([str(two_runs / "b"), _write(tmp_path / "x" / "report.json", r)])
    with pytest.raises(ValueError, match="would overwrite"):
        merge.run([str(two_runs / "a"), str(two_runs / "b")], str(two_runs / "b"))
