"""A/B of ``prepass.MIN_BLOCKS_PER_SM`` (the TileLang pre-pass compiled for n resident programs per SM: ptxas fits
its registers to 65536 / (128 n); 1 leaves it its own count), ``prepass.TMA_KEYS`` (the key tile by TMA: a
variant "n+tma") and ``prepass.A_ROW_PAD`` (A's 16-blocks with rows 20 words apart: "n+pad"; "n+tma+pad" both): for
each variant, the pre-pass alone and forward_hopper (do_bench median ms), the pre-pass's
outputs against the first variant's (neither changes any arithmetic: 0 there), A_inv against the pre-pass's twin
(fp32) and o against float64, at issue 4's rows 2, 3, 5 and 7 (the forward as ``forward.plan`` cuts it), from
hopper_fwd_check's inputs. ≈ 3 min with the compiles for five variants:

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python benchmarks/prepass_occupancy_check.py [n[+tma][+pad] ...]
"""
import functools
import sys

import torch
from hopper_fwd_check import bench, prepass_case, rel  # this folder is on sys.path

from linattn.ops.hopper import prepass
from linattn.ops.hopper.forward import forward_hopper

SHAPES = [(8, 4096, 16, 16), (1, 32768, 16, 16), (4, 8192, 16, 32), (1, 32768, 2, 8)]
VARIANTS = [(int(a.split("+")[0]), "+tma" in a, 4 if "+pad" in a else 0) for a in sys.argv[1:]] or \
    [(n, False, 0) for n in (1, 5, 6, 7, 8)]

table = []
for B, T, H, HV in SHAPES:
    low, launch, S, args, ref, twin = prepass_case(B, T, H, HV)
    with torch.no_grad():
        first = None
        rows = []
        for n, tma, pad in VARIANTS:
            prepass.MIN_BLOCKS_PER_SM, prepass.TMA_KEYS, prepass.A_ROW_PAD = n, tma, pad
            pre = functools.partial(prepass.prepass_hopper, low["k"], low["g"], low["beta"], S)
            outs = pre()
            fwd = functools.partial(forward_hopper, *args, **launch)
            o = fwd()[0]
            first = first or (outs, o)
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs, first[0]))
            rows.append(dict(shape=(B, T, H, HV), segments=S, min_blocks=n, tma_keys=tma, a_row_pad=pad,
                             prepass_ms=bench(pre), forward_ms=bench(fwd), prepass_diff=diff,
                             o_diff=float((o - first[1]).abs().max()), a_inv=rel(outs[2].float(), twin), o=rel(o, ref)))
            print(rows[-1], flush=True)
        table += rows
print("\n| B, T, H, HV | S | n | TMA keys | A row pad | pre-pass ms | forward ms | outputs' max diff to the first "
      "| A_inv vs twin | o rel. error |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in table:
    print(f"| {r['shape']} | {r['segments']} | {r['min_blocks']} | {r['tma_keys']} | {r['a_row_pad']} | "
          f"{r['prepass_ms']:.4f} | {r['forward_ms']:.4f} | {r['prepass_diff']:.1e} / {r['o_diff']:.1e} | "
          f"{r['a_inv']:.2e} | {r['o']:.3e} |")
