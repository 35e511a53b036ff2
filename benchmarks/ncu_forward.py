"""The chunked op's kernels under Nsight Compute (issue 4): what bounds each stage of the split forward (and, with
--backward, of the backward) — DRAM against L1/shared traffic, issue slots, stalls, occupancy. At B=8 T=4096 H=16
the pre-pass (0.589 ms), the state pass (0.505) and the output kernel (0.288) each run 2–3× their byte floors
(run 17); the static SASS (benchmarks/compile_all.py --ops 12) does not say why: this profile should.

    ncu --kernel-name regex:"fused_prepass|state_pass_fwd|output_fwd" --launch-skip 3 --launch-count 3 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        --section LaunchStats --section InstructionStats --print-details all \\
        python benchmarks/ncu_forward.py [--B 8] [--backward]

(--backward: the regex "local_bwd|state_pass_bwd|kkt_solve|wy_kernel|state_pass_fwd" and --launch-skip 8; --path auto
[--roles]: the Hopper forward, regex "gdn_" for its pre-pass and fused kernel, TileLang on the path; --mixed-gates:
per-head decay rates drawn like a Mamba-style initialisation (hopper_fwd_check.mixed_gates), where the segmented
forward's scan and phase A have maps to walk; --slow-gates: the gates / 65536 (no head forgets); --H: the heads
(16); --split-heads: forward.SPLIT_HEADS on, where at --B 2 --T 16384 --H 32 and slow gates the wide launch's
programs all walk nothing: what an exiting program costs, run 39's ≈ 20–29 µs.)
Runs the op (bf16, T=4096, H=HV=16, K=V=128, the split path, today's defaults) a few times; times nothing itself.
"""
from __future__ import annotations

import argparse

import torch

import linattn
from linattn.ops.gated_delta import triton_chunk

ap = argparse.ArgumentParser()
ap.add_argument("--B", type=int, default=8)
ap.add_argument("--T", type=int, default=4096)
ap.add_argument("--backward", action="store_true")
ap.add_argument("--calls", type=int, default=3)
ap.add_argument("--path", default="split", choices=triton_chunk.FORWARD_PATHS,
                help="the forward path (auto: the Hopper forward on sm_90 where its programs fill the card)")
ap.add_argument("--roles", action="store_true", help="the Hopper forward's role-split kernel")
ap.add_argument("--mixed-gates", action="store_true", help="per-head decay rates drawn like a Mamba-style init")
ap.add_argument("--slow-gates", action="store_true", help="the gates / 65536: no head forgets")
ap.add_argument("--H", type=int, default=16)
ap.add_argument("--split-heads", action="store_true", help="hopper.forward.SPLIT_HEADS on")
a = ap.parse_args()
triton_chunk.FORWARD_PATH = a.path
if a.split_heads or a.roles:
    from linattn.ops.hopper import forward as hopper_forward
    hopper_forward.SPLIT_HEADS = a.split_heads or hopper_forward.SPLIT_HEADS
    if a.roles:
        hopper_forward.LAUNCH = dict(hopper_forward.LAUNCH, roles=True)
gen = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
B, T, H, D = a.B, a.T, a.H, 128
q, k = (torch.nn.functional.normalize(r(B, T, H, D), dim=-1).bfloat16().requires_grad_(a.backward) for _ in range(2))
v = r(B, T, H, D).bfloat16().requires_grad_(a.backward)
g = -torch.rand(B, T, H, device="cuda", generator=gen) * 0.1
if a.mixed_gates:
    from hopper_fwd_check import mixed_gates  # this folder is on sys.path when run as a script
    g = mixed_gates(g)
if a.slow_gates:
    g = g / 65536
g = g.contiguous().requires_grad_(a.backward)
beta = torch.rand(B, T, H, device="cuda", generator=gen).bfloat16().requires_grad_(a.backward)
for _ in range(a.calls):
    o, _ = linattn.chunk_gated_delta_rule(q, k, v, g, beta, scale=D ** -0.5, output_final_state=True)
    if a.backward:
        torch.autograd.grad(o, (q, k, v, g, beta), torch.ones_like(o))
torch.cuda.synchronize()
