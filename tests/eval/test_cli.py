"""`linattn eval` end to end on the "tiny" profile: the report schema, the three files, --compare."""
import copy
import json
import os
import subprocess
import sys

import pytest

from linattn.cli import main
from linattn.eval import SECTIONS, compare

SECTION_KEYS = {  # a few numbers every filled section must carry
    "correctness": ("records", "summary", "tolerances"),
    "performance": ("records", "peaks", "timer"),
    "decode": ("records", "drift", "not_measured", "timer"),
    "scaling": ("T_sweep", "batch_sweep", "equal_tokens"),
    "memory": ("sweeps", "method"),
    "stability": ("series",),
    "robustness": ("records", "summary"),
    "soak": ("records",),
    "mixed_precision": ("records",),
    "environment": ("torch", "device", "nvml", "commit"),
    "scorecard": ("scenarios", "weights", "raw"),
}


def test_report_schema(tiny_run):
    out, r = tiny_run
    assert set(SECTIONS) <= set(r)
    for name, keys in SECTION_KEYS.items():
        assert "error" not in r[name], (name, r[name].get("error"))
        for k in keys:
            assert k in r[name], (name, k)
    # every section measured something on the CPU
    assert r["correctness"]["summary"]["linattn"]["passed"] == r["correctness"]["summary"]["linattn"]["cases"] > 0
    perf = {(x["impl"], x["direction"]) for x in r["performance"]["records"] if "p99_ms" in x}
    assert {("linattn", "fwd"), ("linattn", "fwdbwd"), ("sdpa", "fwd")} <= perf
    rec = r["performance"]["records"][0]
    assert rec["p50_ms"] <= rec["p95_ms"] <= rec["p99_ms"] <= rec["max_ms"] and rec["flops"] > 0
    dec = {(x["path"], x["B"]) for x in r["decode"]["records"] if "p99_ms" in x}
    assert dec == {(p, b) for p in ("decode", "recurrent") for b in (1, 2)}
    assert r["decode"]["drift"] and all(x["passed"] for x in r["decode"]["drift"])
    assert r["scorecard"]["raw"]["linattn"]["step_p99_ms"] > 0
    assert all(len(s["T"]) >= 2 for s in r["scaling"]["T_sweep"])
    assert all(m["peak_bytes"] and all(b > 0 for b in m["peak_bytes"]) for m in r["memory"]["sweeps"])
    assert r["stability"]["series"] and all(s["passed"] for s in r["stability"]["series"])
    assert r["soak"]["records"][0]["calls"] > 3
    assert r["mixed_precision"]["records"][0]["steps"] > 0
    assert r["environment"]["nvml"]["available"] is False and "GPU" in r["environment"]["nvml"]["reason"]
    # the JIT-relevant environment is recorded (the tests run with TRITON_INTERPRET set: conftest.py)
    assert r["environment"]["env"]["TRITON_INTERPRET"] == os.environ["TRITON_INTERPRET"]
    assert r["scorecard"]["scenarios"]["scientific"]["linattn"]["score"] is not None
    skipped = {i["name"]: i for i in r["meta"]["impls"]}
    assert skipped["fla"]["available"] is False and "GPU" in skipped["fla"]["reason"]


def test_markdown_and_self_contained_html(tiny_run):
    out, _ = tiny_run
    md = (out / "report.md").read_text()
    for title in ("Correctness", "Performance", "Decode (real time)", "Scaling", "Memory", "Numerical stability",
                  "Robustness", "Soak", "Mixed precision", "Scorecard", "Environment"):
        assert f"## {title}" in md
    assert "fla" in md and "needs a GPU" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 6
    assert os.path.exists(out / "plots" / "decode_latency.png") and os.path.exists(out / "plots" / "decode_drift.png")
    assert "src=\"http" not in html and "href=" not in html and "plots/" not in html
    assert os.path.exists(out / "plots" / "latency_vs_T.png")


def test_compare_reports(tiny_run, tmp_path, capsys):
    out, r = tiny_run
    same = compare.diff(r, r)
    assert same["better"] == [] and same["worse"] == [] and same["unchanged"] > 20
    b = copy.deepcopy(r)
    rec = next(x for x in b["performance"]["records"] if x["impl"] == "linattn" and x["direction"] == "fwd")
    rec["p99_ms"] *= 2
    step = b["decode"]["records"][0]
    step["p99_ms"] *= 2
    b["correctness"]["records"][0]["passed"] = False
    b["scaling"]["T_sweep"][0]["median_ms"][1] *= 0.5
    d = compare.diff(r, b)
    worse = {w["key"] for w in d["worse"]}
    assert f"performance/records/{rec['id']}/p99_ms" in worse
    assert f"decode/records/{step['id']}/p99_ms" in worse
    assert f"correctness/records/{r['correctness']['records'][0]['id']}/passed" in worse
    assert any("median_ms[T=" in x["key"] for x in d["better"])
    path_b = tmp_path / "b.json"
    path_b.write_text(json.dumps(b))
    assert main(["eval", "--compare", str(out / "report.json"), str(path_b)]) == 0
    text = capsys.readouterr().out
    assert "WORSE" in text and "p99_ms" in text
    assert main(["eval", "--compare", str(out / "report.json"), str(path_b), "--fail-on-regression"]) == 1
    assert main(["eval", "--compare", str(out / "report.json"), str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("argv,message", [
    (["--impl", "linattn,nope"], "unknown implementation"),
    (["--impl", "fla"], "none of the requested implementations"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--sections", "speed"], "--sections"),
    (["--time-budget", "0"], "--time-budget"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, tmp_path, capsys):
    assert main(["eval", "--profile", "tiny", "--out", str(tmp_path)] + argv) == 2
    assert message in capsys.readouterr().err


def test_section_subset_still_writes_every_section(tmp_path):
    assert main(["eval", "--profile", "tiny", "--impl", "sdpa", "--sections", "performance,scorecard",
                 "--out", str(tmp_path), "--no-progress"]) == 0
    r = json.loads((tmp_path / "report.json").read_text())
    assert set(SECTIONS) <= set(r)
    assert r["robustness"]["skipped"].startswith("not selected")
    assert r["performance"]["records"] and r["correctness"]["skipped"]


def test_command_exits_past_an_abandoned_worker_thread():
    """A call the eval abandoned (still running in its worker thread) must not be torn down by Python's exit (exit
    134 on the H200): the console script's ``entry`` says so and leaves with ``os._exit`` and main's status."""
    code = ("import sys, threading\n"
            "from linattn.eval.context import abandoned_threads, run_with_timeout\n"
            "gate = threading.Event()\n"
            "assert run_with_timeout(lambda: gate.wait(60), 0.05)[0] == 'hang'\n"
            "assert len(abandoned_threads()) == 1\n"
            "sys.argv = ['linattn', 'info']\n"
            "from linattn.cli import entry\n"
            "entry()\n"
            "print('not reached')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "1 abandoned call(s) still running" in p.stderr
    assert "default_backend" in p.stdout and "not reached" not in p.stdout
