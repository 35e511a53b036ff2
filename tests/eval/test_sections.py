"""Unit checks of the sections' logic on tiny inputs: the accuracy metric, NaN cone, scorecard, time budget."""
import json
import math

import pytest
import torch

from linattn.eval import correctness, robustness, scorecard
from linattn.eval.cases import Case, Shape, correctness_cases, profile
from linattn.eval.context import Context, run_with_timeout
from linattn.eval.impls import Impl, build, parse_impls

from .virtual_clock import STUCK_S, VirtualClock, never_returns

CPU = torch.device("cpu")
TOL = {"fp32_rel_l2": 1e-4}  # what the torch backend reaches on abnormal-but-finite inputs, with margin (~2e-7)


def _ctx():
    return Context(CPU, profile("tiny", CPU), [build("linattn", CPU)], deadline=math.inf)


def test_compare_metric():
    ref = torch.tensor([3.0, 4.0])
    m = correctness.compare(torch.tensor([3.0, 4.5]), ref)
    assert m["rel_l2"] == pytest.approx(0.1) and m["max_abs"] == pytest.approx(0.5) and m["nonfinite"] == 0
    bad = correctness.compare(torch.tensor([float("nan"), float("inf")]), ref)
    assert bad["nan"] == 1 and bad["inf"] == 1 and bad["rel_l2"] == math.inf


CASES = {c.id: c for c in correctness_cases(T=19, H=1, D=16)}


@pytest.mark.parametrize("case_id", ["prefill", "varlen-initial-state", "gva", "gate-in-op"])
def test_linattn_passes_and_a_wrong_impl_fails(case_id):
    case = CASES[case_id]
    good = build("linattn", CPU)
    rec = correctness.check_case(good, case, "fp32", CPU, seed=3)
    assert rec["status"] == "pass", rec
    # the same op with the output off by 1 %: the suite must catch it (forward and backward)
    wrong = Impl("wrong", "gdn", lambda x: (lambda o, h: (o * 1.01, h))(*good(x)), native=good.native)
    bad = correctness.check_case(wrong, case, "fp32", CPU, seed=3)
    assert bad["status"] == "fail" and not bad["fwd_passed"] and not bad["bwd_passed"]


def test_error_and_unsupported_are_recorded():
    def boom(x):
        raise RuntimeError("kernel exploded")
    rec = correctness.check_case(Impl("boom", "gdn", boom), CASES["prefill"], "fp32", CPU, seed=0)
    assert rec["status"] == "error" and rec["error"]["message"] == "kernel exploded" and rec["passed"] is False
    rec = correctness.check_case(Impl("novarlen", "gdn", boom), CASES["varlen"], "fp32", CPU, seed=0)
    assert rec["status"] == "unsupported" and rec["passed"] is None


@pytest.mark.parametrize("tensor,heads,tokens", [("q", [2, 3], [10]), ("k", [2, 3], list(range(10, 19))),
                                                 ("v", [1], list(range(10, 19)))])
def test_nan_cone_with_grouped_heads(tensor, heads, tokens):
    x = {"q": torch.zeros(2, 19, 2, 4), "v": torch.zeros(2, 19, 4, 4)}
    o_mask, h_mask = robustness.cone(x, {"tensor": tensor, "b": 1, "t": 10, "head": 1})
    want = torch.zeros(2, 19, 4, dtype=torch.bool)
    for h in heads:
        want[1, tokens, h] = True
    assert torch.equal(o_mask, want)
    assert h_mask.sum() == (0 if tensor == "q" else len(heads))


