"""Compile the fused forward's two kernels for an H200 (sm_90, triton's own ptxas) on any machine, no GPU needed.

Prints registers, spill bytes and shared memory from ``ptxas -v`` for the sequential walk (``fused_fwd_kernel``)
with and without LOAD_P (P read from the pre-pass instead of Q Kᵀ recomputed), per BV, and for the pre-pass
(``fused_prepass_kernel``) with and without STORE_P, so that a change to either is checked for register pressure
before it reaches the device. bf16 inputs, the launchers' tiles and precisions. Run without TRITON_INTERPRET::

    python benchmarks/compile_walk.py [K=V ...]       # default 128
"""
from __future__ import annotations

import os
import sys

import torch
from sm90 import compile_sm90  # noqa: E402  (this folder is on sys.path)

from linattn.ops.common import block_size, dot_precision
from linattn.ops.common.fused_fwd import fused_dot_precisions, fused_fwd_kernel
from linattn.ops.common.fused_prepass import fused_prepass_kernel
from linattn.ops.common.kkt_solve import merge_precision
from linattn.ops.common.local_bwd_dqk import local_bwd_dqk_kernel  # noqa: F401  (compiled by tests through this module)
from linattn.ops.common.local_bwd_utils import bwd_dot_precision
from linattn.ops.common.output import output_fwd_kernel  # noqa: F401  (compiled by tests through this module)
from linattn.ops.common.split_fwd import output_precision
from linattn.ops.common.state_pass import state_pass_fwd_kernel  # noqa: F401  (likewise)
from linattn.ops.common.state_pass_bwd import state_pass_bwd_kernel  # noqa: F401  (likewise)
from linattn.ops.gated_delta.recurrent_kernels import fused_recurrent_fwd_kernel  # noqa: F401  (likewise)

INPUT_ARGS = {"q", "k", "v", "o", "beta", "do"}  # in the input dtype; g and the intermediates are fp32
INT_ARGS = {"T", "NT", "NTB", "NSEG", "L"}
INDEX_ARGS = {"cu_seqlens", "chunk_indices", "chunk_offsets", "segments", "state_indices"}


def compile_kernel(kernel, consts: dict, dtype: str = "bf16", num_warps: int = 4, bf16_args: tuple = ()):
    """Compile ``kernel`` for sm_90 with the given constexprs; return sm90.Resources. ``bf16_args``: pointer
    arguments stored in bf16 instead of fp32 (the split forward's and the backward recompute's h and v_new)."""
    def arg_type(name: str) -> str:
        if name in INT_ARGS:
            return "i32"
        if name == "scale":
            return "fp32"
        if name in INDEX_ARGS:
            return "*i32"
        if name in bf16_args:
            return "*bf16"
        return f"*{dtype}" if name in INPUT_ARGS else "*fp32"

    return compile_sm90(kernel, consts, arg_type, num_warps)


def walk_consts(d: int, BV: int, load_p: bool) -> dict:
    """Constexprs of the plain walk at K = V = d for bf16 inputs (the launcher's tiles and precisions)."""
    dp, sp = fused_dot_precisions(torch.bfloat16)
    return dict(H=16, HV=16, K=d, V=d, BT=64, BK=block_size(d, 256), BV=BV, DOT_PREC=dp, STATE_PREC=sp,
                INPUT_PREC=dot_precision(torch.bfloat16), USE_INITIAL_STATE=False, IS_VARLEN=False, SEGMENTED=False,
                AFFINE=False, LOAD_P=load_p, INTERPRET=False, NUM_STAGES=0)


def prepass_consts(d: int, store_p: bool) -> dict:
    """Constexprs of the pre-pass at K = V = d for bf16 inputs."""
    ip = dot_precision(torch.bfloat16)
    return dict(H=16, HV=16, K=d, V=d, BT=64, BK=block_size(d, 64), BV=block_size(d, 64), DOT_PREC=ip,
                INPUT_PREC=ip, IS_VARLEN=False, STORE_P=store_p, STORE_A_INV=False,
                MERGE_PREC=merge_precision(torch.bfloat16), INTERPRET=False)


