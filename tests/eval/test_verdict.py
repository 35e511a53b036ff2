"""The verdict that opens every report (issue 47 items 1-5): computed from the measurements, every FAIL in it, one
figure per shape, captions and columns that say what they show, --compare of like with like, 80-column output."""
import copy
import json

import pytest

from linattn.eval import compare, verdict
from linattn.eval.report import blocks, headline, to_markdown
from linattn.eval.summary import render


def _texts(r):
    return [x["text"] for x in verdict.verdict(r)]


def test_the_verdict_opens_the_markdown_the_html_and_the_terminal(tiny_run):
    out, r = tiny_run
    md = (out / "report.md").read_text()
    assert md.index("## Verdict") < md.index("## Summary") < md.index("## Correctness")
    html = (out / "report.html").read_text()
    assert html.index("<ul class='verdict'>") < html.index("<table>")
    printed = (out / "summary.txt").read_text().splitlines()
    first = next(i for i, line in enumerate(printed) if line.startswith("correct:"))
    assert first < next(i for i, line in enumerate(printed) if line.startswith("linattn") and "12/12" in line)
    # the scores the summary shows are explained where they are shown
    assert "offl = offline long text" in md and "offl(ine long" in "\n".join(printed)


def test_the_verdict_is_computed_from_the_measurements(tiny_run):
    _, r = tiny_run
    text = "\n".join(_texts(r))
    s = r["correctness"]["summary"]["linattn"]
    assert f"linattn passes {s['passed']}/{s['cases']} cases" in text
    assert f"fp32 {verdict._num(s['worst_rel_l2_fwd']['fp32'])} fwd" in text
    rows = [x for x in r["performance"]["records"] if x["direction"] == "fwd" and x["dtype"] == "fp32"]
    best, second = sorted(rows, key=lambda x: x["p50_ms"])[:2]
    assert f"forward fp32: {best['impl']} at {best['shape_id']} ({verdict._ratio(second['p50_ms'] / best['p50_ms'])}" \
        f" faster than {second['impl']})" in text
    assert any(line.startswith("linattn vs sdpa (forward fp32") for line in _texts(r))
    assert "linattn one-token step" in text
    assert "fla not run: fla needs a GPU" in text
    # a measurement that changes changes the verdict: nothing is written in advance
    slow = copy.deepcopy(r)
    for x in slow["performance"]["records"]:
        if x["impl"] == best["impl"]:
            x["p50_ms"] *= 1e4
    assert f"forward fp32: {second['impl']} at" in "\n".join(_texts(slow))


@pytest.mark.parametrize("ours,theirs,expect", [
    ([1, 4, 16, 64], [0.1, 0.8, 6.4, 51.2], (None, "never")),      # softmax faster throughout
    ([1, 2, 4, 8], [2, 8, 32, 128], (None, "always")),             # linear faster throughout
    # 2x slower at T = 1024 and 2048, 2x faster at 4096: the ratio crosses 1 halfway in log T, at 2048·√2
    ([2, 2, 2, 2], [1, 1, 1, 4], (2048 * 2 ** 0.5, "interpolated")),
    ([2, 2, 2, 2], [1, 1, 2, 4], (2048.0, "measured")),            # equal at a measured point
])
def test_crossover_is_interpolated_or_none_in_the_measured_range(ours, theirs, expect):
    T0, how = verdict.crossing([512, 1024, 2048, 4096], ours, theirs)
    assert how == expect[1] and (T0 == expect[0] if expect[0] is None else T0 == pytest.approx(expect[0]))


def test_crossover_line_names_the_length_and_the_figures(tiny_run):
    _, r = tiny_run
    r = copy.deepcopy(r)
    sweeps = {x["impl"]: x for x in r["scaling"]["T_sweep"]}
    T = sweeps["linattn"]["T"]
    sweeps["linattn"]["median_ms"] = [4.0, 4.0, 4.0][:len(T)]
    sweeps["sdpa"]["median_ms"] = [1.0, 4.0 * 2, 16.0][:len(T)]  # linattn faster from between T[0] and T[1]
    line = next(t for t in _texts(r) if t.startswith("linattn vs sdpa"))
    assert f"linattn is faster from T ≈ {T[0] * 2 ** (2 / 3):,.0f}" in line and f"at T = {T[-1]}: 4 ms vs 16 ms" in line


