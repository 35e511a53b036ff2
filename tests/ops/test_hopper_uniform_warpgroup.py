"""The walk kernel's warpgroup index made warp-uniform in TileLang's CUDA (``hopper/uniform_warpgroup.py``): the
rewrite on a source of TileLang's shape, the callback's chaining and its scope (only while a marked kernel
compiles), and the compiled sm_90a source (where TileLang is installed): the walk's source is TileLang's with that
rewrite and nothing else."""
from __future__ import annotations

import pytest

from linattn.ops.hopper import chunk_fwd as hopper
from linattn.ops.hopper import uniform_warpgroup as uniform

from .test_hopper_deferred_decay import COMPILES, KERNEL_VARIANTS, kernel_source

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
def test_the_walk_compiles_with_the_uniform_index(variant):
    """sm_90a source of the default launch (and phase A's, and the two-launch walk's): every warpgroup index reads
    the uniform copy, and the source is otherwise what TileLang generates for the unmarked prim_func (compiled after
    the callback was installed, so the callback leaves unmarked kernels alone)."""
    options = KERNEL_VARIANTS[variant]
    marked = kernel_source(variant)
    func = hopper.build_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, **options)
    plain = hopper.compile_prim_func(func, "sm_90a").get_kernel_source()
    assert INDEX in plain and INDEX not in marked and uniform.UNIFORM_NAME not in plain
    assert uniform.rewrite(plain) == marked
