"""Triton stages shared by the chunked gated-linear-attention family (GDN today, plain GLA later).

One file per algorithm stage, each a ``<stage>_kernel`` plus a ``<stage>`` launcher, tested against the PyTorch
``<stage>_ref`` twin in ``linattn/ops/gated_delta/torch_chunk.py``:

    varlen.py      chunk index tables for packed sequences (host → int32 device tensors), the chunk prologue, and
                   the copies between packed rows and a padded batch (the Hopper forward's varlen)
    cumsum.py      gc = cumulative sum of the log decay inside each chunk
    kkt_solve.py   A = strict_lower(diag(β) K Kᵀ ⊙ D),  A_inv = (I + A)⁻¹
    wy.py          W = A_inv diag(βΓ) K,  U = A_inv diag(β) V
    state_pass.py  the sequential walk over chunks: h (state entering each chunk), v_new, final state
    output.py      O = scale·[diag(Γ) Q S + (Q Kᵀ ⊙ D ⊙ causal) V_new]

The fused forward the public op runs (docs/architecture.md, "Fused forward"), twins the same stages chained:

    fused_prepass.py   cumsum → kkt_solve → wy of one chunk in one kernel
    fused_fwd.py       the sequential walk: state_pass → output per chunk, state on chip
    seq_parallel.py    segments of long sequences stitched through affine state maps (planner, scan kernel)
    dot.py             the walk's dot: Triton's precisions or split-bf16 "bf16x3", right under the interpreter
    launch.py          a launch through the compiled kernel's runner instead of Triton's JIT launcher (host time)

The backward (twins in ``torch_chunk.py`` and ``torch_chunk_bwd_parts.py``): ``local_bwd_dv.py``,
``state_pass_bwd.py``, ``local_bwd_dqk.py``, ``local_bwd_wy.py``, and their shared dot in ``local_bwd_utils.py``;
``partial_sum.py`` adds the Hopper backward's per-head dq, dk and per-slice dg, dβ in one launch (twin beside it).

Precision policy (one place, :func:`dot_precision`): every ``tl.dot`` accumulates in fp32. A dot whose operands
are both *inputs* (Q Kᵀ, K Kᵀ) runs in the input dtype, so 16-bit inputs feed the tensor cores directly and the
products are exact. A dot that touches an fp32 *intermediate* (A_inv, W, U, V_new, the state) runs on fp32
operands at ``dot_precision(input dtype)``: ``"tf32x3"`` for fp32 inputs (three tf32 MMAs per product on the
tensor cores, errors ≈ 4e-7 against float64; "ieee" would run them on FMA units and spill), ``"tf32"`` for bf16 inputs (11-bit operands: 8× finer than bf16, which
keeps the bf16 output error near 2e-3) and ``"tf32x3"`` for fp16 inputs (fp16 already has tf32's mantissa; plain
tf32 made fp16 errors 3–5× the rounded-PyTorch baseline). The small 16×16 block merges of the triangular solve
(~1% of the FLOPs) and the WY backward's inverse products follow :func:`product_precision` instead.
The sequential walk (``fused_fwd.py``) picks its own pair with ``fused_dot_precisions`` and may also run
``"bf16x3"`` (``dot.py``: fp32 operands split into bf16 halves, three bf16 MMAs, ≈ 2^-16 per product).
The Triton interpreter ignores the precision and multiplies in fp32, and multiplies bf16 ``tl.dot`` operands as raw
bits: kernels that must run bf16 on the CPU pass ``INTERPRET=triton_interpret()`` to ``dot.dot``, which widens them.
"""
from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar
from types import MappingProxyType
from typing import Iterator, Mapping

import torch
import triton.language as tl

from ..utils import MIN_LOG_DECAY as _MIN_LOG_DECAY
from ..utils import triton_interpret  # noqa: F401  (re-exported for launchers: the INTERPRET constexpr of dot.py)

CHUNK = 64
# utils.MIN_LOG_DECAY as the constexpr the kernels that first read g floor it with (a kernel reads a global only so)
MIN_LOG_DECAY = tl.constexpr(_MIN_LOG_DECAY)

# Extra Triton launch options per kernel (key: the kernel's name without "_kernel"); a kernel not listed launches
# with Triton's defaults. Only "maxnreg" (a cap on registers per thread) and "num_stages" (software pipelining of the
# kernel's for loops) are allowed. Every kernel of the chunked op compiles to ~255 registers, so an SM holds 8 warps
# of it whatever the width; these three trade spills for residency where the GPU measured a gain (docs/decisions.md),
# every other kernel is as fast or faster at Triton's defaults. Read-only: a sweep passes its own table through
# :func:`launch_options_override` (benchmarks/bench_launch_options.py).
LAUNCH_OPTION_KEYS = ("maxnreg", "num_stages")
LAUNCH_OPTIONS: Mapping[str, Mapping[str, int]] = MappingProxyType({
    "output_fwd": MappingProxyType({"num_stages": 1, "maxnreg": 168}),
    "kkt_solve": MappingProxyType({"maxnreg": 168}),
    "fused_prepass": MappingProxyType({"maxnreg": 168}),
})
_launch_table: ContextVar[Mapping[str, Mapping[str, int]]] = ContextVar("linattn_launch_options", default=LAUNCH_OPTIONS)


