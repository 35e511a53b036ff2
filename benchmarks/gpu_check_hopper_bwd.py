"""GPU check of the Hopper backward (linattn/ops/hopper/backward.py, issue 45): accuracy, determinism, then time.

(a) the walk alone against its PyTorch twin on the same inputs (each raw output: dq, dk per value head with the
    slices added in the walk's cluster, the dg, dβ partials); then
    accuracy, bf16, with h0 and dht (GVA, K = 64 and 128, T = 65 to 1000, slow decay, a repeated token): relative
    L2 of every gradient against float64 autograd of the token-by-token reference on the same rounded inputs,
    beside the Triton backward's error and the rounded PyTorch baseline's (gpu_check_core.rounded_twin: every
    stage's output rounded to bf16; the bound is Hopper ≤ 2 × baseline); then a bitwise repeat (two runs, the same
    bits).
    The recompute (``backward.recompute``: the pre-pass without β on T, the walk's states build): its states walk
    against its twin (``chunk_fwd_ref.chunk_states_hopper_ref``) on the same pre-pass outputs.
(b) time (triton.testing.do_bench medians) at the anchor rows 2 (B=8, T=4096, H=HV=16), 3 (B=1, T=32768, H=HV=16)
    and 7 (B=1, T=32768, H=2, HV=8), K = V = 128: the recompute (pre-pass and states walk), the fused walk alone
    (and µs per chunk: walk ms over the T/64 chunks each program walks), the reductions (one launch: sums, mask,
    casts), the whole Hopper backward and the Triton backward; the Hopper backward's peak memory over its inputs
    (torch.cuda.max_memory_allocated around one call, MiB).
    The walk alone unsegmented: rows 3 and 7 run B·HV·2 programs of 512 chunks on 132 SMs; the whole backward as
    the planner cuts it (``segments.plan_walk``: rows 3 and 7 in segments), its states as the forward's
    plan cuts them (``backward.states``: rows 3 and 7 in segments).
(c) --segments (hopper/segments.py): at rows 3 (B=1, T=32768, H=HV=16), 4 (B=1, T=131072, H=HV=16), 7 (B=1,
    T=32768, H=2, HV=8) and 1 (B=1, T=4096, H=HV=16), the segmented backward at the planner's L (or T/256 where
    it plans none): its parts (solve, states, the reverse warm-ups, the walk on the segment views, the sums), the
    whole against the unsegmented Hopper backward and the Triton backward, the whole at forced S = 2, 4, 8, 16
    segments beside the planner's model (calibrates segments.py's constants), and every gradient's relative L2
    segmented vs unsegmented. Part (a) checks segmented cases against float64 too (the "_seg" cases).

(d) --warm (the reverse warm-ups, ``chunk_bwd.reverse_warm_ups_hopper``, the segments' dS_out): the warm-ups kernel
    against its twin (dS_out, rel L2); the segmented backward's accuracy against float64 on small cases (as part
    (a)'s); then at rows 3, 4, 7, at the anchors' gates and at gates / 1024 (every warm-up reaches the end): the
    whole segmented backward and the warm-ups alone (ms), w per segment (min/max over heads), and gradients
    segmented vs unsegmented (rel L2).

(e) --states (``backward.segmented_states``: the recompute's states walk in the forward's segments, plan → phase A
    (maps of the states walk's operator, β in X) → scan → phase C (the warm states walk)): on small cases at row 3's
    heads (H = HV = 16, K = V = 128) phase A's maps and phase C's h against their twins, and the segmented h against
    the unsegmented kernel's and against the float64 states twin; then at rows 3 and 4, at the anchors' gates and at
    gates / 1024 (every head walks its maps): h in segments (ms, and the parts: copies, plan, phase A, scan, phase
    C), h's relative L2 against the unsegmented kernel's and each against float64, the plan's flags. A table last.

(f) --varlen (packed sequences by padding, ``backward.backward_packed``): on a small packed bf16 case (6 sequences:
    a partial last chunk, two whole chunks, one shorter than a chunk, a single row, an empty one; GVA, K = V = 128,
    h0 and dht) every gradient's relative L2 against float64 autograd of the reference over the packed sequences,
    the padded Hopper backward's beside the Triton varlen backward's, and the padded backward against the Hopper
    backward run on each sequence alone; then at 8 ragged sequences summing to 32768 tokens (H = HV = 16, K = V =
    128; 9% and 19% of the padded batch is padding): the padded Hopper backward vs the Triton varlen backward (ms),
    the padding copies alone (6 in, 5 out) and the Hopper backward on the already padded batch, the dispatch's
    decision, and the gradients' relative L2 Hopper vs Triton. A table last. Its
    kernels are part (a)'s and row 2's (the smoke builds them).

(g) --timeline (the walk's in-kernel timeline, ``chunk_bwd.walk_timeline``, hopper/timeline.py): at rows 2 (B=8,
    T=4096, H=HV=16: two waves of 256 programs), 7 (B=1, T=32768, H=2, HV=8: 16 programs, the unsegmented walk alone)
    and a small case (B=2, T=2048, H=2, HV=4: 16 programs), K = V = 128, BV = 64, every step stamped: the timeline
    build's outputs against the default walk's on the same inputs (bit for bit: the stamps change no math), both
    walks' do_bench medians (the instrument's cost), and per phase of the chunk step (timeline.PHASES: the waits for
    the loads, recompute, chain, X terms, q side, dq's exchange, k side, dk's exchange, dv, finish, the whole step and
    the gap to the next) µs per step, median and p90 over programs and steps, per consumer warpgroup, later steps
    and the first (the exchanges also by role: the step's owner slice or another). A table last.

(h) --repeat: the Hopper backward run REPEAT_RUNS times on the same inputs at sequences long enough for a race
    between the walk's warpgroups to show (T = 32768 at K = 64 and 128, H = 2, HV = 4; row 2), as planned: per
    gradient "bitwise" or the largest relative L2 difference from the first run. Compiles as it goes (no
    precompile), ≈ 2 min.

    python benchmarks/gpu_check_hopper_bwd.py --out $OUT --skip-timing    # (a)
    python benchmarks/gpu_check_hopper_bwd.py --out $OUT --timing-only --rows 2
    python benchmarks/gpu_check_hopper_bwd.py --segments --out $OUT   # part (c) alone, ≈ 2-4 min
    python benchmarks/gpu_check_hopper_bwd.py --warm --out $OUT       # part (d) alone
    python benchmarks/gpu_check_hopper_bwd.py --states --out $OUT     # part (e) alone, ≈ 3-5 min
    python benchmarks/gpu_check_hopper_bwd.py --varlen --out $OUT     # part (f) alone, ≈ 1-2 min after compiles
    python benchmarks/gpu_check_hopper_bwd.py --timeline --out $OUT   # part (g) alone, ≈ 1 min after compiles
    python benchmarks/gpu_check_hopper_bwd.py --repeat --out $OUT     # part (h) alone
    python benchmarks/gpu_check_hopper_bwd.py --smoke          # CPU: builds every kernel for sm_90a, ptxas report

Every part but (h) first compiles every TileLang kernel of the script (all parts': the smoke's list) side by side, one
process per CPU core, into TileLang's disk cache (``hopper/precompile.py``; it prints the time taken): the parts
then load them.

Writes hopper_bwd.json (hopper_bwd_segments.json with --segments, hopper_bwd_warm.json with --warm,
hopper_bwd_states.json with --states, hopper_bwd_varlen.json with --varlen, hopper_bwd_timeline.json with --timeline,
hopper_bwd_repeat.json with --repeat)
under --out
after every case (a run cut short keeps what it reached), printing each row's JSON as it goes and a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# name, B, T, H, HV, K, V, BV (None: the host's default), gate decay (gpu_check_core.make's: 1/16 the anchors'),
# repeated (one q and one k for every token: the case that punishes bf16 operands of dA; the twin puts dk at 1.8×
# the rounded baseline)
CASES = [
    ("B2_T300_GVA_K128", 2, 300, 2, 4, 128, 128, None, 1 / 16, False),
    ("B2_T300_GVA_K64", 2, 300, 2, 4, 64, 64, None, 1 / 16, False),
    ("B2_T300_GVA_K64_BV32", 2, 300, 2, 4, 64, 64, 32, 1 / 16, False),
    ("B1_T65_K128", 1, 65, 1, 2, 128, 128, None, 1 / 16, False),
    ("B1_T1000_K128_slow_decay", 1, 1000, 2, 2, 128, 128, None, 1 / 1024, False),
    ("B1_T256_K128_repeated_token", 1, 256, 1, 2, 128, 128, None, 1 / 16, True),
]
# --repeat: sequences long enough for a race between the walk's warpgroups to show (B2_T300_GVA_K64 repeated bit
# for bit where T = 32768 at K = 64 did not: docs/performance.md, "Accuracy"), each run RUNS times as planned
REPEAT_CASES = [
    ("B1_T32768_GVA_K64", 1, 32768, 2, 4, 64, 64, None, 1 / 16, False),
    ("B1_T32768_GVA_K128", 1, 32768, 2, 4, 128, 128, None, 1 / 16, False),
    ("B8_T4096_K128", 8, 4096, 16, 16, 128, 128, None, 1 / 16, False),
]
REPEAT_RUNS = 4
# part (a)'s cases walked in segments (the last field: segment_chunks): S = 4, 2 and 8 segments, their walks
# already among CASES' kernels
SEGMENTED_CASES = [
    (("B2_T512_GVA_K128_seg", 2, 512, 2, 4, 128, 128, None, 1 / 16, False), 2),
    (("B2_T512_GVA_K64_seg", 2, 512, 2, 4, 64, 64, None, 1 / 16, False), 4),
    (("B1_T1024_K128_slow_decay_seg", 1, 1024, 2, 2, 128, 128, None, 1 / 1024, False), 2),
]
SEGMENT_ROWS = [(3, 1, 32768, 16, 16), (4, 1, 131072, 16, 16), (7, 1, 32768, 2, 8), (1, 1, 4096, 16, 16)]
# part (d): SEGMENTED_CASES' cases again (the slow decay's warm-ups reach the end: exact), and the anchors' own gates
# (16× the others': a chunk's bound ≈ −75, so w = 1 and every warm-up truncates)
WARM_CASES = SEGMENTED_CASES + [(("B2_T512_GVA_K128_fast_decay_seg", 2, 512, 2, 4, 128, 128, None, 1.0, False), 2)]
WARM_ROWS = SEGMENT_ROWS[:3]
# part (e): name, B, T, gates divided by, segments (H = HV = 16, K = V = 128: row 3's kernels); and its rows
STATES_CASES = [("B2_T2048_S4", 2, 2048, 1, 4), ("B1_T4096_S8_slow", 1, 4096, 1024, 8)]
STATES_ROWS = SEGMENT_ROWS[:2]
# part (f): the packed accuracy case (name, lengths, H, HV, K = V) and the timed packed rows (name, lengths summing to
# 32768; H = HV = 16, K = V = 128): padded to 4480 rows (8.6% padding) and to 5056 (19.0%, near the 20% rule)
VARLEN_CASE = ("packed_GVA_K128", [300, 128, 65, 1, 0, 200], 2, 4, 128)
VARLEN_ROWS = [("ragged_9pct", [4480, 4100, 3900, 4450, 3700, 4200, 3838, 4100]),
               ("skewed_19pct", [5056, 3400, 3600, 3800, 4000, 4100, 4312, 4500])]
# part (g): label, B, T, H, HV (K = V = 128, BV = 64): rows 2 and 7, and a small case of one program per SM
TIMELINE_ROWS = [("row2", 8, 4096, 16, 16), ("row7", 1, 32768, 2, 8), ("small", 2, 2048, 2, 4)]
WALK_OUTPUTS = ("dq_heads", "dk_heads", "dv", "dg_partials", "dbeta_partials", "dh0")
ROWS = [  # anchor row, B, T, H, HV (K = V = 128)
    (2, 8, 4096, 16, 16),
    (3, 1, 32768, 16, 16),
    (7, 1, 32768, 2, 8),
]


SMS = 132    # an H100's or H200's SMs: the recompute's launch (backward.recompute) is planned for them


def kernel_configs() -> list[tuple]:
    """(H, HV, K, V, scale, BV) of every walk this script launches, ("warm", H, HV, K, V, scale, BV) of every
    reverse warm-ups kernel and ("timeline", H, HV, K, V, scale, BV) of every walk's timeline build."""
    config = lambda H, HV, K, V, BV: (H, HV, K, V, K ** -0.5, BV or min(V, 64))
    configs = [config(H, HV, K, V, BV) for _, _, _, H, HV, K, V, BV, _, _ in CASES]
    configs += [config(H, HV, K, V, BV) for (_, _, _, H, HV, K, V, BV, _, _), _ in SEGMENTED_CASES]
    configs += [config(H, HV, 128, 128, 64) for _, _, _, H, HV in ROWS + SEGMENT_ROWS]
    # the warm-ups of every case and row the planner or segment_chunks cuts (row 2's config is row 3's)
    warm = [("warm",) + config(H, HV, K, V, BV) for (_, _, _, H, HV, K, V, BV, _, _), _ in WARM_CASES]
    warm += [("warm",) + config(H, HV, 128, 128, 64) for _, _, _, H, HV in ROWS + SEGMENT_ROWS]
    timeline = [("timeline",) + config(H, HV, 128, 128, 64) for _, _, _, H, HV in TIMELINE_ROWS]
    return list(dict.fromkeys(configs + warm + timeline))


