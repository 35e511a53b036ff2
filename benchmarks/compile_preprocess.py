"""Compile the fused pre-processing kernels for an H200 (sm_90, triton's own ptxas) on any machine, no GPU needed.

Prints one row per (kernel, dtype, K, HV): registers, spill bytes and shared memory from ``ptxas -v``, so a change
to the tiles can be checked for register pressure before it reaches the device. Run without TRITON_INTERPRET::

    python benchmarks/compile_preprocess.py
"""
from __future__ import annotations

import os

from sm90 import compile_sm90  # noqa: E402  (this folder is on sys.path)

from linattn.ops.common import preprocess as P

DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
QK_ARGS = {"q", "k", "qn", "kn", "dqn", "dkn", "dq", "dk", "beta", "betan", "dbetan", "dbeta"}  # in the input dtype
INT_ARGS = {"NTOK", "NB"}
SHAPES = [(128, 16), (128, 32), (60, 8), (256, 64), (32, 4)]  # (K, HV), H = HV / 2


def compile_kernel(kernel, dtype: str, K: int, HV: int, flags=(True, True, True)):
    """Compile ``kernel`` for sm_90 with the launcher's tiles; return sm90.Resources."""
    BT, BK, BHV = P._tiles(K, HV, flags[0])
    consts = dict(H=HV // 2, HV=HV, K=K, BT=BT, BK=BK, BHV=BHV, L2NORM=flags[0], GATE=flags[1], BETA_SIGMOID=flags[2])
    arg_type = lambda name: "i32" if name in INT_ARGS else DTYPES[dtype] if name in QK_ARGS else "*fp32"
    return compile_sm90(kernel, consts, arg_type, P.NUM_WARPS)


def main():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels this script compiles")
    print("| kernel | dtype | K | HV | BT | registers | spill bytes | shared bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for kernel in (P.preprocess_fwd_kernel, P.preprocess_bwd_kernel):
        for dtype in DTYPES:
            for K, HV in SHAPES:
                r = compile_kernel(kernel, dtype, K, HV)
                regs, spills, shared = r.registers, r.spill_bytes, r.shared_bytes
                print(f"| {kernel.fn.__name__} | {dtype} | {K} | {HV} | {P._tiles(K, HV, True)[0]} | {regs} | "
                      f"{spills} | {shared} |")


if __name__ == "__main__":
    main()
