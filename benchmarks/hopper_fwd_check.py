"""GPU check and timing of the Hopper forward (``linattn/ops/hopper/chunk_fwd.py``) at its launches: the pre-pass
(``prepass.prepass_hopper``: gc, β and each chunk's A_inv diag(β)) followed by one fused kernel that walks the
chunks with the state on chip and writes only o and the final state.

    tar -C /tmp/site -xJf .anchors/anchors-site.tar.xz        # TileLang 0.1.15 (the anchors' site packages)
    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python benchmarks/hopper_fwd_check.py [--quick] [--out DIR]

1. accuracy (bf16): o and the final state against float64 (the token reference for short cases, the float64 torch
   backend for long ones), beside the Triton forward's errors and the rounded-PyTorch baseline (gpu_check_core's
   ``rounded_twin``: every stage's output rounded to bf16); the bound is kernel ≤ 2 × baseline. Also the distance to
   the kernel's PyTorch twin on the same pre-pass outputs (``chunk_fwd_hopper_hm_ref``, the same bf16 rounding
   points): a translation error shows there first. Every launch at the anchor case, the first one at every case.
2. speed: do_bench median ms (no grad) at the seven shapes of issue 4's table (--quick: rows 1, 2, 3): the Triton
   split forward and pre-pass, the TileLang pre-pass alone, the fused kernel alone and pre-pass + kernel, per
   launch.
Prints the tables last; writes hopper_fwd_check.json under --out. A variant that fails to compile or run is a row
with its error, not the end of the run (but an illegal memory access poisons the CUDA context: the rows after it
then fail too, and say so).
"""
from __future__ import annotations

import functools
import math
import time

import torch
import torch.nn.functional as F
import triton
from bench_cli import bench_args, write_json  # noqa: E402  (this folder is on sys.path)
from gpu_check_core import rel, rounded_twin  # noqa: E402  (this folder is on sys.path)

from linattn import chunk_gated_delta_rule
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.gated_delta import triton_chunk
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import chunk_fwd as hopper
from linattn.ops.hopper import chunk_fwd_ref as twins
from linattn.ops.hopper import forward as hopper_forward_module
from linattn.ops.hopper import walk_launch
from linattn.ops.hopper.forward import forward_hopper, hopper_launch, plan
from linattn.ops.hopper.map_bound import chunk_bounds, chunk_bounds_ref
from linattn.ops.hopper.prepass import prepass_hopper, prepass_hopper_ref

BF16 = torch.bfloat16
# the fused kernel's launches (BV, consumer threads, load pipeline depth): forward.LAUNCH, and BV=64 for the rows
# whose value heads are too few for BV=128's programs to fill the card
LAUNCHES = [dict(BV=128, threads=256, num_stages=2), dict(BV=64, threads=256, num_stages=2)]
CASES = [  # name, B, T, H, HV, K, V
    ("anchor_B2_T300_K128", 2, 300, 4, 4, 128, 128),
    ("T1", 1, 1, 2, 2, 128, 128),
    ("T64", 1, 64, 2, 2, 128, 128),
    ("GVA_4x_T1000", 1, 1000, 2, 8, 128, 128),
    ("K64_V64_T4096", 2, 4096, 4, 4, 64, 64),
    ("T32768_K128", 1, 32768, 2, 2, 128, 128),
    ("full_forgets_T1000", 1, 1000, 2, 8, 128, 128),      # g = −inf at one token, −3e38 at two: finite outputs
]
DEVICE = "cuda"
SHAPES = [(1, 4096, 16, 16), (8, 4096, 16, 16), (1, 32768, 16, 16), (1, 131072, 16, 16), (4, 8192, 16, 32),
          (2, 16384, 32, 32), (1, 32768, 2, 8)]


