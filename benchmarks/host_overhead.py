"""Host (CPU-side) overhead of the public ops, step by step (issues 4 and 5).

Three calls, at the shapes of the issues: ``gated_delta_rule_decode`` at B=1, Tq=1, H=16, HV=32, K=V=128 (fp32
pool, fused L2 norm / gate / β sigmoid, with and without the slot check); ``chunk_gated_delta_rule`` forward at
B=1, T=4096 (64 on the CPU), H=16, K=V=128 (plain, and with the pre-processing done in PyTorch around the core); and
``fused_recurrent_gated_delta_rule`` forward at T=1. For each: the median wall time of the public call, of each
step on its own (input checks, backend choice, pre-processing, launchers, the custom-op dispatch the eager path
skips) and the number of device kernels (GPU) or ATen ops (CPU) per call.

Two modes:

* without a GPU (default there): TRITON_INTERPRET=1 and every Triton launch replaced by a no-op, so the figures
  are the Python cost alone (overhead does not depend on T: the tensors are allocated but never computed on);
* on a GPU: the real kernels, with ``--noop`` to replace them by no-ops there too. ``latency`` syncs after every
  call; ``host`` issues 200 calls and syncs once (the rate the CPU can feed the GPU).

    python benchmarks/host_overhead.py [--noop] [--calls N]

Prints one table last.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import linattn  # noqa: E402
from linattn.ops.common import fused_fwd as ff_mod  # noqa: E402
from linattn.ops.common import fused_prepass as fp_mod  # noqa: E402
from linattn.ops.gated_delta import chunk as chunk_mod  # noqa: E402
from linattn.ops.gated_delta import decode as decode_mod  # noqa: E402
from linattn.ops.gated_delta import recurrent as rec_mod  # noqa: E402
from linattn.ops.gated_delta import recurrent_kernels as rk  # noqa: E402
from linattn.ops.utils import check_gated_delta_inputs, eager_call, gate_from_raw, l2norm, select_backend  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
H, HV, K, V = 16, 32, 128, 128


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing and returns a compiled kernel whose
    runner does nothing either, so that ``common.launch`` takes its runner path after the first launch as on a GPU.
    ``kernel``: the one replaced (its parameter names and unspecialised integers, which that path reads)."""

    def __init__(self, kernel=None):
        self.arg_names = list(getattr(kernel, "arg_names", ()))
        # a JITFunction's own list; the interpreter's kernels keep theirs among the jit's keywords
        self.do_not_specialize = list(getattr(kernel, "do_not_specialize", None) or
                                      getattr(kernel, "kwargs", {}).get("do_not_specialize") or ())

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _NoRunner()


class _NoRunner:
    """A compiled kernel's ``[grid](*params)`` runner that does nothing."""

    def __getitem__(self, grid):
        return lambda *params: None


class _NoKernel:
    """Stands in for a compiled TileLang kernel: ``hopper.compile.launcher`` returns it as it is, and launching it
    does nothing."""

    def __call__(self, *args):
        return None


def no_launches():
    import importlib
    for mod, name in ((rk, "fused_recurrent_fwd_kernel"), (ff_mod, "fused_fwd_kernel"),
                      (fp_mod, "fused_prepass_kernel")):
        setattr(mod, name, _NoLaunch(getattr(mod, name)))
    # the split forward's state pass and output kernel (the default path below 128 (sequence, head) pairs), the
    # sequence-parallel scan, the in-op pre-processing, the Hopper backward's gradient sums, segment plan and
    # reverse scan
    for module, name in (("common.state_pass", "state_pass_fwd_kernel"), ("common.output", "output_fwd_kernel"),
                         ("common.seq_parallel", "affine_scan_kernel"), ("common.preprocess", "preprocess_fwd_kernel"),
                         ("common.partial_sum", "partial_sums_kernel"), ("hopper.map_bound", "segment_plan_kernel"),
                         ("hopper.reverse_maps", "reverse_map_scan_kernel")):
        mod = importlib.import_module("linattn.ops." + module)
        setattr(mod, name, _NoLaunch(getattr(mod, name)))
    # the Hopper kernels (TileLang): every build a no-op, so no compile either
    stub = _NoKernel()
    for module, name in (("chunk_fwd", "compiled_kernel"), ("prepass", "compiled_kernel"),
                         ("chunk_bwd", "compiled_kernel"), ("chunk_bwd", "compiled_warm_kernel"),
                         ("chunk_bwd_roles", "compiled_kernel")):
        setattr(importlib.import_module("linattn.ops.hopper." + module), name, lambda *args, **kwargs: stub)


def sync():
    if GPU:
        torch.cuda.synchronize()


def median_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    sync()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    sync()
    return statistics.median(ts) * 1e6


def latency_us(fn, calls: int) -> float:
    """Median of call + sync (on the CPU the same as median_us)."""
    def step():
        fn()
        sync()
    return median_us(step, calls)


