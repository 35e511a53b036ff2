"""The sequential kernels' loop pipelining (NUM_STAGES): argument checks, and the compiled loop on sm_90.

The interpreter always runs the while loop (it cannot take range() of a runtime bound), so the numerics of every
NUM_STAGES are the CPU tests' of the kernels themselves; what only a compile shows is checked here: with
NUM_STAGES = 2 each kernel compiles for an H200 and Triton pipelines its loads (cp.async in the PTX), while
NUM_STAGES = 0 (the while loop) has none.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linattn.ops.common.fused_fwd import fused_fwd
from linattn.ops.common.state_pass import state_pass_fwd
from linattn.ops.common.state_pass_bwd import state_pass_bwd
from tests.ops.sm90_compile import compile_for_h200

pytestmark = pytest.mark.interpreter


def _inputs(B=1, T=8, H=1, K=16, V=16):
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    w, u = torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    gc = -torch.rand(B, T, H)
    return q, k, w, u, gc


@pytest.mark.parametrize("bad", [-1, 1.5, "2"])
def test_bad_num_stages_is_a_value_error(bad):
    q, k, w, u, gc = _inputs()
    with pytest.raises(ValueError, match="num_stages"):
        fused_fwd(q, k, w, u, gc, 0.25, None, torch.float32, num_stages=bad)
    with pytest.raises(ValueError, match="num_stages"):
        state_pass_fwd(k, w, u, gc, None, num_stages=bad)


def test_bad_block_v_is_a_value_error():
    q, k, w, u, gc = _inputs()
    with pytest.raises(ValueError, match="block_v"):
        state_pass_fwd(k, w, u, gc, None, block_v=24)
    with pytest.raises(ValueError, match="block_v"):
        state_pass_bwd(q, k, w, gc, u, u, torch.zeros(1, 1, 16, 16), 0.25, block_v=128)


def test_num_stages_keeps_the_result_in_the_interpreter():
    """Any NUM_STAGES runs the same steps (here: the while loop), so outputs are bitwise equal."""
    q, k, w, u, gc = _inputs(T=70)
    a = fused_fwd(q, k, w, u, gc, 0.25, None, torch.float32, num_stages=0)
    b = fused_fwd(q, k, w, u, gc, 0.25, None, torch.float32, num_stages=2)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_pipelined_loops_compile_for_h200():
    """Each pipelined sequential kernel (the forward walks; the reverse walk is never pipelined) at BV = 16 (bf16,
    K = V = 128) compiles for sm_90 at NUM_STAGES 0 and 2, in a process
    without the interpreter; only NUM_STAGES = 2 issues cp.async (Triton pipelines scf.for, never scf.while)."""
    res = compile_for_h200("import sm90 as c",
                           "{(n, s): tuple(c.compile_kernel(kern, consts))[:4] for s in (0, 2) "
                           "for n, (kern, consts) in c.sequential_kernels(128, 16, s).items()}")
    assert {n for n, _ in res} == {"walk", "state_pass_fwd"}
    for (name, stages), (regs, _, shared, cp_async) in res.items():
        assert 0 < regs <= 255, (name, stages, regs)
        assert (cp_async > 0) == (stages == 2), (name, stages, cp_async)
        # a pipelined loop runs only on grids of one program per SM (common.loop_stages), so it must fit one SM's
        # 227 KB (with pointers aligned as at a launch the three take 123–146 KB at NUM_STAGES = 2: one per SM)
        assert shared <= 227 * 1024, (name, stages, shared)


def test_sass_counts_show_the_walks_dots_on_tensor_cores():
    """sm90.sass_counts reads the cubin's SASS: the bf16 walk's dots are tensor-core MMAs, its totals add up."""
    sass = compile_for_h200("import sm90 as c",
                            "c.compile_kernel(*c.sequential_kernels(128, 16, 0)['walk']).sass")
    assert sass["total"] > 0 and sass["HGMMA"] + sass["HMMA"] > 0, sass
    assert sum(v for k, v in sass.items() if k not in ("total", "ops")) <= sass["total"], sass
    assert sum(sass["ops"].values()) == sass["total"] and sass["ops"].get("HGMMA", 0) == sass["HGMMA"], sass


def test_compile_all_records_every_kernel_of_the_op():
    """benchmarks/compile_all.py's record step (launches intercepted under the interpreter) sees every kernel of a
    forward + backward at the launchers' widths: 8 warps for dq/dk and the WY backward, 4 for the rest."""
    import json
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "compile_all.py", "--record-only", "--H", "2", "--HV", "4", "--D", "32",
                           "--forward", "walk"], cwd=root / "benchmarks", env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    widths = {x["name"]: x["num_warps"] for x in json.loads(done.stdout.strip().splitlines()[-1])}
    assert set(widths) == {"fused_prepass_kernel", "local_bwd_dv_kernel", "state_pass_bwd_kernel",
                           "local_bwd_dqk_kernel", "local_bwd_wy_kernel", "fused_fwd_kernel",
                           "chunk_local_cumsum_kernel", "kkt_solve_kernel", "wy_kernel", "state_pass_fwd_kernel"}
    wide = {"local_bwd_dqk_kernel", "local_bwd_wy_kernel"}
    assert {n: w for n, w in widths.items() if n in wide} == dict.fromkeys(wide, 8)
    assert all(w == 4 for n, w in widths.items() if n not in wide), widths


def test_launch_options_reach_the_launches_and_are_checked():
    """Launch options over common.LAUNCH_OPTIONS (compile_all --launch-options, common.launch_options_override):
    compile_all's record step sees a kernel's options (so its sm_90 compile uses them), the interpreter runs the op
    to the same result with them, an option other than maxnreg / num_stages is refused with the allowed ones named,
    and the defaults come back after the block."""
    import json

    import linattn
    from linattn.ops import common
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    opts = {"local_bwd_dqk": {"num_stages": 1}, "fused_prepass": {"maxnreg": 168}}
    done = subprocess.run([sys.executable, "compile_all.py", "--record-only", "--H", "2", "--HV", "4", "--D", "32",
                           "--launch-options", json.dumps(opts)], cwd=root / "benchmarks", env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = {x["name"]: x["options"] for x in json.loads(done.stdout.strip().splitlines()[-1])}
    assert seen["local_bwd_dqk_kernel"] == {"num_stages": 1} and seen["fused_prepass_kernel"] == {"maxnreg": 168}
    assert seen["local_bwd_wy_kernel"] == {}

    q, k, w, u, gc = _inputs(T=70)
    args = (q, k, torch.randn(1, 70, 2, 32), torch.nn.functional.logsigmoid(torch.randn(1, 70, 2)),
            torch.rand(1, 70, 2))
    plain = linattn.chunk_gated_delta_rule(*args, backend="triton")[0]
    with common.launch_options_override({**common.LAUNCH_OPTIONS, **opts}):
        assert common.launch_options("local_bwd_dqk") == {"num_stages": 1}
        assert torch.equal(linattn.chunk_gated_delta_rule(*args, backend="triton")[0], plain)
    assert common.launch_options("local_bwd_dqk") == {} and common.launch_options("kkt_solve") == {"maxnreg": 168}
    with common.launch_options_override({"fused_prepass": {"num_warps": 8}}):
        with pytest.raises(ValueError, match="maxnreg"):
            linattn.chunk_gated_delta_rule(*args, backend="triton")
    with pytest.raises(TypeError):
        common.LAUNCH_OPTIONS["kkt_solve"] = {}          # the defaults are read-only