def make(B, T, H, HV, K, V, seed=0, decay=1 / 16):
    """float64 inputs; g = decay · logsigmoid(N(0, 1)): the default's mean −0.05 per token forgets a state within
    a few chunks, a small ``decay`` keeps it for thousands of tokens (what the segmented forward's maps carry)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=gen, dtype=torch.float64)
    return dict(q=F.normalize(r(B, T, H, K), dim=-1), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, HV, V),
                g=F.logsigmoid(r(B, T, HV)) * decay, beta=torch.rand(B, T, HV, device=DEVICE, generator=gen,
                                                                 dtype=torch.float64),
                initial_state=r(B, HV, K, V) * 0.1)


def low_precision(x):
    """bf16 q, k, v, β; fp32 g and initial state (what the op is given)."""
    return {n: t.to(torch.bfloat16) if n in ("q", "k", "v", "beta") else t.float() for n, t in x.items()}


def prepass_case(B, T, H, HV):
    """One shape of the pre-pass A/Bs (prepass_ab.py, prepass_occupancy_check.py): the bf16 inputs, forward.plan's
    launch at K = V = 128 (forced: the unsegmented kernel or the segments "auto" would take), its segment count,
    forward_hopper's positional arguments, o in float64 (the torch backend) and A_inv's fp32 twin."""
    low = low_precision(make(B, T, H, HV, 128, 128))
    launch = plan(B, HV, 128, T, torch.cuda.get_device_properties(0).multi_processor_count, forced=True)
    S = launch.get("segments", 1)
    args = [low[n] for n in ("q", "k", "v", "g", "beta")] + [128 ** -0.5, low["initial_state"]]
    with torch.no_grad():
        ref = chunk_gated_delta_rule(**{n: t.double() for n, t in low.items()}, scale=128 ** -0.5,
                                     output_final_state=True, backend="torch")[0]
        twin = prepass_hopper_ref(low["k"], low["g"], low["beta"], S, a_inv_dtype=torch.float32)[2]
    return low, launch, S, args, ref, twin


def hopper_forward(x, scale, launch):
    """The pre-pass, then the fused kernel: (o, final state)."""
    return forward_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"], **launch)


def launch_name(launch):
    return f"BV{launch['BV']}_t{launch['threads']}_s{launch['num_stages']}"


def accuracy(cases, launches):
    """Rows per (case, launch)."""
    rows = []
    for name, B, T, H, HV, K, V in cases:
        x = make(B, T, H, HV, K, V, seed=len(name))
        if name.startswith("full_forgets"):
            x["g"][:, T // 3] = -float("inf")
            x["g"][:, T // 2] = x["g"][:, T // 2 + 1] = -3e38
        low = low_precision(x)
        exact = {n: t.double() for n, t in low.items()}
        scale = K ** -0.5
        if T <= 1000:
            ref = gated_delta_rule_reference(exact["q"], exact["k"], exact["v"], exact["g"], exact["beta"], scale,
                                             exact["initial_state"])
        else:
            ref = chunk_gated_delta_rule(**exact, scale=scale, output_final_state=True, backend="torch")
        tri = split_forward(**low, scale=scale, output_final_state=True, backend="triton")
        zeros_do = torch.zeros(B, T, HV, V, device=DEVICE, dtype=torch.float64)
        zeros_dht = torch.zeros(B, HV, K, V, device=DEVICE, dtype=torch.float64)
        base = rounded_twin(low, torch.bfloat16, scale, zeros_do, zeros_dht)[:2]
        for launch in launches:
            row = dict(case=name, variant=launch_name(launch),
                       triton=[rel(tri[0], ref[0]), rel(tri[1], ref[1])],
                       baseline=[rel(base[0], ref[0]), rel(base[1], ref[1])])
            try:
                torch.cuda.synchronize()
                t0 = time.time()
                o, ht = hopper_forward(low, scale, launch)
                torch.cuda.synchronize()
                # the kernel against its twin on the same pre-pass outputs (the kernel's own rounding points)
                prepassed = prepass_hopper(low["k"], low["g"], low["beta"])[:3]
                twin = twins.chunk_fwd_hopper_hm_ref(low["q"], low["k"], low["v"], *prepassed, scale,
                                                      low["initial_state"], **launch)
                row.update(first_call_s=time.time() - t0, hopper=[rel(o, ref[0]), rel(ht, ref[1])],
                           vs_twin=[rel(o, twin[0]), rel(ht, twin[1])],
                           nonfinite=int((~torch.isfinite(o)).sum() + (~torch.isfinite(ht)).sum()))
            except Exception as e:  # a variant that fails is a row, not the end
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(row, flush=True)
    return rows


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_shape(B, T, H, HV, launches):
    """One row of the speed table: the Triton split forward and its pre-pass, the TileLang pre-pass, and each launch
    of the fused kernel alone (on the pre-pass's outputs made beforehand) and after the pre-pass."""
    x = low_precision(make(B, T, H, HV, 128, 128))
    x["initial_state"] = None
    scale = 128 ** -0.5
    row = dict(shape=(B, T, H, HV))
    with torch.no_grad():
        row["triton_fwd"] = bench(lambda: split_forward(**x, scale=scale, output_final_state=True))
        row["triton_prepass"] = bench(lambda: fused_prepass(x["g"], x["k"], x["v"], x["beta"], write_wy=False,
                                                            store_dtype=BF16))
        row["prepass"] = bench(lambda: prepass_hopper(x["k"], x["g"], x["beta"]))
        gc_hm, beta_hm, a_inv, _ = prepass_hopper(x["k"], x["g"], x["beta"])    # outside the timing
        for launch in launches:
            key = launch_name(launch)
            try:
                def fused(launch=launch):
                    return walk_launch.chunk_fwd_hopper_hm(x["q"], x["k"], x["v"], gc_hm, beta_hm, a_inv, scale,
                                                           None, **launch)
                fused()
                row[key] = bench(fused)
                row[key + "+prepass"] = bench(lambda launch=launch: hopper_forward(x, scale, launch))
            except Exception as e:
                row[key] = f"{type(e).__name__}: {e}"[:160]
    return row


# The segmented forward's check at two decays: with the default (mean −0.05 per token) a segment's map M is
# ≈ e^{−50} at 1024 tokens, so the stitched states equal the unsegmented kernel's bit for bit whatever M holds (run
# 21 saw exactly that); at 1/4096 of it (mean −1.2e-5 per token) M carries the entering state across the segment,
# so an error in phase A's M or the scan shows in o and the final state
DECAYS = (1 / 16, 1 / 65536)


def segmented(shapes):
    """The segmented Hopper forward (``forward_hopper(segments=S)``, as ``forward.plan`` makes it) at the shapes
    whose unsegmented programs do not fill the card, with and without the negligible maps' skip in phase A
    (``skip_maps``), and with warm-ups (``warm_up``: phase C starts early where the gates allow): errors of o and
    the final state against the float64 torch backend, beside the unsegmented kernel's (same launch) and the
    split's; then ms of each (no grad)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for B, T, H, HV in shapes:
        launch = plan(B, HV, 128, T, sms, forced=True)      # what FORWARD_PATH = "hopper" runs
        S = launch.pop("segments", None)
        if S is not None:
            for decay in DECAYS:
                runs = dict(segmented=dict(segments=S, skip_maps=False, warm_up=False, **launch),
                            segmented_skip=dict(segments=S, skip_maps=True, warm_up=False, **launch),
                            segmented_warm=dict(segments=S, skip_maps=True, warm_up=True, **launch),
                            unsegmented=launch)
                rows.append(compare_row(B, T, H, HV, 128, 128, runs, segments=S, decay=decay))
                print(rows[-1], flush=True)
    return rows


DIMS = [(8, 4096, 16, 16, 64, 64), (4, 4096, 16, 16, 128, 256)]   # issue 4: "K = V = 64 and K = 128, V = 256"


def other_dims():
    """K = V = 64 and K = 128, V = 256 at shapes whose programs fill the card: the Hopper forward (the launch
    "auto" takes) against the split, errors and ms."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for B, T, H, HV, K, V in DIMS:
        launch = hopper_launch(B, HV, V, sms)
        rows.append(compare_row(B, T, H, HV, K, V, {"hopper": launch} if launch else {}))
        print(rows[-1], flush=True)
    return rows


def split_forward(**kw):
    """The public op on the Triton split forward ("auto" may take the Hopper forward for these shapes)."""
    path, triton_chunk.FORWARD_PATH = triton_chunk.FORWARD_PATH, "split"
    try:
        return chunk_gated_delta_rule(**kw)
    finally:
        triton_chunk.FORWARD_PATH = path


def compare_row(B, T, H, HV, K, V, hopper_runs, decay=1 / 16, **info):
    """Errors of o and the final state against the float64 torch backend and ms (no grad) of each Hopper forward
    in ``hopper_runs`` (name → forward_hopper keywords) and of the split; with two or more Hopper runs also the
    relative distance of each to the first (``vs_first``)."""
    x = low_precision(make(B, T, H, HV, K, V, decay=decay))
    scale = K ** -0.5
    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [scale, x["initial_state"]]
    runs = {name: functools.partial(forward_hopper, *args, **kw) for name, kw in hopper_runs.items()}
    runs["split"] = functools.partial(split_forward, **x, scale=scale, output_final_state=True)
    row = dict(shape=(B, T, H, HV, K, V), decay=decay, **info)
    first = None
    try:
        with torch.no_grad():
            ref = chunk_gated_delta_rule(**{n: t.double() for n, t in x.items()}, scale=scale,
                                         output_final_state=True, backend="torch")
            for name, fn in runs.items():
                o, ht = fn()
                row[name] = [rel(o, ref[0]), rel(ht, ref[1])]
                if first is None:
                    first = (o, ht)
                else:
                    row[name + "_vs_first"] = [rel(o, first[0]), rel(ht, first[1])]
                row[name + "_ms"] = bench(fn)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


# The pre-pass check's shapes: issue 4's rows 1, 2, 3 (segmented where the forward would be) and 7, and a short
# sequence whose last chunk is partial (T = 1000: rows past T, gc and β padded to Tp)
PREPASS_SHAPES = [SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[6], (2, 1000, 4, 4)]


def prepasses(shapes):
    """The TileLang pre-pass (``prepass.py``) beside the Triton one at each shape (:func:`prepass_row`)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape in shapes:
        rows.append(prepass_row(*shape, sms))
        print(rows[-1], flush=True)
    return rows


def a_inv_blocks(a_inv, ref):
    """Relative L2 error of A_inv ``[B, T, HV, 64]`` per region of the TileLang solve (``prepass.py``: the diagonal
    16-blocks, the two blocks below them, the lower-left quadrant X, the zero upper triangle as its max abs), over
    the full chunks: a wrong step of the kernel shows in its own region."""
    n = a_inv.shape[1] // 64 * 64
    a, r = (t[:, :n].unflatten(1, (-1, 64)).transpose(2, 3).double() for t in (a_inv, ref))  # [B, NT, HV, 64, 64]
    i = torch.arange(64, device=a.device)
    bi, bj = i[:, None] // 16, i[None, :] // 16
    regions = dict(diagonal=bi == bj, below=(bi == bj + 1) & (bi % 2 == 1), quadrant=(bi >= 2) & (bj < 2))
    out = {name: ((a - r)[..., m].norm() / r[..., m].norm()).item() for name, m in regions.items()}
    out["upper_max_abs"] = a[..., i[:, None] < i[None, :]].abs().max().item()
    return out


def prepass_row(B, T, H, HV, sms):
    """The TileLang pre-pass with the segments the forward would use here (``plan``, forced): gc and β as the fused
    kernel reads them against the Triton pre-pass's (max abs difference; β must be equal), A_inv diag(β) against its
    float64 twin of the same bf16 inputs per region of the blocked solve (relative L2), the Triton pre-pass's A_inv
    against its own float64 twin (both bf16), the chunk bounds against float64, each pre-pass alone (ms), then the
    forward (``compare_row``)."""
    launch = plan(B, HV, 128, T, sms, forced=True)
    S = launch.get("segments", 1)
    x = low_precision(make(B, T, H, HV, 128, 128))
    row = dict(segments=S)   # compare_row adds the shape
    tilelang_prepass = functools.partial(prepass_hopper, x["k"], x["g"], x["beta"], S)
    triton_prepass = functools.partial(fused_prepass, x["g"], x["k"], x["v"], x["beta"], write_wy=False,
                                       store_dtype=BF16)
    try:
        with torch.no_grad():
            (gc_t, a_t), (gc_l, beta_l, a_l, bound_l) = triton_prepass(), tilelang_prepass()
            gc_t, beta_t = (hopper.head_major(t.reshape(B * S, T // S, HV)) for t in (gc_t, x["beta"]))
            a64_plain = prepass_hopper_ref(x["k"], x["g"], x["beta"], S, a_inv_dtype=torch.float64,
                                           beta_in_a_inv=False)[2]
            a64 = prepass_hopper_ref(x["k"], x["g"], x["beta"], S, a_inv_dtype=torch.float64)[2]
            bound64 = chunk_bounds_ref(x["k"], x["g"], x["beta"], S)
            row.update(gc_max_abs=(gc_l - gc_t).abs().max().item(), beta_equal=torch.equal(beta_l, beta_t),
                       bound_max_abs=(bound_l.double() - bound64).abs().max().item(),
                       bound_triton_max_abs=(chunk_bounds(x["k"], x["g"], x["beta"], S).double()
                                             - bound64).abs().max().item(),
                       a_inv_triton=rel(a_t, a64_plain), a_inv_tilelang=rel(a_l, a64),
                       a_inv_by_block=a_inv_blocks(a_l, a64), nonfinite=int((~torch.isfinite(a_l.float())).sum()),
                       triton_ms=bench(triton_prepass), tilelang_ms=bench(tilelang_prepass))
            del a64, a64_plain
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return compare_row(B, T, H, HV, 128, 128, dict(hopper=launch), **row)


def mixed_gates(g: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """``g`` [B, T, HV] rescaled per head to rates drawn as a Mamba-style initialisation draws them (A from 1 to 16,
    dt from 0.001 to 0.1, both log-uniform; each head's mean decay −A·dt), the tokens' variation kept: some heads
    forget within a chunk, others not within a segment (op_time_check --mixed-gates, gate_sensitivity.py)."""
    gen = torch.Generator().manual_seed(seed)
    HV = g.shape[-1]
    A = torch.exp(torch.rand(HV, generator=gen) * math.log(16))
    dt = torch.exp(math.log(1e-3) + torch.rand(HV, generator=gen) * math.log(100))
    return g * ((A * dt).to(g.device) / -g.mean())


def host_us(fn, calls=200):
    """µs of host time per call: ``calls`` calls issued back to back, one sync (the rate the CPU can feed the GPU;
    above the GPU time, the call is host-bound)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def graph_ms(fn):
    """do_bench median ms of ``fn`` captured in a CUDA graph and replayed (the GPU's time alone), after one call on a
    side stream (the warm-up a capture needs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def profile(shapes):
    """Where the Hopper forward's time goes, per shape (:func:`profile_shape`)."""
    rows = []
    for shape in shapes:
        rows.append(profile_shape(*shape))
        print(rows[-1], flush=True)
    return rows


def profile_shape(B, T, H, HV):
    """GPU ms of every stage of the forward "auto" plans alone (the pre-pass; phase A and the affine scan where
    segmented; the fused kernel), of
    forward_hopper and of the public op (inputs with and without requires_grad, no grad), and the host µs per call
    of each (a stage whose host µs is below its GPU time was GPU-bound in that measure)."""
    x = low_precision(make(B, T, H, HV, 128, 128))
    x["initial_state"] = None
    scale = 128 ** -0.5
    launch = triton_chunk.hopper_plan(x["q"], x["v"], None, B)
    if launch is None:    # "auto" takes the Triton split here
        return dict(shape=(B, T, H, HV), plan="split")
    row = dict(shape=(B, T, H, HV), plan=dict(launch))
    S = launch.pop("segments", 1)
    # the segmented forward's levers: the plan's where it sets them (small shapes), else the module's switches
    levers = (launch.pop("skip_maps", hopper_forward_module.SKIP_NEGLIGIBLE_MAPS),
              launch.pop("warm_up", hopper_forward_module.WARM_UP))
    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [scale, None]
    xg = {n: t.detach().clone().requires_grad_() if t is not None else None for n, t in x.items()}

    def seg(t):
        return t.reshape(B * S, T // S, *t.shape[2:])

    with torch.no_grad():
        stages = dict(prepass=functools.partial(prepass_hopper, x["k"], x["g"], x["beta"], S))
        gc_hm, beta_hm, a_inv, bound = stages["prepass"]()
        walk = functools.partial(walk_launch.chunk_fwd_hopper_hm, seg(x["q"]), seg(x["k"]), seg(x["v"]), gc_hm,
                                 beta_hm, seg(a_inv), scale, None)
        stages["walk"] = functools.partial(walk, **launch)
        if S > 1:     # the segmented forward's stages as forward_hopper runs them with the module's switches
            from linattn.ops.common.seq_parallel import affine_scan
            from linattn.ops.hopper.forward import SCAN_BV, fitted_launch, segment_flags
            skip, warm = levers
            row.update(skip_maps=skip, warm_up=warm)
            skip_m = flags = None
            if skip or warm:
                stages["plan"] = functools.partial(segment_flags, x["k"], x["g"], x["beta"], S, bound, skip, warm)
                flags = stages["plan"]()
                skip_m = flags.skip_m
                row.update(warmed_heads=int((skip_m == 2).sum()) // S,
                           mean_warm_chunks=flags.warm.float().mean().item())
            stages["phase_a"] = functools.partial(walk, affine=True, skip_m=skip_m,
                                                  **fitted_launch(128, launch))
            mn = stages["phase_a"]()[1]
            stages["affine_scan"] = functools.partial(affine_scan, mn, None, 128, B, nseg=S, BV=SCAN_BV,
                                                      skip=skip_m)
            if warm:
                h_in = stages["affine_scan"]()
                stages["walk"] = functools.partial(walk_launch.chunk_fwd_hopper_hm, x["q"], x["k"], x["v"], gc_hm,
                                                   beta_hm, a_inv, scale, h_in, warm_chunks=flags.warm,
                                                   **launch)
        calls = dict(forward_hopper=functools.partial(forward_hopper, *args, segments=S, skip_maps=levers[0],
                                                      warm_up=levers[1], **launch),
                     op=functools.partial(chunk_gated_delta_rule, **x, scale=scale, output_final_state=True),
                     op_requires_grad=functools.partial(chunk_gated_delta_rule, **xg, scale=scale,
                                                        output_final_state=True))
        for name, fn in stages.items():
            row[name + "_ms"] = bench(fn)
            row[name + "_host_us"] = host_us(fn)
        for name, fn in calls.items():
            row[name + "_ms"] = bench(fn)
            row[name + "_host_us"] = host_us(fn)
    return row


def host_profile(B=1, T=32768, H=2, HV=8, calls=300, fn=None):
    """cProfile of ``calls`` back-to-back calls of the public op where "auto" plans the segmented Hopper forward
    (row 7, host-bound in run 23), or of ``fn``: the Python functions by their own time, then by cumulative time,
    to find the host cost per call (the times are totals over the calls)."""
    import cProfile
    import io
    import pstats
    if fn is None:
        x = low_precision(make(B, T, H, HV, 128, 128))
        x["initial_state"] = None
        fn = functools.partial(chunk_gated_delta_rule, **x, scale=128 ** -0.5, output_final_state=True)
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
    return out.getvalue()


def scan_widths(shapes, widths=(16, 32, 64)):
    """ms of the affine scan (phase B) per V slice width at the segmented shapes: its programs are (V slice,
    sequence × head) and walk the segments one after another."""
    from linattn.ops.common.seq_parallel import affine_scan
    rows = []
    for B, T, H, HV in shapes:
        launch = triton_chunk.hopper_plan(*(torch.empty(B, T, h, 128, device=DEVICE, dtype=BF16) for h in (H, HV)),
                                          None, B)
        if launch is None:      # "auto" takes the Triton split here
            continue
        S = launch.get("segments", 1)
        mn = torch.randn(B * S, HV, 128, 256, device=DEVICE) * 0.05
        row = dict(shape=(B, T, H, HV), segments=S)
        for BV in widths:
            row[f"BV{BV}_ms"] = bench(functools.partial(affine_scan, mn, None, 128, B, nseg=S, BV=BV))
        rows.append(row)
        print(row, flush=True)
    return rows


def speed(shapes, launches):
    """Every launch at every shape (B and T are symbolic: a new head configuration compiles each launch once)."""
    rows = []
    for shape in shapes:
        rows.append(time_shape(*shape, launches))
        print(rows[-1], flush=True)
    return rows


def plans():
    """Row 6 (B=2 T=16384 H=32: "auto" walks unsegmented at BV=64, 128 programs of 256 chunks) against two segments
    at BV=128 (128 programs of 128 chunks plus warm-ups), and row 1 (below MIN_SEGMENTED_HEAD_TOKENS: "auto" takes
    the split) against the segmented forward; the first run of each row is what "auto" runs."""
    from linattn.ops.hopper.forward import LAUNCH
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for (B, T, H, HV), alternatives in (((2, 16384, 32, 32), dict(segmented2=dict(LAUNCH, segments=2))),
                                        ((1, 4096, 16, 16), dict(segmented4=plan(1, 16, 128, 4096, sms, True)))):
        auto = plan(B, HV, 128, T, sms, forced=False)
        runs = dict(auto=auto, **alternatives) if auto is not None else alternatives
        rows.append(compare_row(B, T, H, HV, 128, 128, runs, auto=auto))
        print(rows[-1], flush=True)
    return rows


def lever_verdict(row, lever, tolerance=0.10):
    """One line: whether ``lever``'s errors (o, final state) are within ``tolerance`` of the plain segmented
    forward's in a :func:`segmented` row, and both runs' ms."""
    if "error" in row or lever not in row:
        return f"{row.get('shape')} decay {row.get('decay')}: {lever} missing ({row.get('error', 'no run')})"
    ok = all(e <= (1 + tolerance) * b for e, b in zip(row[lever], row["segmented"]))
    return (f"{row['shape'][:4]} decay {row['decay']:.3g}: {lever} {'PASS' if ok else 'FAIL'} "
            f"o / state {row[lever][0]:.3e} / {row[lever][1]:.3e} against {row['segmented'][0]:.3e} / "
            f"{row['segmented'][1]:.3e}; {row[lever + '_ms']:.3f} ms against {row['segmented_ms']:.3f}")


def report(out, key, rows, title, **extra):
    """Writes ``rows`` (and ``extra``) to hopper_<key>.json under ``out`` and prints them under ``title``."""
    write_json(out, f"hopper_{key}.json", {key: rows, **extra})
    print("\n" + title)
    for r in rows:
        print(f"  {r}")


def main():
    a = bench_args("anchor and T=1 accuracy, rows 1-3 of the speed table",
                   segmented="the segmented forward alone (issue 4's rows 1, 3, 4, 7; with --quick 1 and 3)",
                   dims="K = V = 64 and K = 128, V = 256 alone (the Hopper forward against the split)",
                   profile="the Hopper forward stage by stage and its host time per call (rows 1, 3, 7, 2)",
                   host_profile="cProfile of the public op at row 7, and the affine scan's V slice widths",
                   prepass="the TileLang pre-pass beside the Triton one: outputs against float64, ms, the forward",
                   plans="plan() against the alternatives at rows 6 and 1 (two segments at BV=128 instead of "
                         "the unsegmented BV=64 walk; the segmented forward instead of the split)")
    if not hopper.tilelang_available():
        raise SystemExit("TileLang is not importable: put the anchors' site packages on PYTHONPATH")
    if a.dims:
        return report(a.out, "dims", other_dims(),
                      "Hopper forward at other head sizes (bf16; errors o / final state vs float64; ms no grad)")
    if a.profile:
        return report(a.out, "profile", profile([SHAPES[0], SHAPES[2], SHAPES[6], SHAPES[1]]),
                      "Hopper forward stage by stage (GPU ms each alone; host µs per call)")
    if a.host_profile:
        rows, text = scan_widths([SHAPES[0], SHAPES[2], SHAPES[6]]), host_profile()
        return report(a.out, "host_profile", rows, text + "\naffine scan ms per V slice width", cprofile=text)
    if a.prepass:
        return report(a.out, "prepass", prepasses(PREPASS_SHAPES[:3] + PREPASS_SHAPES[-1:] if a.quick
                                                  else PREPASS_SHAPES),
                      "pre-passes (gc max abs, A_inv rel L2 vs float64, ms alone; the forward on each: errors o / "
                      "final state vs float64, ms no grad)")
    if a.plans:
        return report(a.out, "plans", plans(),
                      "plan alternatives (errors o / final state vs float64; ms no grad; vs_first: distance to auto)")
    if a.segmented:
        rows = segmented([SHAPES[0], SHAPES[2]] if a.quick else SHAPES)
        report(a.out, "segmented", rows,
               "segmented Hopper forward (bf16, K = V = 128; errors o / final state vs float64; ms no grad)")
        print("\nlevers against the segmented forward (pass: errors within 10%):")
        for r in rows:
            for lever in ("segmented_skip", "segmented_warm"):
                print("  " + lever_verdict(r, lever))
        return
    acc = accuracy(CASES[:1], LAUNCHES) + accuracy(CASES[1:2] if a.quick else CASES[1:], LAUNCHES[:1])
    spd = speed(SHAPES[:3] if a.quick else SHAPES, LAUNCHES)
    write_json(a.out, "hopper_fwd_check.json", dict(accuracy=acc, speed=spd))
    print_tables(acc, spd)


def print_tables(acc, spd):
    """The accuracy and speed tables of the default mode."""
    print("\naccuracy (bf16, relative L2 vs float64): o / final state — hopper | triton | rounded baseline; "
          "! marks hopper > 2 × baseline")
    for r in acc:
        if "error" in r:
            print(f"  {r['case']:22s} {r['variant']:24s}  ERROR {r['error']}")
            continue
        flag = "!" if any(h > 2 * b for h, b in zip(r["hopper"], r["baseline"])) else " "
        print(f"{flag} {r['case']:22s} {r['variant']:24s}  "
              f"{r['hopper'][0]:.2e} / {r['hopper'][1]:.2e} | "
              f"{r['triton'][0]:.2e} / {r['triton'][1]:.2e} | {r['baseline'][0]:.2e} / {r['baseline'][1]:.2e}  "
              f"vs twin {r['vs_twin'][0]:.1e} / {r['vs_twin'][1]:.1e}  nonfinite {r['nonfinite']}  "
              f"first call {r['first_call_s']:.1f} s")
    print("\nspeed (ms, do_bench median, bf16, K = V = 128, no grad)")
    for r in spd:
        cells = "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                          if k != "shape")
        print(f"  {r['shape']}  {cells}")


if __name__ == "__main__":
    main()
