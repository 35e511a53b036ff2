"""The public op's in-op pre-processing in ONE Triton launch forward and ONE backward.

``chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True, A_log=..., dt_bias=..., use_beta_sigmoid_in_kernel=True)``
(the way Qwen3-Next calls it) turns its raw inputs into the core's inputs::

    q̂ = q · rsqrt(Σq² + 1e-6)     k̂ = k · rsqrt(Σk² + 1e-6)      (fp32 math, output in q's dtype)
    g = max(−exp(A_log) · softplus(g_raw + dt_bias), MIN_LOG_DECAY)  (fp32)
    β = sigmoid(b)                                                    (b's dtype)

each only when its flag asks for it. In PyTorch that is ~20 ATen kernels, each a pass over memory; here it is :func:`preprocess_fwd_kernel` and, for the gradient,
:func:`preprocess_bwd_kernel` (the chain rule back to q, k, g_raw, b, A_log, dt_bias), wrapped in
:class:`Preprocess`. Twin: :func:`preprocess_ref` (utils' ``l2norm`` / ``gate_from_raw``; its gradients come from
PyTorch autograd). The torch and reference backends, and every traced call (torch.compile fuses the PyTorch ops
itself), keep the twin.

Grid (NB, H) with NB = ⌈B·T / BT⌉: program (i_b, i_h) normalises the [BT, K] tile of query/key head i_h over BT
tokens; the programs with i_h = 0 also do the [BT, HV] gate tile. Pure bandwidth: per token the forward reads and
writes 2·H·K q/k elements and a few gate values. BT is chosen so that no tile exceeds 4096 elements (32 fp32 values
per thread at 4 warps), never from T.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..utils import gate_from_raw, l2norm, next_power_of_2
from . import MIN_LOG_DECAY

L2NORM_EPS = 1e-6
_EPS = tl.constexpr(L2NORM_EPS)  # kernels may read a global only as a constexpr (the interpreter does not check)
TILE_ELEMENTS = 2048
NUM_WARPS = 4
PREPROCESS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _softplus(u):
    """log(1 + exp(u)) = max(u, 0) + log1p(exp(−|u|)) in fp32, as torch's softplus (which returns u for u > 20).

    log1p(x) as log(w)·x / (w − 1) with w = 1 + x (Goldberg): exact to a few ulp where a plain log(1 + x) loses all
    relative precision (x < 1e-7, u < −16), and it needs no libdevice call (the interpreter runs it too).
    """
    x = tl.exp(-tl.abs(u))
    w = 1.0 + x
    d = w - 1.0
    log1p = tl.where(d == 0.0, x, tl.log(w) * (x / tl.where(d == 0.0, 1.0, d)))  # no 0/0 in the unused branch
    return tl.maximum(u, 0.0) + log1p


@triton.jit(do_not_specialize=["NTOK"])
def preprocess_fwd_kernel(q, k, qn, kn, g, A_log, dt_bias, gn, beta, betan, NTOK, H: tl.constexpr, HV: tl.constexpr,
                          K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BHV: tl.constexpr,
                          L2NORM: tl.constexpr, GATE: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    # grid (NB, H or 1): token block i_b, query/key head i_h; tensors are token-major [B·T, H, K] / [B·T, HV]
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_b.to(tl.int64) * BT + tl.arange(0, BT)  # int64: B·T·H·K passes 2^31 at long contexts
    m_t = o_t < NTOK
    if L2NORM:
        o_k = tl.arange(0, BK)
        m_x = m_t[:, None] & (o_k[None, :] < K)
        o_x = (o_t[:, None] * H + i_h) * K + o_k[None, :]
        # q then k: read a [BT, K] tile, write it normalised (the masked tail adds zeros to Σx²)
        b_x = tl.load(q + o_x, mask=m_x, other=0).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) + _EPS)
        tl.store(qn + o_x, b_x * b_r[:, None], mask=m_x)
        b_x = tl.load(k + o_x, mask=m_x, other=0).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) + _EPS)
        tl.store(kn + o_x, b_x * b_r[:, None], mask=m_x)
    if GATE or BETA_SIGMOID:
        if i_h == 0:
            o_hv = tl.arange(0, BHV)
            m_g = m_t[:, None] & (o_hv[None, :] < HV)
            o_g = o_t[:, None] * HV + o_hv[None, :]
            if GATE:
                # read BT·HV raw gates and the HV-vectors A_log, dt_bias; write BT·HV fp32 log decays
                b_a = tl.load(A_log + o_hv, mask=o_hv < HV, other=0).to(tl.float32)
                b_dt = tl.load(dt_bias + o_hv, mask=o_hv < HV, other=0).to(tl.float32)
                b_u = tl.load(g + o_g, mask=m_g, other=0).to(tl.float32) + b_dt[None, :]
                b_gate = -tl.exp(b_a)[None, :] * _softplus(b_u)
                # floored at MIN_LOG_DECAY: exp(A_log) overflows to inf from A_log ≈ 88.7 (a select: NaN stays NaN)
                tl.store(gn + o_g, tl.where(b_gate < MIN_LOG_DECAY, MIN_LOG_DECAY, b_gate), mask=m_g)
            if BETA_SIGMOID:
                b_b = tl.load(beta + o_g, mask=m_g, other=0).to(tl.float32)
                tl.store(betan + o_g, tl.sigmoid(b_b), mask=m_g)


@triton.jit(do_not_specialize=["NTOK", "NB"])
def preprocess_bwd_kernel(q, k, dqn, dkn, dq, dk, g, A_log, dt_bias, dgn, dg, dpart, beta, dbetan, dbeta, NTOK, NB,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          BHV: tl.constexpr, L2NORM: tl.constexpr, GATE: tl.constexpr, BETA_SIGMOID: tl.constexpr):
    # same grid and tiles as the forward, which is recomputed from the raw inputs (nothing but them is saved)
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_b.to(tl.int64) * BT + tl.arange(0, BT)
    m_t = o_t < NTOK
    if L2NORM:
        o_k = tl.arange(0, BK)
        m_x = m_t[:, None] & (o_k[None, :] < K)
        o_x = (o_t[:, None] * H + i_h) * K + o_k[None, :]
        # y = x·r, r = rsqrt(Σx² + eps)  ⇒  dx = r·(dy − y·Σ(dy·y)); per tensor read x and dy, write dx
        b_x = tl.load(q + o_x, mask=m_x, other=0).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) + _EPS)
        b_y = b_x * b_r[:, None]
        b_dy = tl.load(dqn + o_x, mask=m_x, other=0).to(tl.float32)
        b_yd = tl.sum(b_dy * b_y, axis=1)
        tl.store(dq + o_x, b_r[:, None] * (b_dy - b_y * b_yd[:, None]), mask=m_x)
        b_x = tl.load(k + o_x, mask=m_x, other=0).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) + _EPS)
        b_y = b_x * b_r[:, None]
        b_dy = tl.load(dkn + o_x, mask=m_x, other=0).to(tl.float32)
        b_yd = tl.sum(b_dy * b_y, axis=1)
        tl.store(dk + o_x, b_r[:, None] * (b_dy - b_y * b_yd[:, None]), mask=m_x)
    if GATE or BETA_SIGMOID:
        if i_h == 0:
            o_hv = tl.arange(0, BHV)
            m_hv = o_hv < HV
            m_g = m_t[:, None] & m_hv[None, :]
            o_g = o_t[:, None] * HV + o_hv[None, :]
            if GATE:
                # g = −e·softplus(u), e = exp(A_log), u = g_raw + dt_bias:
                #   dg_raw = −e·sigmoid(u)·dg,  ddt_bias = Σ_t dg_raw,  dA_log = Σ_t g·dg
                # the two token sums leave this program as per-block partials dpart [2, NB, HV]: a torch sum over NB
                # finishes them in a fixed order (deterministic, no atomics)
                b_e = tl.exp(tl.load(A_log + o_hv, mask=m_hv, other=0).to(tl.float32))
                b_dt = tl.load(dt_bias + o_hv, mask=m_hv, other=0).to(tl.float32)
                b_u = tl.load(g + o_g, mask=m_g, other=0).to(tl.float32) + b_dt[None, :]
                b_dgn = tl.load(dgn + o_g, mask=m_g, other=0).to(tl.float32)
                b_gate = -b_e[None, :] * _softplus(b_u)
                # below the floor the gate is the constant MIN_LOG_DECAY: no gradient (selects, as e may be inf)
                b_floored = b_gate < MIN_LOG_DECAY
                b_dg = tl.where(b_floored, 0., -b_e[None, :] * tl.sigmoid(b_u) * b_dgn)
                tl.store(dg + o_g, b_dg, mask=m_g)
                b_da = tl.sum(tl.where(b_floored, 0., b_gate * b_dgn), axis=0)
                tl.store(dpart + i_b * HV + o_hv, b_da, mask=m_hv)
                tl.store(dpart + (NB + i_b) * HV + o_hv, tl.sum(b_dg, axis=0), mask=m_hv)
            if BETA_SIGMOID:
                b_s = tl.sigmoid(tl.load(beta + o_g, mask=m_g, other=0).to(tl.float32))
                b_db = tl.load(dbetan + o_g, mask=m_g, other=0).to(tl.float32)
                tl.store(dbeta + o_g, b_db * b_s * (1.0 - b_s), mask=m_g)


def _tiles(K: int, HV: int, l2norm_qk: bool) -> tuple[int, int, int]:
    """(BT, BK, BHV): tokens per program so that neither the [BT, BK] q/k tile nor the [BT, BHV] gate tile exceeds
    TILE_ELEMENTS (B·T plays no part: one compilation per model)."""
    BK, BHV = next_power_of_2(K), next_power_of_2(HV)
    return max(1, TILE_ELEMENTS // max(BK if l2norm_qk else 1, BHV)), BK, BHV


def preprocess_fwd(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], use_qk_l2norm: bool,
                   use_beta_sigmoid: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch: ``(q̂, k̂, g, β)`` from q, k ``[B, T, H, K]``, g, beta ``[B, T, HV]`` (contiguous), A_log and
    dt_bias ``[HV]`` or None. What no flag asks for is returned as given (the same tensor)."""
    gate = A_log is not None
    if not (use_qk_l2norm or gate or use_beta_sigmoid):
        return q, k, g, beta
    B, T, H, K = q.shape
    HV = g.shape[2]
    BT, BK, BHV = _tiles(K, HV, use_qk_l2norm)
    qn, kn = (torch.empty_like(q), torch.empty_like(k)) if use_qk_l2norm else (q, k)
    gn = torch.empty(g.shape, dtype=torch.float32, device=g.device) if gate else g
    betan = torch.empty_like(beta) if use_beta_sigmoid else beta
    grid = (-(-(B * T) // BT), H if use_qk_l2norm else 1)
    preprocess_fwd_kernel[grid](q, k, qn, kn, g, A_log, dt_bias, gn, beta, betan, B * T, H=H, HV=HV, K=K, BT=BT,
                                BK=BK, BHV=BHV, L2NORM=use_qk_l2norm, GATE=gate, BETA_SIGMOID=use_beta_sigmoid)
    return qn, kn, gn, betan


def preprocess_bwd(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], use_qk_l2norm: bool,
                   use_beta_sigmoid: bool, dqn: Optional[torch.Tensor], dkn: Optional[torch.Tensor],
                   dgn: Optional[torch.Tensor], dbetan: Optional[torch.Tensor]) -> tuple:
    """One launch (plus the sum of the A_log / dt_bias partials): gradients ``(dq, dk, dg, dbeta, dA_log,
    ddt_bias)`` of the raw inputs from those of :func:`preprocess_fwd`'s outputs (contiguous; same shapes and dtypes
    as the outputs). Entries of a stage no flag asks for are None; each gradient is in its input's dtype."""
    gate = A_log is not None
    B, T, H, K = q.shape
    HV = g.shape[2]
    BT, BK, BHV = _tiles(K, HV, use_qk_l2norm)
    NB = -(-(B * T) // BT)
    dq, dk = (torch.empty_like(q), torch.empty_like(k)) if use_qk_l2norm else (None, None)
    dg = torch.empty_like(g) if gate else None
    dpart = torch.empty(2, NB, HV, dtype=torch.float32, device=g.device) if gate else None
    dbeta = torch.empty_like(beta) if use_beta_sigmoid else None
    preprocess_bwd_kernel[(NB, H if use_qk_l2norm else 1)](
        q, k, dqn, dkn, dq, dk, g, A_log, dt_bias, dgn, dg, dpart, beta, dbetan, dbeta, B * T, NB, H=H, HV=HV, K=K,
        BT=BT, BK=BK, BHV=BHV, L2NORM=use_qk_l2norm, GATE=gate, BETA_SIGMOID=use_beta_sigmoid)
    dA_log = ddt_bias = None
    if gate:
        dsum = dpart.sum(1)
        dA_log, ddt_bias = dsum[0].to(A_log.dtype), dsum[1].to(dt_bias.dtype)
    return dq, dk, dg, dbeta, dA_log, ddt_bias


class Preprocess(torch.autograd.Function):
    """Autograd over :func:`preprocess_fwd` / :func:`preprocess_bwd`; saves only the raw inputs."""

    @staticmethod
    def forward(ctx, q, k, g, beta, A_log, dt_bias, use_qk_l2norm: bool, use_beta_sigmoid: bool):
        ctx.save_for_backward(q, k, g, beta, A_log, dt_bias)
        ctx.flags = (use_qk_l2norm, use_beta_sigmoid)
        qn, kn, gn, betan = preprocess_fwd(q, k, g, beta, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid)
        # a stage that is off returns its input; autograd then passes that gradient through untouched
        return qn, kn, gn, betan

    @staticmethod
    def backward(ctx, dqn, dkn, dgn, dbetan):
        q, k, g, beta, A_log, dt_bias = ctx.saved_tensors
        use_qk_l2norm, use_beta_sigmoid = ctx.flags
        gate = A_log is not None
        # a gradient autograd did not materialise is a zero one; the kernel wants all of a stage's inputs
        if use_qk_l2norm:
            dqn = torch.zeros_like(q) if dqn is None else dqn.contiguous()
            dkn = torch.zeros_like(k) if dkn is None else dkn.contiguous()
        if gate:
            dgn = torch.zeros(g.shape, dtype=torch.float32, device=g.device) if dgn is None else dgn.contiguous()
        if use_beta_sigmoid:
            dbetan = torch.zeros_like(beta) if dbetan is None else dbetan.contiguous()
        dq, dk, dg, dbeta, dA_log, ddt_bias = preprocess_bwd(q, k, g, beta, A_log, dt_bias, use_qk_l2norm,
                                                             use_beta_sigmoid, dqn, dkn, dgn, dbetan)
        return (dq if use_qk_l2norm else dqn, dk if use_qk_l2norm else dkn, dg if gate else dgn,
                dbeta if use_beta_sigmoid else dbetan, dA_log, ddt_bias, None, None)


def preprocess(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], use_qk_l2norm: bool,
               use_beta_sigmoid: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused pre-processing, differentiable: ``(q̂, k̂, g, β)``, contiguous, as :func:`preprocess_ref`.

    Args:
        q, k (torch.Tensor): ``[B, T, H, K]``, fp16/bf16/fp32; normalised if ``use_qk_l2norm``.
        g (torch.Tensor): ``[B, T, HV]``: raw gate logits if A_log/dt_bias are given (result fp32), else passed on.
        beta (torch.Tensor): ``[B, T, HV]``: logits if ``use_beta_sigmoid`` (result in beta's dtype).
        A_log, dt_bias (torch.Tensor): ``[HV]`` or both None.
    """
    q, k, g, beta = (x.contiguous() for x in (q, k, g, beta))
    if not (use_qk_l2norm or A_log is not None or use_beta_sigmoid):
        return q, k, g, beta
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, g, beta, A_log, dt_bias)):
        return Preprocess.apply(q, k, g, beta, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid)
    return preprocess_fwd(q, k, g, beta, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid)


def preprocess_supported(q: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> bool:
    """Whether :func:`preprocess` takes these inputs (it computes in fp32: float64 stays with the PyTorch twin)."""
    return q.dtype in PREPROCESS_DTYPES and g.dtype in PREPROCESS_DTYPES and beta.dtype in PREPROCESS_DTYPES


def preprocess_ref(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], use_qk_l2norm: bool,
                   use_beta_sigmoid: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch twin of :func:`preprocess` (what the torch and reference backends run); gradients by autograd."""
    if use_qk_l2norm:
        q, k = l2norm(q, L2NORM_EPS), l2norm(k, L2NORM_EPS)
    if A_log is not None:
        g = gate_from_raw(g, A_log, dt_bias)
    if use_beta_sigmoid:
        beta = beta.sigmoid()
    return q, k, g, beta
