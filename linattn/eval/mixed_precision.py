"""Mixed precision: fp16 training steps under ``torch.autocast`` with a ``torch.amp.GradScaler`` over the op.

A one-layer GDN block (linear projections to q, k, v, gate and β, the op, an output projection) is trained on a
fixed random regression target, once in fp16 autocast with a GradScaler and once in fp32 from the same weights.
Reported: how many steps overflowed (the scaler found Inf/NaN gradients, skipped the step and lowered the scale;
a few at the start are normal while the scale comes down from 2^16), the scale history, both loss curves, and the
relative gap between the final fp16 and fp32 losses. Fails when any step's loss is non-finite, when more than half
of the steps overflow, or when no step at all was taken.
"""
from __future__ import annotations

import copy

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


def run(ctx: Context) -> dict:
    p = ctx.profile
    records = []
    ctx.partial.update(records=records)
    for impl in ctx.available("gdn"):
        classes = shape_classes(impl, p.amp_shape, "fp16", "fwdbwd", l2norm=True) + shape_classes(
            impl, p.amp_shape, "fp32", "fwdbwd", l2norm=True)
        desc = f"mixed precision {impl.name}"
        if not ctx.fits(impl.name, classes, desc):
            records.append({"id": impl.name, "impl": impl.name, "skipped": "time budget"})
            continue
        ctx.step(desc, impl.name, classes)
        rec = {"id": impl.name, "impl": impl.name, "steps": p.amp_steps}
        try:
            s = p.amp_shape
            torch.manual_seed(ctx.seed)
            d_model = 2 * s.HV * s.V
            base = GDNBlock(impl, d_model, s.H, s.HV, s.K, s.V).to(ctx.device)
            fp16 = _train(copy.deepcopy(base), ctx, True, d_model)
            fp32 = _train(copy.deepcopy(base), ctx, False, d_model)
        except Exception as e:
            rec.update(error=error_record(e), passed=False)
            records.append(rec)
            ctx.done(f"error {type(e).__name__}")
            continue
        n_over = len(fp16["overflow_steps"])
        finite = all(torch.isfinite(torch.tensor(fp16["losses"])).tolist())
        rec.update(
            overflow_steps=n_over, overflow_step_indices=fp16["overflow_steps"], final_scale=fp16["scales"][-1],
            loss_fp16=fp16["losses"], loss_fp32=fp32["losses"], scale_history=fp16["scales"],
            op_output_dtype=fp16["out_dtype"], final_loss_fp16=fp16["losses"][-1], final_loss_fp32=fp32["losses"][-1],
            final_loss_rel_gap=abs(fp16["losses"][-1] - fp32["losses"][-1]) / max(abs(fp32["losses"][-1]), 1e-12),
            loss_decreased=fp16["losses"][-1] < fp16["losses"][0], all_losses_finite=finite,
            passed=finite and n_over <= p.amp_steps // 2 and n_over < p.amp_steps)
        records.append(rec)
        ctx.done(f"{'ok' if rec['passed'] else 'FAIL'}: {n_over}/{p.amp_steps} overflow steps, final loss fp16 "
                 f"{rec['final_loss_fp16']:.3g} vs fp32 {rec['final_loss_fp32']:.3g}")
    return {"autocast_dtype": "fp16", "scaler": "torch.amp.GradScaler(init_scale=2**16)", "device": ctx.device.type,
            "shape": vars(p.amp_shape).copy(), "records": records}