def recompute_launch(B: int, HV: int, V: int, sms: int = SMS) -> dict:
    """The unsegmented states walk's launch (``backward.states``: BV 128 where its programs fill the card, else
    64)."""
    from linattn.ops.hopper.plan import DEFAULT, hopper_launch
    return hopper_launch(B, HV, V, sms) or DEFAULT.launch(64)


def states_segments(B: int, T: int, HV: int, V: int = 128, sms: int = SMS) -> int:
    """The segments ``backward.states`` cuts each sequence into (the forward's plan; 1: unsegmented)."""
    from linattn.ops.hopper.plan import plan
    chosen = plan(B, HV, V, T, sms)
    return chosen.segments if chosen is not None else 1


def recompute_configs() -> list[tuple]:
    """("states", H, HV, K, V, BV, num_stages) of every unsegmented states walk (the recompute's),
    ("states_warm" / "states_maps", H, HV, K, V, BV) of its segments' phases C and A where the forward's plan cuts
    a row into segments, and ("prepass", H, HV, K) of every pre-pass (β in bf16, T without β) this script launches
    (every case and row has an initial state)."""
    from linattn.ops.hopper.plan import plan
    shapes = [(B, H, HV, K, V) for _, B, _, H, HV, K, V, _, _, _ in CASES]
    rows = [(B, H, HV, 128, 128) for _, B, _, H, HV in ROWS]
    states = lambda B, H, HV, K, V: ("states", H, HV, K, V, recompute_launch(B, HV, V)["BV"],
                                     recompute_launch(B, HV, V)["num_stages"])
    configs = [states(*shape) for shape in shapes + rows]
    configs += [("prepass", H, HV, K) for _, H, HV, K, _ in shapes + rows]
    for B, T, H, HV in [r[1:] for r in ROWS + SEGMENT_ROWS]:      # where backward.states takes the segments
        chosen = plan(B, HV, 128, T, SMS)
        if chosen is not None and chosen.segments > 1:
            BV = chosen.kernel_launch["BV"]
            configs += [("states_warm", H, HV, 128, 128, BV), ("states_maps", H, HV, 128, 128, BV)]
    return list(dict.fromkeys(configs))


def kernel_build(config: tuple, target: Optional[str]):
    """The build (``hopper.precompile.Build``: the compile function the backward calls and its arguments) of a
    :func:`kernel_configs` or :func:`recompute_configs` entry for ``target`` (None: this GPU; "sm_90a" without one):
    one description for the smoke's compiles and the GPU run's precompile alike."""
    from linattn.ops.hopper import chunk_bwd, prepass, walk_launch
    from linattn.ops.hopper.plan import DEFAULT
    from linattn.ops.hopper.precompile import Build
    if config[0] == "states":
        H, HV, K, V, BV, stages = config[1:]
        return Build(walk_launch.states_kernel, (H, HV, K, V, BV, DEFAULT.threads, stages, True, torch.float32,
                                                 target))
    if config[0] == "prepass":     # ("prepass", H, HV, K[, β's dtype: bfloat16, this script's, unless named])
        H, HV, K, beta_dtype = (*config[1:], "bfloat16")[:4]
        return Build(prepass.compiled_kernel, (H, HV, K, beta_dtype, target), dict(beta_in_a_inv=False))
    if config[0] == "states_warm":
        H, HV, K, V, BV = config[1:]
        return Build(walk_launch.states_kernel, (H, HV, K, V, BV, DEFAULT.threads, DEFAULT.num_stages, True,
                                                 torch.float32, target), dict(warm=True))
    if config[0] == "states_maps":
        H, HV, K, V, BV = config[1:]
        return Build(walk_launch.walk_kernel, (H, HV, K, V, BV, 1.0, DEFAULT.threads, DEFAULT.num_stages, False,
                                               torch.float32, True, True, target), dict(beta_in_a_inv=False))
    if config[0] == "warm":
        return Build(chunk_bwd.compiled_warm_kernel, config[1:], dict(target=target))
    if config[0] == "timeline":
        return Build(chunk_bwd.compiled_kernel, config[1:], dict(target=target, timeline=True))
    return Build(chunk_bwd.compiled_kernel, config, dict(target=target))


