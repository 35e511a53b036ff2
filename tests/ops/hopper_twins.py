"""The Hopper forward's host side on the CPU: its kernels replaced by their PyTorch twins (``prepass_hopper_ref``,
``chunk_fwd_hopper_hm_ref``), the Triton plan and scan under the interpreter, and plans made by hand."""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from linattn.ops.hopper import chunk_fwd_ref as twins
from linattn.ops.hopper import forward as hopper_fwd
from linattn.ops.hopper.plan import DEFAULT, HopperPlan, HopperPlanConfig
from linattn.ops.hopper.prepass import prepass_hopper_ref


def use_twins(monkeypatch, walk: Optional[Callable] = None, a_inv_dtype: torch.dtype = torch.float32) -> None:
    """forward.py's pre-pass and walk replaced by their twins (``walk``: a stand-in for the walk's twin), A_inv
    kept in ``a_inv_dtype`` (fp32: the host side's arithmetic, not the kernel's rounding, is under test)."""
    monkeypatch.setattr(hopper_fwd, "prepass_hopper", functools.partial(prepass_hopper_ref, a_inv_dtype=a_inv_dtype))
    monkeypatch.setattr(hopper_fwd, "chunk_fwd_hopper_hm", walk or twins.chunk_fwd_hopper_hm_ref)


def hand_plan(segments: int = 1, planned_walk: bool = False, BV: int = 16, config: HopperPlanConfig = DEFAULT,
              padded_rows: Optional[int] = None) -> HopperPlan:
    """A plan as ``plan.plan`` makes them, for shapes too small to fill a card."""
    launch = (("BV", BV), ("threads", config.threads), ("num_stages", config.num_stages))
    return HopperPlan(launch, segments, planned_walk, padded_rows, config, "by hand")


def run(plan: HopperPlan, x: dict, scale: float = 0.25, with_h0: bool = True, dtype=torch.float32):
    """forward_hopper under ``plan`` on ``x``'s inputs in ``dtype`` (and its initial state, ``with_h0``)."""
    args = [x[n].to(dtype) for n in ("q", "k", "v", "g", "beta")]
    h0 = x["initial_state"].float() if with_h0 else None
    return hopper_fwd.forward_hopper(plan, *args, scale, h0)


def reference(x: dict, scale: float = 0.25, with_h0: bool = True):
    """The float64 recurrence on ``x``."""
    from linattn.ops.gated_delta.reference import gated_delta_rule_reference
    exact = {n: t.double() for n, t in x.items()}
    if not with_h0:
        exact["initial_state"] = None
    return gated_delta_rule_reference(**exact, scale=scale)
