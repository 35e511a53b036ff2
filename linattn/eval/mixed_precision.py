"""Mixed precision: fp16 training steps under ``torch.autocast`` with a ``torch.amp.GradScaler`` over the op.

A one-layer GDN block (linear projections to q, k, v, gate and β, the op, an output projection) is trained on a
fixed random regression target, once in fp16 autocast with a GradScaler and once in fp32 from the same weights.
Reported: how many steps overflowed (the scaler found Inf/NaN gradients, skipped the step and lowered the scale;
a few at the start are normal while the scale comes down from 2^16), the scale history, both loss curves, and the
relative gap between the final fp16 and fp32 losses. Fails when any step's loss is non-finite, when more than half
of the steps overflow, or when no step at all was taken.

Each training run (the fp16 one, then the fp32 reference) is a unit of work in a worker thread, bounded as
robustness's calls are (:meth:`Context.call_with_timeout`): a JIT implementation's first fp16 forward + backward
autotunes for minutes on a GPU, and a call that never returns must not take the section (and the run's outer
``timeout``) with it. A run stopped by the budget's cut is ``skipped``, one stopped by the profile's
``amp_timeout_s`` (beyond its compile estimate) is ``hang``; the implementation's later run is then not started.
Without the fp32 reference the record has no loss gap, and ``fp32_reference`` says why.
"""
from __future__ import annotations

import copy
import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .context import Context, error_record, shape_classes


