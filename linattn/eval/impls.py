"""The implementations ``linattn eval`` compares, behind one calling convention.

Every implementation is called as ``impl(inputs) -> (o, final_state)`` with the dict :func:`cases.make_inputs`
builds (linattn's keyword arguments). Options an implementation lacks natively (the in-op gate, β sigmoid, q/k L2
norm) are applied in plain PyTorch before the call, so every implementation computes the same function; a feature
it cannot do at all (varlen for SDPA) is reported as unsupported, not faked.

Names: ``linattn`` (the default backend for the device: triton on CUDA, torch on CPU), ``linattn-torch``,
``linattn-triton``, ``fla``, ``flashqla`` (both need CUDA) and ``sdpa`` (PyTorch causal softmax attention: a
speed and memory baseline, not a gated-delta-rule implementation, so it takes no part in the accuracy checks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..ops.utils import gate_from_raw, l2norm, triton_available, triton_interpret
from .cases import DTYPES

DEFAULT_IMPLS = ("linattn", "fla", "flashqla", "sdpa")
KNOWN_IMPLS = ("linattn", "linattn-torch", "linattn-triton", "fla", "flashqla", "sdpa")


@dataclass
class Impl:
    name: str
    kind: str  # "gdn" (gated delta rule: checked for accuracy) or "softmax" (baseline: time and memory only)
    fn: Optional[Callable] = None
    available: bool = True
    reason: str = ""  # why it is unavailable
    native: set = field(default_factory=set)  # options it handles itself: l2norm, gate, beta_sigmoid, varlen, h0
    version: Optional[str] = None
    limits: Optional[Callable[[dict], Optional[str]]] = None  # what else it cannot run: inputs -> the reason
    # whether its chunked op's JIT kernels compile a variant for T == 1 and T % 16 == 0 (Triton's default for int
    # arguments); linattn's do not (tests/ops/test_no_length_specialisation.py). Decode kernels are assumed to.
    length_specialised: bool = True
    # kernel sets it picks from the shape beyond the flags of context.shape_classes: shape -> extra flags (each a
    # separate compile); FlashQLA's intra-card sequence parallelism (:func:`_flashqla_modes`)
    modes: Optional[Callable] = None

    def __call__(self, inputs: dict):
        return self.fn(_adapt(inputs, self.native))

    def supports(self, inputs: dict) -> Optional[str]:
        """None if it can run these inputs, else the reason it cannot."""
        if inputs.get("cu_seqlens") is not None and "varlen" not in self.native:
            return f"{self.name} has no varlen (cu_seqlens) support"
        if inputs.get("initial_state") is not None and "h0" not in self.native:
            return f"{self.name} takes no initial state"
        return self.limits(inputs) if self.limits is not None else None

    def supports_shape(self, shape, *, dtype: str = "bf16", varlen: bool = False,
                       initial_state: bool = False) -> Optional[str]:
        """:meth:`supports` for a call on ``shape`` (``q, k: [B, T, H, K]``, ``v: [B, T, HV, V]``) with those
        options, asked before any input exists (placeholders on the meta device: nothing is allocated), so a section
        records an unsupported unit as such instead of budgeting, running or timing it."""
        B, T = shape.B, shape.T
        meta = {"device": "meta", "dtype": DTYPES[dtype]}
        qk = torch.empty(B, T, shape.H, shape.K, **meta)
        return self.supports({"q": qk, "k": qk, "v": torch.empty(B, T, shape.HV, shape.V, **meta),
                              "cu_seqlens": torch.empty(2, **meta) if varlen else None,
                              "initial_state": torch.empty(B, shape.HV, shape.K, shape.V, **meta)
                              if initial_state else None})

    def grad_inputs(self, inputs: dict) -> list:
        names = ("q", "k", "v") if self.kind == "softmax" else ("q", "k", "v", "g", "beta", "initial_state")
        return [inputs[n] for n in names if inputs.get(n) is not None and inputs[n].requires_grad]


def _adapt(inputs: dict, native: set) -> dict:
    """Apply in PyTorch the pre-processing an implementation does not do itself (same math as linattn's)."""
    x = dict(inputs)
    if x.get("use_qk_l2norm_in_kernel") and "l2norm" not in native:
        x["q"], x["k"] = l2norm(x["q"]), l2norm(x["k"])
        x["use_qk_l2norm_in_kernel"] = False
    if x.get("A_log") is not None and "gate" not in native:
        x["g"] = gate_from_raw(x["g"], x.pop("A_log"), x.pop("dt_bias"))
    if x.get("use_beta_sigmoid_in_kernel") and "beta_sigmoid" not in native:
        x["beta"] = x["beta"].sigmoid()
        x["use_beta_sigmoid_in_kernel"] = False
    return x


def _scale(x: dict) -> float:
    return x["scale"] if x.get("scale") is not None else x["q"].shape[-1] ** -0.5


def _linattn(backend: Optional[str]) -> Callable:
    from .. import chunk_gated_delta_rule

    def call(x):
        return chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x.get("scale"), initial_state=x.get("initial_state"),
            output_final_state=True, cu_seqlens=x.get("cu_seqlens"),
            use_qk_l2norm_in_kernel=x.get("use_qk_l2norm_in_kernel", False), A_log=x.get("A_log"),
            dt_bias=x.get("dt_bias"), use_beta_sigmoid_in_kernel=x.get("use_beta_sigmoid_in_kernel", False),
            backend=backend)
    return call


