"""One shape through the public op as bench_anchors times it (its own inputs: bf16 with requires_grad, seed 2; no
grad, do_bench median), with the host µs per call beside it (``gpu_timing.host_us``): whether a figure is the
GPU's or the host's. Needs ``.anchors/bench_anchors.py`` (the carry of every device call):

    PYTHONPATH=/tmp/site:$PWD python benchmarks/op_time_check.py 1,32768,16,16 [1,4096,16,16 ...]

A shape is B,T,H,HV[,K[,V]] (K = V = 128 by default; V = K where only K is given). ``--path P``: the forward path
(auto, split, walk, hopper: ``chunk_gated_delta_rule_on_path``); ``--packed``: each shape's B sequences packed into
one row with ``cu_seqlens``, of uneven lengths (:func:`packed_lengths`: T less 0–255 rows each, so that most end
inside a chunk); ``--slow-gates``: the gates divided by 65536 (no head forgets: the segmented forwards' worst
case); ``--mixed-gates``: per-head decay rates as a Mamba-style initialisation draws them (some heads forget, some
not); ``--graph``: beside the eager time, the call captured in a CUDA graph and replayed (the GPU's time alone: eager
above it is host time); ``--repeat N``: each shape N times in turn, so the spread shows the noise; ``--brief``: each
row as its shape and its times only.

``--train``: every mode times forward + ``torch.autograd.grad`` over q, k, v, g, β (bench_anchors' fwd+bwd) instead of
the forward: the backward's host cost, its syncs (``--host-dist``) and its CUDA graph capture (``--graph``).

``--profile``: each shape's host time by function (cProfile over 200 calls issued back to back, one sync; the
largest by own time, then by cumulative time), to say where a host-bound call's µs go. ``--host-parts``: the same
question without cProfile's overhead: µs per call inside each layer of the Hopper forward and its launches
(perf_counter around each; the plain forward's layers: its timed wrappers keep ``hopper.prepared`` from preparing
the calls; with ``--train`` the plain Hopper backward's stages and launches too, kept from
``hopper.backward_prepared`` alike). ``--host-dist``: each shape's host µs
per call as a distribution (p10 / p50 / p90 / max over isolated calls: a sync before each, then the call timed
alone, so no queue and no GPU wait in it), with Python's garbage
collections inside the calls counted and timed, the calls that synchronise with the device counted
(``torch.cuda.set_sync_debug_mode``), and the caching allocator's trips to the driver during them: whether a
host-bound call's time is its Python, a collection now and then, a hidden sync or cudaMalloc / cudaFree.
``--plain`` (with ``--train``): each shape's fwd+bwd with the Hopper backward prepared (``hopper.backward_prepared``,
the default) and plain (``host_overhead.unprepared``: a signature's first call), alternated four times in one
process, the medians and whether the two give the same gradients bit for bit.
"""
import collections
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from gpu_timing import bench, graph_ms, host_profile, host_us, mixed_gates  # this folder is on sys.path

from linattn.ops.common import partial_sum, seq_parallel
from linattn.ops.gated_delta import chunk as gated_chunk
from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path
from linattn.ops.hopper import backward as hopper_backward
from linattn.ops.hopper import chunk_bwd, chunk_bwd_roles, chunk_fwd, map_bound, prepass, segments
from linattn.ops.hopper import forward as hopper_forward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / ".anchors"))
from bench_anchors import make_inputs  # noqa: E402  (the anchors' inputs, so the figures compare with theirs)

PACKED = "--packed" in sys.argv
# each row as its shape and its times only
BRIEF = "--brief" in sys.argv
# the gates divided by 65536 (a head that forgets nothing within a sequence: every segment walks its maps), the
# segmented forwards' worst case
SLOW_GATES = "--slow-gates" in sys.argv
# per-head decay rates drawn as a Mamba-style initialisation draws them (A from 1 to 16, dt from 0.001 to 0.1, both
# log-uniform; the rate is A·dt), the tokens' variation kept: some heads forget within a chunk, others not within a
# segment, so the segmented forwards mix warm-ups and maps as a real model's layer may
MIXED_GATES = "--mixed-gates" in sys.argv
# forward + backward instead of the forward, in every mode
TRAIN = "--train" in sys.argv
# the forward path every call takes ("auto": the public op's)
PATH = sys.argv[sys.argv.index("--path") + 1] if "--path" in sys.argv else "auto"


def chunk_gated_delta_rule(*args, **kwargs):
    """The public op on ``--path``'s forward."""
    return chunk_gated_delta_rule_on_path(PATH, *args, **kwargs)


