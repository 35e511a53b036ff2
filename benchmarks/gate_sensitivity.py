"""How the forward's time depends on the gates: linattn's public op ("auto") beside FlashQLA in one process, at three
draws of the decay g on the same q, k, v and β (bench_anchors' inputs, seed 2):

    anchors  bench_anchors' own gates (logsigmoid(randn) / 16: mean ≈ −0.05, every head forgets within a segment)
    mixed    per-head rates as a Mamba-style initialisation draws them (gpu_timing.mixed_gates: some heads forget
             within a chunk, others keep their state over a whole segment)
    slow     the anchors' gates / 65536 (no head forgets: the segmented forwards' worst case)

The segmented forward's two levers (warm-ups and skipped maps) read the gates, so its time moves with them; a
forward that does the same work whatever the gates (FlashQLA's, the unsegmented walk) should not move. Each row: the
op's eager do_bench median, its CUDA graph replay (GPU time alone) and FlashQLA's eager median, in ms.

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python benchmarks/gate_sensitivity.py 1,32768,16,16 [B,T,H,HV ...]

``--train``: instead, forward + backward (``torch.autograd.grad`` over q, k, v, g, β; anchors_forward_table's
``time_training``: do_bench median ms and peak extra MB during one call) of the op and FlashQLA at each draw: the
segmented backward's warm-ups read the gates too (at gates that never forget they walk to the sequence's end).

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python benchmarks/gate_sensitivity.py --train 1,32768,2,8 [...]

``--phases``: instead, where the op's GPU time goes at each gate draw: every kernel's µs per call (the profiler's
self device time over :data:`PROFILED_CALLS` calls), so a slower draw says which launch grew (the segmented
forward's warm-ups, the scan, the walk; with ``--train``, of forward + backward: the reverse warm-ups, the walk).
``--trace``: also each profiled run's chrome trace into ``$OUT`` (every kernel's start, end and stream: how the
launches overlap).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from gpu_timing import bench, graph_ms, mixed_gates  # this folder is on sys.path

from linattn import chunk_gated_delta_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / ".anchors"))
from bench_anchors import make_inputs  # noqa: E402  (the anchors' inputs, so the figures compare with theirs)

GATES = {
    "anchors": lambda g: g,
    "mixed": mixed_gates,
    "slow": lambda g: g / 65536,
}


def flash_qla_forward():
    """FlashQLA's forward as bench_anchors calls it, or None where it does not import."""
    try:
        import flash_qla
    except ImportError as error:
        print(f"FlashQLA not timed: {error}", flush=True)
        return None
    return lambda q, k, v, g, beta, scale: flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                                                            output_final_state=True)


def op_at(B, T, H, HV, gates):
    """(the op's call on bench_anchors' inputs with the decays of ``gates``, its inputs and scale)."""
    q, k, v, g, beta = (x.detach() for x in make_inputs(B, T, H, HV, 128, 128, torch.bfloat16, seed=2))
    g = GATES[gates](g).contiguous()
    scale = 128 ** -0.5

    def ours():
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, output_final_state=True)
    return ours, (q, k, v, g, beta), scale


def row(B, T, H, HV, gates, theirs):
    ours, (q, k, v, g, beta), scale = op_at(B, T, H, HV, gates)
    with torch.no_grad():
        ours()
        result = dict(shape=(B, T, H, HV), gates=gates, linattn_ms=round(bench(ours), 4),
                      linattn_graph_ms=round(graph_ms(ours), 4))
        if theirs is not None:
            o, ht = ours()
            o_theirs, ht_theirs = theirs(q, k, v, g, beta, scale)
            result["flashqla_ms"] = round(bench(lambda: theirs(q, k, v, g, beta, scale)), 4)
            # a sanity check that both computed the same thing (bf16: a few 1e-3 apart, not bitwise)
            result["o_max_diff"] = float((o.float() - o_theirs.float()).abs().max())
    return result


PROFILED_CALLS = 20


