"""``hopper/precompile.py``: kernels compiled in worker processes land in TileLang's disk cache, and this process's
own compile of each is then a load from that cache (TileLang's ``JITKernel.from_database``), not a compile.

The compiling case needs TileLang and nvcc (sm_90a, as in test_hopper_fwd.py) and runs in a child process with its
own cache directory, so that no kernel this test session compiled before (per-process caches) can stand in for a
load. Three small walks (K = V = 64, H = 1, HV = 2: ≈ 4 s each cold) in two workers."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from linattn.ops.hopper.compile import tilelang_available
from linattn.ops.hopper.precompile import Build, precompile

ROOT = Path(__file__).resolve().parents[2]
needs_tilelang = pytest.mark.skipif(not tilelang_available(), reason="needs TileLang")

CHILD = """
from unittest import mock

from tilelang.jit import JITKernel

from linattn.ops.hopper import chunk_fwd
from linattn.ops.hopper.precompile import Build, precompile

walk = lambda **flags: Build(chunk_fwd.compiled_kernel, (1, 2, 64, 64, 64, 0.125), dict(target="sm_90a", **flags))
builds = [walk(use_initial_state=True), walk(use_initial_state=False), walk(use_initial_state=True, affine=True)]
report = precompile(builds, workers=2)
loads = []
load = JITKernel.from_database.__func__


def counted(cls, *args, **kwargs):
    loads.append(kwargs["kernel_lib_path"])
    return load(cls, *args, **kwargs)


with mock.patch.object(JITKernel, "from_database", classmethod(counted)):
    kernels = [build() for build in builds]
print(repr((report.compiled, [str(e) for _, e in report.failures], report.workers, len(loads),
            len({k.get_kernel_source() for k in kernels}))))
"""


@needs_tilelang
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_precompiled_kernels_load_from_tilelangs_disk_cache(tmp_path):
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env.update(TILELANG_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled, failures, workers, loads, distinct = eval(done.stdout.strip().splitlines()[-1])
    assert (compiled, failures, workers) == (3, [], 2)
    assert loads == 3          # each of the three came from the disk cache, none was compiled again
    assert distinct == 3       # three different kernels, not one entry three times


@needs_tilelang
def test_a_failed_build_is_reported_not_raised():
    builds = [Build(int, ("not a number",)), Build(int, ("7",)), Build(lambda: 0)]   # bad value; fine; no pickle
    report = precompile(builds, workers=2)
    assert report.compiled == 1 and report.workers == 2
    failed = {str(build): error for build, error in report.failures}
    assert set(failed) == {str(builds[0]), str(builds[2])}
    assert failed[str(builds[0])].startswith("ValueError")


def test_gpu_check_edges_names_each_hopper_kernel_once():
    """benchmarks/gpu_check_edges.py's precompile list at its shapes (B = 2, T = 300: the forced plan is unsegmented,
    as for the packed case, padded to 300 rows) on a 132-SM card: the forward's pre-pass and walk for β in fp32 and
    bf16, the backward's walk and states walk and its pre-pass for β in fp32 and bf16, each once."""
    from .sm90_compile import compile_for_h200
    sms = "types.SimpleNamespace(multi_processor_count=132)"
    built = compile_for_h200(f"import types, torch; from unittest import mock; import gpu_check_edges as edges; "
                             f"mock.patch.object(torch.cuda, 'get_device_properties', lambda i: {sms}).start()",
                             "[str(build) for build in edges.hopper_builds()]")
    called = [name.split("(")[0].removeprefix("linattn.ops.hopper.") for name in built]
    assert sorted(called) == sorted(["prepass.prepass_kernel", "walk_launch.walk_kernel"] * 2
                                    + ["chunk_bwd.compiled_kernel", "walk_launch.states_kernel"]
                                    + ["prepass.compiled_kernel"] * 2), built
    assert len(set(built)) == len(built)


def test_a_build_pickles_and_names_its_call():
    from linattn.ops.hopper import chunk_bwd
    build = Build(chunk_bwd.compiled_kernel, (2, 4, 64, 64, 0.125, 64), dict(target="sm_90a"))
    again = pickle.loads(pickle.dumps(build))
    assert again.compile is chunk_bwd.compiled_kernel and again == build
    assert str(build) == "linattn.ops.hopper.chunk_bwd.compiled_kernel(2, 4, 64, 64, 0.125, 64, target='sm_90a')"


def test_nothing_to_compile_starts_no_process():
    assert precompile([]).workers == 0
    with pytest.raises(ValueError, match="workers"):
        precompile([Build(int)], workers=0)