def test_nan_cone_stops_at_the_sequence_end_and_leaks_are_counted():
    x = {"q": torch.zeros(1, 20, 1, 4), "v": torch.zeros(1, 20, 1, 4),
         "cu_seqlens": torch.tensor([0, 8, 20], dtype=torch.int32)}
    plant = {"tensor": "v", "b": 0, "t": 3, "head": 0}
    o_mask, h_mask = robustness.cone(x, plant)
    assert o_mask[0, :, 0].nonzero().flatten().tolist() == list(range(3, 8))
    assert h_mask.tolist() == [[True], [False]]
    o = torch.zeros(1, 20, 1, 4)
    o[0, 3:8] = float("nan")
    assert robustness.check_confinement(o, torch.zeros(2, 1, 4, 4), x, plant)["confined"]
    o[0, 12, 0, 1] = float("nan")  # leaks into the next packed sequence
    o[0, 1, 0, 0] = float("inf")  # and into an earlier token
    rec = robustness.check_confinement(o, torch.zeros(2, 1, 4, 4), x, plant)
    assert not rec["confined"] and rec["leak_other_heads_or_sequences"] == 1 and rec["leak_earlier_tokens"] == 1


def test_robustness_finite_case_runs_and_hang_is_reported():
    rec = robustness.check(build("linattn", CPU), "g-minus-100", "fp32", _ctx())
    assert rec["status"] == "pass" and rec["rel_l2"] < TOL["fp32_rel_l2"]
    import threading
    gate, clock = threading.Event(), VirtualClock()
    status, _ = run_with_timeout(never_returns(gate, clock), timeout_s=0.1, clock=clock)
    gate.set()
    assert status == "hang"
    assert run_with_timeout(lambda: 1 / 0, 1, clock=clock)[0] == "error"


def test_scorecard_normalisation():
    raw = {"a": {"p99_ms": 2.0, "first_token_ms": 1.0, "first_call_s": 1.0, "worst_rel_l2": 1e-6, "pass_rate": 1.0},
           "b": {"p99_ms": 1.0, "first_token_ms": 1.0, "first_call_s": 4.0, "worst_rel_l2": 1e-2, "pass_rate": 0.5}}
    s = scorecard.score(raw)
    rt = s["real_time"]
    assert rt["b"]["metrics"]["p99_ms"]["normalised"] == 1.0 and rt["a"]["metrics"]["p99_ms"]["normalised"] == 0.5
    w = {m: wt for m, wt, _ in scorecard.SCENARIOS["real_time"]}  # no step_p99_ms here: the rest renormalised
    present = w["p99_ms"] + w["first_token_ms"] + w["first_call_s"]
    assert rt["a"]["score"] == pytest.approx(100 * (w["p99_ms"] * 0.5 + w["first_token_ms"] + w["first_call_s"])
                                             / present)
    assert rt["b"]["score"] == pytest.approx(100 * (w["p99_ms"] + w["first_token_ms"] + w["first_call_s"] * 0.25)
                                             / present)
    sci = s["scientific"]
    assert sci["b"]["metrics"]["worst_rel_l2"]["normalised"] == pytest.approx(0.0)  # 4 decades worse
    assert sci["a"]["score"] == pytest.approx(100) and sci["a"]["coverage"] == pytest.approx(0.6)
    assert s["edge"]["a"]["score"] == pytest.approx(100)  # only first_token_ms present, equal for both


def test_parse_impls_and_availability():
    impls = parse_impls("linattn,fla,sdpa,linattn", CPU)
    assert [i.name for i in impls] == ["linattn", "fla", "sdpa"]
    assert not impls[1].available and "GPU" in impls[1].reason
    with pytest.raises(ValueError, match="unknown implementation"):
        parse_impls("linattn,flashattn9", CPU)
    o, _ = impls[2]({"q": torch.randn(1, 8, 1, 4), "k": torch.randn(1, 8, 1, 4), "v": torch.randn(1, 8, 2, 4)})
    assert o.shape == (1, 8, 2, 4)


def test_structured_inputs_are_not_random_noise():
    s = Shape(1, 9, 1, 1, 4, 4)
    from linattn.eval.cases import make_inputs
    x = make_inputs(s, torch.float32, CPU, 0, case=Case("r", s, structure="repeated_token"))
    assert torch.equal(x["q"][0, 0], x["q"][0, 8]) and not torch.equal(x["q"], torch.zeros_like(x["q"]))
    y = make_inputs(s, torch.float32, CPU, 0, case=Case("o", s, structure="onehot_keys"))
    assert torch.equal(y["k"][0, 5, 0], torch.eye(4)[1])


