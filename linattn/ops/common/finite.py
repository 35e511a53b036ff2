"""Causality under NaN and Inf: a non-finite value at token t reaches no output before t.

Row i of a chunk's T = (I + A)⁻¹, W, U, V_new and O reads rows j ≤ i only, but the products over the chunk's tokens
(T Z for the WY form and V_new from A_inv, P V_new for the output) multiply the later rows of Z by exact zeros of
row i, and NaN · 0 = NaN: one non-finite row of Z would reach every earlier row of its chunk. So the kernels zero
the rows of Z from its first non-finite row on before such a product and set the result's rows from there to NaN
(:func:`dead_rows`, :func:`zero_rows`, :func:`nan_rows`), and mask with selects, never with a multiply by 0. The
state leaving the chunk then becomes NaN on its own (its product over the tokens reads the NaN rows), as the token
loop's does. Twin: ``torch_chunk.causal_matmul``.

Where the inputs are first read, the row reductions run: the solve (the first non-finite β, G or ‖k‖², from
[BT] vectors), the V tiles of U (the pre-pass, ``wy.py``) and of V_new from A_inv (``state_pass.py``, off the
sequential chain). So every stored W, U and V_new has its non-finite rows *closed downward* (each row after a
non-finite row is non-finite), and the output products downstream (``output.py``, the walk) need only elementwise
selects: V_new's non-finite entries zeroed before P V_new and o NaN there. On finite inputs the selects change
nothing; their cost is a compare per element, and a row reduction where the inputs are read.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def nonfinite(x):
    """Elementwise: NaN, +inf or −inf."""
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def nonfinite_rows(x):
    """[R] bool of x [R, C]: the rows that hold a non-finite value."""
    return tl.sum(nonfinite(x.to(tl.float32)).to(tl.int32), axis=1) > 0


@triton.jit
def from_first(bad):
    """[R] bool: true from the first true row of ``bad`` [R] on (the rows a non-finite row feeds). A min and a
    compare, not a cumulative sum: the scan cost the pre-pass 76 bytes of spill on sm_90 (maxnreg 168)."""
    o_r = tl.arange(0, bad.shape[0])
    return o_r >= tl.min(tl.where(bad, o_r, bad.shape[0]), axis=0)


@triton.jit
def dead_rows(x):
    """[R] bool of x [R, C]: true from its first row that holds a non-finite value on."""
    return from_first(nonfinite_rows(x))


@triton.jit
def zero_rows(x, dead):
    """x [R, C] with the rows where ``dead`` [R] is true set to 0 (a select: NaN and Inf go too)."""
    return tl.where(dead[:, None], 0., x)


@triton.jit
def nan_rows(x, dead):
    """x [R, C] with the rows where ``dead`` [R] is true set to NaN."""
    return tl.where(dead[:, None], float("nan"), x)