@contextlib.contextmanager
def launch_options_override(table: Mapping[str, Mapping[str, int]]) -> Iterator[None]:
    """Launch every kernel inside the ``with`` block with ``table`` (same form as :data:`LAUNCH_OPTIONS`) instead of
    the defaults: the way a benchmark sweeps register caps and loop stages. Scoped to the block and the thread."""
    token = _launch_table.set(MappingProxyType({k: MappingProxyType(dict(v)) for k, v in table.items()}))
    try:
        yield
    finally:
        _launch_table.reset(token)


def launch_options(kernel: str) -> dict:
    """The extra launch options of ``kernel`` (:data:`LAUNCH_OPTIONS`, or the table of an enclosing
    :func:`launch_options_override`), checked."""
    opts = dict(_launch_table.get().get(kernel, {}))
    bad = set(opts) - set(LAUNCH_OPTION_KEYS)
    if bad:
        raise ValueError(f"launch options of {kernel!r} may set only {LAUNCH_OPTION_KEYS}, got {sorted(bad)}")
    return opts


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the dots on fp32 intermediates for inputs of ``dtype`` (see the module docstring)."""
    # bf16's 8-bit mantissa is well under tf32's 10; fp16 already has tf32's mantissa, so plain tf32 would round
    # its products as coarsely as the inputs (fp16 errors 3-5x the rounded-PyTorch baseline)
    return "tf32" if dtype == torch.bfloat16 else "tf32x3"


def product_precision(dtype: torch.dtype, setting: str, override, allowed: tuple, name: str) -> str:
    """Precision of a kernel's small products of fp32 intermediates (the solve's block merges, the WY backward's
    inverse products): "ieee" for fp32 inputs (on sm_90 "tf32x3" adds hundreds of shuffles to the solve and is
    slower), else ``override`` (benchmarks, tests) or the kernel's ``setting`` for 16-bit inputs; a value outside
    ``allowed`` is refused, naming ``name``."""
    prec = "ieee" if dtype == torch.float32 else (override or setting)
    if prec not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {prec!r}")
    return prec


def check_store_dtype(who: str, dtype: torch.dtype, name: str = "store_dtype") -> None:
    """Refuse a dtype for stored fp32 intermediates other than fp32 or bf16 (``state_pass_fwd``'s h and V_new, the
    pre-pass's W and U, the reverse walk's dh), naming ``who``'s argument ``name``."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{who} {name} must be torch.float32 or torch.bfloat16, got {dtype}")


def block_size(d: int, cap: int) -> int:
    """Power-of-two tile covering ``d`` (tails are masked), at least 16 (``tl.dot``'s minimum) and at most cap."""
    b = 16
    while b < d and b < cap:
        b *= 2
    return b


def loop_stages(num_stages, setting: int, programs: int, sms: int) -> int:
    """NUM_STAGES of a sequential kernel's chunk loop (fused_fwd, state_pass, state_pass_bwd): ``num_stages`` when
    given (benchmarks), else the launcher's module ``setting`` when its grid of ``programs`` fits one wave of one
    program per SM, else 0. 0 is the unpipelined while loop; n >= 1 a tl.range loop. Pipelining pays when each SM
    runs one latency-bound walk, and costs when the extra shared memory leaves fewer programs resident per SM."""
    stages = (setting if programs <= sms else 0) if num_stages is None else num_stages
    if not isinstance(stages, int) or stages < 0:
        raise ValueError(f"num_stages must be an int >= 0 (0: the unpipelined while loop), got {stages!r}")
    return stages


def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device; 132 (an H200) elsewhere, so CPU tests plan as the GPU would. Cached per device
    index: every launcher of the forward asks, and the property lookup is host time on each call."""
    if device.type != "cuda":
        return 132
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fill_tile_v(NHV: int, V: int, cap: int, sms: int, min_fill: float = 1.0) -> int:
    """V tile of a sequential kernel (one program per (sequence, value head, V tile), each walking its chunks in
    order) for NHV (sequence, value head) pairs on ``sms`` SMs: the widest of 64, 32, 16 (at most ``cap``, and
    at most V's power-of-two cover) whose NHV·cdiv(V, BV) programs fill the SMs (at least ``min_fill`` · sms of
    them), else 16. The walk is sequential, so narrower tiles are the one way to put more SMs on a few long
    sequences; wider tiles do less redundant work per column once the SMs are full."""
    widest = min(cap, 64, max(16, 1 << (max(V, 1) - 1).bit_length()))
    BV = 16
    for bv in (64, 32):
        if bv <= widest and NHV * -(-V // bv) >= min_fill * sms:
            BV = bv
            break
    return BV


def state_tile_v(block_v, default: int) -> int:
    """BV of a state pass (the V columns of the state one program carries): ``block_v`` (benchmarks), or the
    launcher's rule when None; a power of two in [16, 64]."""
    BV = default if block_v is None else block_v
    if not isinstance(BV, int) or not (16 <= BV <= 64 and BV & (BV - 1) == 0):
        raise ValueError(f"block_v must be a power of two in [16, 64], got {BV!r}")
    return BV
