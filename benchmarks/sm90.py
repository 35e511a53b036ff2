"""Compile a Triton kernel for an H200 (sm_90) on any machine, no GPU needed, and read ptxas's resource report.

Shared by ``compile_walk.py`` and ``compile_preprocess.py``: each builds the kernel's signature and constexprs
from its launcher; this file compiles to PTX with Triton and assembles it with Triton's own ptxas (``-v``).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import NamedTuple

import triton
from triton.backends.compiler import GPUTarget

TARGET = GPUTarget("cuda", 90, 32)  # sm_90, 32-thread warps
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


class Resources(NamedTuple):
    registers: int       # per thread
    spill_bytes: int     # stores + loads, ptxas -v
    shared_bytes: int    # Triton's shared memory (pipelining buffers included)
    cp_async: int        # cp.async instructions in the PTX: > 0 when a loop's loads were software-pipelined


def compile_sm90(kernel, consts: dict, arg_type, num_warps: int, maxnreg: int | None = None) -> Resources:
    """Compile ``kernel`` (a ``@triton.jit`` function) with the constexprs ``consts`` and, for every other
    argument, the Triton type string ``arg_type(name)`` gives ("*bf16", "i32", ...); return its resources.
    ``maxnreg`` caps the registers per thread (Triton's launch option of that name; None: ptxas decides)."""
    signature = {name: "constexpr" if name in consts else arg_type(name) for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(n),): v for n, v in consts.items()}
    compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=TARGET, options=dict(num_warps=num_warps, maxnreg=maxnreg))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill", log))
    return Resources(regs, spills, compiled.metadata.shared, compiled.asm["ptx"].count("cp.async."))