def op_call(xs, K, packed):
    """The timed call: the op's forward on ``xs``, or with ``--train`` forward + ``torch.autograd.grad`` over every
    input against a fixed random dO (run it inside :func:`grad_mode`)."""
    def forward():
        return chunk_gated_delta_rule(*xs, scale=K ** -0.5, output_final_state=True, **packed)
    if not TRAIN:
        return forward
    with torch.enable_grad():
        do = torch.randn_like(forward()[0])
    return lambda: torch.autograd.grad(forward()[0], xs, do)


def grad_mode():
    """Autograd on with ``--train`` (the backward needs the forward's graph), else off."""
    return torch.enable_grad() if TRAIN else torch.no_grad()


def packed_lengths(B, T):
    """``--packed``'s B sequence lengths: T less (97·i mod 256) rows for sequence i (the first one T)."""
    return [T - (97 * i) % 256 for i in range(B)]


def op_inputs(B, T, H, HV, K, V):
    """The op's arguments (bench_anchors' inputs): B sequences of T rows, or with ``--packed`` their uneven lengths
    packed into one row (``cu_seqlens`` int32 among the keywords)."""
    if not PACKED:
        xs = make_inputs(B, T, H, HV, K, V, torch.bfloat16, seed=2, requires_grad=True)
        if SLOW_GATES:
            xs[3] = (xs[3].detach() / 65536).requires_grad_()
        if MIXED_GATES:
            xs[3] = mixed_gates(xs[3].detach()).requires_grad_()
        return xs, {}
    lengths = packed_lengths(B, T)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    xs = make_inputs(1, offsets[-1], H, HV, K, V, torch.bfloat16, seed=2, requires_grad=True)
    return xs, dict(cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=xs[0].device))


def check(B, T, H, HV, K=128, V=None, graph=False):
    xs, packed = op_inputs(B, T, H, HV, K, V or K)
    fn = op_call(xs, K, packed)
    with grad_mode():
        t0 = time.time()
        fn()
        torch.cuda.synchronize()
        first = time.time() - t0
        ms = bench(fn)
        host = host_us(fn)
        extra = dict(graph_ms=round(graph_ms(fn), 4)) if graph else {}
    return dict(shape=(B, T, H, HV, K, V or K), packed=PACKED, path=PATH, train=TRAIN, slow_gates=SLOW_GATES,
                mixed_gates=MIXED_GATES, first_call_s=round(first, 1), op_ms=round(ms, 4), host_us=round(host, 1),
                **extra)


def prepared_against_plain(B, T, H, HV, K=128, V=None, rounds=4):
    """Print ``--plain``'s medians (ms) of fwd+bwd with the Hopper backward prepared and plain, alternated."""
    if not TRAIN:
        raise SystemExit("--plain compares two backwards: pass --train too")
    from host_overhead import unprepared
    xs, packed = op_inputs(B, T, H, HV, K, V or K)
    fn = op_call(xs, K, packed)
    plain = lambda: unprepared(fn)
    with grad_mode():
        same = all(torch.equal(a, b) for a, b in zip(fn(), plain()))
        ms = {"prepared": [], "plain": []}
        for _ in range(rounds):
            ms["prepared"].append(bench(fn))
            ms["plain"].append(bench(plain))
    print(dict(shape=(B, T, H, HV, K, V or K), **{f"{name}_ms": round(statistics.median(v), 4)
                                                  for name, v in ms.items()}, bitwise_same=same), flush=True)


def profile(B, T, H, HV, K=128, V=None, calls=200):
    """Print where ``calls`` calls' host time goes, by function (``gpu_timing.host_profile``)."""
    xs = make_inputs(B, T, H, HV, K, V or K, torch.bfloat16, seed=2, requires_grad=True)
    print(f"--- host profile {B, T, H, HV}: {calls} calls ---")
    print(host_profile(calls=calls, fn=op_call(xs, K, {}), grad=TRAIN))