def precompile_kernels(target: Optional[str] = None) -> None:
    """Compile every kernel of this script (all its parts': :func:`kernel_configs`, :func:`recompute_configs`) in
    one process per CPU core, into TileLang's disk cache (``hopper.precompile``): each part's first launches then
    load them instead of compiling one after another. Prints the time taken and any build that failed there (the
    part that launches it compiles it again and reports its error)."""
    from linattn.ops.hopper.precompile import precompile
    report = precompile(kernel_build(config, target) for config in kernel_configs() + recompute_configs())
    print(report, flush=True)


def smoke() -> list[dict]:
    """Build every kernel (the walks, the reverse warm-ups, the recompute's states walks and pre-passes) for sm_90a
    without a GPU and report its shared memory and ptxas figures (compiled in parallel first, then each loaded from
    TileLang's cache)."""
    from linattn.ops.hopper import backward  # noqa: F401  (the host chain imports)
    from linattn.ops.hopper.cubin import compile_sm90a, launch_shared_bytes, ptxas_summary
    precompile_kernels("sm_90a")
    out = []
    for config in kernel_configs() + recompute_configs():
        t0 = time.time()
        kernel = kernel_build(config, "sm_90a")()
        with tempfile.TemporaryDirectory() as d:
            report = compile_sm90a(kernel.get_kernel_source(), Path(d))[1]
        row = dict(config=config, shared_bytes=launch_shared_bytes(kernel), compile_s=round(time.time() - t0, 1),
                   **ptxas_summary(report))
        print(row, flush=True)
        out.append(row)
    return out


def bf16_inputs(name, B, T, H, HV, K, V, decay, repeated=False):
    """gpu_check_core.make's inputs (unit-norm q, k; h0; ``repeated``: the first token's q and k for every token),
    q, k, v, β and do rounded to bf16, and their float64 ground-truth copies; do and dht fresh normals."""
    import zlib

    from gpu_check_core import make
    x = make(B, T, H, HV, K, V, B, seed=zlib.crc32(name.encode()) % 1000, decay=decay)
    if repeated:
        x["q"], x["k"] = (x[n][:, :1].expand_as(x[n]).clone() for n in ("q", "k"))
    gen = torch.Generator(device="cuda").manual_seed(7)
    x["do"] = torch.randn(B, T, HV, V, device="cuda", dtype=torch.float64, generator=gen)
    dht = torch.randn(B, HV, K, V, device="cuda", dtype=torch.float64, generator=gen).float()
    low = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v", "beta", "do") else t.float()) for n, t in x.items()}
    exact = {n: t.double() for n, t in low.items()}
    return low, exact, dht


