"""Where the peak memory of linattn's forward + backward sits: the public op's fwd + ``torch.autograd.grad`` at
bench_anchors' inputs (bf16, the anchors' gates; inputs and dO alive before, as bench_anchors measures), with each
stage of the Hopper backward wrapped to record the MiB allocated before it, its own peak and after it, all over the
memory before the forward. The row whose peak is the call's peak names the stage to shrink.

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/bwd_memory_phases.py [--rows 2,5]

Rows are the anchors' (1 … 7). The stages: the pre-pass (``backward.solve``), the reverse warm-ups
(``segments.warm_state_grads``, segmented walks only), the states recompute (``backward.states``), the walk
(``chunk_bwd_roles.chunk_bwd_roles_hopper`` or ``chunk_bwd.chunk_bwd_hopper``, once per batch of rows) and its
reductions (``backward.gradients_from_partials``).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from linattn.ops.gated_delta import chunk_gated_delta_rule
from linattn.ops.hopper import backward, chunk_bwd, chunk_bwd_roles, segments

ROWS = {1: (1, 4096, 16, 16), 2: (8, 4096, 16, 16), 3: (1, 32768, 16, 16), 4: (1, 131072, 16, 16),
        5: (4, 8192, 16, 32), 6: (2, 16384, 32, 32), 7: (1, 32768, 2, 8)}
STAGES = [(backward, "solve"), (segments, "warm_state_grads"), (backward, "states"),
          (chunk_bwd_roles, "chunk_bwd_roles_hopper"), (chunk_bwd, "chunk_bwd_hopper"),
          (backward, "gradients_from_partials")]
MiB = 2 ** 20


def recorded(log: list, f):
    """``f`` wrapped to append (its name, MiB allocated before, its peak, after) to ``log``."""
    def stage(*args, **kwargs):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = f(*args, **kwargs)
        torch.cuda.synchronize()
        log.append((f.__name__, before / MiB, torch.cuda.max_memory_allocated() / MiB,
                    torch.cuda.memory_allocated() / MiB))
        return out
    return stage


def anchors_inputs(B: int, T: int, H: int, HV: int) -> list:
    """bench_anchors' inputs: unit-norm q, k, Gaussian v, logsigmoid(randn) / 16 gates, β uniform; seed 2."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    unit = lambda: F.normalize(torch.randn(B, T, H, 128, device="cuda", generator=gen), dim=-1).bfloat16()
    q, k = unit(), unit()
    v = torch.randn(B, T, HV, 128, device="cuda", generator=gen).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, HV, device="cuda", generator=gen)) / 16
    beta = torch.rand(B, T, HV, device="cuda", generator=gen).bfloat16()
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def phases(row: int, log: list) -> None:
    """Print row ``row``'s forward peak and every backward stage's before / peak / after, MiB over the inputs."""
    xs = anchors_inputs(*ROWS[row])
    run = lambda: chunk_gated_delta_rule(*xs, 128 ** -0.5, output_final_state=True)[0]
    do = torch.randn_like(run())
    torch.autograd.grad(run(), xs, do)          # compiles, caches and the allocator's pools outside the measure
    torch.cuda.synchronize()
    log.clear()
    base = torch.cuda.memory_allocated() / MiB
    torch.cuda.reset_peak_memory_stats()
    o = run()
    torch.cuda.synchronize()
    forward_peak, after_forward = torch.cuda.max_memory_allocated() / MiB, torch.cuda.memory_allocated() / MiB
    torch.autograd.grad(o, xs, do)
    print(f"row {row} {ROWS[row]}: forward peak +{forward_peak - base:.0f} MiB, after it +{after_forward - base:.0f}")
    for name, before, peak, after in log:
        print(f"  {name:<24} before +{before - base:7.1f}  peak +{peak - base:7.1f}  after +{after - base:7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="2,5", help="comma-separated anchors rows (1-7)")
    rows = [int(r) for r in ap.parse_args().rows.split(",")]
    log: list = []
    for module, name in STAGES:
        setattr(module, name, recorded(log, getattr(module, name)))
    print(torch.cuda.get_device_name())
    for row in rows:
        phases(row, log)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
