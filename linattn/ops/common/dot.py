"""One dot for the kernels whose operands may be fp32 intermediates: Triton's precisions plus split-bf16 "bf16x3".

``"bf16x3"`` gets near-fp32 products out of the bf16 tensor cores. An fp32 operand x is split as

    hi = bf16(x),  lo = bf16(x − hi)          (hi + lo carries 16 of fp32's 24 significand bits)

and a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi: three bf16 MMAs accumulated in fp32 (the dropped a_lo·b_lo is
2^-16 of the product). An operand that is already bf16 (Q or K of bf16 inputs) is exact and is not split, so its
product needs two MMAs (a·b_hi + a·b_lo), and Q stays a bf16 operand instead of an fp32 copy.

Cost against ``"tf32x3"`` (also three MMAs, done by Triton on fp32 operands): a bf16 MMA has twice the throughput
of a tf32 one, so three bf16 MMAs cost about 1.5 tf32 MMAs, and the hi/lo halves are 16-bit, half the operand
registers of tf32x3's fp32 halves. Accuracy: each split operand is off by ≤ 2^-16 relatively (round to nearest
on the GPU), so a product is off by ≈ 2^-16 (plus the dropped lo·lo term, same order): far under the 2^-8 unit
roundoff of a bf16 output (≈ 1.7e-3 relative L2 on o), 32× finer than plain tf32's 2^-11, and like tf32x3 (≈ 2^-22)
it leaves o's error at the output-rounding floor. Measured on random 32×64 @ 64×16 fp32 blocks (relative L2):
plain bf16 operands 2.4e-3; split, round-to-nearest (torch emulation) 4.7e-6; split under the interpreter 2.7e-5.

Triton 3.6 also has a native ``input_precision="bf16x3"`` (a compiler pass on fp32×fp32 dots); this helper is
used instead because it sees operand dtypes: it skips the split of a bf16 operand, which the native pass (fp32
operands only) cannot, and its arithmetic runs under the interpreter, where the native precision is ignored.

Under the Triton interpreter (``INTERPRET``, from ``common.triton_interpret()`` on the host) a bf16 ``tl.dot``
multiplies the raw bits (triton issue 11584), so there every bf16 operand is widened to fp32 first: bf16 × bf16
products are exact in fp32, so this gives the numbers the GPU's bf16 MMA with fp32 accumulation gives, and the
split itself is tested on the CPU. One difference remains: the interpreter rounds fp32 → bf16 toward zero, not to
nearest, so its lo halves are off by up to 2^-14 instead of 2^-16 (the CPU tests' bounds allow for it).
"""
from __future__ import annotations

import triton
import triton.language as tl

# input_precision values of the fused forward's dots: Triton's own, and the split-bf16 product of this file
DOT_PRECISIONS = ("ieee", "tf32", "tf32x3", "bf16x3")


@triton.jit
def _split_bf16(x):
    """(hi, lo) bf16 halves of x (any float dtype): x ≈ hi + lo to 2^-16 relatively."""
    x32 = x.to(tl.float32)
    hi = x32.to(tl.bfloat16)
    lo = (x32 - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def _dot_bf16(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b for bf16 a, b: exact products, fp32 accumulation (widened under the interpreter, see above)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def dot(a, b, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``a @ b`` at PREC, one of :data:`DOT_PRECISIONS` ("bf16x3": the split above; the others:
    ``tl.dot``'s input_precision). Operands of different dtypes are widened to fp32 for Triton's precisions
    (``tl.dot`` takes one operand dtype); bf16 ones are widened under the interpreter."""
    if PREC == "bf16x3":
        # small terms first, the large hi·hi last, so the fp32 accumulator rounds once at the largest magnitude; the
        # first term starts the accumulator (acc None: any rank, batched [S, M, N] dots included)
        if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:
            return _dot_bf16(a, b, None, INTERPRET)
        elif a.dtype == tl.bfloat16:
            b_hi, b_lo = _split_bf16(b)
            return _dot_bf16(a, b_hi, _dot_bf16(a, b_lo, None, INTERPRET), INTERPRET)
        elif b.dtype == tl.bfloat16:
            a_hi, a_lo = _split_bf16(a)
            return _dot_bf16(a_hi, b, _dot_bf16(a_lo, b, None, INTERPRET), INTERPRET)
        else:
            a_hi, a_lo = _split_bf16(a)
            b_hi, b_lo = _split_bf16(b)
            acc = _dot_bf16(a_lo, b_hi, None, INTERPRET)
            acc = _dot_bf16(a_hi, b_lo, acc, INTERPRET)
            return _dot_bf16(a_hi, b_hi, acc, INTERPRET)
    elif (INTERPRET and (a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16)) or a.dtype != b.dtype:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    else:
        return tl.dot(a, b, input_precision=PREC)