def check_case(case, segment_chunks: Optional[int] = None) -> dict:
    """Errors of the Hopper and Triton backwards and of the rounded baseline against float64 autograd; with
    ``segment_chunks``, the Hopper backward's walk in segments, and its gradients' distance to the unsegmented
    one's (``vs_unsegmented``, relative L2)."""
    from gpu_check_core import grads_of, rel, rounded_twin

    from linattn.ops.gated_delta.reference import gated_delta_rule_reference
    from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton
    from linattn.ops.hopper.backward import chunk_gated_delta_rule_bwd_hopper
    name, B, T, H, HV, K, V, BV, decay, repeated = case
    low, exact, dht = bf16_inputs(name, B, T, H, HV, K, V, decay, repeated)
    scale = K ** -0.5
    args = [low[n] for n in ("q", "k", "v", "g", "beta")]
    ref = grads_of(lambda **a: gated_delta_rule_reference(
        **{n: a[n] for n in ("q", "k", "v", "g", "beta")}, scale=scale, initial_state=a["initial_state"]),
        {n: t for n, t in exact.items() if n != "do"}, exact["do"], dht.double())[2:]
    t0 = time.time()
    hop = chunk_gated_delta_rule_bwd_hopper(*args, scale, low["initial_state"], low["do"], dht, BV,
                                            segment_chunks=segment_chunks)
    torch.cuda.synchronize()
    first_s = time.time() - t0
    whole = chunk_gated_delta_rule_bwd_hopper(*args, scale, low["initial_state"], low["do"], dht, BV,
                                              segment_chunks=-(-T // 64)) if segment_chunks else None
    tri = chunk_gated_delta_rule_bwd_triton(*args, scale, low["initial_state"], None, None, low["do"], dht)
    base = rounded_twin(low, torch.bfloat16, scale, low["do"].double(), dht.double())[2:]
    row = dict(case=name, B=B, T=T, H=H, HV=HV, K=K, V=V, BV=BV, segment_chunks=segment_chunks,
               first_call_s=round(first_s, 1), nonfinite=sum(int((~torch.isfinite(t)).sum()) for t in hop))
    if whole is not None:
        row["vs_unsegmented"] = {n: rel(a, b) for n, a, b in zip(GRADS, hop, whole)}
    for label, grads in (("hopper", hop), ("triton", tri), ("base", base)):
        row[label] = {n: rel(a, b) for n, a, b in zip(GRADS, grads, ref)}
    row["vs_triton"] = {n: row["hopper"][n] / max(row["triton"][n], 1e-30) for n in GRADS}
    row["vs_base"] = {n: row["hopper"][n] / max(row["base"][n], 1e-30) for n in GRADS}
    return row


def twin_case(case) -> dict:
    """The walk alone against its twin (``chunk_bwd_ref.chunk_bwd_v_slices_ref``, fp32 on the GPU, the kernel's
    rounding points) on the same recomputed gc, T and h: relative L2 of each raw output (dq, dk per value head, the
    slices added in the walk; dg, dβ per slice, before the host's sums), so that a wrong output of the kernel — a
    slice's tile missed or added twice by the cluster's exchange — shows apart from the host chain around it."""
    from gpu_check_core import rel

    from linattn.ops.hopper import backward, chunk_bwd
    from linattn.ops.hopper import chunk_bwd_ref as bwd
    name, B, T, H, HV, K, V, BV, decay, repeated = case
    BV = BV or min(V, 64)
    low, _, dht = bf16_inputs(name, B, T, H, HV, K, V, decay, repeated)
    scale = K ** -0.5
    gc_hm, beta_hm, a_inv, h = backward.recompute(low["k"], low["v"], low["g"], low["beta"], low["initial_state"])
    got = chunk_bwd.chunk_bwd_hopper(low["q"], low["k"], low["v"], low["do"], gc_hm, beta_hm, a_inv, h, dht, scale, BV)
    # the twin pads gc past T with the sequence's last value (its γ is the chunk's last row), β with zeros (as the
    # recompute does); its "checkpoints" are h itself, one per chunk
    pad = (0, gc_hm.shape[-1] - T)
    saved = bwd.SavedForward(torch.nn.functional.pad(gc_hm[..., :T], pad, mode="replicate"), beta_hm,
                             a_inv.float(), h.transpose(1, 2).float(), 1)
    twin = bwd.chunk_bwd_v_slices_ref(low["q"], low["k"], low["v"], low["do"], dht, saved, scale, BV)
    tokens = lambda x: x[..., :T].transpose(-1, -2)       # [NV, B, HV, Lp] → [NV, B, T, HV]
    outputs = dict(dq_heads=(got[0], twin.dq), dk_heads=(got[1], twin.dk), dv=(got[2], twin.dv),
                   dg_partials=(tokens(got[3]), twin.dg), dbeta_partials=(tokens(got[4]), twin.dbeta),
                   dh0=(got[5], twin.dh0))
    return dict(case=name, rel_l2={n: rel(a, b) for n, (a, b) in outputs.items()},
                nonfinite=sum(int((~torch.isfinite(a)).sum()) for a, _ in outputs.values()))


def difference(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Max abs difference and relative L2 of a against b."""
    from gpu_check_core import rel
    return dict(max_abs=(a.float() - b.float()).abs().max().item(), rel_l2=rel(a.float(), b.float()))


def recompute_case(case) -> dict:
    """The recompute's states walk against the states twin on the same pre-pass outputs (h max abs difference,
    relative L2)."""
    from linattn.ops.hopper import backward
    from linattn.ops.hopper.chunk_fwd_ref import chunk_states_hopper_ref
    name, B, T, H, HV, K, V, BV, decay, repeated = case
    low, _, _ = bf16_inputs(name, B, T, H, HV, K, V, decay, repeated)
    args = [low[n] for n in ("k", "v", "g", "beta", "initial_state")]
    new = backward.recompute(*args)
    h_twin, _ = chunk_states_hopper_ref(low["k"], low["v"], *new[:3], low["initial_state"])
    return dict(case=name, h_vs_twin=difference(new[3], h_twin),
                nonfinite=int((~torch.isfinite(new[3].float())).sum()))


def repeat_case(case, segment_chunks: Optional[int] = None, runs: int = 2) -> dict:
    """``runs`` runs of the Hopper backward on the same inputs (walked in segments of ``segment_chunks``, or as
    planned): whether every output of every run equals the first's bit for bit, and the largest relative L2
    difference from it."""
    from linattn.ops.hopper.backward import chunk_gated_delta_rule_bwd_hopper
    name, B, T, H, HV, K, V, BV, decay, repeated = case
    low, _, dht = bf16_inputs(name, B, T, H, HV, K, V, decay, repeated)
    args = ([low[n] for n in ("q", "k", "v", "g", "beta")] + [K ** -0.5, low["initial_state"], low["do"], dht, BV])
    first, *others = [chunk_gated_delta_rule_bwd_hopper(*args, segment_chunks=segment_chunks) for _ in range(runs)]
    return dict(case=name, segment_chunks=segment_chunks, runs=runs,
                bitwise_equal={n: all(torch.equal(a, o[i]) for o in others)
                               for i, (n, a) in enumerate(zip(GRADS, first))},
                max_difference={n: max(difference(o[i], a)["rel_l2"] for o in others)
                                for i, (n, a) in enumerate(zip(GRADS, first))})


def time_row(row) -> dict:
    """do_bench medians (ms) of the backward's parts and of the whole, Hopper and Triton, at one anchor row."""
    import triton

    from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton
    from linattn.ops.hopper import backward, chunk_bwd, prepass
    index, B, T, H, HV = row
    K = V = 128
    scale = K ** -0.5
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
    v, do = (torch.randn(B, T, HV, V, device="cuda").bfloat16() for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda")) / 16
    beta = torch.rand(B, T, HV, device="cuda").bfloat16()
    h0, dht = (torch.randn(B, HV, K, V, device="cuda") * 0.1 for _ in range(2))
    # first, while only the inputs are allocated (the first call also compiles: one call before it)
    backward.chunk_gated_delta_rule_bwd_hopper(q, k, v, g, beta, scale, h0, do, dht)
    peak = peak_memory_mib(lambda: backward.chunk_gated_delta_rule_bwd_hopper(q, k, v, g, beta, scale, h0, do, dht))
    gc_hm, beta_hm, a_inv, bound = backward.solve(k, g, beta)
    h = backward.states(k, v, gc_hm, beta_hm, a_inv, bound, h0)
    launch = recompute_launch(B, HV, V, torch.cuda.get_device_properties(0).multi_processor_count)
    states = lambda: backward.states(k, v, gc_hm, beta_hm, a_inv, bound, h0)
    walk = lambda: chunk_bwd.chunk_bwd_hopper(q, k, v, do, gc_hm, beta_hm, a_inv, h, dht, scale, 64)
    dq_h, dk_h, _, dg_p, db_p, _ = walk()
    ms = dict(
        recompute=triton.testing.do_bench(lambda: backward.recompute(k, v, g, beta, h0)),
        recompute_prepass=triton.testing.do_bench(lambda: prepass.prepass_hopper(k, g, beta, beta_in_a_inv=False)),
        recompute_states=triton.testing.do_bench(states),
        walk=triton.testing.do_bench(walk),
        reductions=triton.testing.do_bench(lambda: backward.gradients_from_partials(
            dq_h, dk_h, dg_p, db_p, g, beta.dtype, q.dtype, H)),
        hopper=triton.testing.do_bench(lambda: backward.chunk_gated_delta_rule_bwd_hopper(
            q, k, v, g, beta, scale, h0, do, dht)),
        triton=triton.testing.do_bench(lambda: chunk_gated_delta_rule_bwd_triton(
            q, k, v, g, beta, scale, h0, None, None, do, dht)))
    chunks = -(-T // 64)
    return dict(row=index, B=B, T=T, H=H, HV=HV, K=K, V=V, programs=B * HV * 2, chunks_per_program=chunks,
                ms=ms, walk_us_per_chunk=ms["walk"] * 1000 / chunks, states_BV=launch["BV"], peak_MiB=peak,
                states_segments=states_segments(B, T, HV))


def peak_memory_mib(fn) -> dict:
    """One call of ``fn`` (a backward): ``extra`` its peak allocation over what was allocated before it (MiB: the
    inputs excluded, its gradients and every intermediate included), ``outputs`` what its results hold."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    del out
    return dict(extra=round((peak - before) / 2 ** 20, 1), outputs=round((after - before) / 2 ** 20, 1))


def row_inputs(B, T, H, HV, K=128, V=128) -> dict:
    """Timing inputs (bf16 unit-norm q, k; the anchors' gates; h0 and dht), seeded."""
    torch.manual_seed(0)
    unit = lambda: torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
    q, k = unit(), unit()
    v, do = (torch.randn(B, T, HV, V, device="cuda").bfloat16() for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda")) / 16
    beta = torch.rand(B, T, HV, device="cuda").bfloat16()
    h0, dht = (torch.randn(B, HV, K, V, device="cuda") * 0.1 for _ in range(2))
    return dict(q=q, k=k, v=v, g=g, beta=beta, scale=K ** -0.5, initial_state=h0, do=do, dht=dht)


def segment_parts_ms(x: dict, L: int) -> dict:
    """do_bench medians (ms) of the segmented backward's parts at segments of L chunks, run as
    ``backward.chunk_gated_delta_rule_bwd_hopper`` runs them (the same calls on the same views)."""
    import triton

    from linattn.ops.common import CHUNK, num_sms
    from linattn.ops.hopper import backward, chunk_bwd, segments
    q, k, v, g, beta, do, dht, scale = (x[n] for n in ("q", "k", "v", "g", "beta", "do", "dht", "scale"))
    T, H = q.shape[1], q.shape[2]
    S = T // CHUNK // L
    gc_hm, beta_hm, t_inv, bound = backward.solve(k, g, beta)
    seg = lambda t: segments.as_segments(t, S)
    hm_seg = lambda t: segments.head_major_as_segments(t, S)
    warm_ups = lambda: segments.warm_state_grads(q, k, v, do, gc_hm, beta_hm, hm_seg(gc_hm), hm_seg(beta_hm), t_inv,
                                                 bound, dht, scale, L, 64, num_sms(q.device))
    dS_out = warm_ups()
    h = backward.states(k, v, gc_hm, beta_hm, t_inv, bound, x["initial_state"])
    walk_args = (seg(q), seg(k), seg(v), seg(do), hm_seg(gc_hm), hm_seg(beta_hm), seg(t_inv), seg(h), dS_out, scale,
                 64)
    walk = lambda: chunk_bwd.chunk_bwd_hopper(*walk_args)
    dq_h, dk_h, _, dg_p, db_p, _ = walk()

    def sums():     # one launch over every segment (the op's batches of rows: walk_rows)
        return backward.gradients_from_partials(dq_h, dk_h, dg_p, db_p, seg(g), beta.dtype, q.dtype, H)
    return dict(solve=triton.testing.do_bench(lambda: backward.solve(k, g, beta)),
                states=triton.testing.do_bench(lambda: backward.states(k, v, gc_hm, beta_hm, t_inv, bound,
                                                                       x["initial_state"])),
                warm_ups=triton.testing.do_bench(warm_ups),
                walk=triton.testing.do_bench(walk), sums=triton.testing.do_bench(sums))


def time_segments(row) -> dict:
    """Part (c) at one anchor row: the segmented Hopper backward (the planner's L, else T/256) by parts, the whole
    at that L, unsegmented, at forced S = 2, 4, 8, 16, and the Triton backward's; gradients' relative L2 segmented
    vs unsegmented."""
    import triton
    from gpu_check_core import rel

    from linattn.ops.common import num_sms
    from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton
    from linattn.ops.hopper import backward, segments
    index, B, T, H, HV = row
    x = row_inputs(B, T, H, HV)
    NT = T // 64
    plan = segments.plan_walk(None, B, T, HV, 128, 64, HV // H, num_sms(x["q"].device))
    planned = plan.L
    L = planned or NT // 4
    hopper = lambda chunks: backward.chunk_gated_delta_rule_bwd_hopper(**x, segment_chunks=chunks)
    split, whole = hopper(L), hopper(NT)
    ms = segment_parts_ms(x, L)
    ms.update(segmented=triton.testing.do_bench(lambda: hopper(L)),
              unsegmented=triton.testing.do_bench(lambda: hopper(NT)),
              triton=triton.testing.do_bench(lambda: chunk_gated_delta_rule_bwd_triton(
                  x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], None, None, x["do"],
                  x["dht"])))
    by_segments = {S: triton.testing.do_bench(lambda S=S: hopper(NT // S)) for S in (2, 4, 8, 16) if NT % S == 0}
    model_ms = {S: segments.walk_cost_us(B, NT, HV, 128, 64, NT // S, num_sms(x["q"].device), plan.parts) / 1000
                for S in (1, 2, 4, 8, 16) if NT % S == 0}
    return dict(row=index, B=B, T=T, H=H, HV=HV, planned_L=planned, L=L, segments=NT // L,
                walk_programs=B * (NT // L) * HV * 2, ms=ms, whole_ms_by_segments=by_segments,
                model_walk_ms_by_segments=model_ms,
                segmented_vs_unsegmented={n: rel(a, b) for n, a, b in zip(GRADS, split, whole)})


def warm_twin_case(item) -> dict:
    """The reverse warm-ups kernel against its twin (``chunk_bwd_ref.reverse_warm_ups_hopper_ref``, fp32 on the GPU,
    the kernel's rounding points) on the same pre-pass outputs: dS_out's relative L2, and the twin's w per segment."""
    from gpu_check_core import rel

    from linattn.ops.hopper import backward, chunk_bwd
    from linattn.ops.hopper import chunk_bwd_ref as bwd
    (name, B, T, H, HV, K, V, BV, decay, repeated), L = item
    BV = BV or min(V, 64)
    low, _, dht = bf16_inputs(name, B, T, H, HV, K, V, decay, repeated)
    scale = K ** -0.5
    gc_hm, beta_hm, t_inv, bound = backward.solve(low["k"], low["g"], low["beta"])
    S = -(-T // 64) // L
    got = chunk_bwd.reverse_warm_ups_hopper(low["q"], low["k"], low["do"], gc_hm, beta_hm, t_inv, bound, dht, scale,
                                            S, BV)
    twin = bwd.reverse_warm_ups_hopper_ref(low["q"], low["k"], low["do"], gc_hm, beta_hm, t_inv, bound, dht, scale, S)
    warm = bwd.reverse_warm_ups_ref(bound, bwd.segment_cuts(bound.shape[-1], S))
    return dict(case=name, segments=S, ds_out_rel_l2=rel(got, twin), nonfinite=int((~torch.isfinite(got)).sum()),
                w_min=[int(w.min()) for w in warm], w_max=[int(w.max()) for w in warm])


def time_warm(item) -> dict:
    """Part (d) at one anchor row and gate scale (``decay``: the anchors' gates divided by it): the segmented
    backward at the planner's L (else T/256) whole and the warm-ups alone (ms), the warm-ups' w per segment
    (min/max over value heads, from the chunk bounds as the kernel finds it), and the gradients segmented vs
    unsegmented (relative L2)."""
    import triton
    from gpu_check_core import rel

    from linattn.ops.common import num_sms
    from linattn.ops.hopper import backward, chunk_bwd, segments
    from linattn.ops.hopper import chunk_bwd_ref as bwd
    (index, B, T, H, HV), decay = item
    x = row_inputs(B, T, H, HV)
    x["g"] = x["g"] / decay
    q, k, g, beta, do, dht, scale = (x[n] for n in ("q", "k", "g", "beta", "do", "dht", "scale"))
    NT = T // 64
    L = segments.plan_walk(None, B, T, HV, 128, 64, HV // H, num_sms(q.device)).L or NT // 4
    S = NT // L
    hopper = lambda chunks: backward.chunk_gated_delta_rule_bwd_hopper(**x, segment_chunks=chunks)
    split, whole = hopper(L), hopper(NT)
    gc_hm, beta_hm, t_inv, bound = backward.solve(k, g, beta)
    w = bwd.reverse_warm_ups_ref(bound, bwd.segment_cuts(NT, S))             # [S, B, HV]
    ms = dict(segmented=triton.testing.do_bench(lambda: hopper(L)),
              warm_ups=triton.testing.do_bench(lambda: chunk_bwd.reverse_warm_ups_hopper(
                  q, k, do, gc_hm, beta_hm, t_inv, bound, dht, scale, S, 64)))
    return dict(row=index, B=B, T=T, H=H, HV=HV, gates_divided_by=decay, L=L, segments=S, ms=ms,
                w_min=[int(t.min()) for t in w], w_max=[int(t.max()) for t in w],
                segmented_vs_unsegmented={n: rel(a, b) for n, a, b in zip(GRADS, split, whole)})


def states_inputs(B: int, T: int, decay: float) -> dict:
    """Part (e)'s inputs at row 3's heads (H = HV = 16, K = V = 128): :func:`row_inputs` with the gates divided by
    ``decay``, and :func:`backward.solve`'s outputs on them."""
    from linattn.ops.hopper import backward
    x = row_inputs(B, T, 16, 16)
    x["g"] = x["g"] / decay
    x["solved"] = backward.solve(x["k"], x["g"], x["beta"])
    return x


def states_errors(split: torch.Tensor, whole: torch.Tensor, x: dict) -> dict:
    """h's relative L2 segmented vs unsegmented, and each against the float64 states twin on the same pre-pass
    outputs (k, v, h0 in float64: no rounding but T's bf16)."""
    from gpu_check_core import rel

    from linattn.ops.hopper.chunk_fwd_ref import chunk_states_hopper_ref
    gc_hm, beta_hm, t_inv, _ = x["solved"]
    exact = chunk_states_hopper_ref(x["k"].double(), x["v"].double(), gc_hm, beta_hm, t_inv,
                                    x["initial_state"].double())[0]
    errors = dict(segmented_vs_unsegmented=rel(split.float(), whole.float()),
                  unsegmented_vs_float64=rel(whole.double(), exact), segmented_vs_float64=rel(split.double(), exact),
                  nonfinite=int((~torch.isfinite(split.float())).sum()))
    del exact
    torch.cuda.empty_cache()
    return errors


def states_twin_case(case) -> dict:
    """Part (e)'s kernels against their twins (fp32 on the GPU, the kernels' rounding points) on the same inputs:
    phase A with β in X ([M | N] of every segment, none skipped), phase C's warm states walk from random entering
    states with warm-ups drawn per segment and head in 0 … L/64 (segment 0: 0), so that both starts run; then the
    segmented h (as ``backward.states`` runs it, the plan's flags) against the unsegmented kernel's and float64."""
    from gpu_check_core import rel

    from linattn.ops.hopper import backward, segments, walk_launch
    from linattn.ops.hopper.chunk_fwd_ref import chunk_fwd_hopper_hm_ref, chunk_states_hopper_ref
    from linattn.ops.hopper.plan import DEFAULT
    name, B, T, decay, S = case
    x = states_inputs(B, T, decay)
    k, v, h0 = x["k"], x["v"], x["initial_state"]
    gc_hm, beta_hm, t_inv, bound = x["solved"]
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    view = lambda t: segments.as_segments(t, S)
    gc_s, beta_s = (segments.head_major_as_segments(t, S) for t in (gc_hm, beta_hm))
    maps_args = (view(k), view(k), view(v), gc_s, beta_s, view(t_inv), 1.0, None)
    maps_kw = dict(affine=True, skip_m=torch.zeros(B * S, HV, dtype=torch.int32, device="cuda"), lean=True,
                   beta_in_a_inv=False)
    mn = walk_launch.chunk_fwd_hopper_hm(*maps_args, **maps_kw, BV=128)[1]
    mn_twin = chunk_fwd_hopper_hm_ref(*maps_args, **maps_kw)[1]
    gen = torch.Generator(device="cuda").manual_seed(3)
    later = (torch.arange(B * S, device="cuda") % S > 0)[:, None]
    warm = (torch.randint(0, T // 64 // S + 1, (B * S, HV), device="cuda", generator=gen) * later).int()
    h_in = torch.randn(B * S, HV, K, V, device="cuda", generator=gen) * 0.1
    h_c = walk_launch.chunk_states_hopper(k, v, gc_s, beta_s, t_inv, h_in, warm_chunks=warm, BV=128)[0]
    h_c_twin = chunk_states_hopper_ref(k, v, gc_s, beta_s, t_inv, h_in, warm_chunks=warm)[0]
    split = backward.segmented_states(k, v, gc_hm, beta_hm, t_inv, bound, h0, S, DEFAULT.launch(128))
    whole = walk_launch.chunk_states_hopper(k, v, gc_hm, beta_hm, t_inv, h0, **DEFAULT.launch(64))[0]
    return dict(case=name, B=B, T=T, segments=S, gates_divided_by=decay, maps_vs_twin=rel(mn, mn_twin),
                phase_c_vs_twin=rel(h_c.float(), h_c_twin.float()), warm_ups_drawn=int((warm > 0).sum()),
                **states_errors(split, whole, x))


def time_states(item) -> dict:
    """Part (e) at one row and gate scale: h in the plan's segments (``backward.states``; ms, do_bench medians, and
    the parts as ``backward.segmented_states`` runs them), h's errors against the unsegmented kernel's (the walk at
    BV 128 where it fills the card, else 64) and float64 (:func:`states_errors`), the plan's flags."""
    import triton

    from linattn.ops.common import num_sms, seq_parallel
    from linattn.ops.hopper import backward, forward, segments, walk_launch
    from linattn.ops.hopper.plan import fitted_launch, plan, scan_options
    (index, B, T, H, HV), decay = item
    x = states_inputs(B, T, decay)
    k, v, h0 = x["k"], x["v"], x["initial_state"]
    gc_hm, beta_hm, t_inv, bound = x["solved"]
    K, V = k.shape[3], v.shape[3]
    chosen = plan(B, HV, V, T, num_sms(k.device))
    S, launch, config = chosen.segments, chosen.kernel_launch, chosen.config
    whole_launch = recompute_launch(B, HV, V, num_sms(k.device))
    unsegmented = lambda: walk_launch.chunk_states_hopper(k, v, gc_hm, beta_hm, t_inv, h0, **whole_launch)[0]
    segmented = lambda: backward.states(k, v, gc_hm, beta_hm, t_inv, bound, h0)
    row = dict(row=index, B=B, T=T, H=H, HV=HV, gates_divided_by=decay, segments=S, BV=launch["BV"],
               unsegmented_BV=whole_launch["BV"], **states_errors(segmented(), unsegmented(), x))
    view = lambda t: segments.as_segments(t, S)
    copies = lambda: [segments.head_major_as_segments(t, S) for t in (gc_hm, beta_hm, bound)]
    gc_s, beta_s, bound_s = copies()
    flags = forward.segment_flags(bound_s, S, k.device, B, config)
    phase_a = lambda: walk_launch.chunk_fwd_hopper_hm(
        view(k), view(k), view(v), gc_s, beta_s, view(t_inv), 1.0, None, affine=True, skip_m=flags.skip_m, lean=True,
        beta_in_a_inv=False, **fitted_launch(K, launch))[1]
    mn = phase_a()
    scan = lambda: seq_parallel.affine_scan(mn, h0, V, B, nseg=S, BV=config.scan_bv, skip=flags.skip_m,
                                            skip_writes=True, **scan_options(K, config))
    h_in = scan()
    phase_c = lambda: walk_launch.chunk_states_hopper(k, v, gc_s, beta_s, t_inv, h_in, warm_chunks=flags.warm,
                                                      **launch)[0]
    row["ms"] = dict(segmented=triton.testing.do_bench(segmented), copies=triton.testing.do_bench(copies),
                     plan=triton.testing.do_bench(lambda: forward.segment_flags(bound_s, S, k.device, B, config)),
                     phase_a=triton.testing.do_bench(phase_a), scan=triton.testing.do_bench(scan),
                     phase_c=triton.testing.do_bench(phase_c))
    row["flags"] = dict(mapped_heads=int(flags.walk.sum()), skipped_m=int((flags.skip_m == 1).sum()),
                        of=B * S * HV, max_warm_up=int(flags.warm.max()))
    return row


def packed_inputs(name: str, lengths: list[int], H: int, HV: int, K: int, decay: float = 1 / 16) -> dict:
    """Part (f)'s packed inputs ``[1, ΣT, ...]`` (gpu_check_core.make's, one h0 per sequence) rounded as
    :func:`bf16_inputs` rounds them, their float64 copies, dht ``[N, HV, K, V]``, cu_seqlens and its host offsets."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    low, exact, _ = bf16_inputs(name, 1, offsets[-1], H, HV, K, K, decay)
    gen = torch.Generator(device="cuda").manual_seed(11)
    low["initial_state"] = torch.randn(len(lengths), HV, K, K, device="cuda", generator=gen) * 0.1
    exact["initial_state"] = low["initial_state"].double()
    dht = torch.randn(len(lengths), HV, K, K, device="cuda", generator=gen)
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    return dict(low=low, exact=exact, dht=dht, cu_seqlens=cu, offsets=offsets)


def packed_backwards(x: dict) -> dict:
    """The padded Hopper backward and the Triton varlen backward on :func:`packed_inputs`' inputs, as callables."""
    from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton
    from linattn.ops.hopper.backward import chunk_gated_delta_rule_bwd_hopper
    low, dht, cu, offsets = x["low"], x["dht"], x["cu_seqlens"], x["offsets"]
    args = [low[n] for n in ("q", "k", "v", "g", "beta")] + [low["q"].shape[-1] ** -0.5, low["initial_state"]]
    return dict(hopper=lambda: chunk_gated_delta_rule_bwd_hopper(*args, low["do"], dht, cu_seqlens=cu,
                                                                 offsets=offsets),
                triton=lambda: chunk_gated_delta_rule_bwd_triton(*args, cu, offsets, low["do"], dht))


def varlen_case(case) -> dict:
    """Part (f)'s accuracy: relative L2 of every gradient of the padded Hopper backward and of the Triton varlen
    backward against float64 autograd over the packed sequences, and the padded backward against the Hopper
    backward on each non-empty sequence alone (B = 1; an empty sequence's dh0 against its dht)."""
    from gpu_check_core import grads_of, rel

    from linattn.ops.gated_delta.reference import gated_delta_rule_reference
    from linattn.ops.hopper.backward import chunk_gated_delta_rule_bwd_hopper
    name, lengths, H, HV, K = case
    x = packed_inputs(name, lengths, H, HV, K)
    low, exact, dht, offsets = x["low"], x["exact"], x["dht"], x["offsets"]
    scale = K ** -0.5
    ref = grads_of(lambda **a: gated_delta_rule_reference(
        **{n: a[n] for n in ("q", "k", "v", "g", "beta")}, scale=scale, initial_state=a["initial_state"],
        cu_seqlens=offsets), {n: t for n, t in exact.items() if n != "do"}, exact["do"], dht.double())[2:]
    runs = packed_backwards(x)
    hop, tri = runs["hopper"](), runs["triton"]()
    alone = [[] for _ in GRADS]
    for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        if bos == eos:
            alone[5].append(dht[n])
            continue
        # copies: a view at an odd row would start β (bf16, 4 heads) off the kernels' 16-byte boundary
        one = [low[m][:, bos:eos].clone() for m in ("q", "k", "v", "g", "beta", "do")]
        grads = chunk_gated_delta_rule_bwd_hopper(*one[:5], scale, low["initial_state"][n:n + 1], one[5],
                                                  dht[n:n + 1])
        for i, t in enumerate(grads):
            alone[i].append(t if i < 5 else t[0])
    alone = [torch.cat(a, 1) for a in alone[:5]] + [torch.stack(alone[5])]
    row = dict(case=name, lengths=lengths, H=H, HV=HV, K=K,
               nonfinite=sum(int((~torch.isfinite(t)).sum()) for t in hop))
    for label, grads in (("hopper", hop), ("triton", tri)):
        row[label] = {n: rel(a, b) for n, a, b in zip(GRADS, grads, ref)}
    row["vs_triton"] = {n: row["hopper"][n] / max(row["triton"][n], 1e-30) for n in GRADS}
    row["vs_alone"] = {n: rel(a.float(), b.float()) for n, a, b in zip(GRADS, hop, alone)}
    row["bitwise_alone"] = {n: bool(torch.equal(a, b.to(a.dtype))) for n, a, b in zip(GRADS, hop, alone)}
    return row


def time_varlen(item) -> dict:
    """Part (f) at one packed row: do_bench medians (ms) of the padded Hopper backward, the Triton varlen backward,
    the padding copies alone (q, k, v, g, β, dO in; dq, dk, dv, dg, dβ out) and the Hopper backward on the already
    padded batch; the dispatch's decision; the gradients' relative L2 Hopper vs Triton."""
    import triton
    from gpu_check_core import rel

    from linattn.ops.gated_delta import dispatch
    from linattn.ops.hopper import backward, varlen
    name, lengths = item
    H = HV = 16
    K = 128
    x = packed_inputs(name, lengths, H, HV, K)
    low, dht, cu, offsets = x["low"], x["dht"], x["cu_seqlens"], x["offsets"]
    N, total, Tp = len(lengths), offsets[-1], varlen.padded_rows(offsets)
    names = ("q", "k", "v", "g", "beta", "do")
    batch = {n: varlen.to_padded(low[n], cu, N, Tp) for n in names}
    outs = [batch[n] for n in ("q", "k", "v", "g", "beta")]             # the gradients' shapes and dtypes
    runs = packed_backwards(x)
    hop, tri = runs["hopper"](), runs["triton"]()
    on_batch = lambda: backward.chunk_gated_delta_rule_bwd_hopper(
        *(batch[n] for n in names[:5]), K ** -0.5, low["initial_state"], batch["do"], dht)
    blocker = dispatch.hopper_backward_blocker(1, total, HV, K, K, torch.bfloat16, low["g"].dtype, offsets)
    ms = dict(hopper=triton.testing.do_bench(runs["hopper"]), triton=triton.testing.do_bench(runs["triton"]),
              copies_in=triton.testing.do_bench(lambda: [varlen.to_padded(low[n], cu, N, Tp) for n in names]),
              copies_out=triton.testing.do_bench(lambda: [varlen.from_padded(t, cu, total) for t in outs]),
              hopper_on_batch=triton.testing.do_bench(on_batch))
    return dict(row=name, N=N, total=total, Tp=Tp, padded_fraction=1 - total / (N * Tp), H=H, HV=HV, K=K,
                route=blocker or "hopper", ms=ms, speedup=ms["triton"] / ms["hopper"],
                hopper_vs_triton={n: rel(a.float(), b.float()) for n, a, b in zip(GRADS, hop, tri)})


def time_timeline(item) -> dict:
    """Part (g) at one row: the walk's timeline build (every step stamped) against the default walk on the same
    recomputed inputs (each raw output bit for bit), both walks' do_bench medians (ms, and µs per step), and the
    stamps reduced to µs per phase (``timeline.timeline_phases``)."""
    import triton

    from linattn.ops.hopper import backward, chunk_bwd, timeline
    label, B, T, H, HV = item
    x = row_inputs(B, T, H, HV)
    q, k, v, g, beta, do, dht, scale = (x[n] for n in ("q", "k", "v", "g", "beta", "do", "dht", "scale"))
    gc_hm, beta_hm, a_inv, bound = backward.solve(k, g, beta)
    h = backward.states(k, v, gc_hm, beta_hm, a_inv, bound, x["initial_state"])
    args = (q, k, v, do, gc_hm, beta_hm, a_inv, h, dht, scale, 64)
    walk = lambda: chunk_bwd.chunk_bwd_hopper(*args)
    timed = lambda: chunk_bwd.walk_timeline(*args)
    default, (outputs, stamps) = walk(), timed()
    chunks = -(-T // 64)
    ms = dict(walk=triton.testing.do_bench(walk), walk_timeline=triton.testing.do_bench(timed))
    return dict(row=label, B=B, T=T, H=H, HV=HV, programs=B * HV * 2, chunks=chunks,
                bitwise_equal={n: bool(torch.equal(a, b)) for n, a, b in zip(WALK_OUTPUTS, default, outputs)},
                ms=ms, us_per_step={n: t * 1000 / chunks for n, t in ms.items()},
                phases=timeline.timeline_phases(stamps.cpu(), slices=2))


def print_timeline_table(results: dict) -> None:
    from linattn.ops.hopper.timeline import format_table
    print(f"\ndevice: {results.get('device')}")
    for r in measured(results["timeline"], "row", 8):
        same = sum(r["bitwise_equal"].values())
        print(f"\n{r['row']}: B={r['B']} T={r['T']} H={r['H']} HV={r['HV']}, {r['programs']} programs × "
              f"{r['chunks']} steps; walk {r['ms']['walk']:.3f} ms ({r['us_per_step']['walk']:.2f} µs/step), "
              f"timeline build {r['ms']['walk_timeline']:.3f} ms ({r['us_per_step']['walk_timeline']:.2f} µs/step); "
              f"outputs bit for bit equal: {same}/{len(r['bitwise_equal'])}"
              + ("" if same == len(r["bitwise_equal"]) else f" {r['bitwise_equal']}"))
        print(format_table(r["phases"], r["row"]))


def grad_cells(values: dict, fmt: str) -> str:
    """One printed cell per gradient (GRADS' order) of ``values``, each in ``fmt``."""
    return "".join(f"{values[n]:{fmt}}" for n in GRADS)


def print_varlen_table(results: dict) -> None:
    print(f"\ndevice: {results.get('device')}")
    print(f"\n{'case':<20}" + "".join(f"{n:>9}" for n in GRADS) + "   (rel L2 vs float64 over the packed sequences)")
    for r in measured(results["varlen_accuracy"], "case", 20):
        print(f"{r['case']:<20}" + grad_cells(r["hopper"], "9.1e") + "   hopper padded")
        print(f"{'':<20}" + grad_cells(r["triton"], "9.1e") + "   triton varlen")
        print(f"{'':<20}" + grad_cells(r["vs_triton"], "9.2f") + "   hopper / triton")
        print(f"{'':<20}" + grad_cells(r["vs_alone"], "9.1e")
              + f"   padded vs each sequence alone (bitwise: {sum(r['bitwise_alone'].values())}/6); "
              f"nonfinite {r['nonfinite']}")
    print(f"\n{'row':<14}{'N':>3}{'ΣT':>7}{'Tp':>6}{'pad':>6}{'hopper':>9}{'triton':>9}{'tri/hop':>8}"
          f"{'copies':>8}{'on batch':>9}  route; max rel L2 hopper vs triton"
          "   (ms, do_bench medians; copies = 6 in + 5 out)")
    for r in measured(results["varlen"], "row", 14):
        ms = r["ms"]
        print(f"{r['row']:<14}{r['N']:>3}{r['total']:>7}{r['Tp']:>6}{r['padded_fraction']:6.1%}{ms['hopper']:9.3f}"
              f"{ms['triton']:9.3f}{r['speedup']:8.2f}{ms['copies_in'] + ms['copies_out']:8.3f}"
              f"{ms['hopper_on_batch']:9.3f}  {r['route']}; {max(r['hopper_vs_triton'].values()):.1e}")


def print_states_table(results: dict) -> None:
    print(f"\ndevice: {results.get('device')}")
    print("part (e) kernels against their twins (rel L2; ≈ 1e-3 is rounding), then h (rel L2):")
    for r in measured(results["states_twin"], "case", 22):
        print(f"{r['case']:<22}maps {r['maps_vs_twin']:.1e}  phase C {r['phase_c_vs_twin']:.1e} "
              f"({r['warm_ups_drawn']} warm-ups)  seg/unseg {r['segmented_vs_unsegmented']:.1e}  vs float64: "
              f"unseg {r['unsegmented_vs_float64']:.2e} seg {r['segmented_vs_float64']:.2e}  "
              f"nonfinite {r['nonfinite']}")
    print(f"\n{'row':<5}{'B,T,H,HV':<18}{'g/':>6}{'S':>4}{'seg':>8}{'copies':>8}{'plan':>8}{'A':>8}"
          f"{'scan':>8}{'C':>8}  h rel L2 seg/unseg; vs float64 unseg, seg; flags   (ms, do_bench medians)")
    for r in measured(results["states"], "row", 5):
        ms = r["ms"]
        print(f"{r['row']:<5}{row_shape(r):<18}{r['gates_divided_by']:>6}{r['segments']:>4}"
              + "".join(f"{ms[n]:8.3f}" for n in ("segmented", "copies", "plan", "phase_a", "scan", "phase_c"))
              + f"  {r['segmented_vs_unsegmented']:.1e}; {r['unsegmented_vs_float64']:.2e}, "
              f"{r['segmented_vs_float64']:.2e}; {r['flags']}")


def measured(rows: list, label: str, width: int):
    """The rows that were measured; each that failed printed as one line (its ``label`` field, then the error)."""
    for r in rows:
        if "error" in r:
            print(f"{r[label]:<{width}}ERROR {r['error'][:200]}")
        else:
            yield r


def row_shape(r: dict) -> str:
    return f"{r['B']},{r['T']},{r['H']},{r['HV']}"


def print_warm_table(results: dict) -> None:
    print(f"\ndevice: {results.get('device')}")
    print("the reverse warm-ups kernel against its twin (dS_out rel L2; ≈ 1e-3 is rounding), twin's w per segment:")
    for r in results["warm_twin"]:
        print(f"{r['case']:<32}{r.get('ds_out_rel_l2', r.get('error'))}  nonfinite {r.get('nonfinite')}  "
              f"w min {r.get('w_min')} max {r.get('w_max')}")
    print(f"\n{'case':<32}" + "".join(f"{n:>9}" for n in GRADS) + "   (hopper / rounded baseline vs float64)")
    for r in measured(results["accuracy"], "case", 32):
        print(f"{r['case']:<32}" + grad_cells(r["vs_base"], "9.2f")
              + f"   worst {max(r['vs_base'].values()):.2f}; vs unsegmented "
              f"{max(r['vs_unsegmented'].values()):.1e}")
    print(f"\n{'row':<5}{'B,T,H,HV':<18}{'g/':>6}{'L':>6}{'S':>4}{'seg':>9}{'warm-ups':>10}"
          f"  w min/max per segment; max rel L2 seg/unseg   (ms, do_bench medians)")
    for r in measured(results["warm"], "row", 5):
        ms, shape = r["ms"], row_shape(r)
        print(f"{r['row']:<5}{shape:<18}{r['gates_divided_by']:>6}{r['L']:>6}{r['segments']:>4}"
              f"{ms['segmented']:9.3f}{ms['warm_ups']:10.3f}  {r['w_min']}/{r['w_max']}; "
              f"{max(r['segmented_vs_unsegmented'].values()):.1e}")


def print_segment_table(results: dict) -> None:
    print(f"\ndevice: {results.get('device')}")
    print("segmented Hopper backward (ms, do_bench medians):")
    print(f"{'row':<5}{'B,T,H,HV':<18}{'L':>5}{'S':>4}{'solve':>8}{'states':>8}{'warm-ups':>9}"
          f"{'walk':>8}{'sums':>8}{'seg':>9}{'unseg':>9}{'triton':>9}  max rel L2 seg/unseg")
    for r in measured(results["segments"], "row", 5):
        ms, shape = r["ms"], row_shape(r)
        print(f"{r['row']:<5}{shape:<18}{r['L']:>5}{r['segments']:>4}{ms['solve']:8.3f}{ms['states']:8.3f}"
              f"{ms['warm_ups']:9.3f}{ms['walk']:8.3f}{ms['sums']:8.3f}"
            + "".join(f"{ms[n]:9.3f}" for n in ("segmented", "unsegmented", "triton"))
            + f"  {max(r['segmented_vs_unsegmented'].values()):.1e}")
    print("whole Hopper backward by forced segment count S (ms), beside the planner's model of the walk and the "
          "warm-ups (ms, S = 1: unsegmented):")
    for r in results["segments"]:
        if "error" not in r:
            print(f"{r['row']:<5}measured {r['whole_ms_by_segments']}  model {r['model_walk_ms_by_segments']}")


def print_tables(results: dict) -> None:
    print(f"\ndevice: {results.get('device')}")
    print("\nthe walk against its twin on the same gc, T, h (rel L2 of each raw output; ≈ 1e-3 is rounding):")
    for r in results["twin"]:
        print(f"{r['case']:<28}{r.get('rel_l2', r.get('error'))}  nonfinite {r.get('nonfinite')}")
    print(f"\n{'case':<28}" + "".join(f"{n:>9}" for n in GRADS) + "   (rel L2 vs float64; hopper/triton; hopper/base)")
    for r in measured(results["accuracy"], "case", 28):
        print(f"{r['case']:<28}" + grad_cells(r["hopper"], "9.1e") + "   hopper")
        print(f"{'':<28}" + grad_cells(r["triton"], "9.1e") + "   triton")
        print(f"{'':<28}" + grad_cells(r["base"], "9.1e") + "   rounded baseline")
        print(f"{'':<28}" + grad_cells(r["vs_triton"], "9.2f") + "   hopper / triton")
        print(f"{'':<28}" + grad_cells(r["vs_base"], "9.2f")
              + f"   hopper / base (goal ≤ 2; worst {max(r['vs_base'].values()):.2f})")
        if r.get("vs_unsegmented"):
            print(f"{'':<28}" + grad_cells(r["vs_unsegmented"], "9.1e")
                  + f"   segments of {r['segment_chunks']} chunks vs unsegmented (rel L2)")
    for r in results["repeat"]:
        print(f"bitwise repeat {r.get('case')}: {r.get('bitwise_equal', r.get('error'))}")
    print("\nthe recompute's h against the states twin (max abs / rel L2):")
    for r in measured(results["recompute"], "case", 28):
        d = r["h_vs_twin"]
        print(f"{r['case']:<28}{d['max_abs']:.1e} / {d['rel_l2']:.1e}, nonfinite {r['nonfinite']}")
    print(f"\n{'row':<5}{'B,T,H,HV':<18}{'recompute':>10}{'walk':>9}{'µs/chunk':>10}{'reduce':>9}"
          f"{'hopper':>9}{'triton':>9}   (ms, do_bench medians)")
    for r in measured(results["timing"], "row", 5):
        ms, shape = r["ms"], row_shape(r)
        print(f"{r['row']:<5}{shape:<18}{ms['recompute']:10.3f}{ms['walk']:9.3f}"
              f"{r['walk_us_per_chunk']:10.2f}{ms['reductions']:9.3f}{ms['hopper']:9.3f}{ms['triton']:9.3f}")
        print(f"{'':<23}recompute = pre-pass {ms['recompute_prepass']:.3f} + states {ms['recompute_states']:.3f} "
              f"({r['states_segments']} segments; unsegmented at BV {r['states_BV']}); Hopper backward's peak over its "
              f"inputs {r['peak_MiB']['extra']:.0f} MiB (its gradients {r['peak_MiB']['outputs']:.0f})")


def long_repeats(out_dir: Path) -> dict:
    """--repeat: :func:`repeat_case` of every REPEAT_CASES case, REPEAT_RUNS runs, as planned; one table."""
    rows = []
    for case in REPEAT_CASES:
        try:
            rows.append(repeat_case(case, runs=REPEAT_RUNS))
        except Exception as e:      # one failing case must not hide the others
            rows.append(dict(case=case[0], error=f"{type(e).__name__}: {e}"))
        print(json.dumps(rows[-1]), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "hopper_bwd_repeat.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'case':<22} " + " ".join(f"{n:>16}" for n in GRADS))
    for r in rows:
        cells = [("bitwise" if r["bitwise_equal"][n] else f"{r['max_difference'][n]:.1e}") for n in GRADS] \
            if "error" not in r else [r["error"][:80]]
        print(f"{r['case']:<22} " + " ".join(f"{c:>16}" for c in cells))
    return dict(repeat=rows)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="CPU: build every kernel for sm_90a (no GPU run)")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--timing-only", action="store_true", help="only part (b), e.g. after (a) ran in another process")
    ap.add_argument("--rows", default=None, help="anchor rows to time, e.g. 2,3 (default: all of the part's)")
    ap.add_argument("--segments", action="store_true", help="only part (c), the segmented backward's rows")
    ap.add_argument("--warm", action="store_true", help="only part (d), the reverse warm-ups")
    ap.add_argument("--states", action="store_true", help="only part (e), the states recompute in segments")
    ap.add_argument("--varlen", action="store_true", help="only part (f), packed sequences by padding")
    ap.add_argument("--timeline", action="store_true", help="only part (g), the walk's in-kernel timeline")
    ap.add_argument("--repeat", action="store_true",
                    help=f"only the long bitwise repeats ({REPEAT_RUNS} runs of each of REPEAT_CASES; no precompile)")
    args = ap.parse_args(argv)
    if args.smoke:
        return dict(smoke=smoke())
    if args.repeat:
        return long_repeats(Path(args.out))
    precompile_kernels()
    name = ("hopper_bwd_segments" if args.segments else "hopper_bwd_warm" if args.warm
            else "hopper_bwd_states" if args.states else "hopper_bwd_varlen" if args.varlen
            else "hopper_bwd_timeline" if args.timeline
            else "hopper_bwd_timing" if args.timing_only else "hopper_bwd")
    out = Path(args.out) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results = dict(device=torch.cuda.get_device_name(), twin=[], recompute=[], accuracy=[], repeat=[], timing=[],
                   segments=[], warm_twin=[], warm=[], states_twin=[], states=[], varlen_accuracy=[],
                   varlen=[], timeline=[])

    def chosen(table: list) -> list:
        """The rows of ``table`` that --rows names (all of them without it)."""
        names = {int(r) for r in args.rows.split(",")} if args.rows else {r[0] for r in table}
        return [r for r in table if r[0] in names]

    def step(key, fn, item, label):
        try:
            results[key].append(fn(item))
        except Exception as e:      # keep the other parts: one failure is a row of the table
            traceback.print_exc()
            results[key].append({label: item[0], "error": f"{type(e).__name__}: {e}"})
        out.write_text(json.dumps(results, indent=1))
        print(json.dumps(results[key][-1]), flush=True)

    if args.timeline:
        for row in TIMELINE_ROWS:
            step("timeline", time_timeline, row, "row")
        print_timeline_table(results)
        return results
    if args.varlen:
        step("varlen_accuracy", varlen_case, VARLEN_CASE, "case")
        for row in VARLEN_ROWS:
            step("varlen", time_varlen, row, "row")
        print_varlen_table(results)
        return results
    if args.states:
        for case in STATES_CASES:
            step("states_twin", states_twin_case, case, "case")
        for decay in (1, 1024):
            for row in chosen(STATES_ROWS):
                step("states", time_states, (row, decay), "row")
        print_states_table(results)
        return results
    if args.segments:
        for row in chosen(SEGMENT_ROWS):
            step("segments", time_segments, row, "row")
        print_segment_table(results)
        return results
    if args.warm:
        for item in WARM_CASES:
            step("warm_twin", warm_twin_case, item, "case")
        for case, chunks in WARM_CASES:
            step("accuracy", lambda c, L=chunks: check_case(c, L), case, "case")
        step("repeat", lambda c: repeat_case(c, WARM_CASES[0][1]), WARM_CASES[0][0], "case")
        for decay in (1, 1024):
            for row in chosen(WARM_ROWS):
                step("warm", time_warm, (row, decay), "row")
        print_warm_table(results)
        return results
    if not args.timing_only:
        for case in CASES:
            step("twin", twin_case, case, "case")
        for case in CASES:
            step("recompute", recompute_case, case, "case")
        for case in CASES:
            step("accuracy", check_case, case, "case")
        for case, chunks in SEGMENTED_CASES:
            step("accuracy", lambda c, L=chunks: check_case(c, L), case, "case")
        step("repeat", repeat_case, CASES[0], "case")
        step("repeat", lambda c: repeat_case(c, SEGMENTED_CASES[0][1]), SEGMENTED_CASES[0][0], "case")
    if not args.skip_timing:
        for row in chosen(ROWS):
            step("timing", time_row, row, "row")
    print_tables(results)
    return results


if __name__ == "__main__":
    main()
