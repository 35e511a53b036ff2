"""Compile the three sequential (chunk-walking) kernels for an H200 (sm_90) on any machine, no GPU needed, at every
loop-pipelining depth, and print what ptxas and Triton report.

The kernels: the fused forward's walk (``fused_fwd_kernel``, LOAD_P, bf16 precisions), the forward state pass the
backward recomputes with (``state_pass_fwd_kernel``) and the backward's reverse walk (``state_pass_bwd_kernel``).
NUM_STAGES = 0 is the while loop (never pipelined); n ≥ 1 a ``tl.range`` loop with num_stages = n. A row shows
registers, spill bytes, shared memory (the prefetch buffers live there: two programs per SM need ≤ 114 KB each)
and the number of cp.async instructions (0: nothing was pipelined). Run without TRITON_INTERPRET::

    python benchmarks/compile_sequential.py [--stages 0,1,2,3] [--bv 16,32,64] [--dtype bf16|fp32]

fp32 inputs run every dot at "ieee" (FMA, no tensor cores): there the walk and the reverse walk compile to 32
registers with ≈ 60 KB of spills per thread (docs/performance.md run 10).
"""
from __future__ import annotations

import argparse
import os

import torch
from compile_walk import compile_kernel, walk_consts  # noqa: E402  (this folder is on sys.path)

from linattn.ops.common import block_size, dot_precision
from linattn.ops.common.fused_fwd import fused_dot_precisions, fused_fwd_kernel
from linattn.ops.common.state_pass import state_pass_fwd_kernel


def kernels(d: int, BV: int, stages: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """{name: (kernel, constexprs)} at K = V = d, inputs of ``dtype``, the launchers' tiles and precisions."""
    walk = walk_consts(d, BV, True)
    dp, sp = fused_dot_precisions(dtype)
    walk.update(NUM_STAGES=stages, DOT_PREC=dp, STATE_PREC=sp, INPUT_PREC=dot_precision(dtype))
    bk = block_size(d, 256)
    fwd = dict(H=16, HV=16, K=d, V=d, BT=64, BK=bk, BV=BV, DOT_PREC=dot_precision(dtype), USE_DECAY=True,
               USE_DELTA=True, FROM_A_INV=False, USE_INITIAL_STATE=False, IS_VARLEN=False, INTERPRET=False,
               NUM_STAGES=stages)
    return {"walk": (fused_fwd_kernel, walk), "state_pass_fwd": (state_pass_fwd_kernel, fwd)}


def main():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels this script compiles")
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--bv", default="16,32,64")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    a = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    print(f"{a.dtype} inputs\n| kernel | K=V | BV | NUM_STAGES | registers | spill bytes | shared bytes | cp.async |")
    print("|---|---|---|---|---|---|---|---|")
    for BV in (int(x) for x in a.bv.split(",")):
        for stages in (int(x) for x in a.stages.split(",")):
            for name, (kernel, consts) in kernels(a.d, BV, stages, dtype).items():
                r = compile_kernel(kernel, consts, a.dtype)
                print(f"| {name} | {a.d} | {BV} | {stages} | {r.registers} | {r.spill_bytes} | {r.shared_bytes} | "
                      f"{r.cp_async} |", flush=True)


if __name__ == "__main__":
    main()
