"""Correctness: every gated-delta-rule implementation against the float64 token-by-token reference.

For each case of :func:`cases.correctness_cases` and each dtype, the implementation's forward (o, final state) and
backward (gradients of ``(o·dO).sum() + (h_T·dh_T).sum()`` with respect to q, k, v, g, β and the initial state)
are compared with the reference run in float64 on the *same rounded inputs* (so the figure is the kernel's error,
not the input rounding). Per tensor: relative L2 error ``‖x − ref‖ / ‖ref‖``, max absolute error, and the count of
NaN/Inf. A case passes when every tensor is finite and within the dtype's relative-L2 tolerance.

The tolerances bound what a correct chunked kernel reaches at that precision (fla and FlashQLA measure about
3-4e-3 in bf16 on the forward); a bug (a wrong mask, a missing chunk, a stale state) gives errors of order one.
The softmax baseline (SDPA) computes a different function and is not checked here.

Order and budget: a JIT implementation compiles per compile class (signature: dtype, K/V, flags), which costs
tens of seconds on a GPU (linattn's Triton kernels 70-90 s for a first forward + backward on an H200), so every
implementation's units are grouped into *tiers*, one per (dtype, compile class): preferred dtype first (bf16, fp16,
fp32 on a GPU and for fla and FlashQLA; on a CPU linattn keeps the profile's order, fp32 first) and, within a dtype,
the base shape's class first (prefill, the structured inputs and what the implementation does in PyTorch), then T = 1,
varlen, initial state, GVA, K ≠ V, ... The implementations take turns, one tier each per round (:func:`run`), so
each runs its base-shape cases in its first dtype before any runs a second class or dtype: one slow compiler cannot
spend the section before the others start. When the time is short the budget cuts whole classes at the end
(recorded per implementation in ``skipped_for_time``) instead of paying a compile per case.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import chunk_gated_delta_rule
from .cases import DTYPES, correctness_cases, make_inputs
from .context import COMPILED_THIRD_PARTY, SLOW_UNIT_S, Context, error_record, shape_classes

# relative L2 error bounds: forward tensors (o, final state), backward tensors (gradients)
# (fp32 admits TF32 tensor-core products, which Triton uses for fp32 tl.dot by default; the torch backend on a CPU
# measures ~2e-7 forward, bf16 ~2e-3, fp16 ~3e-4)
TOLERANCES = {
    "fp32": {"fwd": 2e-3, "bwd": 5e-3},
    "fp16": {"fwd": 3e-3, "bwd": 1e-2},
    "bf16": {"fwd": 1e-2, "bwd": 4e-2},
}
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")
DTYPE_PREFERENCE = ("bf16", "fp16", "fp32")  # what those kernels are built for first


def compare(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative L2 error, max absolute error and non-finite count of ``x`` against ``ref`` (both any dtype)."""
    x64 = x.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    finite = torch.isfinite(x64)
    nonfinite = int((~finite).sum())
    diff = torch.where(finite, x64 - ref, torch.zeros_like(ref))
    denom = ref.norm().item()
    rel = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    return {"rel_l2": rel if nonfinite == 0 else float("inf"), "max_abs": diff.abs().max().item() if x.numel() else 0.0,
            "ref_max_abs": ref.abs().max().item() if ref.numel() else 0.0, "nonfinite": nonfinite,
            "nan": int(torch.isnan(x64).sum()), "inf": int(torch.isinf(x64).sum())}


