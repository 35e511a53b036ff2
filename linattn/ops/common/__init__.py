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
``state_pass_bwd.py``, ``local_bwd_dqk.py``, ``local_bwd_wy.py``, and their shared dot in ``local_bwd_utils.py``.

Precision policy (one place, :func:`dot_precision`): every ``tl.dot`` accumulates in fp32. A dot whose operands
are both *inputs* (Q Kᵀ, K Kᵀ) runs in the input dtype, so 16-bit inputs feed the tensor cores directly and the
products are exact. A dot that touches an fp32 *intermediate* (A_inv, W, U, V_new, the state) runs on fp32
operands at ``dot_precision(input dtype)``: ``"tf32x3"`` for fp32 inputs (:data:`FP32_DOT_PRECISION`;
errors ≈ 4e-7 against float64, run 16), ``"tf32"`` for bf16 inputs (11-bit operands: 8× finer than bf16, which
keeps the bf16 output error near 2e-3) and ``"tf32x3"`` for fp16 inputs (fp16 already has tf32's mantissa; plain
tf32 made fp16 errors 3–5× the rounded-PyTorch baseline). The small 16×16 block merges of the triangular solve
(~1% of the FLOPs) and the WY backward's inverse products follow :func:`product_precision` instead.
The sequential walk (``fused_fwd.py``) picks its own pair with ``fused_dot_precisions`` and may also run
``"bf16x3"`` (``dot.py``: fp32 operands split into bf16 halves, three bf16 MMAs, ≈ 2^-16 per product).
The Triton interpreter ignores the precision and multiplies in fp32, and multiplies bf16 ``tl.dot`` operands as raw
bits: kernels that must run bf16 on the CPU pass ``INTERPRET=triton_interpret()`` to ``dot.dot``, which widens them.
"""
from __future__ import annotations

import functools

import torch

from ..utils import triton_interpret  # noqa: F401  (re-exported for launchers: the INTERPRET constexpr of dot.py)

CHUNK = 64

# dot_precision's answer for fp32 inputs. "ieee" ran those dots on FMA units; on sm_90 it compiled the walks to 32
# registers and tens of KB of spills per thread (docs/performance.md run 10) and made fp32 slow: 86 ms forward at
# B=8 T=4096 H=16 (bf16 1.4; SDPA in fp32 12), fwd+bwd 367 ms (run 15). "tf32x3" (three tf32 MMAs per product on the
# tensor cores, ≈ 2^-22 per product) measured in run 16 (bench_pipelining.py table 4), ieee → tf32x3: forward 86.2 →
# 6.4 ms on the walk and 54.3 → 5.6 on the split at B=8, 2.86 → 0.93 at B=1; fwd+bwd 367 → 23.6 at B=8, 26.3 → 3.7
# at B=1; every error against float64 at the anchor 1.4–4.2e-7 → 2.1–5.0e-7 (o 2.5e-7 → 3.6e-7, final state
# 1.37e-7 → 2.1e-7), two orders below any 16-bit input's. The switch rule written before the run (every error
# ≤ 1e-5 and ≥ 3× faster) holds, so tf32x3 is the default; "ieee" stays selectable for bit-level studies.
FP32_DOT_PRECISION = "tf32x3"
# The precision product_precision gives fp32 inputs: the triangular solve's 16×16 block merges
# (kkt_solve.merge_precision) and the WY backward's two inverse products dA = Tᵀ dT Tᵀ (local_bwd_wy). Still "ieee"
# after run 16 switched the other dots: on sm_90 (benchmarks/compile_all.py --dtype fp32 --B 8) the WY backward then
# compiles to 2156 FFMA and 3.4 KB of spills per thread, kkt_solve to 522 FFMA. For 16-bit inputs run 12 measured
# the same products at tf32x3 (WY backward 2.11 → 1.50 ms at B=8 T=4096 H=16, gradients unchanged to two digits).
# Run 17 timed "tf32x3" for fp32 (bench_pipelining.py table 4; prediction fwd+bwd 23.3 → ≈ 22.7 ms at B=8, forward
# unchanged): forward 5.49 → 6.71 ms at B=8 and 0.927 → 1.064 at B=1, fwd+bwd 22.87 → 23.85 — slower, errors the
# same (≤ 5.7e-7). The solve's merges, not the WY backward, decide it (forward only runs the solve; ptxas: 268
# shuffles at tf32x3 against 28 for the sixteen 16×16 merge dots of that time): stays "ieee".
FP32_PRODUCT_PRECISION = "ieee"


# Extra Triton launch options per kernel (key: the kernel's name without "_kernel"), read at every launch; empty means
# Triton's defaults. Only "maxnreg" (a cap on registers per thread) and "num_stages" (software pipelining of the
# kernel's for loops) are allowed. Why they exist: every kernel of the chunked op compiles to ~255 registers, so an
# SM holds 8 warps of it whatever the width (sm_90 ptxas, benchmarks/compile_all.py), and local_bwd_dqk's default
# 3-stage pipelining takes 176–192 KB of shared memory (one program per SM). A cap or fewer stages trade spills
# for residency, which only the GPU can price: benchmarks/bench_launch_options.py sweeps them (bench_decode.py does
# for the decode step's kernel, "fused_recurrent_fwd").
LAUNCH_OPTION_KEYS = ("maxnreg", "num_stages")
# Defaults from the H200 sweep (run 12, bench_launch_options.py; outputs bitwise equal to the uncapped ones):
# output_fwd's tile loops unpipelined and capped at 168 registers 0.142 → 0.083 ms at B=1 T=4096 H=16, 1.029 → 0.549
# at B=8; kkt_solve at 168 0.089 → 0.073, 0.668 → 0.524; fused_prepass at 168 0.147 → 0.136, 1.125 → 1.011. Every
# other kernel was as fast or faster at the defaults (local_bwd_dqk 1.68 → 3.12 ms at 168 registers, the walks and
# state passes 1.5–2× slower), so they keep them.
LAUNCH_OPTIONS: dict[str, dict] = {
    "output_fwd": {"num_stages": 1, "maxnreg": 168},
    "kkt_solve": {"maxnreg": 168},
    "fused_prepass": {"maxnreg": 168},
}


def launch_options(kernel: str) -> dict:
    """The extra launch options of ``kernel`` (see :data:`LAUNCH_OPTIONS`), checked."""
    opts = LAUNCH_OPTIONS.get(kernel, {})
    bad = set(opts) - set(LAUNCH_OPTION_KEYS)
    if bad:
        raise ValueError(f"LAUNCH_OPTIONS[{kernel!r}] may set only {LAUNCH_OPTION_KEYS}, got {sorted(bad)}")
    return opts


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the dots on fp32 intermediates for inputs of ``dtype`` (see the module docstring)."""
    if dtype == torch.float16:
        return "tf32x3"  # tf32's 10-bit mantissa is fp16's own: plain tf32 made fp16 errors 3-5x the baseline (run 1)
    return FP32_DOT_PRECISION if dtype == torch.float32 else "tf32"


