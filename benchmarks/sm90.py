"""Compile a Triton kernel for an H200 (sm_90) on any machine, no GPU needed, and read ptxas's resource report.

Shared by ``compile_walk.py`` and ``compile_preprocess.py``: each builds the kernel's signature and constexprs
from its launcher; this file compiles to PTX with Triton and assembles it with Triton's own ptxas (``-v``).
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import NamedTuple, Optional

import triton
from triton.backends.compiler import GPUTarget

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