def phases(B, T, H, HV, gates, trace=False, train=False):
    """{kernel name: µs of GPU time per call} of the op at ``gates``, largest first; ``trace``: the profiled calls'
    chrome trace written to ``$OUT/trace-B-T-H-HV-gates.json``; ``train``: of forward + ``torch.autograd.grad`` over
    q, k, v, g, β (the backward's kernels with the forward's)."""
    from torch.profiler import ProfilerActivity, profile
    ours, xs, _ = op_at(B, T, H, HV, gates)
    call = ours
    if train:
        for x in xs:        # the op's own inputs: ``ours`` reads these tensors
            x.requires_grad_()
        do = torch.randn(B, T, HV, 128, device=xs[0].device, dtype=torch.bfloat16)
        call = lambda: torch.autograd.grad(ours()[0], xs, do)
    with torch.enable_grad() if train else torch.no_grad():
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_CALLS):
                call()
            torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(str(Path(os.environ.get("OUT", "/tmp")) / f"trace-{B}-{T}-{H}-{HV}-{gates}.json"))
    per_kernel = {}
    for event in prof.key_averages():
        # self time: only a kernel has its own device time (an op's total would count its kernels again)
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0)
        if us > 0:
            per_kernel[event.key[:90]] = per_kernel.get(event.key[:90], 0.0) + us / PROFILED_CALLS
    return dict(sorted(per_kernel.items(), key=lambda item: -item[1]))


def train_row(B, T, H, HV, gates, theirs):
    """fwd+bwd ms and peak extra MB of the op (and FlashQLA's) at ``gates`` on bench_anchors' inputs."""
    from anchors_forward_table import time_training
    q, k, v, g, beta = (x.detach() for x in make_inputs(B, T, H, HV, 128, 128, torch.bfloat16, seed=2))
    xs = [x.requires_grad_() for x in (q, k, v, GATES[gates](g).contiguous(), beta)]
    scale = 128 ** -0.5
    ours = time_training(lambda *x: chunk_gated_delta_rule(*x, scale=scale, output_final_state=True), xs)
    result = dict(shape=(B, T, H, HV), gates=gates, linattn_ms=round(ours["fwdbwd_ms"], 4),
                  linattn_peak_MB=round(ours["peak_extra_MB"]))
    if theirs is not None:
        flash = time_training(lambda *x: theirs(*x, scale), xs)
        result.update(flashqla_ms=round(flash["fwdbwd_ms"], 4), flashqla_peak_MB=round(flash["peak_extra_MB"]))
    return result


def train_table(shapes, theirs) -> None:
    rows = []
    for shape in shapes:
        for gates in GATES:
            rows.append(train_row(*shape, gates, theirs))
            print(rows[-1], flush=True)
    print("\n| B, T, H, HV | gates | linattn fwd+bwd ms | FlashQLA ms | linattn / FlashQLA | peak MB linattn | "
          "FlashQLA |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['linattn_ms'] / r['flashqla_ms']:.2f}×" if "flashqla_ms" in r else "-"
        print(f"| {', '.join(map(str, r['shape']))} | {r['gates']} | {r['linattn_ms']:.3f} | "
              f"{r.get('flashqla_ms', float('nan')):.3f} | {ratio} | {r['linattn_peak_MB']} | "
              f"{r.get('flashqla_peak_MB', '-')} |")


def main(argv):
    shapes = [tuple(int(x) for x in a.split(",")) for a in argv if "," in a]
    if "--phases" in argv:
        for shape in shapes:
            for gates in GATES:
                kernels = phases(*shape, gates, trace="--trace" in argv, train="--train" in argv)
                print(f"\n{shape} {gates}: {sum(kernels.values()):.1f} µs per call")
                for name, us in kernels.items():
                    print(f"  {us:8.1f}  {name}")
        return
    theirs = flash_qla_forward()
    if "--train" in argv:
        train_table(shapes, theirs)
        return
    rows = []
    for shape in shapes:
        for gates in GATES:
            rows.append(row(*shape, gates, theirs))
            print(rows[-1], flush=True)
    print("\n| B, T, H, HV | gates | linattn ms | linattn replay ms | FlashQLA ms | linattn / FlashQLA |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['linattn_ms'] / r['flashqla_ms']:.2f}×" if "flashqla_ms" in r else "-"
        print(f"| {', '.join(map(str, r['shape']))} | {r['gates']} | {r['linattn_ms']:.3f} | "
              f"{r['linattn_graph_ms']:.3f} | {r.get('flashqla_ms', float('nan')):.3f} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1:])
