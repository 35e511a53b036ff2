"""The shared dot helper (``linattn/ops/common/dot.py``): split-bf16 "bf16x3" and the widening of mixed dtypes.

Runs under the interpreter on the CPU (the helper widens bf16 halves to fp32 there: bf16 × bf16 products are exact
in fp32, so the split arithmetic is the GPU's) and unchanged on a GPU (real bf16 MMAs). Each case multiplies an
[M, K] by a [K, N] block and compares with the float64 product of the same operands (already rounded to their
dtype), so only the dot's own error is measured. Block shapes (M, K, N):

- (32, 64, 16): tl.dot's 16 minimum in N. On Hopper Triton lowers it to mma.sync: wgmma needs M a multiple of 64.
- (64, 128, 16): wgmma with the walk's tiles (BT = 64 rows, BK = 128, BV = 16 columns), where the fused forward's
  bf16x3 dots fault on the H200 (docs/performance.md run 8).
- (64, 64, 64): wgmma with a square tile (BV = 64 gives the bf16 B operand a wider swizzle than N = 16).

Bound: "bf16x3" carries 16 significand bits per operand: 2^-16 per product with round-to-nearest halves (GPU),
2^-14 with the interpreter's round-toward-zero fp32 → bf16 casts; the relative L2 error of a 64- or 128-term dot
with random signs is below either (measured 6e-6 to 3e-5 on the CPU, every shape). 1e-4 holds it with margin while
plain bf16 operands (2^-9 per product, ≈ 3e-3 here) and tf32 ones (2^-11) would fail it.
"""
from __future__ import annotations

import pytest
import torch

from linattn.ops.utils import triton_available, triton_interpret

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not triton_available() or (not torch.cuda.is_available() and not triton_interpret()),
                       reason="needs triton on CUDA, or TRITON_INTERPRET=1"),
]

if triton_available():
    import triton
    import triton.language as tl

    from linattn.ops.common.dot import dot

    @triton.jit
    def _dot_kernel(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, PREC: tl.constexpr,
                    INTERPRET: tl.constexpr):
        o_m, o_n, o_k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        b_a = tl.load(a + o_m[:, None] * K + o_k[None, :])
        b_b = tl.load(b + o_k[:, None] * N + o_n[None, :])
        tl.store(c + o_m[:, None] * N + o_n[None, :], dot(b_a, b_b, PREC, INTERPRET))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (M, K, N); M = 32 runs mma.sync on Hopper, M = 64 wgmma (see the module docstring)
SHAPES = [(32, 64, 16), (64, 128, 16), (64, 64, 64)]
SHAPE_IDS = [f"{m}x{k}x{n}" for m, k, n in SHAPES]
TOL = {"bf16x3": 1e-4, "ieee": 1e-6}

# (id, dtype of a, dtype of b, spread): spread multiplies each element by e^(3·randn), so the operands span about
# ±9 binades and the split is checked relative to each element's own magnitude, not one shared exponent
CASES = [
    ("fp32xfp32", torch.float32, torch.float32, False),
    ("fp32xfp32_wide_range", torch.float32, torch.float32, True),
    ("bf16xfp32", torch.bfloat16, torch.float32, False),      # Q S of bf16 inputs: a is not split (2 MMAs)
    ("fp32xbf16", torch.float32, torch.bfloat16, True),
    ("bf16xbf16", torch.bfloat16, torch.bfloat16, False),     # Q Kᵀ of bf16 inputs: one plain bf16 MMA
    ("fp16xfp32", torch.float16, torch.float32, False),       # fp16 holds 11 bits: its split is exact too
]


def operand(shape, dtype, spread):
    x = torch.randn(shape, dtype=torch.float64)
    if spread:
        x = x * torch.exp(3 * torch.randn(shape, dtype=torch.float64))
    return x.to(dtype).to(DEVICE)


def run_dot(a, b, prec):
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32, device=DEVICE)
    _dot_kernel[(1,)](a, b, c, M=M, N=N, K=K, PREC=prec, INTERPRET=triton_interpret())
    return c


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("M,K,N", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("prec", ["bf16x3", "ieee"])
@pytest.mark.parametrize("da,db,spread", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_dot_matches_float64(da, db, spread, prec, M, K, N):
    a, b = operand((M, K), da, spread), operand((K, N), db, spread)
    exact = a.double() @ b.double()
    err = rel(run_dot(a, b, prec), exact)
    assert err < TOL[prec], f"{prec}: {err:.2e}"


@pytest.mark.parametrize("M,K,N", SHAPES, ids=SHAPE_IDS)
def test_bound_rejects_plain_bf16_operands(M, K, N):
    """The bf16x3 bound is tight enough to fail: rounding both fp32 operands to bf16 once (what a plain bf16 dot
    of fp32 intermediates would do) misses it by far, and the split's error is well below it."""
    a, b = operand((M, K), torch.float32, False), operand((K, N), torch.float32, False)
    exact = a.double() @ b.double()
    plain = rel(a.bfloat16().double() @ b.bfloat16().double(), exact)
    split = rel(run_dot(a, b, "bf16x3"), exact)
    assert plain > 10 * TOL["bf16x3"], f"plain bf16 {plain:.2e}"
    assert split < TOL["bf16x3"] < plain
