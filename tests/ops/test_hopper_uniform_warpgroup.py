"""The walk kernel's warpgroup index made warp-uniform in TileLang's CUDA (``hopper/uniform_warpgroup.py``,
``chunk_fwd.UNIFORM_WARPGROUP``): the rewrite on a source of TileLang's shape, the callback's chaining and its
scope (only while a marked kernel compiles), the compiled sm_90a source (where TileLang is installed), and on the GPU
the op's outputs bitwise those of the plain kernels."""
from __future__ import annotations

import pytest
import torch

from linattn.ops.hopper import chunk_fwd as hopper
from linattn.ops.hopper import uniform_warpgroup as uniform

from .test_hopper_deferred_decay import COMPILES, KERNEL_VARIANTS, kernel_source
from .test_hopper_fwd import ON_HOPPER, gpu_inputs, op_outputs_off_and_on

INDEX = uniform.WARPGROUP_INDEX
SOURCE = f"""extern "C" __global__ void k_kernel(const float* __restrict__ x, int T);
extern "C" __global__ void __launch_bounds__(384, 1) k_kernel(const float* __restrict__ x, int T) {{
  extern __shared__ __align__(1024) uchar buf_dyn_shmem[];
  if (256 <= ((int)threadIdx.x)) {{
    y = {INDEX} * 8192;
  }} else {{
    z = (({INDEX} + 1) & 1) * 16384;
  }}
}}
"""


def test_the_rewrite_reads_a_uniform_copy_declared_at_the_kernels_entry():
    out = uniform.rewrite(SOURCE)
    declaration = f"const int {uniform.UNIFORM_NAME} = __shfl_sync(0xffffffffu, ((int)threadIdx.x) >> 7, 0);"
    assert INDEX not in out and out.count(uniform.UNIFORM_NAME) == 3 and out.count(declaration) == 1
    body = out.index("k_kernel(const float* __restrict__ x, int T) {")        # the definition, not the declaration
    assert out.index(declaration) > body and out.index(declaration) < out.index("extern __shared__")
    assert out.replace(declaration, "").replace(uniform.UNIFORM_NAME, INDEX).replace("{\n  \n", "{\n") == SOURCE
    assert uniform.rewrite("int main() { return 0; }") == "int main() { return 0; }"
    device_function = f"__device__ int wg() {{ return {INDEX}; }}"            # no kernel to declare it in
    assert uniform.rewrite(device_function) == device_function


def test_the_callback_rewrites_only_while_a_marked_kernel_compiles_and_chains(monkeypatch):
    seen = []
    monkeypatch.setattr(uniform, "_previous", lambda code, target: seen.append(code) or code + "//previous")
    monkeypatch.setattr(uniform, "_install", lambda: None)        # no TileLang registry needed for this
    assert uniform._postproc(SOURCE, None) == SOURCE + "//previous"          # not inside rewriting(): untouched
    with uniform.rewriting():
        assert uniform._postproc(SOURCE, None) == uniform.rewrite(SOURCE) + "//previous"
    assert uniform._postproc(SOURCE, None) == SOURCE + "//previous" and seen[1] == uniform.rewrite(SOURCE)


@COMPILES
@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
def test_the_marked_kernel_compiles_with_the_uniform_index(variant):
    """sm_90a source of the default launch (and phase A's, and the two-launch walk's): with ``uniform_warpgroup``
    every warpgroup index reads the uniform copy and the source is otherwise the plain kernel's; a plain kernel
    compiled afterwards (the callback installed) is untouched."""
    marked, plain = kernel_source(variant, uniform_warpgroup=True), kernel_source(variant)
    assert INDEX in plain and INDEX not in marked and uniform.UNIFORM_NAME not in plain
    assert uniform.rewrite(plain) == marked
    assert INDEX in kernel_source(variant, BV=64)              # compiled after the callback was installed


@ON_HOPPER
@pytest.mark.parametrize("B,T", [(8, 1024), (1, 16384), (1, 4096)], ids=["unsegmented", "segmented", "two_launch"])
def test_uniform_warpgroup_is_bitwise_the_plain_kernel_on_the_gpu(monkeypatch, B, T):
    """bf16 H=16 K=V=128 through the op ("auto": the unsegmented kernel, the five-launch and the two-launch
    segmented forwards) with UNIFORM_WARPGROUP off and on: o and the final state bitwise equal (the rewrite
    changes no value)."""
    outs = op_outputs_off_and_on(monkeypatch, hopper, "UNIFORM_WARPGROUP", gpu_inputs(B, T, 16, 16, 128, 128, seed=7))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
