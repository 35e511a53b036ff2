"""``common/launch.py``: the compiled kernel's runner stands in for Triton's JIT launcher only where it launches the
same compiled kernel: the same key, aligned tensors, unspecialised 32-bit integers."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from linattn.ops.common import launch as launch_mod


class FakeCompiled:
    """A CompiledKernel's ``[grid](*params)`` runner, recording its launches."""

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *params: self.calls.append(("runner", grid, params))


class FakeJit:
    """A ``@triton.jit`` kernel: ``[grid](*args, **kwargs)`` records the launch and returns its compiled kernel."""
    arg_names = ["x", "n", "m", "BLOCK", "FLAG"]
    do_not_specialize = ["n"]

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            self.calls.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.calls)
        return jit


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(launch_mod, "_compiled", {})


def test_runner_takes_the_launches_after_the_first(fast):
    kernel, x = FakeJit(), torch.zeros(8)
    for n in (5, 6):
        launch_mod.launch(kernel, (3,), x, n, None, BLOCK=16, FLAG=True, num_warps=4)
    assert [c[0] for c in kernel.calls] == ["jit", "runner"]
    # the runner gets every parameter in the kernel's order (constexprs included) and a three-dimensional grid
    assert kernel.calls[1][1:] == ((3, 1, 1), (x, 6, None, 16, True))
    assert kernel.calls[0][3] == dict(BLOCK=16, FLAG=True, num_warps=4)


def test_a_different_specialisation_goes_through_the_jit_launcher(fast):
    kernel, x = FakeJit(), torch.zeros(8)
    launch_mod.launch(kernel, (1,), x, 5, None, BLOCK=16, FLAG=True)
    launch_mod.launch(kernel, (1,), x, 5, None, BLOCK=32, FLAG=True)          # another constexpr
    launch_mod.launch(kernel, (1,), x.double(), 5, None, BLOCK=16, FLAG=True)  # another dtype
    launch_mod.launch(kernel, (1,), x, 5, x, BLOCK=16, FLAG=True)             # a tensor where None was
    launch_mod.launch(kernel, (1,), x, 5, None, BLOCK=16, FLAG=True, num_warps=8)
    assert [c[0] for c in kernel.calls] == ["jit"] * 5


def test_what_triton_would_specialise_goes_through_the_jit_launcher(fast):
    kernel, x = FakeJit(), torch.zeros(16)
    launch_mod.launch(kernel, (1,), x, 5, None, BLOCK=16, FLAG=True)
    launch_mod.launch(kernel, (1,), x[1:], 5, None, BLOCK=16, FLAG=True)      # not 16-byte aligned
    launch_mod.launch(kernel, (1,), x, 2 ** 31, None, BLOCK=16, FLAG=True)    # a 64-bit integer
    launch_mod.launch(kernel, (1,), x, 5, 7, BLOCK=16, FLAG=True)             # m is specialised on its value
    assert [c[0] for c in kernel.calls] == ["jit"] * 4
    launch_mod.launch(kernel, (1,), x, 9, None, BLOCK=16, FLAG=True)
    assert kernel.calls[-1][0] == "runner"


def test_a_bound_launch_takes_the_runner_without_the_key(fast, monkeypatch):
    """BoundLaunch: the first call through launch() (the JIT path), then the compiled runner straight, its grid and
    constexprs fixed, without launch()'s signature and key (a prepared call's arguments keep their kinds)."""
    kernel, x = FakeJit(), torch.zeros(8)
    bound = launch_mod.BoundLaunch(kernel, (3,), 8, BLOCK=16, FLAG=True)
    bound(x, 5, None)
    monkeypatch.setattr(launch_mod, "_signature", None)                # not consulted any more
    bound(x, 6, None)
    assert [c[0] for c in kernel.calls] == ["jit", "runner"]
    assert kernel.calls[0][3] == dict(BLOCK=16, FLAG=True, num_warps=8)
    assert kernel.calls[1][1:] == ((3, 1, 1), (x, 6, None, 16, True))


def test_a_bound_launch_keeps_the_jit_path_where_launch_would(fast):
    """A misaligned tensor among the foreign ones (the caller's own are aligned by construction), or a first launch
    launch() would not cache (a 64-bit integer), goes through launch()."""
    kernel, x = FakeJit(), torch.zeros(16)
    wide = launch_mod.BoundLaunch(kernel, (1,), BLOCK=16, FLAG=True)
    wide(x, 2 ** 31, None)
    wide(x, 2 ** 31, None)
    assert [c[0] for c in kernel.calls] == ["jit", "jit"]
    bound = launch_mod.BoundLaunch(kernel, (1,), foreign=(0,), BLOCK=16, FLAG=False)
    bound(x, 5, None)
    bound(x[1:], 5, None)                     # a foreign tensor not 16-byte aligned: the JIT path again
    bound(x, 5, None)
    assert [c[0] for c in kernel.calls[2:]] == ["jit", "jit", "runner"]


@triton.jit(do_not_specialize=["n"])
def _add_one_kernel(x, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x + o, tl.load(x + o, mask=o < n) + 1, mask=o < n)


def test_a_real_kernel_launches_through_it(fast):
    """Under the interpreter the JIT launcher returns no compiled kernel: every launch is a JIT one, and runs; on a
    GPU the second and third go through the compiled kernel's runner."""
    x = torch.zeros(8, device="cuda" if torch.cuda.is_available() else "cpu")
    for _ in range(3):
        launch_mod.launch(_add_one_kernel, (1,), x, 5, BLOCK=8, num_warps=1)
    assert x.tolist() == [3.0] * 5 + [0.0] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the runner exists only for compiled kernels (a GPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_split_forward_launches_through_it(fast, dtype):
    """The split forward's three kernels (pre-pass, state pass, output) take the runner from the second call on,
    with o and the final state bitwise those of the first, JIT-launched call (None arguments and launch options
    included)."""
    from linattn.ops.common.fused_prepass import fused_prepass_kernel
    from linattn.ops.common.output import output_fwd_kernel
    from linattn.ops.common.state_pass import state_pass_fwd_kernel
    from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 1, 300, 2, 64
    q, k, v = (torch.randn(B, T, H, K, generator=gen).to("cuda", dtype) for _ in range(3))
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(dtype)
    g = (-torch.rand(B, T, H, generator=gen)).cuda()
    beta = torch.rand(B, T, H, generator=gen).to("cuda", dtype)
    h0 = torch.randn(B, H, K, K, generator=gen).cuda()

    def run():
        return chunk_gated_delta_rule_on_path("split", q, k, v, g, beta, initial_state=h0, output_final_state=True)
    want = run()                              # the first launch under each key: the JIT launcher
    first, second = run(), run()
    launched = {key[0] for key in launch_mod._compiled}
    assert {fused_prepass_kernel, state_pass_fwd_kernel, output_fwd_kernel} <= launched
    for got in (first, second):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
