"""Shapes, input generators and the evaluation profiles (tiny / quick / full, per device type).

Inputs are what a GDN layer feeds the op: unit-norm q and k (so the delta rule is a contraction, as in trained
models), standard-normal v, log decays ``g = logsigmoid(x) / 16`` (mean ≈ −0.05, as fla's and FlashQLA's
benchmarks use) and ``beta ∈ (0, 1)``. Every call draws fresh random numbers from a seeded generator, never zeros.

The speed sections can draw the decays another way (``linattn eval --gates``, :data:`GATES`): ``mamba`` gives each
value head its own rate as a Mamba-style initialisation does (``A`` from 1 to 16 and ``dt`` from 0.001 to 0.1, both
log-uniform: rates from 0.001 to 1.6 per token), so some heads keep their state for thousands of tokens. A forward
whose work depends on the gates (linattn's segmented Hopper forward skips or shortens what a fast decay makes
negligible) is slower there than at the default gates.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
# the decay draws of make_inputs (the module's docstring): "default" logsigmoid(x) / 16 for every head, "mamba" a
# rate per value head as a Mamba-style initialisation draws it
GATES = ("default", "mamba")
# E[logsigmoid(x)] for x ~ N(0, 1): the mamba draw scales logsigmoid(x) by rate / this, so a head's mean is −rate
_MEAN_LOGSIGMOID = 0.8063


@dataclass(frozen=True)
class Shape:
    """``q, k: [B, T, H, K]``, ``v: [B, T, HV, V]``, ``g, beta: [B, T, HV]``."""
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int

    @property
    def id(self) -> str:
        heads = f"H{self.H}" if self.H == self.HV else f"H{self.H}x{self.HV}"
        dims = f"D{self.K}" if self.K == self.V else f"K{self.K}V{self.V}"
        return f"B{self.B}-T{self.T}-{heads}-{dims}"

    @property
    def tokens(self) -> int:
        return self.B * self.T

    def with_(self, **kw) -> Shape:
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class Case:
    """One correctness case: a shape plus the op's options.

    ``seqlens`` packs sequences of those lengths into one row (varlen, B == 1); ``structure`` picks a
    non-random input pattern (see :func:`make_inputs`).
    """
    id: str
    shape: Shape
    seqlens: Optional[tuple] = None
    initial_state: bool = False
    l2norm: bool = False
    gate_in_op: bool = False
    beta_sigmoid: bool = False
    structure: str = "random"


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def make_inputs(shape: Shape, dtype: torch.dtype, device, seed: int = 0, *, case: Optional[Case] = None,
                requires_grad: bool = False, gates: str = "default") -> dict:
    """Random (or structured) inputs for one call, as a dict of the op's keyword arguments.

    Tensors are drawn in float64 on ``device`` and then cast, so the caller can rebuild the exact float64 values an
    implementation saw with ``x.double()`` (the reference then measures the kernel's error, not input rounding).
    ``g`` stays fp32 (the API's recommendation) unless dtype is fp64. ``gates``: the decays' draw (:data:`GATES`; a
    case's own structure or in-op gate wins).
    """
    if gates not in GATES:
        raise ValueError(f"gates must be one of {GATES}, got {gates!r}")
    device = torch.device(device)
    gen = _generator(device, seed)
    B, T, H, HV, K, V = shape.B, shape.T, shape.H, shape.HV, shape.K, shape.V
    f64 = dict(device=device, dtype=torch.float64, generator=gen)
    structure = case.structure if case is not None else "random"
    q = torch.randn(B, T, H, K, **f64)
    k = torch.randn(B, T, H, K, **f64)
    v = torch.randn(B, T, HV, V, **f64)
    g_raw = torch.randn(B, T, HV, **f64)
    beta = torch.rand(B, T, HV, **f64) * 0.9 + 0.05
    if structure == "onehot_keys":
        # keys cycle through the basis vectors: the delta rule then overwrites one row of the state per token,
        # an exact associative memory whose outputs are easy to reason about
        k = F.one_hot(torch.arange(T, device=device) % K, K).to(torch.float64)[None, :, None].expand(B, T, H, K)
        beta = torch.ones_like(beta)
    elif structure == "repeated_token":
        q, k, v = (x[:, :1].expand_as(x) for x in (q, k, v))
    elif structure == "alternating_gates":
        # decay switches between none and strong every token: stresses the in-chunk cumulative-sum differences
        g_raw = torch.where(torch.arange(T, device=device)[None, :, None] % 2 == 0, 20.0, -20.0).expand(B, T, HV)
        g_raw = g_raw.to(torch.float64)
    gate_in_op = case is not None and case.gate_in_op
    l2 = case is not None and case.l2norm
    if not l2:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = g_raw if gate_in_op else F.logsigmoid(g_raw) / 16
    if gates == "mamba" and not gate_in_op and structure != "alternating_gates":
        u = torch.rand(2, HV, **f64)                    # log-uniform A in [1, 16] and dt in [1e-3, 0.1]
        rate = torch.exp(u[0] * math.log(16)) * torch.exp(math.log(1e-3) + u[1] * math.log(100))
        g = F.logsigmoid(g_raw) * (rate / _MEAN_LOGSIGMOID)
    if structure == "alternating_gates" and not gate_in_op:
        g = torch.where(g_raw > 0, torch.zeros_like(g_raw), torch.full_like(g_raw, -8.0))
    g_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(g_dtype), beta=beta.to(dtype))
    if case is not None and case.beta_sigmoid:
        out["beta"] = torch.logit(beta).to(dtype)
    if requires_grad:
        for name in ("q", "k", "v", "g", "beta"):
            out[name].requires_grad_()
    N = B
    if case is not None and case.seqlens is not None:
        offs = [0]
        for n in case.seqlens:
            offs.append(offs[-1] + n)
        out["cu_seqlens"] = torch.tensor(offs, dtype=torch.int32, device=device)
        N = len(case.seqlens)
    if case is not None and case.initial_state:
        h0 = torch.randn(N, HV, K, V, **f64) * 0.1
        out["initial_state"] = h0.to(g_dtype).requires_grad_(requires_grad)
    if gate_in_op:
        out["A_log"] = torch.log(torch.rand(HV, **f64) * 4 + 1).to(g_dtype)
        out["dt_bias"] = (torch.rand(HV, **f64) - 0.5).to(g_dtype)
    out["use_qk_l2norm_in_kernel"] = l2
    out["use_beta_sigmoid_in_kernel"] = case is not None and case.beta_sigmoid
    return out


# --------------------------------------------------------------------------------------------------------------
# correctness case table (the shapes are small: the float64 reference is a Python loop over T)
# --------------------------------------------------------------------------------------------------------------
def correctness_cases(T: int, H: int, D: int) -> list[Case]:
    """The case table: causal prefill, varlen, initial state, GVA, K ≠ V, gates, l2norm, and structured inputs.

    T is odd on purpose (not a multiple of any chunk size), so every implementation's tail handling is exercised.
    """
    base = Shape(B=2, T=T, H=H, HV=H, K=D, V=D)
    third = max(1, T // 3)
    return [
        Case("prefill", base),
        Case("prefill-T1", base.with_(T=1)),
        Case("varlen", base.with_(B=1, T=2 * T), seqlens=(third, 1, T - third - 1 + T - 1, 1)),
        Case("initial-state", base, initial_state=True),
        Case("varlen-initial-state", base.with_(B=1, T=T), seqlens=(third, T - third), initial_state=True),
        Case("gva", base.with_(HV=2 * H)),
        Case("k-ne-v", base.with_(K=D, V=D + D // 2 + 4)),
        Case("gate-in-op", base, gate_in_op=True, beta_sigmoid=True),
        Case("l2norm", base, l2norm=True),
        Case("onehot-keys", base, structure="onehot_keys"),
        Case("repeated-token", base, structure="repeated_token"),
        Case("alternating-gates", base, structure="alternating_gates"),
    ]


# --------------------------------------------------------------------------------------------------------------
# profiles
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Profile:
    """Everything that sizes a run. ``quick`` and ``full`` come in a CPU and a GPU flavour (see :func:`profile`)."""
    name: str
    time_budget_s: float
    # correctness: T, H, D of the case table, dtypes, and whether to check gradients
    corr_T: int = 67
    corr_H: int = 2
    corr_D: int = 32
    corr_dtypes: tuple = ("fp32",)
    # performance
    perf_shapes: tuple = ()
    perf_dtypes: tuple = ("fp32",)
    perf_directions: tuple = ("fwd", "fwdbwd")
    warmup: int = 2
    reps: int = 10
    point_budget_s: float = 5.0
    # scaling / memory: base shape, T sweep (doubling), batch sweep, equal-total-token sweep
    scale_base: Shape = field(default_factory=lambda: Shape(1, 512, 4, 4, 64, 64))
    scale_T: tuple = (256, 512, 1024)
    scale_batch: tuple = (1, 2, 4)
    scale_batch_T: int = 256
    equal_tokens: int = 2048
    scale_reps: int = 3
    scale_dtype: str = "fp32"
    # stability: T sweep against the float64 reference
    stab_T: tuple = (64, 128, 256)
    stab_H: int = 2
    stab_D: int = 32
    stab_dtypes: tuple = ("fp32", "bf16", "fp16")
    # decode (real time): heads and dims (B, T unused), batches, tokens per step, pool dtypes, q/k/v dtype, timed
    # steps, CUDA-graph calls per capture and replays (GPU), drift steps after a prefill of dec_prompt_T tokens
    dec_shape: Shape = field(default_factory=lambda: Shape(1, 1, 2, 4, 32, 32))
    dec_batch: tuple = (1, 8)
    dec_Tq: tuple = (1,)
    dec_pools: tuple = ("fp32",)
    dec_dtype: str = "fp32"
    dec_steps: int = 1000
    dec_warmup: int = 20
    dec_graph_calls: int = 20
    dec_graph_replays: int = 30
    dec_drift_steps: int = 256
    dec_drift_pools: tuple = ("fp32", "bf16")
    dec_prompt_T: int = 64
    # robustness
    rob_shape: Shape = field(default_factory=lambda: Shape(2, 67, 2, 2, 32, 32))
    rob_timeout_s: float = 30.0
    # soak: seconds, and the largest T tried for it
    soak_s: float = 5.0
    soak_T: int = 1024
    # mixed precision: training steps, and a training run's hang limit (beyond the estimate of its compiles)
    amp_steps: int = 8
    amp_timeout_s: float = 60.0
    amp_shape: Shape = field(default_factory=lambda: Shape(2, 64, 2, 2, 32, 32))


def profile(name: str, device: torch.device) -> Profile:
    """The named profile for ``device`` (``tiny`` is for tests; ``quick`` is the default; ``full`` the whole grid)."""
    gpu = torch.device(device).type == "cuda"
    if name == "tiny":
        return Profile(
            name="tiny", time_budget_s=120, corr_T=19, corr_H=1, corr_D=16,
            perf_shapes=(Shape(1, 64, 2, 2, 16, 16),), warmup=1, reps=3, point_budget_s=2,
            scale_base=Shape(1, 32, 2, 2, 16, 16), scale_T=(32, 64, 128), scale_batch=(1, 2), scale_batch_T=32,
            equal_tokens=128, scale_reps=2, stab_T=(16, 32, 64), stab_H=1, stab_D=16, stab_dtypes=("fp32", "bf16"),
            rob_shape=Shape(2, 19, 1, 1, 16, 16), soak_s=0.5, soak_T=128, amp_steps=3,
            amp_shape=Shape(1, 16, 1, 1, 16, 16), dec_shape=Shape(1, 1, 1, 2, 16, 16), dec_batch=(1, 2),
            dec_steps=40, dec_warmup=3, dec_drift_steps=24, dec_prompt_T=16)
    if name == "quick" and not gpu:
        # sized so the whole run takes about 2-3 minutes on a 2-core laptop-class CPU
        return Profile(
            name="quick", time_budget_s=270, corr_T=67, corr_H=2, corr_D=32, corr_dtypes=("fp32", "bf16"),
            perf_shapes=(Shape(1, 1024, 4, 4, 64, 64), Shape(4, 1024, 4, 4, 64, 64), Shape(1, 2048, 2, 4, 64, 64)),
            warmup=2, reps=15, point_budget_s=8,
            scale_base=Shape(1, 512, 4, 4, 64, 64), scale_T=(256, 512, 1024, 2048, 4096, 8192, 16384),
            scale_batch=(1, 2, 4, 8, 16), scale_batch_T=512, equal_tokens=4096, scale_reps=5,
            stab_T=(64, 128, 256, 512, 1024), stab_H=2, stab_D=32, stab_dtypes=("fp32", "bf16", "fp16"),
            rob_shape=Shape(2, 67, 2, 2, 32, 32), soak_s=10, soak_T=4096, amp_steps=10,
            dec_shape=Shape(1, 1, 2, 4, 32, 32), dec_batch=(1, 8), dec_steps=1000, dec_drift_steps=256)
    if name == "quick":
        return Profile(
            # 480 s leaves room for fla's / FlashQLA's JIT compiles (unbounded first calls) in a 10-minute run
            name="quick", time_budget_s=480, corr_T=131, corr_H=4, corr_D=128, corr_dtypes=("fp32", "bf16"),
            perf_shapes=(Shape(1, 4096, 16, 16, 128, 128), Shape(8, 4096, 16, 16, 128, 128),
                         Shape(1, 32768, 16, 16, 128, 128), Shape(4, 8192, 16, 32, 128, 128)),
            perf_dtypes=("bf16",), warmup=5, reps=50, point_budget_s=10,
            scale_base=Shape(1, 4096, 16, 16, 128, 128), scale_T=(512, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
            scale_batch=(1, 2, 4, 8, 16, 32), scale_batch_T=4096, equal_tokens=65536, scale_reps=10,
            scale_dtype="bf16", stab_T=(256, 512, 1024, 2048, 4096), stab_H=4, stab_D=64,
            rob_shape=Shape(2, 131, 4, 4, 64, 64), soak_s=30, soak_T=65536, amp_steps=20,
            amp_shape=Shape(2, 512, 4, 4, 64, 64), dec_shape=Shape(1, 1, 16, 32, 128, 128), dec_batch=(1, 64),
            dec_dtype="bf16", dec_steps=1000, dec_warmup=50, dec_drift_steps=1024, dec_prompt_T=512)
    if name == "full" and not gpu:
        return Profile(
            name="full", time_budget_s=1800, corr_T=131, corr_H=2, corr_D=64, corr_dtypes=("fp32", "bf16", "fp16"),
            perf_shapes=(Shape(1, 2048, 4, 4, 64, 64), Shape(4, 2048, 4, 4, 64, 64), Shape(1, 8192, 4, 4, 64, 64),
                         Shape(1, 2048, 4, 4, 128, 128), Shape(2, 4096, 2, 4, 128, 128)),
            perf_dtypes=("fp32", "bf16"), warmup=3, reps=30, point_budget_s=20,
            scale_base=Shape(1, 512, 4, 4, 64, 64), scale_T=tuple(512 * 2 ** i for i in range(8)),
            scale_batch=(1, 2, 4, 8, 16, 32), scale_batch_T=1024, equal_tokens=16384, scale_reps=5,
            stab_T=(64, 128, 256, 512, 1024, 2048, 4096), rob_shape=Shape(2, 131, 2, 2, 64, 64), soak_s=60,
            soak_T=32768, amp_steps=30, dec_shape=Shape(1, 1, 4, 8, 64, 64), dec_batch=(1, 8, 32), dec_Tq=(1, 4, 8),
            dec_pools=("fp32", "bf16"), dec_steps=1000, dec_drift_steps=1024, dec_prompt_T=256)
    if name == "full":
        # the fast-forward issue's table first (K = V = 128), in its order, then batch 32 and head dim 64
        shapes = [Shape(B, T, H, HV, 128, 128) for B, T, H, HV in (
            (1, 4096, 16, 16), (8, 4096, 16, 16), (1, 32768, 16, 16), (1, 131072, 16, 16), (4, 8192, 16, 32),
            (2, 16384, 32, 32), (1, 32768, 2, 8), (32, 4096, 16, 16))]
        shapes += [Shape(B, T, 16, 16, 64, 64) for B, T in ((1, 4096), (8, 4096), (1, 32768), (32, 4096), (1, 131072))]
        return Profile(
            name="full", time_budget_s=3600, corr_T=257, corr_H=4, corr_D=128,
            corr_dtypes=("fp32", "bf16", "fp16"), perf_shapes=tuple(shapes), perf_dtypes=("bf16", "fp32"),
            warmup=10, reps=100, point_budget_s=20,
            scale_base=Shape(1, 4096, 16, 16, 128, 128), scale_T=tuple(512 * 2 ** i for i in range(9)),
            scale_batch=(1, 4, 16, 32), scale_batch_T=4096, equal_tokens=131072, scale_reps=20, scale_dtype="bf16",
            stab_T=(256, 512, 1024, 2048, 4096, 8192, 16384), stab_H=4, stab_D=64,
            rob_shape=Shape(2, 257, 4, 4, 128, 128), soak_s=120, soak_T=131072, amp_steps=50,
            amp_shape=Shape(2, 2048, 8, 8, 128, 128), dec_shape=Shape(1, 1, 16, 32, 128, 128),
            dec_batch=(1, 64, 256), dec_Tq=(1, 4, 8), dec_pools=("fp32", "bf16"), dec_dtype="bf16", dec_steps=2000,
            dec_warmup=50, dec_drift_steps=4096, dec_prompt_T=2048)
    raise ValueError(f"unknown profile {name!r}; choose quick, full or tiny")
