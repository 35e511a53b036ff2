"""Robustness: abnormal inputs. Every call runs in a worker thread with a timeout, so a hang is reported, not
suffered; an exception is recorded with its type and message.

Finite abnormal inputs (every token identical, values of 1e4, g = 0 and g = −100, β = 0 and β = 1, a random
quarter of the tokens zeroed) must give finite outputs that match the float64 reference within the correctness
tolerance of the dtype.

A NaN planted in one token must stay inside the set of outputs that token feeds (its *cone*), and must not crash:

* in q at (b, t, head h): only o[b, t] of the value heads that read head h;
* in k at (b, t, h): o[b, t'] for t' ≥ t in the same sequence, value heads reading h, and their final states;
* in v, g or β at (b, t, value head h): o[b, t' ≥ t] of head h in the same sequence, and that final state.

The timeout is ``rob_timeout_s`` (plus the first-call estimate when the call needs a new compile), cut to what is
left of the time budget: a call stopped by that cut is recorded as skipped for time, not as a hang, and the
implementation's remaining cases are skipped (its call may still be running in the worker thread).

Non-finite outputs outside the cone are counted separately as *other heads / sequences* and *earlier tokens*:
a chunked kernel that multiplies a NaN by a masked zero (NaN · 0 = NaN) leaks it into the earlier tokens of the
same chunk, and a packed (varlen) kernel must never leak it into the next sequence.
"""
from __future__ import annotations

from typing import Optional

import torch

from .cases import DTYPES, Case, make_inputs
from .context import Context, error_record, shape_classes
from .correctness import TOLERANCES, _reference, compare, preferred_dtypes

FINITE_CASES = ("identical-tokens", "huge-1e4", "g-zero", "g-minus-100", "beta-zero", "beta-one", "zeroed-tokens")
CHUNK = 64  # the chunk of the chunked kernels: where a masked-product NaN leak can reach (leak_before_chunk)
NAN_CASES = ("nan-q", "nan-k", "nan-v", "nan-g", "nan-beta", "nan-varlen-v")


def case_shape(name: str, shape):
    """The shape robustness case ``name`` runs: the packed (varlen) case holds two sequences of ``shape.T``."""
    return shape.with_(B=1, T=2 * shape.T) if name == "nan-varlen-v" else shape