def host_rate_us(fn, calls: int) -> float:
    """Issue 200 calls, sync once: µs per call when the CPU is the bottleneck."""
    fn()
    sync()
    best = float("inf")
    for _ in range(max(3, calls // 200)):
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / 200 * 1e6)
    return best


def launches(fn) -> int:
    """Device kernels per call on the GPU; ATen ops with a kernel (views excluded) per call on the CPU."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if GPU else [])
    fn()
    sync()
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sync()
    events = prof.events()
    if GPU:
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    views = ("aten::view", "aten::as_strided", "aten::empty", "aten::empty_strided", "aten::lift_fresh",
             "aten::_reshape_alias", "aten::alias", "aten::detach", "aten::unsqueeze", "aten::slice",
             "aten::select", "aten::expand", "aten::t", "aten::transpose", "aten::permute", "aten::reshape",
             "aten::contiguous", "aten::to", "aten::_to_copy_view")
    tops = [e for e in events if e.name.startswith("aten::") and e.cpu_parent is None]
    return sum(1 for e in tops if e.name not in views)


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEV).to(dtype)


def decode_case():
    q, k, v = rand(1, 1, H, K), rand(1, 1, H, K), rand(1, 1, HV, V)
    g, beta = rand(1, 1, HV, dtype=torch.float32), rand(1, 1, HV, dtype=torch.float32)
    A_log, dt_bias = torch.rand(HV, device=DEV).log(), torch.randn(HV, device=DEV)
    pool = torch.randn(8, HV, K, V, device=DEV)
    slots = torch.tensor([3], dtype=torch.int32, device=DEV)
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              backend="triton")
    op_args = (q, k, v, g, beta, K ** -0.5, pool, slots, A_log, dt_bias, True, True, False, "triton", False)
    calls = {
        "decode B=1 Tq=1 (slot check)": lambda: linattn.gated_delta_rule_decode(q, k, v, g, beta, pool, slots, **kw),
        "decode B=1 Tq=1 (no check)": lambda: linattn.gated_delta_rule_decode(q, k, v, g, beta, pool, slots,
                                                                              check_indices=False, **kw),
    }
    steps = {
        "check_gated_delta_inputs": lambda: check_gated_delta_inputs(q, k, v, g, beta, None, None, None, A_log,
                                                                     dt_bias),
        "pool shape check": lambda: decode_mod._check_pool(pool, slots, 1, HV, K, V, q.device, False),
        "slot value check (.tolist sync)": lambda: decode_mod._check_pool(pool, slots, 1, HV, K, V, q.device, True),
        "select_backend": lambda: select_backend("triton", q.device),
        "eager_call": lambda: eager_call(q, k, v, g, beta, pool, slots, A_log, dt_bias),
        "launcher (alloc + launch)": lambda: decode_mod._decode_impl(*op_args),
        "custom op (dispatch + launcher)": lambda: decode_mod._decode_op(*op_args),
    }
    return calls, steps


def chunk_case(T: int):
    q, k, v = rand(1, T, H, K), rand(1, T, H, K), rand(1, T, H, V)
    g = torch.nn.functional.logsigmoid(rand(1, T, H, dtype=torch.float32))
    beta = rand(1, T, H, dtype=torch.float32).sigmoid()
    A_log, dt_bias = torch.rand(H, device=DEV).log(), torch.randn(H, device=DEV)
    op_args = (q, k, v, g, beta, K ** -0.5, None, None, "triton")
    calls = {
        f"chunk fwd B=1 T={T}": lambda: linattn.chunk_gated_delta_rule(q, k, v, g, beta, backend="triton"),
        f"chunk fwd B=1 T={T} +prep": lambda: linattn.chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=True, backend="triton"),
    }
    steps = {
        "check_gated_delta_inputs": lambda: check_gated_delta_inputs(q, k, v, g, beta, None, None, None),
        "select_backend": lambda: select_backend("triton", q.device),
        "5x contiguous()": lambda: [x.contiguous() for x in (q, k, v, g, beta)],
        "prep: l2norm(q), l2norm(k)": lambda: (l2norm(q), l2norm(k)),
        "prep: gate_from_raw": lambda: gate_from_raw(g, A_log, dt_bias),
        "prep: beta.sigmoid()": lambda: beta.sigmoid(),
        "fused_prepass launcher": lambda: fp_mod.fused_prepass(g, k, v, beta),
        "launchers, split path (pre-pass, state pass, output)": lambda: chunk_mod._fwd_impl(*op_args, "split"),
        "launchers, walk path (prepass + fused_fwd)": lambda: chunk_mod._fwd_impl(*op_args, "walk"),
        "custom op (dispatch + launchers)": lambda: chunk_mod._fwd_op(*op_args, "auto"),
    }
    return calls, steps


def recurrent_case():
    q, k, v = rand(1, 1, H, K), rand(1, 1, H, K), rand(1, 1, HV, V)
    g, beta = rand(1, 1, HV, dtype=torch.float32), rand(1, 1, HV, dtype=torch.float32)
    A_log, dt_bias = torch.rand(HV, device=DEV).log(), torch.randn(HV, device=DEV)
    h0 = torch.randn(1, HV, K, V, device=DEV)
    op_args = (q, k, v, g, beta, K ** -0.5, h0, None, A_log, dt_bias, True, True, "triton")
    calls = {
        "fused_recurrent fwd T=1": lambda: rec_mod.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
            A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, backend="triton"),
    }
    steps = {
        "check_gated_delta_inputs": lambda: check_gated_delta_inputs(q, k, v, g, beta, None, h0, None, A_log,
                                                                     dt_bias),
        "launcher (alloc + launch)": lambda: rec_mod._fwd_impl(*op_args),
        "custom op (dispatch + launcher)": lambda: rec_mod._fwd_op(*op_args),
    }
    return calls, steps


def unprepared(call):
    """``call()`` with the Hopper backward's prepared calls out of the way (``backward_prepared.py``): the plain
    backward, as on a signature's first call."""
    from linattn.ops.hopper import backward_prepared
    taken, kept = backward_prepared.prepared_call, backward_prepared.remember
    backward_prepared.prepared_call, backward_prepared.remember = (lambda key: None), (lambda *a: None)
    try:
        return call()
    finally:
        backward_prepared.prepared_call, backward_prepared.remember = taken, kept


def hopper_backward_case(noop: bool):
    """The Hopper backward at row 1 (B = 1, T = 4096, H = HV = 16, K = V = 128: a host-bound fwd+bwd), called directly
    (no autograd): its prepared call (``backward_prepared.py``) and the plain backward, then its host stages.
    Without a GPU its input checks are skipped (they refuse CPU tensors); the rest runs as on the GPU with every
    launch a no-op."""
    from linattn.ops.common import num_sms
    from linattn.ops.hopper import backward, segments
    from linattn.ops.hopper import compile as hopper_compile
    if not noop and hopper_compile.unsupported_reason(torch.empty(1, device=DEV, dtype=torch.bfloat16),
                                                      torch.empty(1, device=DEV, dtype=torch.bfloat16)):
        return {}, {}
    T, Hb = 4096, 16
    q, k, v, do = rand(1, T, Hb, K), rand(1, T, Hb, K), rand(1, T, Hb, V), rand(1, T, Hb, V)
    g = torch.nn.functional.logsigmoid(rand(1, T, Hb, dtype=torch.float32)) / 16
    beta = rand(1, T, Hb).sigmoid()
    scale = K ** -0.5
    if not GPU:
        backward.check_inputs = lambda *args, **kwargs: None
    BV, plan = backward.choose_walk(1, T, Hb, Hb, K, V, None, None, num_sms(q.device))
    solved = backward.solve(k, g, beta)
    run = lambda: backward.chunk_gated_delta_rule_bwd_hopper(q, k, v, g, beta, scale, None, do, None)
    calls = {f"Hopper bwd B=1 T={T} H={Hb} (prepared)": run,
             f"Hopper bwd B=1 T={T} H={Hb} (plain)": lambda: unprepared(run)}
    steps = {
        "check_inputs" + ("" if GPU else " (skipped: CPU)"): lambda: backward.check_inputs(q, k, v, g, beta, scale,
                                                                                          None, do, None),
        "choose_walk": lambda: backward.choose_walk(1, T, Hb, Hb, K, V, None, None, num_sms(q.device)),
        "solve (pre-pass)": lambda: backward.solve(k, g, beta),
        "states recompute": lambda: backward.states(k, v, *solved, None),
    }
    if plan.L:
        S = T // 64 // plan.L
        gc_s, beta_s = (segments.head_major_as_segments(x, S) for x in solved[:2])
        steps["reverse warm-ups"] = lambda: segments.warm_state_grads(
            q, k, v, do, *solved[:2], gc_s, beta_s, *solved[2:], None, scale, plan.L, segments.warm_slice(BV),
            num_sms(q.device))
    return calls, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--noop", action="store_true", help="replace the Triton launches by no-ops (always on a CPU)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--T", type=int, default=4096 if GPU else 64,
                    help="chunk forward length (default 4096 on a GPU; 64 on the CPU, where the PyTorch "
                         "pre-processing really computes)")
    args = ap.parse_args()
    noop = args.noop or not GPU
    if noop:
        no_launches()
    mode = f"{'GPU ' + torch.cuda.get_device_name() if GPU else 'CPU'}, " + \
        ("no-op launches" if noop else "real kernels")
    rows = []
    torch.set_grad_enabled(False)
    for calls, steps in (decode_case(), chunk_case(args.T), recurrent_case(), hopper_backward_case(noop)):
        for name, fn in calls.items():
            rows.append((name, "public call", latency_us(fn, args.calls), host_rate_us(fn, args.calls),
                         launches(fn)))
            print(rows[-1], file=sys.stderr)
        for name, fn in steps.items():
            rows.append(("", name, median_us(fn, args.calls), None, None))
    print(f"\n## Host overhead per call ({mode}; torch {torch.__version__}); median µs")
    print("| call | step | latency µs | host µs/call (200 queued) | kernels (GPU) / ATen ops (CPU) |")
    print("|---|---|---|---|---|")
    for call, step, lat, rate, n in rows:
        print(f"| {call} | {step} | {lat:.1f} | {'' if rate is None else f'{rate:.1f}'} | "
              f"{'' if n is None else n} |")


if __name__ == "__main__":
    main()