def test_every_fail_row_is_in_the_verdict_and_a_chunk_leak_names_the_known_limitation(tiny_run):
    _, r = tiny_run
    r = copy.deepcopy(r)
    rob = r["robustness"]["records"]
    nan = next(x for x in rob if x["case"] == "nan-v")
    nan.update(status="fail", passed=False, confined=False, leak_earlier_tokens=3, leak_before_chunk=0,
               leak_other_heads_or_sequences=0)
    spread = next(x for x in rob if x["case"] == "nan-k")
    spread.update(status="fail", passed=False, confined=False, leak_earlier_tokens=3, leak_before_chunk=0,
                  leak_other_heads_or_sequences=2)
    r["correctness"]["records"][0].update(status="fail", passed=False)
    r["stability"]["series"][0]["passed"] = False
    fails = [x["text"] for x in verdict.verdict(r) if x["level"] == "fail"]
    text = "\n".join(fails)
    for x in rob:
        if x["status"] in ("fail", "error", "hang"):
            assert any(x["case"] in t and x["dtype"] in t and t.startswith(f"robustness {x['impl']}") for t in fails)
    assert "64-token chunk" in next(t for t in fails if "nan-v" in t)
    assert "known limitation" in next(t for t in fails if "nan-v" in t)
    assert "known limitation" not in next(t for t in fails if "nan-k" in t)  # leaked to another head
    c0 = r["correctness"]["records"][0]
    assert f"correctness {c0['impl']} {c0['case']} {c0['dtype']}: FAIL" in text
    assert f"stability {r['stability']['series'][0]['impl']}" in text
    # and in every report: the markdown lists them under the verdict
    assert "nan-v in fp32" in to_markdown(blocks(r)).split("## Summary")[0]


def test_the_robustness_section_records_whether_a_leak_stays_in_its_chunk(tiny_run):
    _, r = tiny_run
    planted = [x for x in r["robustness"]["records"] if x.get("planted")]
    assert planted and all("leak_before_chunk" in x for x in planted)
    in_verdict = "\n".join(_texts(r))
    for x in planted:  # whatever the op does with a NaN, each failing row is in the verdict
        if x["status"] != "pass":
            assert x["case"] in in_verdict


def test_one_shape_has_one_figure(tiny_run):
    """The performance row and the scaling point of the same shape (B1-T64-H2-D16 fp32 forward on the tiny
    profile) are one measurement."""
    _, r = tiny_run
    perf = {x["id"]: x for x in r["performance"]["records"] if "p50_ms" in x}
    shared = 0
    for sweep in r["scaling"]["T_sweep"]:
        for point in sweep["points"]:
            same = perf.get(point["id"])
            if same is not None:
                shared += 1
                assert point["median_ms"] == same["median_ms"] and point["timed_in"] == "performance"
    assert shared >= 2  # linattn and sdpa


def test_captions_and_columns_say_what_they_show(tiny_run):
    out, r = tiny_run
    md = (out / "report.md").read_text()
    assert not any(x["direction"] == "fwdbwd" for x in r["scaling"]["T_sweep"])  # a CPU sweeps the forward only
    assert "dashed" not in md.split("## Scaling")[1].split("## Memory")[0]
    assert "forward only" in md
    states = {tuple(x["rel_l2_state"]) for x in r["stability"]["series"] if x["impl"] == "linattn"}
    if len(states) == 1:  # identical across dtypes: the report says why
        assert "state error is identical for fp32, bf16" in md
    # correctness not selected: linattn's column says so, it is no baseline; SDPA is the softmax one
    r2 = copy.deepcopy(r)
    r2["correctness"] = {"skipped": "not selected (--sections)"}
    cells = {row[0]: row[1] for row in headline(r2)[1]}
    assert cells["linattn"] == "not run" and cells["sdpa"] == "n/a (softmax)"


def test_compare_warns_about_partial_and_busy_reports_and_compares_like_with_like(tiny_run, tmp_path, capsys):
    out, r = tiny_run
    b = copy.deepcopy(r)
    b["partial"] = True
    b["sections_done"] = ["environment", "correctness", "performance"]
    b["environment"]["warning"] = "the machine was busy (load average up to 9 on 2 cores)"
    for x in b["performance"]["records"]:
        x["p50_ms"] *= 30
    for x in b["scaling"]["T_sweep"]:
        x["median_ms"] = [v * 30 for v in x["median_ms"]]
    d = compare.diff(r, b)
    assert any("report B is partial" in w for w in d["warnings"])
    assert any("report B: the machine was busy" in w for w in d["warnings"])
    assert "scaling" in d["left_out_sections"] and not any(k["key"].startswith("scaling/") for k in d["worse"])
    assert any(k["key"].startswith("performance/") for k in d["worse"])  # finished in both: compared
    mamba = copy.deepcopy(r)
    mamba["meta"]["gates"] = "mamba"
    for x in mamba["performance"]["records"]:
        x["p50_ms"] *= 30
    d = compare.diff(r, mamba)
    assert not d["timings_compared"] and not d["worse"]
    path = tmp_path / "b.json"
    path.write_text(json.dumps(b))
    text = compare.run(str(out / "report.json"), str(path))[1]
    assert "warning: report B is partial" in text.split("WORSE")[0]


def test_the_piped_summary_fits_80_columns_and_keeps_cells_whole(tiny_run):
    out, r = tiny_run
    printed = (out / "summary.txt").read_text()
    assert all(len(line) <= 80 for line in printed.splitlines()), max(printed.splitlines(), key=len)
    shape = r["performance"]["records"][0]["shape_id"]
    assert shape in printed  # not cut into fragments across lines
    wide = render(r, {"json": "report.json"}, width=200)
    assert any(line.startswith("impl ") for line in wide.splitlines())  # a wide terminal gets the table