def build_inputs(name: str, shape, dtype: str, device, seed: int) -> tuple[dict, dict]:
    """Inputs for robustness case ``name`` and where a NaN was planted (empty for the finite cases)."""
    varlen = name == "nan-varlen-v"
    case = None
    shape = case_shape(name, shape)
    if varlen:
        case = Case(name, shape, seqlens=(shape.T // 2, shape.T - shape.T // 2))
    elif name == "identical-tokens":
        case = Case(name, shape, structure="repeated_token")
    elif name == "huge-1e4":
        case = Case(name, shape, l2norm=True)  # trained models normalise q, k; v carries the magnitude
    x = make_inputs(shape, DTYPES[dtype], device, seed, case=case)
    with torch.no_grad():
        if name == "huge-1e4":
            for n in ("q", "k", "v"):
                x[n] = x[n] * 1e4
        elif name == "g-zero":
            x["g"] = torch.zeros_like(x["g"])
        elif name == "g-minus-100":
            x["g"] = torch.full_like(x["g"], -100.0)
        elif name == "beta-zero":
            x["beta"] = torch.zeros_like(x["beta"])
        elif name == "beta-one":
            x["beta"] = torch.ones_like(x["beta"])
        elif name == "zeroed-tokens":
            gen = torch.Generator(device=device).manual_seed(seed + 7)
            keep = (torch.rand(shape.B, shape.T, 1, 1, device=device, generator=gen) > 0.25)
            for n in ("q", "k", "v"):
                x[n] = x[n] * keep.to(x[n].dtype)
    plant = {}
    if name.startswith("nan-"):
        tensor = "v" if varlen else name.split("-")[1]
        # inside the first sequence, past the start of a chunk, so earlier tokens of the same chunk exist
        t0 = shape.T // 4 + 1 if varlen else shape.T // 2 + 1
        plant = {"tensor": tensor, "b": 0, "t": t0, "head": 0}
        x[tensor] = x[tensor].clone()
        with torch.no_grad():
            x[tensor][0, t0, 0] = float("nan")
    return x, plant


def cone(inputs: dict, plant: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean masks of the outputs a planted NaN may reach: o ``[B, T, HV]`` and final state ``[N, HV]``."""
    B, T, H = inputs["q"].shape[:3]
    HV = inputs["v"].shape[2]
    rep = HV // H
    cu = inputs.get("cu_seqlens")
    offs = cu.tolist() if cu is not None else [0, T]
    N = len(offs) - 1 if cu is not None else B
    b, t, h = plant["b"], plant["t"], plant["head"]
    heads = list(range(h * rep, (h + 1) * rep)) if plant["tensor"] in ("q", "k") else [h]
    seq = next(i for i in range(len(offs) - 1) if offs[i] <= t < offs[i + 1]) if cu is not None else 0
    eos = offs[seq + 1]
    o_mask = torch.zeros(B, T, HV, dtype=torch.bool)
    h_mask = torch.zeros(N, HV, dtype=torch.bool)
    for hv in heads:
        if plant["tensor"] == "q":
            o_mask[b, t, hv] = True
        else:
            o_mask[b, t:eos, hv] = True
            h_mask[seq if cu is not None else b, hv] = True
    return o_mask, h_mask


def check_confinement(o: torch.Tensor, ht, inputs: dict, plant: dict) -> dict:
    o_mask, h_mask = cone(inputs, plant)
    bad = ~torch.isfinite(o.detach()).all(-1).cpu()  # [B, T, HV]: any non-finite entry in the head's output
    outside = bad & ~o_mask
    # outside the cone: split into tokens before the NaN in the cone's own heads/sequence, and everything else
    b, t = plant["b"], plant["t"]
    heads_in_cone = o_mask.any(1)  # [B, HV]
    earlier = torch.zeros_like(outside)
    earlier[b, :t] = outside[b, :t] & heads_in_cone[b][None, :]
    # the 64-token chunk holding t, counted from the start of t's sequence (chunked kernels restart per sequence)
    cu = inputs.get("cu_seqlens")
    bos = max((s for s in (cu.tolist() if cu is not None else [0]) if s <= t), default=0)
    chunk_start = bos + (t - bos) // CHUNK * CHUNK
    rec = {"cone_tokens": int(o_mask.sum()), "nonfinite_in_cone": int((bad & o_mask).sum()),
           "nonfinite_outside_cone": int(outside.sum()), "leak_earlier_tokens": int(earlier.sum()),
           "leak_before_chunk": int(earlier[b, :chunk_start].sum()),
           "leak_other_heads_or_sequences": int((outside & ~earlier).sum())}
    if ht is not None:
        hbad = ~torch.isfinite(ht.detach()).flatten(2).all(-1).cpu()
        rec["state_nonfinite_outside_cone"] = int((hbad & ~h_mask).sum())
    rec["confined"] = rec["nonfinite_outside_cone"] == 0 and rec.get("state_nonfinite_outside_cone", 0) == 0
    return rec


def case_classes(impl, name: str, dtype: str, shape) -> tuple:
    return shape_classes(impl, case_shape(name, shape), dtype, "fwd", varlen=name == "nan-varlen-v",
                         l2norm=name == "huge-1e4")


def check(impl, name: str, dtype: str, ctx: Context) -> dict:
    p = ctx.profile
    inputs, plant = build_inputs(name, p.rob_shape, dtype, ctx.device, ctx.seed)
    rec = {"id": f"{impl.name}/{name}/{dtype}", "impl": impl.name, "case": name, "dtype": dtype}
    reason = impl.supports(inputs)
    if reason:
        rec.update(status="unsupported", reason=reason, passed=None)
        return rec

    def call():
        with torch.no_grad():
            o, ht = impl(inputs)
            ctx.sync()
            return o, ht

    status, result, stopped = ctx.call_with_timeout(call, impl.name, case_classes(impl, name, dtype, p.rob_shape),
                                                    p.rob_timeout_s)
    if stopped:
        rec.update(stopped)
        return rec
    if status == "error":
        rec.update(status="error", error=error_record(result), passed=False)
        return rec
    o, ht = result
    rec["o_nan"] = int(torch.isnan(o).sum())
    rec["o_inf"] = int(torch.isinf(o).sum())
    rec["state_nonfinite"] = int((~torch.isfinite(ht)).sum()) if ht is not None else None
    if plant:
        rec["planted"] = plant
        rec.update(check_confinement(o, ht, inputs, plant))
        rec["passed"] = rec["confined"]
    else:
        ref = _reference(inputs, grads=False)
        err = compare(o, ref["o"])
        rec["rel_l2"] = err["rel_l2"]
        rec["reference_finite"] = bool(torch.isfinite(ref["o"]).all())
        rec["passed"] = (rec["o_nan"] + rec["o_inf"] == 0 and not rec["state_nonfinite"]
                         and err["rel_l2"] <= TOLERANCES[dtype]["fwd"])
    rec["status"] = "pass" if rec["passed"] else "fail"
    return rec


def _result(rec: dict) -> str:
    if rec["status"] in ("error", "hang", "skipped", "unsupported"):
        return f"{rec['status']}" + (f": {rec['error']['type']}" if "error" in rec else
                                     f": {rec['reason']}" if rec.get("reason") else "")
    if "confined" in rec:
        return ("ok: NaN confined" if rec["confined"] else
                f"FAIL: NaN leaked to {rec['nonfinite_outside_cone']} tokens outside its cone")
    return f"{'ok' if rec['passed'] else 'FAIL'} rel L2 {rec['rel_l2']:.1e}"


def same_error_everywhere(records: list) -> Optional[str]:
    """"Type: message" when every case that ran raised one identical error, else None. Benign inputs (identical
    tokens, g = 0, β = 1) raise nothing in a working implementation, so one error on every case says the harness or
    the installation is broken, not that the implementation rejects abnormal inputs: the report flags it."""
    ran = [r for r in records if r["status"] not in ("skipped", "unsupported")]
    errors = {(r["error"]["type"], r["error"]["message"]) for r in ran if r["status"] == "error"}
    if len(ran) < 2 or len(errors) != 1 or any(r["status"] != "error" for r in ran):
        return None
    return "{}: {}".format(*errors.pop())


def run(ctx: Context) -> dict:
    p = ctx.profile
    records, skipped = [], []
    ctx.partial.update(records=records, skipped_for_time=skipped)
    impls = ctx.available("gdn")
    for i, impl in enumerate(impls):
        with ctx.share(len(impls) - i):
            cut, hung = False, None
            for dtype in preferred_dtypes(impl, p.corr_dtypes, ctx.gpu):
                for name in FINITE_CASES + NAN_CASES:
                    if impl.supports_shape(case_shape(name, p.rob_shape), dtype=dtype,
                                           varlen=name == "nan-varlen-v"):
                        records.append(check(impl, name, dtype, ctx))  # its "unsupported" record, nothing run
                        continue
                    if ctx.carry(f"{impl.name}/{name}/{dtype}", records):  # check()'s record id
                        continue
                    if hung:
                        # the hung call still runs in its abandoned thread and may hold the GPU: every later call
                        # would queue behind it and time out too, spending the budget to report nothing
                        records.append({"id": f"{impl.name}/{name}/{dtype}", "impl": impl.name, "case": name,
                                        "dtype": dtype, "status": "skipped", "passed": None,
                                        "reason": f"not run: case {hung} of this implementation hung"})
                        continue
                    classes = case_classes(impl, name, dtype, p.rob_shape)
                    desc = f"robustness {impl.name} {name} {dtype}"
                    if cut or not ctx.fits(impl.name, classes, desc):
                        skipped.append(f"{impl.name}/{name}/{dtype}")
                        continue
                    ctx.step(desc, impl.name, classes)
                    rec = check(impl, name, dtype, ctx)
                    records.append(rec)
                    cut = rec["status"] == "skipped"
                    hung = f"{name}/{dtype}" if rec["status"] == "hang" else None
                    ctx.done(_result(rec))
    summary = {}
    for impl in ctx.available("gdn"):
        mine = [r for r in records if r["impl"] == impl.name]
        summary[impl.name] = {
            "cases": sum(r["passed"] is not None for r in mine), "passed": sum(bool(r["passed"]) for r in mine),
            "errors": sum(r["status"] == "error" for r in mine), "hangs": sum(r["status"] == "hang" for r in mine),
            "nan_leaks": sum(r.get("confined") is False for r in mine),
            "nan_leaks_across_heads_or_sequences": sum(bool(r.get("leak_other_heads_or_sequences")) for r in mine),
            "same_error_every_case": same_error_everywhere(mine)}
        if summary[impl.name]["same_error_every_case"]:
            ctx.emit(f"robustness {impl.name}: every case raised {summary[impl.name]['same_error_every_case']}; "
                     "suspect the harness or the installation, not the inputs")
    return {"shape": vars(p.rob_shape).copy(), "timeout_s": p.rob_timeout_s, "records": records, "summary": summary,
            "not_checked": [{"impl": i.name, "reason": "softmax baseline"} for i in ctx.available("softmax")],
            "skipped_for_time": skipped}