def _reference(inputs: dict, grads: bool, do=None, dht=None) -> dict:
    """float64 reference outputs (and gradients) on the float64 values of ``inputs``."""
    x = {n: (t.detach().to(torch.float64).requires_grad_(grads and n in GRAD_NAMES)
             if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in inputs.items()}
    o, ht = chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("initial_state"), output_final_state=True,
        cu_seqlens=x.get("cu_seqlens"), use_qk_l2norm_in_kernel=x["use_qk_l2norm_in_kernel"], A_log=x.get("A_log"),
        dt_bias=x.get("dt_bias"), use_beta_sigmoid_in_kernel=x["use_beta_sigmoid_in_kernel"], backend="reference")
    out = {"o": o.detach(), "final_state": ht.detach()}
    if grads:
        wrt = [n for n in GRAD_NAMES if x.get(n) is not None]
        gs = torch.autograd.grad((o, ht), [x[n] for n in wrt], (do, dht))
        out.update({f"d{n}": gr for n, gr in zip(wrt, gs)})
    return out


def check_case(impl, case, dtype: str, device, seed: int, grads: bool = True) -> dict:
    """One correctness record for ``impl`` on ``case`` in ``dtype``."""
    tol = TOLERANCES[dtype]
    rec = {"id": f"{impl.name}/{case.id}/{dtype}", "impl": impl.name, "case": case.id, "dtype": dtype,
           "shape": vars(case.shape).copy(), "tolerance": tol}
    inputs = make_inputs(case.shape, DTYPES[dtype], device, seed, case=case, requires_grad=grads)
    reason = impl.supports(inputs)
    if reason:
        rec.update(status="unsupported", reason=reason, passed=None)
        return rec
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    try:
        o, ht = impl(inputs)
        do = torch.randn(o.shape, dtype=torch.float64, device=device, generator=gen)
        dht = torch.randn(ht.shape, dtype=torch.float64, device=device, generator=gen) if ht is not None else None
        ref = _reference(inputs, grads, do, dht)
        fwd = {"o": compare(o, ref["o"])}
        if ht is not None:
            fwd["final_state"] = compare(ht, ref["final_state"])
        rec["fwd"] = fwd
        bwd = {}
        if grads:
            wrt = [n for n in GRAD_NAMES if inputs.get(n) is not None and inputs[n].requires_grad]
            outs, gouts = [o], [do.to(o.dtype)]
            if ht is not None:
                outs.append(ht)
                gouts.append(dht.to(ht.dtype))
            gs = torch.autograd.grad(outs, [inputs[n] for n in wrt], gouts, allow_unused=True)
            for n, gr in zip(wrt, gs):
                if gr is None:
                    raise RuntimeError(f"no gradient reached {n}")
                bwd[f"d{n}"] = compare(gr, ref[f"d{n}"])
            rec["bwd"] = bwd
    except Exception as e:
        rec.update(status="error", error=error_record(e), passed=False)
        return rec
    rec["fwd_passed"] = all(m["nonfinite"] == 0 and m["rel_l2"] <= tol["fwd"] for m in fwd.values())
    rec["bwd_passed"] = all(m["nonfinite"] == 0 and m["rel_l2"] <= tol["bwd"] for m in bwd.values()) if grads else None
    rec["passed"] = rec["fwd_passed"] and rec["bwd_passed"] is not False
    rec["status"] = "pass" if rec["passed"] else "fail"
    rec["max_rel_l2_fwd"] = max(m["rel_l2"] for m in fwd.values())
    rec["max_rel_l2_bwd"] = max((m["rel_l2"] for m in bwd.values()), default=None)
    rec["nonfinite"] = sum(m["nonfinite"] for m in list(fwd.values()) + list(bwd.values()))
    return rec


def reproducibility(impl, case, dtype: str, device, seed: int) -> dict:
    """Run one case twice (forward + backward) on identical inputs: bitwise equal, or how far apart."""
    outs = []
    for _ in range(2):
        inputs = make_inputs(case.shape, DTYPES[dtype], device, seed, case=case, requires_grad=True)
        o, ht = impl(inputs)
        gs = torch.autograd.grad(o.float().square().sum(), impl.grad_inputs(inputs))
        outs.append([o.detach(), ht.detach()] + [g.detach() for g in gs])
    bitwise = all(torch.equal(a, b) for a, b in zip(*outs))
    diff = max(((a.double() - b.double()).abs().max().item() for a, b in zip(*outs)), default=0.0)
    return {"impl": impl.name, "case": case.id, "dtype": dtype, "bitwise": bitwise, "max_abs_diff": diff,
            "within_tolerance": diff <= TOLERANCES[dtype]["fwd"]}


