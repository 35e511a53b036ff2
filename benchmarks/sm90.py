"""Compile a Triton kernel for an H200 (sm_90) on any machine, no GPU needed, and read ptxas's resource report.

:func:`compile_sm90` compiles to PTX with Triton and assembles it with Triton's own ptxas (``-v``); ``compile_all.py``
uses it for every recorded launch. Below it, the signatures and constexprs of single kernels as their launchers
build them for bf16 inputs (:func:`compile_kernel` with ``*_consts``, :func:`sequential_kernels`,
:func:`compile_preprocess_kernel`): the tests' sm_90 compile checks (``tests/ops/sm90_compile.py``) run through
them in a process without the interpreter.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import NamedTuple, Optional

import torch
import triton
from triton.backends.compiler import GPUTarget

from linattn.ops.common import block_size, dot_precision
from linattn.ops.common import preprocess as P
from linattn.ops.common.fused_fwd import fused_dot_precisions, fused_fwd_kernel
from linattn.ops.common.kkt_solve import merge_precision
from linattn.ops.common.local_bwd_utils import bwd_dot_precision
from linattn.ops.common.split_fwd import output_precision
from linattn.ops.common.state_pass import state_pass_fwd_kernel

TARGET = GPUTarget("cuda", 90, 32)  # sm_90, 32-thread warps
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
CUOBJDUMP = os.path.join(os.path.dirname(PTXAS), "cuobjdump")
# SASS opcode families worth counting (static instructions, not executed ones): tensor-core MMAs (HMMA: mma.sync,
# HGMMA: wgmma), fp32 FMAs (an "ieee" dot's work lands here), local-memory traffic (spills), shared memory, global
# loads / stores and async copies, cross-lane shuffles (reductions), barriers, special functions (exp, rsqrt)
SASS_FAMILIES = ("HGMMA", "HMMA", "FFMA", "LDL", "STL", "LDS", "STS", "LDSM", "LDG", "STG", "LDGSTS", "SHFL", "BAR",
                 "MUFU")


class Resources(NamedTuple):
    registers: int       # per thread
    spill_bytes: int     # stores + loads, ptxas -v
    shared_bytes: int    # Triton's shared memory (pipelining buffers included)
    cp_async: int        # cp.async instructions in the PTX: > 0 when a loop's loads were software-pipelined
    sass: Optional[dict] = None  # static SASS instruction count per family of SASS_FAMILIES, and "total"


def sass_counts(cubin: bytes) -> dict:
    """Static instruction counts of a cubin's SASS (cuobjdump), per opcode family of :data:`SASS_FAMILIES`, and
    under "ops" every opcode's, most frequent first."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    ops = collections.Counter(m.group(1) for m in re.finditer(
        r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", sass, re.MULTILINE))
    return {"total": sum(ops.values()), **{k: ops[k] for k in SASS_FAMILIES}, "ops": dict(ops.most_common())}


def compile_sm90(kernel, consts: dict, arg_type, num_warps: int, maxnreg: int | None = None,
                 num_stages: int | None = None) -> Resources:
    """Compile ``kernel`` (a ``@triton.jit`` function) with the constexprs ``consts`` and, for every other
    argument, the Triton type string ``arg_type(name)`` gives ("*bf16", "i32", ...); return its resources.
    ``maxnreg`` caps the registers per thread (Triton's launch option of that name; None: ptxas decides);
    ``num_stages`` is the launch option that software-pipelines the kernel's ``for`` loops (None: Triton's 3)."""
    signature = {name: "constexpr" if name in consts else arg_type(name) for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(n),): v for n, v in consts.items()}
    # every pointer 16-byte aligned, as Triton's launcher specialises a kernel for torch tensors (their storage is
    # aligned, and the ops pass contiguous tensors): without it the compiler cannot vectorise a single load or
    # store, and the SASS below would not be the GPU's (this script's numbers before 2026-11-30 are without it)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if signature[name].startswith("*")}
    options = dict(num_warps=num_warps, maxnreg=maxnreg, **({} if num_stages is None else dict(num_stages=num_stages)))
    compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                                        attrs=attrs), target=TARGET, options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill", log))
    return Resources(regs, spills, compiled.metadata.shared, compiled.asm["ptx"].count("cp.async."),
                     sass_counts(compiled.asm["cubin"]))


INPUT_ARGS = {"q", "k", "v", "o", "beta", "do"}  # in the input dtype; g and the intermediates are fp32
INT_ARGS = {"T", "NT", "NTB", "NSEG", "L"}
INDEX_ARGS = {"cu_seqlens", "chunk_indices", "chunk_offsets", "segments", "segment_first", "state_indices"}


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


def state_pass_bwd_consts(d: int, BV: int, maps: bool = False) -> dict:
    """Constexprs of the backward's reverse walk at K = V = d for bf16 inputs (its launch: 4 warps); ``maps``: its
    MAPS mode (phase A' of the sequence-parallel walk, seq_parallel_bwd.py)."""
    return dict(H=16, HV=16, K=d, V=d, BT=64, BK=block_size(d, 256), BV=BV,
                DOT_PREC=bwd_dot_precision(torch.bfloat16), IS_VARLEN=False, MAPS=maps)


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


def sequential_kernels(d: int, BV: int, stages: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The forward's sequential kernels (the walk with LOAD_P, the state pass) at loop-pipelining depth ``stages``
    (0: the while loop, never pipelined; n ≥ 1: a ``tl.range`` loop with num_stages = n), as
    {name: (kernel, constexprs)} at K = V = d, inputs of ``dtype``, the launchers' tiles and precisions."""
    walk = walk_consts(d, BV, True)
    dp, sp = fused_dot_precisions(dtype)
    walk.update(NUM_STAGES=stages, DOT_PREC=dp, STATE_PREC=sp, INPUT_PREC=dot_precision(dtype))
    bk = block_size(d, 256)
    fwd = dict(H=16, HV=16, K=d, V=d, BT=64, BK=bk, BV=BV, DOT_PREC=dot_precision(dtype), USE_DECAY=True,
               USE_DELTA=True, FROM_A_INV=False, USE_INITIAL_STATE=False, IS_VARLEN=False, INTERPRET=False,
               NUM_STAGES=stages)
    return {"walk": (fused_fwd_kernel, walk), "state_pass_fwd": (state_pass_fwd_kernel, fwd)}


PREPROCESS_DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
PREPROCESS_INPUT_ARGS = {"q", "k", "qn", "kn", "dqn", "dkn", "dq", "dk", "beta", "betan", "dbetan", "dbeta"}
PREPROCESS_INT_ARGS = {"NTOK", "NB"}


def compile_preprocess_kernel(kernel, dtype: str, K: int, HV: int, flags=(True, True, True)) -> Resources:
    """Compile a pre-processing kernel (``common/preprocess.py``) for sm_90 with its launcher's tiles, H = HV / 2,
    ``flags`` = (L2NORM, GATE, BETA_SIGMOID); q, k, beta and their norms / gradients in ``dtype``."""
    BT, BK, BHV = P._tiles(K, HV, flags[0])
    consts = dict(H=HV // 2, HV=HV, K=K, BT=BT, BK=BK, BHV=BHV, L2NORM=flags[0], GATE=flags[1], BETA_SIGMOID=flags[2])

    def arg_type(name: str) -> str:
        if name in PREPROCESS_INT_ARGS:
            return "i32"
        return PREPROCESS_DTYPES[dtype] if name in PREPROCESS_INPUT_ARGS else "*fp32"
    return compile_sm90(kernel, consts, arg_type, P.NUM_WARPS)
