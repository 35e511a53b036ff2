"""GPU check and timing of the WY backward's inverse products at "ieee" against "tf32x3"
(``local_bwd_wy.INVERSE_DOT_PREC``, 16-bit inputs).

    python benchmarks/bench_bwd_precision.py [--quick] [--out DIR]

dA = Tᵀ dT Tᵀ (two 64×64×64 products per chunk and value head) runs on FMA units at "ieee": 2108 FFMA instructions
of the kernel's ~5600 in its sm_90 SASS (bf16, 8 warps) and 1016 spill bytes per thread; at "tf32x3" 60 FFMA, 128
HGMMA, no spills (ptxas, no GPU). Prediction written before any run: WY 1.96 → ~1.0 ms at B=8 T=4096 H=16 (run
11), forward + backward 9.49 → ~8.5 ms; gradients within 2× of the rounded-PyTorch baseline as at "ieee".

1. accuracy: gpu_check_core's cases (anchor, K=V=64 T=4096, T=32768 K=128) in bf16 and fp16 at both settings:
   every gradient's relative L2 against float64, next to the baseline (kernel ≤ 2 × baseline passes);
2. speed: the WY kernel alone and the public op's forward + backward at both settings (do_bench median ms).
Prints the tables last; writes bench_bwd_precision.json under --out.
"""
from __future__ import annotations

import json

import torch
import triton
from bench_cli import bench_args, write_json  # noqa: E402  (this folder is on sys.path)
from bench_launch_options import stage_inputs  # noqa: E402
from gpu_check_core import CASES, NAMES, check  # noqa: E402  (this folder is on sys.path)

from linattn import chunk_gated_delta_rule
from linattn.ops.common import local_bwd_wy as WY

PRECS = ("ieee", "tf32x3")
DEFAULT_PREC = WY.INVERSE_DOT_PREC  # restored after each sweep
ACCURACY_CASES = ("anchor_B2_T300_K128", "K64_V64_T4096", "T32768_K128")
SHAPES = [(1, 4096, 16, 16), (8, 4096, 16, 16), (1, 32768, 16, 16), (4, 8192, 16, 32)]
D = 128


def accuracy(names):
    rows = []
    for case in (c for c in CASES if c[0] in names):
        for dt in (torch.bfloat16, torch.float16):
            for prec in PRECS:
                WY.INVERSE_DOT_PREC = prec
                row = check(case, dt, use_token_ref=case[2] <= 1000)
                row["inverse_prec"] = prec
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    WY.INVERSE_DOT_PREC = DEFAULT_PREC
    return rows


def speed(B, T, H, HV):
    st = stage_inputs(B, T, H, HV)  # the WY kernel's real inputs: the backward's own stages up to it
    ins = [st[n].requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    k, v, beta, gc, A_inv, dv_new, dk, do = (st[n] for n in ("k", "v", "beta", "gc", "A_inv", "dv_new", "dk", "do"))
    dA_inv_p, dbeta_p, dg_p, scale = st["dA_inv_p"], st["dbeta_p"], st["dg_p"], st["scale"]
    f = lambda: chunk_gated_delta_rule(*ins, scale=scale, output_final_state=True)
    row = dict(shape=(B, T, H, HV))
    for prec in PRECS:
        WY.INVERSE_DOT_PREC = prec
        row[f"wy_{prec}_ms"] = triton.testing.do_bench(
            lambda: WY.local_bwd_wy(k, v, beta, gc, A_inv, dv_new, dA_inv_p, dbeta_p, dg_p, dk.clone(), None, None))
        row[f"fwdbwd_{prec}_ms"] = triton.testing.do_bench(lambda: torch.autograd.grad(f()[0], ins, do))
    WY.INVERSE_DOT_PREC = DEFAULT_PREC
    print(json.dumps(row), flush=True)
    return row


def main():
    a = bench_args("the anchor case and the first two shapes only")
    acc = accuracy(ACCURACY_CASES[:1] if a.quick else ACCURACY_CASES)
    rows = [speed(*s) for s in (SHAPES[:2] if a.quick else SHAPES)]
    write_json(a.out, "bench_bwd_precision.json", dict(accuracy=acc, speed=rows))

    print("\nrelative L2 vs float64, kernel / baseline ratio per gradient (pass: ≤ 2)")
    print("%-22s %-9s %-7s " % ("case", "dtype", "prec") + " ".join("%-7s" % n for n in NAMES))
    for r in acc:
        if "error" in r:
            print(r["case"], r["dtype"], r["inverse_prec"], r["error"])
            continue
        base = r.get("base")
        cells = [f"{r['err'][n] / base[n]:.2f}" if base else f"{r['err'][n]:.1e}" for n in NAMES]
        print("%-22s %-9s %-7s " % (r["case"][:22], r["dtype"], r["inverse_prec"]) +
              " ".join("%-7s" % c for c in cells))
    print("\n| B, T, H, HV | WY ieee ms | WY tf32x3 ms | fwd+bwd ieee ms | fwd+bwd tf32x3 ms |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {', '.join(map(str, r['shape']))} | {r['wy_ieee_ms']:.3f} | {r['wy_tf32x3_ms']:.3f} | "
              f"{r['fwdbwd_ieee_ms']:.3f} | {r['fwdbwd_tf32x3_ms']:.3f} |")


if __name__ == "__main__":
    main()