def output_consts(d: int) -> dict:
    """Constexprs of the output kernel at K = V = d for bf16 inputs, the split forward's precision."""
    return dict(H=16, HV=16, K=d, V=d, BT=64, BK=block_size(d, 64), BV=block_size(d, 64),
                DOT_PREC=dot_precision(torch.bfloat16), OUT_PREC=output_precision(torch.bfloat16), USE_DECAY=True,
                IS_VARLEN=False, INTERPRET=False)


def state_pass_consts(d: int, BV: int, from_a_inv: bool = False) -> dict:
    """Constexprs of the forward state pass at K = V = d for bf16 inputs (pipelined loop, as at one wave); with
    ``from_a_inv`` it reads A_inv and the values (then pass bf16_args=("u",) to compile_kernel)."""
    return dict(H=16, HV=16, K=d, V=d, BT=64, BK=block_size(d, 256), BV=BV, DOT_PREC=dot_precision(torch.bfloat16),
                USE_DECAY=True, USE_DELTA=True, FROM_A_INV=from_a_inv, USE_INITIAL_STATE=False, IS_VARLEN=False,
                INTERPRET=False, NUM_STAGES=3)


def state_pass_bwd_consts(d: int, BV: int) -> dict:
    """Constexprs of the backward's reverse walk at K = V = d for bf16 inputs (its launch: 4 warps)."""
    return dict(H=16, HV=16, K=d, V=d, BT=64, BK=block_size(d, 256), BV=BV,
                DOT_PREC=bwd_dot_precision(torch.bfloat16), IS_VARLEN=False)


def dqk_consts(d: int) -> dict:
    """Constexprs of the backward's dq/dk stage at K = V = d for bf16 inputs (its launch: 8 warps)."""
    return dict(H=16, HV=16, K=d, V=d, BT=64, BK=block_size(d, 64), BV=block_size(d, 64),
                DOT_PREC=bwd_dot_precision(torch.bfloat16), IS_VARLEN=False)


def decode_consts(BV: int, one_step: bool, state_vk: bool = False) -> dict:
    """Constexprs of one decode step (HV=32 K=V=128, pool slots, gates and norms fused) on the token loop or the
    ONE_STEP path, over a K-major pool or (``state_vk``) a V-major one; the pool's dtype is the h0 / ht arguments'
    (``bf16_args``)."""
    return dict(H=16, HV=32, K=128, V=128, BK=128, BV=BV, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True,
                STORE_INTERMEDIATE=False, IS_VARLEN=False, USE_STATE_INDICES=True, USE_QK_L2NORM=True,
                USE_GATE_IN_KERNEL=True, USE_BETA_SIGMOID=True, ONE_STEP=one_step, STATE_VK=state_vk)


def main():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels this script compiles")
    print("| kernel | K=V | BV | flag | DOT_PREC / STATE_PREC | registers | spill bytes | shared bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for d in [int(a) for a in sys.argv[1:]] or [128]:
        for BV in (16, 32, 64):
            for load_p in (False, True):
                c = walk_consts(d, BV, load_p)
                r = compile_kernel(fused_fwd_kernel, c)
                print(f"| walk | {d} | {BV} | LOAD_P={load_p} | {c['DOT_PREC']} / {c['STATE_PREC']} | "
                      f"{' | '.join(map(str, r[:3]))} |", flush=True)
        for store_p in (False, True):
            c = prepass_consts(d, store_p)
            r = compile_kernel(fused_prepass_kernel, c)
            print(f"| prepass | {d} | - | STORE_P={store_p} | {c['DOT_PREC']} | {' | '.join(map(str, r[:3]))} |",
                  flush=True)


if __name__ == "__main__":
    main()