def product_precision(dtype: torch.dtype, setting: str, override, allowed: tuple, name: str) -> str:
    """Precision of a kernel's products of fp32 intermediates that a module setting picks for 16-bit inputs
    (kkt_solve.MERGE_PREC_BF16, local_bwd_wy.INVERSE_DOT_PREC): :data:`FP32_PRODUCT_PRECISION` for fp32 inputs,
    else ``override`` (benchmarks, tests) or ``setting``; a value outside ``allowed`` is refused, naming ``name``."""
    prec = FP32_PRODUCT_PRECISION if dtype == torch.float32 else (override or setting)
    if prec not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {prec!r}")
    return prec


def check_store_dtype(who: str, dtype: torch.dtype, name: str = "store_dtype") -> None:
    """Refuse a dtype for stored fp32 intermediates other than fp32 or bf16 (``state_pass_fwd``'s h and V_new, the
    pre-pass's W and U: ``split_fwd.STORE_BF16`` / ``WU_STORE_BF16``; the reverse walk's dh:
    ``triton_bwd.DH_STORE_BF16``), naming ``who``'s argument ``name``."""
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
    program per SM, else 0. 0 is the unpipelined while loop; n >= 1 a tl.range loop. Measured on the H200 (run
    11): pipelining pays when each SM runs one latency-bound walk (walk −26%, forward state pass −40% at B=1
    T=4096 H=16), and costs when the extra shared memory leaves fewer programs resident per SM (walk +6% … +42%
    at B=8)."""
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
    sequences; wider tiles do less redundant work per column once the SMs are full (H200, bench_pipelining.py,
    docs/performance.md run 11)."""
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
