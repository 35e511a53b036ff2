"""Numerical stability: forward error against float64 as T grows, per dtype (fp32, bf16, fp16).

Each point runs the implementation on one sequence of length T and the float64 token-by-token reference on the
same rounded inputs, and records the relative L2 error of the output and of the final state. Rounding errors of a
recurrence that is a contraction (unit-norm keys, β ≤ 1, decays ≤ 1) should stay flat or grow slowly; the check is
that the error does not grow *faster than linearly* in T: the fitted exponent p of err ∝ T^p must be at most
``MAX_EXPONENT`` (1, plus slack for noise over a short sweep). An error that doubles faster than T is the sign of an
accumulating bug (a state kept in low precision, a decay formed as e^{G_i}·e^{−G_j}).

The inputs are rounded once to values that bf16, fp16 and fp32 all represent exactly (bf16 then fp16), so the three
dtypes see the same numbers and one float64 reference per T serves them all.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.gated_delta.reference import gated_delta_rule_reference
from .cases import DTYPES, Shape, make_inputs
from .context import Context, error_record, shape_classes
from .correctness import compare
from .perf import loglog_slope

MAX_EXPONENT = 1.25


def _reference(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, g, beta = (inputs[n].detach().to(torch.float64) for n in ("q", "k", "v", "g", "beta"))
    return gated_delta_rule_reference(q, k, v, g, beta, q.shape[-1] ** -0.5)


def _common_inputs(shape: Shape, ctx: Context) -> dict:
    x = make_inputs(shape, torch.float32, ctx.device, ctx.seed + shape.T, gates=ctx.gates)
    for n in ("q", "k", "v", "beta"):
        x[n] = x[n].to(torch.bfloat16).to(torch.float16).to(torch.float32)
    return x


def _passed(points: list, exponent) -> Optional[bool]:
    """False on any non-finite output or an error growing faster than linearly; None if nothing to fit."""
    if any(q["o"]["nonfinite"] for q in points):
        return False
    return None if exponent is None else exponent <= MAX_EXPONENT


def _series(ctx: Context, impl, dtype: str, refs: dict, common: dict, skipped: list) -> dict:
    """One implementation in one dtype over the T sweep; ``refs``/``common`` cache the references and inputs."""
    p = ctx.profile
    pts = []
    for T in p.stab_T:
        shape = Shape(1, T, p.stab_H, p.stab_H, p.stab_D, p.stab_D)
        classes = shape_classes(impl, shape, dtype, "fwd")
        desc = f"stability {impl.name} {dtype} T={T}"
        if not ctx.fits(impl.name, classes, desc):
            skipped.append(f"{impl.name}/{dtype}/T{T}")
            continue
        ctx.step(desc, impl.name, classes)
        if T not in common:
            common[T] = _common_inputs(shape, ctx)
        inputs = {n: (x.to(DTYPES[dtype]) if n != "g" and torch.is_tensor(x) else x) for n, x in common[T].items()}
        try:
            with torch.no_grad():
                o, ht = impl(inputs)
                if T not in refs:
                    refs[T] = _reference(common[T])
            ro, rh = refs[T]
            pts.append({"T": T, "o": compare(o, ro), "final_state": compare(ht, rh)})
            ctx.done(f"rel L2 o {pts[-1]['o']['rel_l2']:.1e}")
        except Exception as e:
            pts.append({"T": T, "error": error_record(e)})
            ctx.done(f"error {type(e).__name__}")
    ok = [q for q in pts if "error" not in q]
    Ts = [q["T"] for q in ok]
    err_o = [q["o"]["rel_l2"] for q in ok]
    expo = loglog_slope(Ts, err_o)
    return {"id": f"{impl.name}/{dtype}", "impl": impl.name, "dtype": dtype, "T": Ts, "rel_l2_o": err_o,
            "rel_l2_state": [q["final_state"]["rel_l2"] for q in ok],
            "error_ratio_per_doubling": [b / a if a else None for a, b in zip(err_o[:-1], err_o[1:])],
            "growth_exponent": expo,
            "passed": _passed(ok, expo),
            "points": pts}


def run(ctx: Context) -> dict:
    p = ctx.profile
    series, skipped, unsupported = [], [], []
    refs: dict = {}
    common: dict = {}
    ctx.partial.update(series=series, skipped_for_time=skipped, unsupported=unsupported)
    # asked once per implementation: the points differ only in T
    shape = Shape(1, p.stab_T[0], p.stab_H, p.stab_H, p.stab_D, p.stab_D)
    impls = [i for i in ctx.available("gdn") if not ctx.unsupported(i, shape, f"{i.name}/D{p.stab_D}", unsupported)]
    jobs = [(dtype, impl) for dtype in p.stab_dtypes for impl in impls
            if not ctx.unsupported(impl, shape, f"{impl.name}/D{p.stab_D}/{dtype}", unsupported, dtype=dtype)]
    for i, (dtype, impl) in enumerate(jobs):
        with ctx.share(len(jobs) - i):
            series.append(_series(ctx, impl, dtype, refs, common, skipped))
    return {"reference": "float64 token-by-token", "shape": {"B": 1, "H": p.stab_H, "D": p.stab_D},
            "max_growth_exponent": MAX_EXPONENT, "series": series, "skipped_for_time": skipped,
            "unsupported": unsupported}