def host_parts(B, T, H, HV, K=128, V=None, calls=200):
    """Print the host µs per call spent inside each layer of the Hopper forward (``forward_hopper``, the pre-pass,
    the plan, the walk, the scan) and in its launches (TileLang's and Triton's), perf_counter around each, over
    ``calls`` calls issued back to back; layers nest (forward_hopper holds the others). With ``--train`` also the
    Hopper backward's (the whole backward, the pre-pass, the states recompute, the reverse warm-ups, the walk, the
    reductions) and its launches."""
    spent = collections.Counter()

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper
    tilelang_launcher = chunk_fwd.launcher
    tilelang_modules = [chunk_fwd, prepass] + ([chunk_bwd, chunk_bwd_roles] if TRAIN else [])
    triton_modules = [map_bound, seq_parallel] + ([partial_sum] if TRAIN else [])
    layers = [(hopper_forward, name) for name in ("forward_hopper", "prepass_hopper", "segment_plan",
                                                  "chunk_fwd_hopper_hm", "affine_scan")]
    if TRAIN:
        layers += [(gated_chunk, "run_backward"), (hopper_backward, "solve"), (hopper_backward, "states"),
                   (segments, "warm_state_grads"), (hopper_backward, "walk_rows"),
                   (hopper_backward, "gradients_from_partials")]
    saved = [(m, "launcher", m.launcher) for m in tilelang_modules] + \
        [(m, "launch", m.launch) for m in triton_modules] + [(m, name, getattr(m, name)) for m, name in layers]
    try:
        for m in tilelang_modules:
            m.launcher = lambda kernel: timed("TileLang launches", tilelang_launcher(kernel))
        for m in triton_modules:
            m.launch = timed("Triton launches", m.launch)
        for m, name in layers:
            setattr(m, name, timed(name + "()", getattr(m, name)))
        xs = make_inputs(B, T, H, HV, K, V or K, torch.bfloat16, seed=2, requires_grad=True)
        fn = op_call(xs, K, {})
        with grad_mode():
            fn()
            torch.cuda.synchronize()
            spent.clear()
            whole = host_us(fn, calls=calls)
        parts = {name: round(s / (calls + 1) * 1e6, 1) for name, s in spent.items()}   # host_us calls once more
        print(dict(shape=(B, T, H, HV), path=PATH, train=TRAIN, host_us=round(whole, 1), **parts), flush=True)
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def host_dist(B, T, H, HV, K=128, V=None, calls=300):
    """Print the host µs of isolated calls (a sync before each, the call alone timed) as p10 / p50 / p90 / max, the
    garbage collections that ran inside the timed calls (count and ms), how many calls synchronised with the device
    (``torch.cuda.set_sync_debug_mode("warn")``'s warnings) and how often the caching allocator went to the driver
    (``torch.cuda.memory_stats``): ``--host-dist`` (the module's docstring)."""
    xs, packed = op_inputs(B, T, H, HV, K, V or K)
    collections_ms = []
    started = []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            collections_ms.append((time.perf_counter() - started.pop()) * 1e3)

    fn = op_call(xs, K, packed)
    with grad_mode():
        fn()
        times, syncing = [], 0
        allocator = torch.cuda.memory_stats()
        gc.callbacks.append(on_gc)
        try:
            for _ in range(calls):
                torch.cuda.synchronize()
                collections_ms.clear()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    torch.cuda.set_sync_debug_mode("default")
                syncing += any("synchroniz" in str(w.message) for w in caught)
                times.append(((t1 - t0) * 1e6, sum(collections_ms), len(collections_ms)))
        finally:
            gc.callbacks.remove(on_gc)
    after = torch.cuda.memory_stats()
    # the caching allocator going to the driver (cudaMalloc / cudaFree can synchronise) during the timed calls
    device_calls = {key: after.get(key, 0) - allocator.get(key, 0)
                    for key in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
    us = sorted(t for t, _, _ in times)
    q = statistics.quantiles(us, n=10)
    print(dict(shape=(B, T, H, HV), calls=calls, host_us_p10=round(q[0], 1), p50=round(statistics.median(us), 1),
               p90=round(q[-1], 1), max=round(us[-1], 1), gc_in_calls=sum(n for _, _, n in times),
               gc_ms=round(sum(ms for _, ms, _ in times), 2), syncing_calls=syncing, **device_calls,
               live_objects=len(gc.get_objects())), flush=True)


args = sys.argv[1:]
repeat = int(args.pop(args.index("--repeat") + 1)) if "--repeat" in args else 1
if "--path" in args:
    args.pop(args.index("--path") + 1)
for arg in (a for a in args if not a.startswith("--")):
    shape = [int(x) for x in arg.split(",")]
    if "--profile" in args:
        profile(*shape)
        continue
    if "--host-dist" in args:
        host_dist(*shape)
        continue
    if "--host-parts" in args:
        host_parts(*shape)
        continue
    if "--plain" in args:
        prepared_against_plain(*shape)
        continue
    graph = "--graph" in args
    for _ in range(repeat):
        row = check(*shape, graph=graph)
        if BRIEF:
            row = {key: row[key] for key in ("shape", "first_call_s", "op_ms", "host_us") + ("graph_ms",) * graph}
        print(row, flush=True)
