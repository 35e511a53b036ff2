"""`linattn eval --warm-from`: signatures earlier runs compiled are charged a cache load, not a compile (CPU runs;
the estimates are checked on a GPU Context, which touches no CUDA)."""
import json
import re
import time

import pytest
import torch

from linattn.cli import main
from linattn.eval import merge, warm
from linattn.eval.cases import Shape, profile
from linattn.eval.context import CACHE_LOAD_S, FIRST_CALL_PRIOR_S, HANG_COMPILE_ALLOWANCE, Context, shape_classes
from linattn.eval.impls import Impl

CPU, GPU = torch.device("cpu"), torch.device("cuda")
COMMON = ["eval", "--profile", "tiny", "--impl", "linattn,sdpa", "--device", "cpu", "--no-progress",
          "--time-budget", "300"]
FLA = Impl("fla", "gdn", None, native={"l2norm", "varlen", "h0"})
QLA = Impl("flashqla", "gdn", None, native={"l2norm", "gate", "beta_sigmoid"})


def _sigs(impl, dtype="bf16", **options):
    return shape_classes(impl, Shape(1, 64, 2, 2, 64, 64), dtype, "fwdbwd", **options)


def _entry(sig):  # a meta.compiles entry as report.json has it
    return {"family": sig.family, "kernel": list(sig.kernel), "dtype": sig.dtype, "dims": list(sig.dims),
            "flags": list(sig.flags), "seconds": 30.0, "incremental": False, "cached": False}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("warm") / "first"
    assert main(COMMON + ["--sections", "correctness,scorecard", "--out", str(out)]) == 0
    return out


def _report(first_run, tmp_path, name="earlier", env_vars=None, **compiles):
    """The first run's report with extra compiles (impl -> signatures) and environment variables, written anew."""
    r = json.loads((first_run / "report.json").read_text())
    for impl, sigs in compiles.items():
        r["meta"]["compiles"][impl] = [_entry(s) for s in sigs]
    r["environment"]["env"].update(env_vars or {})
    path = tmp_path / name / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r))
    return path


def _gpu_ctx(cached):
    ctx = Context(GPU, profile("tiny", CPU), [], deadline=time.monotonic() + 1000)
    ctx.cached = cached
    ctx.begin_section("performance")
    return ctx


def test_a_listed_signature_costs_a_cache_load(first_run, tmp_path):
    path = _report(first_run, tmp_path, flashqla=_sigs(QLA))
    cached, meta = warm.load_cached([str(path.parent)], CPU, ["linattn", "flashqla"])
    assert meta["paths"] == [str(path)] and meta["cached_signatures"]["flashqla"] == 2
    assert meta["cached_signatures"]["linattn"] > 0  # the first run's own compiles
    ctx = _gpu_ctx(cached)
    assert ctx.estimate("flashqla", _sigs(QLA)) == (2 * CACHE_LOAD_S["flashqla"], "cached")
    # a signature no earlier run compiled keeps its estimate: here the family's prior, per direction
    assert ctx.estimate("flashqla", _sigs(QLA, "fp32")) == (2 * FIRST_CALL_PRIOR_S["chunk"]["flashqla"], "prior")
    # a cache load never costs more than a compile would (a CPU has no compiler: 0 either way)
    assert _gpu_ctx({}).estimate("flashqla", _sigs(QLA))[1] == "prior"


def test_fla_is_cached_only_with_autotune_caching_in_both(first_run, tmp_path, monkeypatch):
    def fla_estimate(env_vars, name):
        path = _report(first_run, tmp_path, name, env_vars, fla=_sigs(FLA))
        cached, meta = warm.load_cached([str(path)], CPU, ["fla"])
        return _gpu_ctx(cached).estimate("fla", _sigs(FLA)), meta

    prior = (2 * FIRST_CALL_PRIOR_S["chunk"]["fla"], "prior")
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    est, meta = fla_estimate({}, "unset-there")
    assert est == prior and "was not set in the run of" in meta["not_cached"]["fla"][0]
    assert est == fla_estimate({"TRITON_CACHE_AUTOTUNING": "0"}, "zero-there")[0]
    assert fla_estimate({"TRITON_CACHE_AUTOTUNING": "1"}, "both")[0] == (2 * CACHE_LOAD_S["fla"], "cached")
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING")
    est, meta = fla_estimate({"TRITON_CACHE_AUTOTUNING": "1"}, "unset-here")
    assert est == prior and meta["not_cached"]["fla"] == ["TRITON_CACHE_AUTOTUNING is not set in this process"]
    assert "fla" not in meta["cached_signatures"]


