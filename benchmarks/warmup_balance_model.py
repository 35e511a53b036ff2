"""Count first, on the CPU: how long phase C's longest program is, in chunks, at a gate draw, for the segmented
forward's warm-ups as they are and for the two levers docs/performance.md names for row 4 at realistic gates:
warm-up chunks that run the state's steps alone (``chunk_fwd.STATE_ONLY_WARMUPS``: a warm-up chunk at ``--warm-cost``
of a full one) and a segment count chosen per head (slow heads cut finer, within the card's programs).

The gates are drawn as bench_anchors draws them (logsigmoid(randn) / 16, on the CPU: the same law, not the GPU's
values), then the anchors' (as drawn), mixed (``hopper_fwd_check.mixed_gates``'s per-head rates) or slow (/ 65536).
bench_anchors' keys are unit vectors and β < 1, so a chunk's bound is its gates' sum in log2 units (the
``map_bound.chunk_bounds_ref`` term |1 − β‖k‖²| is below 1 and clamps to 0). A segment's warm-up is the fewest
chunks before it whose bounds sum below 2^``NEGLIGIBLE_M_LOG2`` (``map_bound.warm_from_bound_ref``), else the whole
prefix. Phase A's maps and the wave-fill rule are left out: a head that would not warm up within a segment is
reported, not modelled.

    python benchmarks/warmup_balance_model.py 1,131072,16,16 [--gates mixed] [--warm-cost 0.65] [--sms 132]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from hopper_fwd_check import mixed_gates  # this folder is on sys.path

from linattn.ops.hopper import forward

LOG2E = 1 / math.log(2)


def draw_gates(B: int, T: int, HV: int, gates: str, seed: int = 0) -> torch.Tensor:
    g = F.logsigmoid(torch.randn(B, T, HV, generator=torch.Generator().manual_seed(seed))) / 16
    if gates == "mixed":
        g = mixed_gates(g)
    elif gates == "slow":
        g = g / 65536
    return g


def warm_ups(bound: torch.Tensor, segments: int) -> torch.Tensor:
    """Each segment's warm-up in chunks, ``[HV, segments]`` (segment 0: none), for one sequence's chunk bounds
    ``[HV, NC]`` cut into ``segments`` segments starting at chunk ⌊s · NC / segments⌋: the fewest chunks before the
    segment whose bounds (nearest first) sum below the threshold, else its whole prefix. Equal segments give
    ``map_bound.warm_from_bound_ref``'s (in float64 here, fp32 there)."""
    HV, NC = bound.shape
    w = torch.zeros(HV, segments, dtype=torch.long)
    for s in range(1, segments):
        start = s * NC // segments
        run = bound[:, :start].double().flip(1).cumsum(1)                  # j + 1 chunks before the segment
        below = run < forward.NEGLIGIBLE_M_LOG2
        w[:, s] = torch.where(below.any(1), below.int().argmax(1) + 1, start)
    return w


def longest(own: int, w: torch.Tensor, warm_cost: float) -> float:
    """The longest program, in full chunks' time: its own chunks plus its warm-up at ``warm_cost`` each."""
    return own + warm_cost * float(w.max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", help="B,T,H,HV (K = V = 128)")
    ap.add_argument("--gates", default="mixed", choices=("anchors", "mixed", "slow"))
    ap.add_argument("--warm-cost", type=float, default=0.65, help="a state-only warm-up chunk / a full chunk")
    ap.add_argument("--sms", type=int, default=132)
    a = ap.parse_args()
    B, T, H, HV = (int(x) for x in a.shape.split(","))
    S = forward.segment_count(B, HV, 128, T, a.sms)
    if S is None or B != 1:
        raise SystemExit(f"{a.shape}: the model takes one sequence that the forward segments (S = {S})")
    NC = T // 64
    bound = (draw_gates(B, T, HV, a.gates)[0] * LOG2E).reshape(NC, 64, HV).sum(1).T          # [HV, NC]
    w = warm_ups(bound, S)
    whole = (w[:, 1:] == torch.arange(1, S) * (NC // S)).any(1)
    print(f"{a.shape}, {a.gates} gates: {S} segments of {NC // S} chunks, {HV * S} programs at BV=128")
    print("longest warm-up per head:", w.max(1).values.tolist(),
          f"({int(whole.sum())} heads walk some whole prefix: phase A's maps in the five-launch forward)")
    plain = longest(NC // S, w, 1.0)
    state_only = longest(NC // S, w, a.warm_cost)
    print(f"uniform segments: longest program {plain:.0f} chunks; with state-only warm-ups at {a.warm_cost} of a "
          f"chunk {state_only:.0f} ({state_only / plain - 1:+.1%})")
    # per head: the fewest segments (S to 4S, of ⌈NC / s⌉ chunks or one fewer: the layout's segments would no longer
    # be equal) whose longest program fits t, for the smallest t the card's programs allow; with and without the
    # state-only warm-ups
    counts = list(range(S, 4 * S + 1))
    per_head = {s: warm_ups(bound, s).max(1).values.float() for s in counts}
    for warm_cost in (1.0, a.warm_cost):
        cost = {s: -(-NC // s) + warm_cost * per_head[s] for s in counts}                 # [HV] per count
        for t in sorted({float(x) for s in counts for x in cost[s]}):
            chosen = [next((s for s in counts if cost[s][h] <= t), None) for h in range(HV)]
            if None not in chosen and sum(chosen) <= a.sms:
                print(f"segments per head, warm-up chunks at {warm_cost} of a chunk: longest program {t:.0f} chunks "
                      f"({t / plain - 1:+.1%}), segments {chosen} ({sum(chosen)} programs)")
                break
        else:
            print(f"segments per head, warm-up chunks at {warm_cost}: no choice fits the card")

if __name__ == "__main__":
    main()
