"""The decode (real-time) section on tiny shapes: drift against float64 catches a wrong step, the pool's other rows are
watched, the byte model, the latency record, the time budget, and the scorecard's pick of the step latency."""
import dataclasses
import math
import time

import pytest
import torch

from linattn.eval import decode, scorecard
from linattn.eval.cases import Shape, profile
from linattn.eval.context import Context
from linattn.eval.impls import parse_impls

CPU = torch.device("cpu")
# what the fp32 torch path reaches after a 16-token prefill and 24 steps (~1e-7), with margin; the section's own
# pass thresholds are decode.DRIFT_TOL
TOL = {"fp32_rel_l2": 1e-5, "bf16_pool_rel_l2": 5e-3}


def _ctx(impls="linattn,sdpa", deadline=math.inf, **prof):
    p = dataclasses.replace(profile("tiny", CPU), **prof)
    return Context(CPU, p, parse_impls(impls, CPU), deadline=deadline, seed=5)


def _path(ctx, name):
    return next(x for x in decode.paths_for(ctx)[0] if x.name == name)


@pytest.mark.parametrize("path_name,pool,tol", [
    ("linattn/decode", "fp32", TOL["fp32_rel_l2"]),
    ("linattn/decode", "bf16", TOL["bf16_pool_rel_l2"]),
    ("linattn/recurrent", "fp32", TOL["fp32_rel_l2"]),
])
def test_drift_passes_and_a_wrong_step_fails(path_name, pool, tol, monkeypatch):
    ctx = _ctx()
    path = _path(ctx, path_name)
    rec = decode.drift(ctx, path, pool, {})
    assert rec["passed"], rec
    assert rec["rel_l2_o"] < tol and rec["rel_l2_state"] < 4 * tol and rec["nonfinite"] == 0
    assert len(rec["rel_l2_o_windows"]) == len(rec["window_end_steps"]) and rec["window_end_steps"][-1] == 24
    assert rec["others_untouched"] is (True if path.path == "decode" else None)
    # the same step with its output off by 10 % (above every tolerance): the drift check must fail
    real = decode.make_step
    monkeypatch.setattr(decode, "make_step", lambda p, st: (lambda f: lambda x: f(x) * 1.1)(real(p, st)))
    bad = decode.drift(ctx, path, pool, {})
    assert not bad["passed"] and bad["rel_l2_o"] > 0.05


def test_pool_rows_of_other_sequences_are_watched():
    path = decode.DecodePath("linattn", "decode", ("fp32",))
    st = decode.State(path, torch.randn(3, 2, 4, 4), torch.float32, seed=1)
    assert st.pool.shape == (7, 2, 4, 4) and len(set(st.slots.tolist())) == 3 and st.others_untouched()
    assert torch.equal(st.current(), st.pool[st.slots])
    st.pool[st.others[0], 0, 0, 0] += 1
    assert st.others_untouched() is False


def test_triton_decode_path_under_the_interpreter():
    """The GPU code path (backend="triton") wired through make_step runs and matches float64 (fp32: the
    interpreter computes bf16 dots wrongly)."""
    ctx = _ctx("linattn-triton", dec_prompt_T=0, dec_drift_steps=3)
    rec = decode.drift(ctx, _path(ctx, "linattn-triton/decode"), "fp32", {})
    assert rec["passed"] and rec["rel_l2_o"] < TOL["fp32_rel_l2"], rec


def test_step_bytes():
    s = Shape(1, 1, 2, 4, 32, 16)
    b = decode.step_bytes(s, B=3, Tq=2, io_dtype="bf16", state_dtype="fp32")
    assert b["state_bytes"] == 2 * 3 * 4 * 32 * 16 * 4  # read + write the fp32 state once per step
    assert b["io_bytes"] == 3 * 2 * (2 * 2 * 32 * 2 + 4 * (2 * 16 * 2 + 4 + 2))  # q, k, v, o, g (fp32), beta
    assert decode.step_bytes(s, 3, 2, "bf16", "bf16")["state_bytes"] == b["state_bytes"] // 2


def test_latency_record():
    ctx = _ctx()
    rec = decode.measure(ctx, _path(ctx, "linattn/decode"), B=2, Tq=3, pool="bf16", budget_s=30, copy_cache={})
    assert "error" not in rec, rec
    assert rec["n"] == len(rec["samples_ms"]) == ctx.profile.dec_steps and not rec["truncated"]
    assert 0 < rec["p50_ms"] <= rec["p95_ms"] <= rec["p99_ms"] <= rec["max_ms"]
    assert rec["ms_per_token"] == pytest.approx(rec["p50_ms"] / 3) and rec["finite"]
    assert rec["graph_ms"] is None and rec["id"] == "linattn/decode/B2-Tq3-H1x2-K16V16/bf16"


def test_section_respects_the_time_budget():
    ctx = _ctx(deadline=time.monotonic() - 1)
    r = decode.run(ctx)
    assert r["records"] == [] and r["drift"] == []
    assert len(r["skipped_for_time"]) == 3 + 2 * len(ctx.profile.dec_batch)  # 3 drift jobs, 2 paths x batches
    assert r["not_measured"] == [{"impl": "sdpa", "reason": "softmax baseline: a KV-cache decode is not measured"}]
    assert torch.get_num_threads() >= 1


def test_one_thread_on_cpu_is_restored():
    before = torch.get_num_threads()
    decode.run(_ctx(dec_batch=(1,), dec_steps=5, dec_drift_steps=2, dec_prompt_T=0))
    assert torch.get_num_threads() == before


def _rec(impl, path, B, Tq, pool, p99):
    return {"impl": impl, "path": path, "B": B, "Tq": Tq, "pool": pool, "p99_ms": p99}


def test_best_step_and_the_real_time_score():
    d = {"records": [_rec("linattn", "decode", 8, 1, "fp32", 0.01), _rec("linattn", "decode", 1, 1, "fp32", 0.3),
                     _rec("linattn", "recurrent", 1, 1, "fp32", 0.2), _rec("linattn", "decode", 1, 4, "fp32", 0.1),
                     _rec("linattn", "decode", 1, 1, "bf16", 0.1), _rec("fla", "fla", 1, 1, "fp32", 0.4)]}
    best = decode.best_step(d, "linattn")
    assert (best["path"], best["B"], best["p99_ms"]) == ("recurrent", 1, 0.2)
    assert decode.best_step(d, "sdpa") is None and decode.best_step({}, "linattn") is None
    raw, _ = scorecard.metrics({"decode": d})
    assert raw["linattn"]["step_p99_ms"] == 0.2 and raw["fla"]["step_p99_ms"] == 0.4
    rt = scorecard.score(raw)["real_time"]
    assert rt["linattn"]["score"] == pytest.approx(100) and rt["fla"]["score"] == pytest.approx(50)


def test_copy_reference_is_the_best_of_copies_and_an_in_place_pass(monkeypatch):
    """copy_gbs times every copy placement and the in-place pass, and reports the fastest (GB/s of 2·n·4 bytes)."""
    calls = []

    def fake_graph_ms(fn, n_calls, replays):
        fn()
        calls.append(fn)
        return 2.0 if len(calls) <= len(decode.COPY_PLACEMENTS) else 1.0  # the last one (in place) is fastest
    monkeypatch.setattr(decode, "graph_ms", fake_graph_ms)
    gbs = decode.copy_gbs(torch.device("cpu"), 8 << 20)
    n = (8 << 20) // 8
    assert len(calls) == len(decode.COPY_PLACEMENTS) + 1
    assert gbs == pytest.approx(2 * n * 4 / 1e-3 / 1e9)
