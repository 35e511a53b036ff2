"""The FLOP/byte model, the roofline arithmetic and the latency statistics of linattn.eval.perf."""
import math
import random

import numpy as np
import pytest
import torch

from linattn.eval import perf
from linattn.eval.cases import Shape, profile
from linattn.eval.context import Context

TOL = {"rel": 1e-12}


@pytest.mark.parametrize("shape", [Shape(1, 4096, 16, 16, 128, 128), Shape(2, 1000, 4, 8, 64, 64),
                                   Shape(1, 63, 2, 2, 60, 100)], ids=lambda s: s.id)
def test_gdn_flops_match_hand_count(shape):
    C = 64
    # per chunk per value head: KKᵀ, QKᵀ (C²K each), T·X and (QKᵀ⊙D)V_new (C²V each), KS, QS, KᵀV_new (CKV each)
    macs_per_chunk = 2 * C * C * shape.K + 2 * C * C * shape.V + 3 * C * shape.K * shape.V
    expected = 2 * macs_per_chunk / C * shape.B * shape.T * shape.HV
    got = perf.gdn_cost(shape, "bf16")["flops"]
    assert got == pytest.approx(expected, **TOL)
    if shape.K == shape.V:  # the anchors' closed form 8Cd + 6d² per token and value head
        d = shape.K
        assert got == pytest.approx(shape.B * shape.T * shape.HV * (8 * C * d + 6 * d * d), **TOL)


def test_gdn_bytes_count_every_tensor_once():
    s = Shape(2, 100, 4, 8, 64, 32)
    # bf16 q, k (per q/k head), v and o (per value head), fp32 g, bf16 beta
    expected = 2 * 100 * (2 * 4 * 64 * 2 + 8 * (2 * 32 * 2 + 4 + 2))
    assert perf.gdn_cost(s, "bf16")["bytes"] == expected
    # fp32 everything: beta 4 bytes, element size 4
    expected32 = 2 * 100 * (2 * 4 * 64 * 4 + 8 * (2 * 32 * 4 + 4 + 4))
    assert perf.gdn_cost(s, "fp32")["bytes"] == expected32
    # with an initial and a final fp32 state per sequence
    assert perf.gdn_cost(s, "fp32", state=True)["bytes"] == expected32 + 2 * 2 * 8 * 64 * 32 * 4


def test_backward_factors_and_bad_direction():
    s = Shape(1, 512, 2, 2, 64, 64)
    f, fb = perf.gdn_cost(s, "bf16"), perf.gdn_cost(s, "bf16", "fwdbwd")
    assert fb["flops"] == pytest.approx(3.5 * f["flops"]) and fb["bytes"] == pytest.approx(3.0 * f["bytes"])
    with pytest.raises(ValueError, match="direction"):
        perf.gdn_cost(s, "bf16", "bwd")


def test_sdpa_cost_is_quadratic_in_T():
    a = perf.sdpa_cost(Shape(1, 1024, 4, 4, 64, 64), "bf16")
    b = perf.sdpa_cost(Shape(1, 2048, 4, 4, 64, 64), "bf16")
    assert b["flops"] == pytest.approx(4 * a["flops"]) and b["bytes"] == pytest.approx(2 * a["bytes"])
    assert a["flops"] == 4 * 1024 * 1024 * 128


def test_roofline_fraction_and_bound():
    cost = {"flops": 790e12 * 1e-3, "bytes": 4.3e12 * 0.5e-3}  # 1 ms of compute, 0.5 ms of traffic at the peaks
    r = perf.roofline(cost, median_ms=4.0, tokens=1000, peaks=(790.0, 4300.0, "test"))
    assert r["floor_ms"] == pytest.approx(1.0) and r["bound"] == "compute"
    assert r["roofline_fraction"] == pytest.approx(0.25)
    assert r["tflops"] == pytest.approx(790 / 4) and r["tokens_per_s"] == pytest.approx(250_000)
    none = perf.roofline(cost, 4.0, 1000, (None, None, "unknown"))
    assert none["roofline_fraction"] is None and none["tflops"] == pytest.approx(790 / 4)


def test_peak_override_on_cpu():
    dev = torch.device("cpu")
    ctx = Context(dev, profile("tiny", dev), [], deadline=math.inf)
    assert perf.device_peaks(ctx, "fp32")[:2] == (None, None)
    ctx.peak_tflops, ctx.peak_gbs = 1.5, 20.0
    assert perf.device_peaks(ctx, "fp32")[:2] == (1.5, 20.0)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentiles_match_numpy(n):
    rng = random.Random(n)
    xs = [rng.lognormvariate(0, 1) for _ in range(n)]
    for p in (0, 1, 25, 50, 90, 95, 99, 99.9, 100):
        assert perf.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12)
    s = perf.summarize(xs)
    assert s["median_ms"] == s["p50_ms"] == pytest.approx(float(np.median(xs)))
    assert s["max_ms"] == max(xs) and s["min_ms"] == min(xs) and s["n"] == n
    assert s["std_ms"] == pytest.approx(float(np.std(xs, ddof=1)) if n > 1 else 0.0)


def test_percentile_hand_values_and_errors():
    assert perf.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert perf.percentile([10.0, 0.0], 99) == pytest.approx(9.9)
    assert perf.percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        perf.percentile([], 50)
    with pytest.raises(ValueError):
        perf.percentile([1.0], 101)


def test_loglog_slope_recovers_exponents():
    xs = [256, 512, 1024, 2048]
    assert perf.loglog_slope(xs, [3 * x for x in xs]) == pytest.approx(1.0)
    assert perf.loglog_slope(xs, [x * x for x in xs]) == pytest.approx(2.0)
    assert perf.loglog_slope(xs, [7.0] * 4) == pytest.approx(0.0)
    assert perf.loglog_slope([1], [1]) is None


def test_planned_calls_fit_the_row_budget():
    """The number of calls comes from the measured steady call, not from a host clock read between (asynchronous)
    GPU launches: a 0.45 s call under a 20 s budget gets 44 timed calls, not the profile's 100."""
    assert perf.planned_calls(0.453, 10, 100, 20.0) == (10, 44)
    assert perf.planned_calls(1e-4, 10, 100, 20.0) == (10, 100)  # fast calls: the profile's counts
    assert perf.planned_calls(30.0, 10, 100, 20.0) == (0, 3)      # slower than the budget: the minimum
    assert perf.planned_calls(0.0, 10, 100, 20.0) == (10, 100)    # an immeasurably fast call


def test_time_calls_honours_the_plan_on_the_cpu():
    ctx = Context(torch.device("cpu"), profile("tiny", torch.device("cpu")), [], deadline=1e18)
    calls = []
    out = perf.time_calls(ctx, lambda: calls.append(1), warmup=4, reps=7, budget_s=5.0)
    # one first call, one planning call, warmup − 1 more warm-up calls, then the timed ones
    assert len(out["samples_ms"]) == 7 and len(calls) == 1 + 1 + 3 + 7