def case_classes(impl, case, dtype: str) -> tuple:
    """The compile classes of one correctness unit (forward + backward) of ``impl``."""
    return shape_classes(impl, case.shape, dtype, "fwdbwd", varlen=case.seqlens is not None, h0=case.initial_state,
                         l2norm=case.l2norm, gate=case.gate_in_op, beta_sigmoid=case.beta_sigmoid)


def preferred_dtypes(impl, dtypes, gpu: bool) -> list:
    """``dtypes`` in the order ``impl`` runs them: preferred first (bf16, fp16, fp32) on a GPU, where bf16 is what
    users run, and always for the compiled third parties (their kernels are built for it); linattn on a CPU keeps
    the profile's order (fp32 first: the torch backend's own precision)."""
    if not gpu and impl.name not in COMPILED_THIRD_PARTY:
        return list(dtypes)
    return sorted(dtypes, key=lambda d: DTYPE_PREFERENCE.index(d) if d in DTYPE_PREFERENCE else len(DTYPE_PREFERENCE))


def unit_tiers(impl, cases: list, dtypes, gpu: bool) -> tuple[list, str]:
    """``impl``'s units as *tiers*, in the order it runs them, and that order in words: one tier per (dtype, compile
    class), dtypes in :func:`preferred_dtypes` order and, within a dtype, compile classes in the order the case table
    first needs them, so tier 0 is the base shape's class (prefill and every case on its signature)."""
    tiers, order = [], preferred_dtypes(impl, dtypes, gpu)
    for d in order:
        groups: dict = {}
        for c in cases:
            groups.setdefault(case_classes(impl, c, d), []).append(c)
        tiers += [[(d, c) for c in group] for group in groups.values()]
    return tiers, f"dtypes {', '.join(order)}, cases grouped by compile class"


def _case_unit(ctx: Context, impl, case, dtype: str, records: list, skipped: list,
               slow: Optional[list] = None) -> None:
    """One case: recorded as unsupported, carried (--resume), put in ``slow`` (the second pass, if given and the
    unit is slow: :meth:`Context.defers`), skipped for time, or run."""
    if impl.supports_shape(case.shape, dtype=dtype, varlen=case.seqlens is not None,
                           initial_state=case.initial_state):
        records.append(check_case(impl, case, dtype, ctx.device, ctx.seed))  # its "unsupported" record, nothing run
        return
    if ctx.carry(f"{impl.name}/{case.id}/{dtype}", records):  # check_case's record id
        return
    classes = case_classes(impl, case, dtype)
    if slow is not None and ctx.defers(impl.name, classes):
        slow.append((impl, case, dtype))
        return
    desc = f"correctness {impl.name} {dtype} case {case.id}"
    if not ctx.fits(impl.name, classes, desc):
        skipped.append(f"{impl.name}/{case.id}/{dtype}")
        return
    ctx.step(desc, impl.name, classes)
    records.append(check_case(impl, case, dtype, ctx.device, ctx.seed))
    ctx.done(_result(records[-1]))


def _result(rec: dict) -> str:
    if rec["status"] in ("pass", "fail"):
        bwd = rec.get("max_rel_l2_bwd")
        return (f"{'ok' if rec['passed'] else 'FAIL'} fwd {rec['max_rel_l2_fwd']:.1e}"
                + (f" bwd {bwd:.1e}" if bwd is not None else ""))
    if rec["status"] == "error":
        return f"error {rec['error']['type']}: {rec['error']['message'][:80]}"
    return f"{rec['status']}: {rec.get('reason', '')}"