def test_mamba_gates_give_each_value_head_its_own_rate():
    """--gates mamba: per value head a mean decay between 0.001 and 1.6 per token (log-uniform rates, some heads
    that keep their state for thousands of tokens, some that forget within a few), the same per seed; the default
    draw gives every head ≈ 0.05. A case's own gates (alternating, in-op) win; an unknown draw is refused."""
    from linattn.eval.cases import make_inputs
    s = Shape(2, 8192, 2, 16, 4, 4)
    x = make_inputs(s, torch.float32, CPU, 0, gates="mamba")
    rates = -x["g"].double().mean(dim=(0, 1))
    assert ((rates > 5e-4) & (rates < 2.0)).all() and rates.max() / rates.min() > 10
    assert (x["g"] <= 0).all()
    assert torch.equal(make_inputs(s, torch.float32, CPU, 0, gates="mamba")["g"], x["g"])
    default = -make_inputs(s, torch.float32, CPU, 0)["g"].double().mean(dim=(0, 1))
    assert ((default - 0.05).abs() < 0.005).all()
    alt = Case("a", s, structure="alternating_gates")
    assert torch.equal(make_inputs(s, torch.float32, CPU, 0, case=alt, gates="mamba")["g"],
                       make_inputs(s, torch.float32, CPU, 0, case=alt)["g"])
    with pytest.raises(ValueError, match="gates must be one of"):
        make_inputs(s, torch.float32, CPU, 0, gates="slow")


def test_the_speed_sections_draw_the_contexts_gates(monkeypatch):
    """perf's timed calls (scaling's too: it times through perf.measure) take the context's --gates draw."""
    from linattn.eval import cases, perf
    seen = []
    real = cases.make_inputs

    def recording(*args, **kwargs):
        seen.append(kwargs.get("gates"))
        return real(*args, **kwargs)
    monkeypatch.setattr(perf, "make_inputs", recording)
    ctx = _ctx()
    ctx.gates = "mamba"
    impl = ctx.available()[0]
    rec = perf.measure(ctx, impl, Shape(1, 64, 1, 1, 8, 8), "fp32", "fwd", warmup=0, reps=1, budget_s=5.0)
    assert "error" not in rec and seen == ["mamba"]


def test_busy_machine_warning():
    from linattn.eval.environment import busy_warning
    assert busy_warning({"load_avg_start": 0.3, "load_avg_end": 1.1, "cpu_count": 2}) is None
    assert "busy" in busy_warning({"load_avg_start": 0.3, "load_avg_end": 4.5, "cpu_count": 2})
    assert busy_warning({"load_avg_start": None, "load_avg_end": None, "cpu_count": 2}) is None