def _fla() -> Callable:
    import os

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    os.environ.setdefault("FLA_FLASH_QLA", "0")  # time fla's own kernels, not its FlashQLA dispatch

    def call(x):
        kw = dict(scale=_scale(x), output_final_state=True,
                  use_qk_l2norm_in_kernel=x.get("use_qk_l2norm_in_kernel", False))
        if x.get("initial_state") is not None:
            kw["initial_state"] = x["initial_state"]
        if x.get("cu_seqlens") is not None:
            kw["cu_seqlens"] = x["cu_seqlens"].long()
        return fla_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    return call


def _flashqla() -> Callable:
    import flash_qla

    def call(x):
        kw = dict(scale=_scale(x), output_final_state=True)
        if x.get("initial_state") is not None:
            kw["initial_state"] = x["initial_state"]
        if x.get("cu_seqlens") is not None:
            kw["cu_seqlens"] = x["cu_seqlens"]
        return flash_qla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    return call


def _flashqla_modes(shape) -> tuple:
    """FlashQLA 0.1.3 runs a batch of one sequence (its ``k.shape[0] == 1``) long enough to split with its own
    intra-card sequence parallelism, a kernel set of its own (warm-up chunks, initial-state correction) compiled on
    first use: on an H200, B=1 T=32768 compiles for 67 s (forward) after T=4096 has compiled, and T=131072 then
    hits the cache. Its choice comes from a calibrated model; the proxy here is its fallback heuristic's 128-chunk
    threshold, which matches those three shapes."""
    return ("intra_cp",) if shape.B == 1 and -(-shape.T // 64) >= 128 else ()


def _flashqla_limits(x: dict) -> Optional[str]:
    """FlashQLA's Hopper kernels take head dim 128 only: what we observed, flash-qla 0.1.3 raised AssertionError for
    K = V = 64 (the full GPU profile's stability shape) on an H200. And bf16 or fp16 inputs only: its entry point
    asserts so ("FlashQLA only supports bfloat16 and float16.", flash-qla 0.1.3), which the eval used to learn only
    after budgeting a compile for every fp32 unit and skipping them "for time" (runs 13–15)."""
    K, V = x["q"].shape[-1], x["v"].shape[-1]
    if K != 128 or V != 128:
        return f"flashqla needs K = V = 128, got K = {K}, V = {V} (AssertionError for K = V = 64 on flash-qla 0.1.3)"
    if x["q"].dtype not in (torch.bfloat16, torch.float16):
        return f"flashqla takes bf16 or fp16 inputs, got {str(x['q'].dtype).removeprefix('torch.')} (flash-qla 0.1.3)"
    return None


def _sdpa(x):
    """Causal softmax attention over the same q, k, v (query/key heads repeated for grouped value heads)."""
    q, k, v = x["q"], x["k"], x["v"]
    rep = v.shape[2] // q.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       scale=x.get("scale"))
    return o.transpose(1, 2), None


def _version(module: str) -> Optional[str]:
    from importlib import metadata
    for dist in {"fla": ("flash-linear-attention", "fla-core"), "flash_qla": ("flash-qla", "flash_qla")}[module]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def build(name: str, device: torch.device) -> Impl:
    """The implementation ``name`` for ``device``, or an unavailable one that says why."""
    cuda = device.type == "cuda"
    linattn_native = {"l2norm", "gate", "beta_sigmoid", "varlen", "h0"}
    if name in ("linattn", "linattn-torch", "linattn-triton"):
        backend = None if name == "linattn" else name.split("-")[1]
        if backend == "triton" and not (cuda and triton_available()) and not triton_interpret():
            return Impl(name, "gdn", available=False, reason="the triton backend needs a GPU (and triton)")
        label = backend or ("triton" if cuda and triton_available() else "torch")
        from .. import __version__
        return Impl(name, "gdn", _linattn(backend), native=linattn_native, version=f"{__version__} ({label})",
                    length_specialised=False)
    if name in ("fla", "flashqla"):
        if not cuda:
            return Impl(name, "gdn", available=False, reason=f"{name} needs a GPU")
        try:
            fn = _fla() if name == "fla" else _flashqla()
        except Exception as e:  # not installed, or installed but broken: either way, say what happened
            return Impl(name, "gdn", available=False, reason=f"not importable ({type(e).__name__}: {e})"[:300])
        if name == "fla":
            return Impl(name, "gdn", fn, native={"l2norm", "varlen", "h0"}, version=_version("fla"))
        return Impl(name, "gdn", fn, native={"h0", "varlen"}, version=_version("flash_qla"), limits=_flashqla_limits,
                    modes=_flashqla_modes)
    if name == "sdpa":
        return Impl(name, "softmax", _sdpa, version=torch.__version__)
    raise ValueError(f"unknown implementation {name!r}; known: {', '.join(KNOWN_IMPLS)}")


def parse_impls(spec: str, device: torch.device) -> list[Impl]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError("--impl needs at least one implementation name")
    unknown = [n for n in names if n not in KNOWN_IMPLS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; known: {', '.join(KNOWN_IMPLS)}")
    return [build(n, device) for n in dict.fromkeys(names)]
