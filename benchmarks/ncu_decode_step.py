"""One decode step under Nsight Compute (issue 5): why the bf16 pool stops at ≈ 2.6 TB/s of state traffic while the
fp32 pool reaches ≈ 3.6. Runs a few steps of ``gated_delta_rule_decode`` (HV=32, K=V=128, gates and norms fused, the
pool rows with gaps) for one pool dtype; profile it with

    ncu --kernel-name regex:fused_recurrent --launch-skip 3 --launch-count 1 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        python benchmarks/ncu_decode_step.py --pool bf16 --B 64
"""
from __future__ import annotations

import argparse

import torch
from bench_decode import FUSED, gate_params, make_step  # noqa: E402  (this folder is on sys.path)

import linattn

ap = argparse.ArgumentParser()
ap.add_argument("--pool", choices=("bf16", "fp32"), default="bf16")
ap.add_argument("--B", type=int, default=64)
ap.add_argument("--steps", type=int, default=5)
a = ap.parse_args()
t, gate = make_step(a.B, 1), gate_params()
P = 2 * a.B + 1
pool = (torch.randn(P, 32, 128, 128, device="cuda") * 0.05).to(torch.bfloat16 if a.pool == "bf16" else torch.float32)
slots = torch.randperm(P, device="cuda")[:a.B]
for _ in range(a.steps):
    linattn.gated_delta_rule_decode(**t, state_pool=pool, state_indices=slots, **gate, **FUSED)
torch.cuda.synchronize()
