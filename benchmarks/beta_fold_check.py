"""A/B of ``prepass.BETA_IN_A_INV`` (β folded into A_inv's columns by the TileLang pre-pass, so the fused kernel's X
is V − Γ ⊙ (K S) and β is not loaded): o and final-state errors against the float64 torch backend and
forward_hopper's ms (do_bench median), off then on, at issue 4's row 2 (B=8 T=4096 H=16, the unsegmented kernel)
and row 3 (B=1 T=32768 H=16, the segmented forward: phase A's affine walk, the scan and the warm walk) at the
anchors' gates and at 1/4096 of them (the maps carry the state across segments), from hopper_fwd_check's inputs
(an initial state included). ≈ 2 min with the compiles:

    PYTHONPATH=/tmp/site:$PWD python benchmarks/beta_fold_check.py
"""
import functools

import torch
from hopper_fwd_check import DECAYS, bench, low_precision, make, rel  # this folder is on sys.path

from linattn import chunk_gated_delta_rule
from linattn.ops.hopper import prepass
from linattn.ops.hopper.forward import forward_hopper, plan

CASES = [((8, 4096, 16, 16), DECAYS[0])] + [((1, 32768, 16, 16), decay) for decay in DECAYS]

sms = torch.cuda.get_device_properties(0).multi_processor_count
for (B, T, H, HV), decay in CASES:
    low = low_precision(make(B, T, H, HV, 128, 128, decay=decay))
    launch = plan(B, HV, 128, T, sms, forced=True)
    args = [low[n] for n in ("q", "k", "v", "g", "beta")] + [128 ** -0.5, low["initial_state"]]
    with torch.no_grad():
        ref = chunk_gated_delta_rule(**{n: t.double() for n, t in low.items()}, scale=128 ** -0.5,
                                     output_final_state=True, backend="torch")
        for folded in (False, True):
            prepass.BETA_IN_A_INV = folded
            fn = functools.partial(forward_hopper, *args, **launch)
            o, ht = fn()
            print(dict(shape=(B, T, H, HV), decay=decay, segments=launch.get("segments", 1),
                       beta_in_a_inv=folded, o=rel(o, ref[0]), state=rel(ht, ref[1]),
                       nonfinite=int((~torch.isfinite(o)).sum()), ms=bench(fn)), flush=True)