@pytest.mark.parametrize("field,value,message", [
    ("gpu", {"name": "NVIDIA H200"}, "GPU 'NVIDIA H200' there, None here"),
    ("device", "cuda:0", "device type 'cuda' there, 'cpu' here"),
    ("torch", "1.0.0", "torch '1.0.0' there"),
    ("triton", "0.1", "triton '0.1' there"),
])
def test_another_machine_or_software_is_refused(first_run, tmp_path, capsys, field, value, message):
    r = json.loads((first_run / "report.json").read_text())
    r["environment"][field] = value
    path = tmp_path / "other" / "report.json"
    path.parent.mkdir()
    path.write_text(json.dumps(r))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + re.escape(message)):
        warm.load_cached([str(path)], CPU, ["linattn"])
    assert main(COMMON + ["--out", str(tmp_path / "x"), "--warm-from", str(path.parent)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err


def test_cli_warm_from_a_directory_and_merge(first_run, tmp_path, capsys):
    second = tmp_path / "second"
    assert main(COMMON + ["--sections", "correctness,scorecard", "--out", str(second),
                          "--warm-from", str(first_run)]) == 0
    err = capsys.readouterr().err
    first_json = str(first_run / "report.json")
    assert f"warm from {first_json}: signatures taken as cached: linattn " in err
    assert "signatures compiled by an earlier run)" in err  # the same cases: every first call was cached
    r = json.loads((second / "report.json").read_text())
    w = r["meta"]["warm_from"]
    assert w["paths"] == [first_json] and w["cached_signatures"]["linattn"] == len(
        json.loads((first_run / "report.json").read_text())["meta"]["compiles"]["linattn"])
    assert r["meta"]["compiles"]["linattn"] and all(c["cached"] for c in r["meta"]["compiles"]["linattn"])
    assert f"| warm from | {first_json}: signatures taken as cached: linattn" in (second / "report.md").read_text()
    # a run made with --warm-from merges; each run's warm_from stays in merged_from
    out = tmp_path / "merged"
    m, _ = merge.run([str(first_run), str(second)], str(out), prefer_last=True)
    assert m["meta"]["warm_from"] is None and m["meta"]["merged_from"][1]["warm_from"] == w
    assert m["meta"]["merged_from"][0]["warm_from"] is None
    assert "| run 2 warm from |" in (out / "report.md").read_text()
    # and the merged report can itself be warmed from (each of its runs is checked)
    cached, meta = warm.load_cached([str(out)], CPU, ["linattn"])
    assert meta["cached_signatures"]["linattn"] == w["cached_signatures"]["linattn"]


def test_a_measured_first_call_overrides_the_cache_assumption():
    a, b, c = _sigs(QLA), _sigs(QLA, l2norm=True), _sigs(QLA, "fp32")
    ctx = _gpu_ctx({"flashqla": set(a) | set(b)})
    assert ctx.estimate("flashqla", b) == (10.0, "cached")
    ctx.step("a", "flashqla", a)
    ctx.done("ok", first_call_s=50.0)  # the cache was cold: 25 s per kernel set, recorded as loads
    comp = ctx.costs["flashqla"].compiles
    assert [(e.seconds, e.cached, e.incremental) for e in comp] == [(25.0, True, False)] * 2
    assert ctx.estimate("flashqla", a)[1] == "steady"
    assert ctx.estimate("flashqla", b) == (50.0, "cached")  # the measured load, no longer 5 s
    # loads are no compiles: a signature no run compiled keeps the prior, not 25 s as a "new kernel"
    assert ctx.estimate("flashqla", c) == (2 * FIRST_CALL_PRIOR_S["chunk"]["flashqla"], "prior")
    # a load measured above what compiling would cost: the compile estimate wins
    cold = _gpu_ctx({"flashqla": set(a) | set(b)})
    cold.step("a", "flashqla", a)
    cold.done("ok", first_call_s=400.0)
    assert cold.estimate("flashqla", b) == (2 * FIRST_CALL_PRIOR_S["chunk"]["flashqla"], "prior")
    # a timeout allows for a cold cache: robustness must not report a slow load as a hang
    fresh = _gpu_ctx({"flashqla": set(a)})
    assert fresh.hard_timeout("flashqla", a, 30.0) == (
        30.0 + HANG_COMPILE_ALLOWANCE * 2 * FIRST_CALL_PRIOR_S["chunk"]["flashqla"], False)


def test_warm_from_is_no_merge_option(first_run, tmp_path, capsys):
    assert json.loads((first_run / "report.json").read_text())["meta"]["warm_from"] is None
    assert main(["eval", "--merge", str(first_run), str(first_run), "--out", str(tmp_path / "m"),
                 "--warm-from", str(first_run)]) == 2
    assert "--warm-from applies to a run" in capsys.readouterr().err
