"""The Hopper forward's host cost without its kernels: ``forward_hopper`` and the public op's path into it with every
TileLang kernel (pre-pass, walk, phase A) and Triton kernel (plan, scan) replaced by a no-op, so what is left is the
Python, the checks and the allocations (issue 4: rows 1, 3 and 7 are host-bound wherever the host is slow). Runs on
a CPU (CPU tensors: allocation there is cheaper than the CUDA caching allocator's, so these figures are a floor) or
a GPU. Prints µs per call for the unsegmented forward and the segmented one (S = 4: the warm-up levers on, off, and
planned in the walk), each with ``prepared.PREPARED`` off (the plain forward's checks and plan on every call), on
(a repeated signature's prepared launches) and on with ``prepared.REUSE_SCRATCH`` (its scratch tensors kept), the
three interleaved in rounds so that the host's drift falls on all; then the public op at issue 4's rows 1 and 7
(plain, prepared, routed by ``gated_delta.prepared_route``, and routed with kept scratch);
then a cProfile of the segmented one by own time.

    python benchmarks/host_hopper.py [--calls N] [--rounds R] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics

import torch
from host_overhead import DEV, _NoLaunch, median_us  # this folder is on sys.path; it sets the interpreter on a CPU

import linattn
from linattn.ops.common import seq_parallel
from linattn.ops.gated_delta import prepared_route, triton_chunk
from linattn.ops.hopper import chunk_fwd, map_bound, prepared, prepass
from linattn.ops.hopper import forward as hopper_forward


def no_kernels():
    """Every kernel of the Hopper forward a no-op: the TileLang ones compile nothing and launch nothing."""
    dummy = object()
    for module in (chunk_fwd, prepass):
        module.compiled_kernel = lambda *args, **kwargs: dummy
        module.launcher = lambda kernel: (lambda *args: None)
    map_bound.segment_plan_kernel = _NoLaunch(map_bound.segment_plan_kernel)
    seq_parallel.affine_scan_kernel = _NoLaunch(seq_parallel.affine_scan_kernel)


def inputs(B, T, H, HV, K=128, V=128):
    r = lambda *s, dtype=torch.bfloat16: torch.randn(*s, device=DEV).to(dtype)  # noqa: E731
    return (r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), -torch.rand(B, T, HV, device=DEV) * 0.1,
            torch.rand(B, T, HV, device=DEV), K ** -0.5, None)


def op_table(args) -> None:
    """The public op's host µs per call at issue 4's rows 1 and 7 (their "auto" plans), kernels as no-ops: plain,
    prepared, then also routed (``gated_delta.prepared_route``), then also with kept scratch. On a CPU,
    ``hopper_plan``'s device gates cannot pass, so a stand-in makes its plan and alignment check for 132 SMs."""
    if DEV == "cpu":
        def plan_for_132(q, v, cu_seqlens, num_sequences, offsets=None, others=()):
            if chunk_fwd.misaligned(q, v, *others) is not None:
                return None
            return hopper_forward.plan(num_sequences, v.shape[2], v.shape[-1], q.shape[1], 132, False)
        triton_chunk.hopper_plan = plan_for_132
    rows = {"op, row 1 (B=1 T=4096 H=16, two launches)": inputs(1, 4096, 16, 16),
            "op, row 7 (B=1 T=32768 H=2 HV=8, five launches)": inputs(1, 32768, 2, 8)}
    modes = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
    print("\n| call | plain µs | prepared µs | routed µs | routed, kept scratch µs |\n|---|---|---|---|---|")
    for name, x in rows.items():
        fn = functools.partial(linattn.chunk_gated_delta_rule, *x[:5], scale=x[5], output_final_state=True,
                               backend="triton")
        times = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode in modes:
                prepared.PREPARED, prepared_route.ROUTES, prepared.REUSE_SCRATCH = mode
                fn()
                fn()                                 # the second call records the route
                times[mode].append(median_us(fn, args.calls))
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[mode]):.1f}" for mode in modes) + " |")
    prepared.PREPARED, prepared_route.ROUTES, prepared.REUSE_SCRATCH = True, False, False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5, help="off/on rounds per case (the median of their medians)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    no_kernels()
    torch.set_grad_enabled(False)
    x = inputs(1, 4096, 16, 16)
    cases = {
        "forward_hopper unsegmented (B=1 T=4096 H=16)": lambda: hopper_forward.forward_hopper(
            *x, **hopper_forward.LAUNCH),
        "forward_hopper segmented S=4, warm-ups": lambda: hopper_forward.forward_hopper(
            *x, segments=4, **hopper_forward.LAUNCH),
        "forward_hopper segmented S=4, no levers": lambda: hopper_forward.forward_hopper(
            *x, segments=4, skip_maps=False, warm_up=False, **hopper_forward.LAUNCH),
        "forward_hopper segmented S=4, warm-ups planned in the walk (two launches)": lambda:
            hopper_forward.forward_hopper(*x, segments=4, plan_in_walk=True, **hopper_forward.LAUNCH),
    }
    print(f"## Host µs per call, kernels replaced by no-ops ({DEV}, torch {torch.__version__}), median of "
          f"{args.calls}")
    print("| call | plain µs | prepared µs | prepared, kept scratch µs |\n|---|---|---|---|")
    modes = ((False, False), (True, False), (True, True))        # (PREPARED, REUSE_SCRATCH)
    for name, fn in cases.items():
        times = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode in modes:
                prepared.PREPARED, prepared.REUSE_SCRATCH = mode
                times[mode].append(median_us(fn, args.calls))
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[mode]):.1f}" for mode in modes) + " |")
    prepared.PREPARED, prepared.REUSE_SCRATCH = True, False
    op_table(args)
    if args.profile:
        fn = cases["forward_hopper segmented S=4, warm-ups"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