def test_environment_records_the_triton_settings(monkeypatch):
    """The report's environment carries every module's settings as they are at collection time (values set to
    something other than their defaults, so a recorded value cannot be a hard-coded default), and the Hopper forward's
    plan tunables, cache limits and compile state, every field of each."""
    from dataclasses import fields, replace
    from types import MappingProxyType

    from linattn.eval.environment import collect
    from linattn.ops import common, settings
    from linattn.ops.gated_delta import dispatch
    from linattn.ops.hopper import compile as hopper_compile
    from linattn.ops.hopper import plan as hopper_plan
    recorded = collect(CPU)["linattn_settings"]
    assert set(settings._MODULES) | {"HOPPER"} == set(recorded), "a settings module did not import"
    assert recorded["dispatch"]["WALK_MIN_PAIRS"] == {"bfloat16": None, "float16": 128, "float32": None}
    monkeypatch.setattr(dispatch, "WALK_MIN_PAIRS", MappingProxyType({torch.float16: 7}))
    monkeypatch.setattr(common, "LAUNCH_OPTIONS", {"wy": {"maxnreg": 168}})
    plan = replace(hopper_plan.DEFAULT, fill_fraction=hopper_plan.DEFAULT.fill_fraction / 2,
                   min_segment_chunks=hopper_plan.DEFAULT.min_segment_chunks + 1,
                   min_segmented_head_tokens=hopper_plan.DEFAULT.min_segmented_head_tokens * 2,
                   negligible_m_log2=hopper_plan.DEFAULT.negligible_m_log2 - 1,
                   warm_up_max_fraction=hopper_plan.DEFAULT.warm_up_max_fraction / 2,
                   scan_bv=2 * hopper_plan.DEFAULT.scan_bv,
                   scan_precision="tf32x3" if hopper_plan.DEFAULT.scan_precision == "tf32" else "tf32",
                   max_padded_fraction=hopper_plan.DEFAULT.max_padded_fraction / 2,
                   BV=192 - hopper_plan.DEFAULT.BV, threads=384 - hopper_plan.DEFAULT.threads,
                   num_stages=hopper_plan.DEFAULT.num_stages + 1)
    cached = hopper_plan.CACHE_LIMITS
    limits = replace(cached, prepared=cached.prepared + 1, routes=cached.routes + 2,
                     scratch_bytes=cached.scratch_bytes // 2)
    assert all(getattr(plan, f.name) != getattr(hopper_plan.DEFAULT, f.name) for f in fields(plan))
    assert all(getattr(limits, f.name) != getattr(cached, f.name) for f in fields(limits))
    monkeypatch.setattr(hopper_plan, "DEFAULT", plan)
    monkeypatch.setattr(hopper_plan, "CACHE_LIMITS", limits)
    monkeypatch.setattr(hopper_compile, "_compile_failure", "no sm_90a here")
    settings_now = collect(CPU)["linattn_settings"]
    assert settings_now["dispatch"]["WALK_MIN_PAIRS"] == {"float16": 7}
    assert settings_now["common"]["LAUNCH_OPTIONS"] == {"wy": {"maxnreg": 168}}
    recorded = settings_now["HOPPER"]
    assert recorded["PLAN"] == {f.name: getattr(plan, f.name) for f in fields(plan)}
    assert recorded["CACHE_LIMITS"] == {f.name: getattr(limits, f.name) for f in fields(limits)}
    assert recorded["compile_failed"] == "no sm_90a here"
    assert isinstance(recorded["tilelang_installed"], bool)
    json.dumps(settings_now)                                # the report writes it as JSON


def test_share_splits_the_remaining_time():
    clock = VirtualClock()
    ctx = Context(CPU, profile("tiny", CPU), [], deadline=clock() + 100, clock=clock)
    with ctx.share(4):
        assert 20 < ctx.remaining() <= 25
    assert ctx.remaining() > 95


def _fake_cuda(monkeypatch, current: int) -> list:
    """CUDA device selection as torch does it, without a GPU: ``current_device`` is ``current`` in this thread and 0
    in any other (a new thread starts on device 0); ``set_device`` refuses a device without an index. Returns the
    devices selected."""
    import threading
    caller, seen = threading.current_thread(), []

    def set_device(d):
        if isinstance(d, torch.device) and d.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{d}")
        seen.append(d)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current if threading.current_thread() is caller else 0)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return seen


def test_an_index_less_cuda_device_is_the_callers_current_device(monkeypatch):
    seen = _fake_cuda(monkeypatch, current=1)
    assert run_with_timeout(lambda: "ran", 5, torch.device("cuda")) == ("ok", "ran")
    assert seen == [torch.device("cuda", 1)]  # the caller's device, not the worker thread's default 0
    assert run_with_timeout(lambda: "ran", 5, torch.device("cuda", 2)) == ("ok", "ran") and seen[-1].index == 2