class GDNBlock(nn.Module):
    def __init__(self, impl, d_model: int, H: int, HV: int, K: int, V: int):
        super().__init__()
        self.impl, self.H, self.HV, self.K, self.V = impl, H, HV, K, V
        self.qk = nn.Linear(d_model, 2 * H * K, bias=False)
        self.v = nn.Linear(d_model, HV * V, bias=False)
        self.gb = nn.Linear(d_model, 2 * HV)
        self.o = nn.Linear(HV * V, d_model, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k = self.qk(x).view(B, T, 2, self.H, self.K).unbind(2)
        v = self.v(x).view(B, T, self.HV, self.V)
        g_logit, b_logit = self.gb(x).float().chunk(2, -1)
        g = F.logsigmoid(g_logit) / 16  # gates stay fp32, as the op's API recommends
        beta = b_logit.sigmoid().to(v.dtype)
        o, _ = self.impl({"q": q, "k": k, "v": v, "g": g, "beta": beta, "use_qk_l2norm_in_kernel": True,
                          "use_beta_sigmoid_in_kernel": False})
        return self.o(o.reshape(B, T, -1))


def _train(model, ctx: Context, amp: bool, d_model: int) -> dict:
    p = ctx.profile
    s = p.amp_shape
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.seed + 1)
    x = torch.randn(s.B, s.T, d_model, device=ctx.device, generator=gen)
    y = torch.randn(s.B, s.T, d_model, device=ctx.device, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dev = ctx.device.type
    scaler = torch.amp.GradScaler(dev, enabled=amp)
    losses, scales, overflow_steps = [], [], []
    op_dtype = None
    for step in range(p.amp_steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.float16, enabled=amp):
            out = model(x)
            op_dtype = op_dtype or str(out.dtype).replace("torch.", "")
            loss = F.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale() if amp else 1.0
        scaler.step(opt)
        scaler.update()
        if amp and scaler.get_scale() < before:
            overflow_steps.append(step)
        losses.append(loss.item())
        scales.append(scaler.get_scale() if amp else None)
    return {"losses": losses, "scales": scales, "overflow_steps": overflow_steps, "out_dtype": op_dtype}


def _unit(ctx: Context, impl, dtype: str, train) -> tuple[Optional[dict], dict]:
    """One training run (``train``: fp16 autocast or the fp32 reference) as a unit of work, in a worker thread
    bounded like robustness's calls: (its history, {}), or (None, the record fields that say why there is none)."""
    p = ctx.profile
    classes = shape_classes(impl, p.amp_shape, dtype, "fwdbwd", l2norm=True)
    desc = f"mixed precision {impl.name} {dtype}"
    if not ctx.fits(impl.name, classes, desc):
        return None, {"status": "skipped", "skipped": "time budget", "passed": None, "reason": "time budget"}
    ctx.step(desc, impl.name, classes)
    status, result, stopped = ctx.call_with_timeout(train, impl.name, classes, p.amp_timeout_s)
    if status == "error":
        stopped = {"status": "error", "error": error_record(result), "passed": False}
    if stopped:
        ctx.done(stopped["status"] + (f" {stopped['error']['type']}" if "error" in stopped else
                                      f": {stopped['reason']}" if "reason" in stopped else ""))
        return None, stopped
    ctx.done(f"{len(result['overflow_steps'])}/{p.amp_steps} overflow steps, final loss {result['losses'][-1]:.3g}")
    return result, {}


def _verdict(fp16: dict, fp32: Optional[dict], steps: int) -> dict:
    """The record's numbers: the fp16 run decides; the fp32 reference, when it ran, gives the final-loss gap."""
    n_over = len(fp16["overflow_steps"])
    finite = all(torch.isfinite(torch.tensor(fp16["losses"])).tolist())
    passed = finite and n_over <= steps // 2 and n_over < steps
    last32 = fp32["losses"][-1] if fp32 else None
    return dict(
        status="pass" if passed else "fail", passed=passed, overflow_steps=n_over,
        overflow_step_indices=fp16["overflow_steps"], final_scale=fp16["scales"][-1], loss_fp16=fp16["losses"],
        loss_fp32=fp32["losses"] if fp32 else None, scale_history=fp16["scales"], op_output_dtype=fp16["out_dtype"],
        final_loss_fp16=fp16["losses"][-1], final_loss_fp32=last32,
        final_loss_rel_gap=None if fp32 is None else abs(fp16["losses"][-1] - last32) / max(abs(last32), 1e-12),
        loss_decreased=fp16["losses"][-1] < fp16["losses"][0], all_losses_finite=finite)


def run(ctx: Context) -> dict:
    """Per implementation two units, the fp16 run then the fp32 reference; a unit that is refused, raises or is
    stopped (budget or hang limit) ends the implementation's units: a stopped call may still be running."""
    p = ctx.profile
    s = p.amp_shape
    d_model = 2 * s.HV * s.V
    records = []
    ctx.partial.update(records=records)
    for impl in ctx.available("gdn"):
        if ctx.unsupported(impl, s, impl.name, records, dtype="fp16") or ctx.carry(impl.name, records):
            continue
        rec = {"id": impl.name, "impl": impl.name, "steps": p.amp_steps}
        records.append(rec)
        torch.manual_seed(ctx.seed)
        base = GDNBlock(impl, d_model, s.H, s.HV, s.K, s.V).to(ctx.device)
        # each run trains its own copy, made here: an abandoned worker thread keeps only what it was given
        fp16, why = _unit(ctx, impl, "fp16", functools.partial(_train, copy.deepcopy(base), ctx, True, d_model))
        if fp16 is None:
            rec.update(why)
            continue
        no_fp32 = impl.supports_shape(s, dtype="fp32")  # FlashQLA: bf16 / fp16 only, no fp32 reference run
        if no_fp32:
            fp32, why = None, {"status": "unsupported", "reason": no_fp32}
        else:
            fp32, why = _unit(ctx, impl, "fp32",
                              functools.partial(_train, copy.deepcopy(base), ctx, False, d_model))
        rec.update(_verdict(fp16, fp32, p.amp_steps))
        if why:
            rec["fp32_reference"] = why
    return {"autocast_dtype": "fp16", "scaler": "torch.amp.GradScaler(init_scale=2**16)", "device": ctx.device.type,
            "shape": vars(p.amp_shape).copy(), "timeout_s": p.amp_timeout_s, "records": records}