def run(ctx: Context) -> dict:
    p = ctx.profile
    cases = correctness_cases(p.corr_T, p.corr_H, p.corr_D)
    impls = ctx.available("gdn")
    records, repro, skipped = [], [], []
    ctx.partial.update(records=records, skipped_for_time=skipped, reproducibility=repro)
    tiers, orders = {}, {}
    for impl in impls:
        tiers[impl.name], orders[impl.name] = unit_tiers(impl, cases, p.corr_dtypes, ctx.gpu)
    # round r runs every implementation's tier r: each runs its base-shape cases in its first dtype before any runs a
    # second compile class or dtype, so a slow compiler cannot spend the others' turn; in a round, each has a fair
    # share of what is left (the later ones' shares are not lent to it)
    slow: list = []  # the second pass: units expected to compile for longer than SLOW_UNIT_S, in run order
    for r in range(max(map(len, tiers.values()), default=0)):
        turn = [impl for impl in impls if r < len(tiers[impl.name])]
        for i, impl in enumerate(turn):
            with ctx.share(len(turn) - i):
                for dtype, case in tiers[impl.name][r]:
                    _case_unit(ctx, impl, case, dtype, records, skipped, slow)
    for impl, case, dtype in slow:
        _case_unit(ctx, impl, case, dtype, records, skipped)
    for impl in impls:  # prefill in the implementation's first dtype: tier 0's signature, compiled already
        dtype = tiers[impl.name][0][0][0]
        if impl.supports_shape(cases[0].shape, dtype=dtype):  # its records say why
            continue
        classes = case_classes(impl, cases[0], dtype)
        desc = f"correctness {impl.name} {dtype} reproducibility"
        if ctx.carry(f"reproducibility/{impl.name}", repro):
            continue
        if ctx.fits(impl.name, classes, desc):
            ctx.step(desc, impl.name, classes)
            try:
                repro.append(reproducibility(impl, cases[0], dtype, ctx.device, ctx.seed))
                ctx.done("bitwise" if repro[-1]["bitwise"] else f"max diff {repro[-1]['max_abs_diff']:.1e}")
            except Exception as e:
                repro.append({"impl": impl.name, "error": error_record(e)})
                ctx.done(f"error {type(e).__name__}")
    summary = {}
    for impl in impls:
        mine = [r for r in records if r["impl"] == impl.name and r.get("passed") is not None]
        summary[impl.name] = {
            "cases": len(mine), "passed": sum(bool(r["passed"]) for r in mine),
            "failed": [r["id"] for r in mine if not r["passed"]],
            "unsupported": [r["id"] for r in records if r["impl"] == impl.name and r["status"] == "unsupported"],
            "skipped_for_time": [s for s in skipped if s.split("/", 1)[0] == impl.name],
            "order": orders[impl.name],
            "worst_rel_l2_fwd": {d: max((r["max_rel_l2_fwd"] for r in mine if r["dtype"] == d
                                         and "max_rel_l2_fwd" in r), default=None) for d in p.corr_dtypes},
            "worst_rel_l2_bwd": {d: max((r["max_rel_l2_bwd"] for r in mine if r["dtype"] == d
                                         and r.get("max_rel_l2_bwd") is not None), default=None)
                                 for d in p.corr_dtypes}}
    not_checked = [{"impl": i.name, "reason": "softmax baseline: a different function, timed only"}
                   for i in ctx.available("softmax")]
    return {"reference": "float64 token-by-token (linattn.ops.gated_delta.reference)", "tolerances": TOLERANCES,
            "order": "round-robin over the implementations, one tier (dtype and compile class) each per round; "
                     f"units expected to take over {SLOW_UNIT_S:g} s (new compiles) after all the others",
            "cases": [c.id for c in cases], "dtypes": list(p.corr_dtypes), "records": records, "summary": summary,
            "reproducibility": repro, "not_checked": not_checked, "skipped_for_time": skipped}