def test_the_cli_context_holds_an_indexed_cuda_device(monkeypatch, tmp_path):
    import argparse

    from linattn.eval import cli
    seen = _fake_cuda(monkeypatch, current=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for spec in (["--device", "cuda"], []):  # explicit, and the default device on a machine with CUDA
        args = parser.parse_args(["--profile", "tiny", "--impl", "sdpa", "--out", str(tmp_path)] + spec)
        ev = cli.Evaluation(args)
        assert ev.ctx.device == torch.device("cuda", 1) and seen[-1] == torch.device("cuda", 1)


def test_a_harness_failure_is_raised_not_recorded_as_the_calls_error(monkeypatch):
    def broken(d):
        raise RuntimeError("CUDA driver gone")
    monkeypatch.setattr(torch.cuda, "set_device", broken)
    with pytest.raises(RuntimeError, match="could not select cuda:0"):
        run_with_timeout(lambda: "never", 5, torch.device("cuda", 0))


def test_robustness_sanity_benign_inputs_pass_on_the_tiny_profile():
    """The section as the CLI runs it: linattn's benign cases are results, not errors (an H200 run once recorded a
    harness ValueError as every case's outcome)."""
    ctx = _ctx()
    ctx.begin_section("robustness")
    r = robustness.run(ctx)
    recs = {x["case"]: x for x in r["records"]}
    assert set(recs) == set(robustness.FINITE_CASES + robustness.NAN_CASES)
    for name in ("identical-tokens", "g-zero", "g-minus-100", "beta-zero", "beta-one", "zeroed-tokens"):
        assert recs[name]["status"] == "pass", recs[name]
    # a planted NaN gives a verdict on confinement, never an error, and stays in its cone (issue 46 item 4: the
    # torch backend's chunk products are causal under NaN)
    assert all(recs[n]["status"] == "pass" and recs[n]["confined"] for n in robustness.NAN_CASES)
    s = r["summary"]["linattn"]
    assert s["errors"] == 0 and s["same_error_every_case"] is None


def test_robustness_flags_one_error_on_every_case():
    def harness_bug(x):
        raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")
    impls = [Impl("broken", "gdn", harness_bug, native={"varlen"}), build("linattn", CPU)]
    ctx = Context(CPU, profile("tiny", CPU), impls, deadline=math.inf)
    lines = []
    ctx.log = lines.append
    ctx.begin_section("robustness")
    s = robustness.run(ctx)["summary"]
    assert s["broken"]["same_error_every_case"].startswith("ValueError: Expected a torch.device")
    assert any("robustness broken: every case raised ValueError" in x for x in lines)
    assert s["linattn"]["same_error_every_case"] is None


def _stuck(gate, clock):
    """An implementation whose call does not return until ``gate`` is set (a hang, or an endless first autotune);
    it has run for STUCK_S of ``clock`` when first checked."""
    return Impl("stuck", "gdn", never_returns(gate, clock), native={"l2norm"})


def test_mixed_precision_survives_a_call_that_never_returns():
    import dataclasses
    import threading

    from linattn.eval import mixed_precision
    gate, clock = threading.Event(), VirtualClock()
    # linattn trains in no time of the clock, the stuck call outlasts the limit: whatever the machine's speed
    prof = dataclasses.replace(profile("tiny", CPU), amp_timeout_s=3.0)
    ctx = Context(CPU, prof, [_stuck(gate, clock), build("linattn", CPU)], deadline=math.inf, clock=clock)
    ctx.begin_section("mixed_precision")
    t = clock()
    try:
        r = mixed_precision.run(ctx)
    finally:
        gate.set()
    assert clock() - t == STUCK_S  # one stuck call, one timeout
    stuck, lin = r["records"]
    assert stuck["status"] == "hang" and stuck["passed"] is False and stuck["timeout_s"] == pytest.approx(3.0)
    assert ctx.section_stats["stuck"]["units"] == 1  # the fp32 run was not started beside the abandoned one
    assert lin["status"] == "pass" and lin["final_loss_rel_gap"] is not None and "fp32_reference" not in lin


def test_mixed_precision_skips_the_fp32_reference_an_implementation_cannot_run():
    """FlashQLA takes bf16 / fp16 only: its fp16 run is trained and judged, its fp32 reference is not attempted
    (no compile budgeted, no error recorded) and the record says why."""
    from linattn.eval import mixed_precision
    lin = build("linattn", CPU)
    half_only = Impl("half-only", "gdn", lin.fn, native=lin.native,
                     limits=lambda x: "half only" if x["q"].dtype == torch.float32 else None)
    ctx = Context(CPU, profile("tiny", CPU), [half_only], deadline=math.inf)
    ctx.begin_section("mixed_precision")
    rec = mixed_precision.run(ctx)["records"][0]
    assert rec["status"] == "pass" and rec["loss_fp32"] is None and rec["final_loss_rel_gap"] is None
    assert rec["fp32_reference"] == {"status": "unsupported", "reason": "half only"}
    assert ctx.section_stats["half-only"]["units"] == 1  # the fp16 run only


def test_mixed_precision_call_cut_by_the_budget_is_skipped_not_a_hang():
    import threading

    from linattn.eval import mixed_precision
    gate, clock = threading.Event(), VirtualClock()
    ctx = Context(CPU, profile("tiny", CPU), [_stuck(gate, clock)], deadline=clock() + 0.5, clock=clock)
    ctx.begin_section("mixed_precision")
    try:
        rec = mixed_precision.run(ctx)["records"][0]
    finally:
        gate.set()
    assert rec["status"] == "skipped" and rec["passed"] is None
    assert rec["reason"].startswith("time budget: still running after")


def test_every_section_records_flashqlas_head_dim_as_unsupported(monkeypatch):
    """FlashQLA as build() configures it, its kernel faked on the CPU as flash-qla 0.1.3 behaves (an assertion on
    the head dim): on the tiny profile (K = V = 16) every section records it as unsupported, with the reason,
    without running or budgeting a unit (an H200 run recorded 7 x "error AssertionError" in stability)."""
    from linattn.eval import impls, memory, mixed_precision, perf, scaling, soak, stability
    lin = build("linattn", CPU)

    def hopper_kernel(x):
        assert x["q"].shape[-1] == x["v"].shape[-1] == 128
        return lin.fn(x)

    monkeypatch.setattr(impls, "_flashqla", lambda: hopper_kernel)
    qla = impls.build("flashqla", torch.device("cuda"))  # the Impl only; its calls run on the CPU here
    assert qla.supports_shape(Shape(1, 64, 2, 2, 128, 128)) is None
    assert qla.supports_shape(Shape(1, 64, 2, 2, 128, 128), dtype="fp16") is None
    assert "K = V = 128" in qla.supports_shape(Shape(1, 64, 2, 2, 64, 64))
    # and bf16 / fp16 inputs only (its entry point asserts so): fp32 units are unsupported, not "skipped for time"
    assert "bf16 or fp16" in qla.supports_shape(Shape(1, 64, 2, 2, 128, 128), dtype="fp32")
    sections = {"correctness": correctness.run, "performance": perf.run, "scaling": scaling.run,
                "memory": memory.run, "stability": stability.run, "robustness": robustness.run,
                "soak": soak.run, "mixed_precision": mixed_precision.run}
    for name, run in sections.items():
        ctx = Context(CPU, profile("tiny", CPU), [qla], deadline=math.inf)
        ctx.begin_section(name)
        r = run(ctx)
        if "unsupported" in r:  # a section of measurements: nothing measured, its list says why
            marked = r["unsupported"]
            assert not any(r.get(k) for k in ("records", "series", "sweeps", "T_sweep")), name
        else:  # a section of verdicts: its records say it
            marked = r["records"]
        assert marked and all(x["status"] == "unsupported" and "K = V = 128" in x["reason"] for x in marked), name
        assert ctx.section_stats == {}, name  # nothing started, nothing budgeted


def test_robustness_stops_an_implementation_after_its_first_hang():
    """A hung call keeps running in its abandoned thread (on a GPU it may hold the stream): the implementation's
    later cases are recorded as not run instead of each waiting out its own timeout."""
    import dataclasses
    import threading

    gate, clock = threading.Event(), VirtualClock()
    prof = dataclasses.replace(profile("tiny", CPU), rob_timeout_s=1.0, corr_dtypes=("fp32",))
    ctx = Context(CPU, prof, [_stuck(gate, clock)], deadline=math.inf, clock=clock)
    ctx.begin_section("robustness")
    t = clock()
    try:
        recs = robustness.run(ctx)["records"]
    finally:
        gate.set()
    assert clock() - t == STUCK_S  # one timeout, not one per case
    assert recs[0]["status"] == "hang"
    later = [r for r in recs[1:] if r["status"] != "unsupported"]  # it has no varlen: that case is unsupported
    assert len(later) > 2 and all(r["status"] == "skipped" and "hung" in r["reason"] for r in later)
