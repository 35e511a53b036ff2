"""A/B of ``prepass.BETA_IN_A_INV`` (β folded into A_inv's columns by the TileLang pre-pass, so the fused kernel's X
is V − Γ ⊙ (K S)) at issue 4's row 2, B=8 T=4096 H=16: o and final-state errors against the float64 torch backend
and forward_hopper's ms (do_bench median), off then on. Small on purpose (four TileLang compiles, ≈ 1 min):

    PYTHONPATH=/tmp/site:$PWD python benchmarks/beta_fold_check.py [B,T,H,HV]
"""
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from linattn import chunk_gated_delta_rule
from linattn.ops.hopper import prepass
from linattn.ops.hopper.forward import LAUNCH, forward_hopper


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


B, T, H, HV = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8,4096,16,16").split(","))
gen = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.float64)
x64 = dict(q=F.normalize(r(B, T, H, 128), dim=-1), k=F.normalize(r(B, T, H, 128), dim=-1), v=r(B, T, HV, 128),
           g=F.logsigmoid(r(B, T, HV)) / 16, beta=torch.rand(B, T, HV, device="cuda", generator=gen,
                                                              dtype=torch.float64))
low = {n: t.bfloat16() if n in ("q", "k", "v", "beta") else t.float() for n, t in x64.items()}
with torch.no_grad():
    ref = chunk_gated_delta_rule(**{n: t.double() for n, t in low.items()}, scale=128 ** -0.5,
                                 output_final_state=True, backend="torch")
    for folded in (False, True):
        prepass.BETA_IN_A_INV = folded
        fn = lambda: forward_hopper(low["q"], low["k"], low["v"], low["g"], low["beta"], 128 ** -0.5, None,
                                    **LAUNCH)
        o, ht = fn()
        print(dict(shape=(B, T, H, HV), beta_in_a_inv=folded, o=rel(o, ref[0]), state=rel(ht, ref[1]),
                   nonfinite=int((~torch.isfinite(o)).sum()), ms=do_bench(fn, warmup=25, rep=100,
                                                                         return_mode="median")), flush=True)
