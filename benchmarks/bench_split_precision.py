"""GPU check and timing of the pre-pass's and the split forward's cheaper variants (bf16 and fp16 inputs): the split
forward's output dots (``split_fwd.OUTPUT_PREC_BF16``), the in-chunk solve's block merges
(``kkt_solve.MERGE_PREC_BF16``) and how the solve inverts its four diagonal 16×16 blocks (``kkt_solve.DIAG_INVERSE``:
one substitution per block, or one for the four stacked) — the solve is shared by the pre-pass and the backward's
recompute.

    python benchmarks/bench_split_precision.py [--quick] [--out DIR]

Run 12 (--quick: output variants): output kernel 0.981 → 0.397 ms at bf16x3, split forward 2.508 → 1.916 at B=8
T=4096 H=16, o error unchanged (1.731e-3) — the default since. Run 13 (the merge variants): bf16x3 merges kkt_solve
0.522 → 0.493 ms at B=8, errors unchanged — the default for bf16 since (tf32x3 merges 0.60 ms).

Now (prepared in the sixth session, not yet run): the stacked diagonal blocks (``kkt_solve.DIAG_INVERSE =
"batched"``; kkt_solve.py says how). Static sm_90 SASS (bf16, 4 warps, maxnreg 168): per block the substitution is
4 loops of 15 trips × 95 instructions that every warp runs for every block; batched one loop of 15 trips × 95 per
warp for its own block, the K loop 605 → 850 instructions (2 trips); ≈ 38% fewer instructions per warp. Prediction
written before any run: kkt_solve 0.49 → ≈ 0.30 ms at B=8, pre-pass 0.84 → ≈ 0.65, split forward 1.84 → ≈ 1.65,
fwd+bwd 7.94 → ≈ 7.6 (the backward recomputes the solve); every error unchanged (same arithmetic per block).
Also the fused pre-pass at 2 warps (``fused_prepass.PREPASS_WARPS``; 4 since run 11, 8 was slower): half the
replicated solve work per program, but ptxas spills 2.2–3.0 KB per thread (uncapped; 0.1–0.3 KB at 4 warps) —
expected slower, measured because nothing else says so.

1. accuracy: gpu_check_core's check (o, final state, every gradient vs float64 next to the baseline) at the anchor
   case and T=32768 K=128, in bf16 and, for the diagonal inverse (which every 16-bit input runs), fp16;
2. speed per variant: the op's forward on the split path and forward + backward (do_bench median ms), the output
   kernel, kkt_solve and the fused pre-pass alone, at B=1 T=4096, B=8 T=4096, B=1 T=32768 (H=16, K=V=128).
Prints the tables last; writes bench_split_precision.json under --out.
"""
from __future__ import annotations

import json

import torch
import triton
from bench_cli import bench_args, write_json  # noqa: E402  (this folder is on sys.path)
from gpu_check_core import CASES, NAMES, check  # noqa: E402  (this folder is on sys.path)
from gpu_check_fwd import make  # noqa: E402  (this folder is on sys.path)

from linattn import chunk_gated_delta_rule
from linattn.ops.common import fused_prepass as FP
from linattn.ops.common import kkt_solve as KS
from linattn.ops.common import split_fwd as SF
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.common.output import output_fwd
from linattn.ops.common.state_pass import state_pass_fwd
from linattn.ops.gated_delta import triton_chunk

VARIANTS = [  # (OUTPUT_PREC_BF16, MERGE_PREC_BF16, DIAG_INVERSE, PREPASS_WARPS): today's defaults first
    ("bf16x3", "bf16x3", "per_block", 4), ("bf16x3", "bf16x3", "batched", 4), ("bf16x3", "bf16x3", "per_block", 2),
    ("bf16x3", "bf16x3", "batched", 2), ("bf16x3", "ieee", "batched", 4),
]
ACCURACY_CASES = ("anchor_B2_T300_K128", "T32768_K128")
SHAPES = [(1, 4096, 16, 16), (8, 4096, 16, 16), (1, 32768, 16, 16)]
D = 128


class variant:
    """Set the four module settings (and the split path) for a with-block; restore them after."""

    def __init__(self, out_prec, merge_prec, diag, warps):
        self.new = (out_prec, merge_prec, diag, warps)

    def __enter__(self):
        self.old = (SF.OUTPUT_PREC_BF16, KS.MERGE_PREC_BF16, KS.DIAG_INVERSE, FP.PREPASS_WARPS,
                    triton_chunk.FORWARD_PATH)
        SF.OUTPUT_PREC_BF16, KS.MERGE_PREC_BF16, KS.DIAG_INVERSE, FP.PREPASS_WARPS = self.new
        triton_chunk.FORWARD_PATH = "split"

    def __exit__(self, *exc):
        (SF.OUTPUT_PREC_BF16, KS.MERGE_PREC_BF16, KS.DIAG_INVERSE, FP.PREPASS_WARPS,
         triton_chunk.FORWARD_PATH) = self.old


def accuracy(names, variants):
    rows = []
    for case in (c for c in CASES if c[0] in names):
        for out_prec, merge_prec, diag, warps in variants:
            # fp16 reads only the diagonal inverse and the warps (its merges are "ieee", its output dots tf32x3)
            dtypes = (torch.bfloat16, torch.float16) if (diag, warps) != ("per_block", 4) else (torch.bfloat16,)
            for dt in dtypes:
                with variant(out_prec, merge_prec, diag, warps):
                    try:
                        row = check(case, dt, use_token_ref=case[2] <= 1000)
                    except Exception as e:  # a variant that fails is a row, not the end
                        row = dict(case=case[0], dtype=str(dt).split(".")[-1], error=f"{type(e).__name__}: {e}"[:300])
                row.update(out_prec=out_prec, merge_prec=merge_prec, diag=diag, warps=warps)
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    return rows


def speed(B, T, H, HV, variants):
    x, _, _ = make(B, T, H, HV, D, D, None, torch.bfloat16)
    ins = [x[n].requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    q, k, v, g, beta = (t.detach() for t in ins)
    f = lambda: chunk_gated_delta_rule(*ins, scale=D ** -0.5, output_final_state=True)
    do = torch.randn_like(x["v"])
    gc, w, u = fused_prepass(g, k, v, beta)
    h, v_new, _ = state_pass_fwd(k, w, u, gc, None)
    rows = []
    for out_prec, merge_prec, diag, warps in variants:
        row = dict(shape=(B, T, H, HV), out_prec=out_prec, merge_prec=merge_prec, diag=diag, warps=warps)
        with variant(out_prec, merge_prec, diag, warps):
            try:
                with torch.no_grad():
                    row["fwd_ms"] = triton.testing.do_bench(f)
                row["fwdbwd_ms"] = triton.testing.do_bench(lambda: torch.autograd.grad(f()[0], ins, do))
                row["output_ms"] = triton.testing.do_bench(
                    lambda p=out_prec: output_fwd(q, k, v_new, h, gc, D ** -0.5, v.dtype, dot_prec=p))
                row["kkt_solve_ms"] = triton.testing.do_bench(lambda: KS.kkt_solve(k, beta, gc, HV))
                row["prepass_ms"] = triton.testing.do_bench(lambda: fused_prepass(g, k, v, beta))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    a = bench_args("the anchor case, the first two variants and the first two shapes only")
    variants = VARIANTS[:2] if a.quick else VARIANTS
    acc = accuracy(ACCURACY_CASES[:1] if a.quick else ACCURACY_CASES, variants)
    rows = [r for s in (SHAPES[:2] if a.quick else SHAPES) for r in speed(*s, variants)]
    write_json(a.out, "bench_split_precision.json", dict(accuracy=acc, speed=rows))

    print("\nrelative L2 vs float64, kernel / baseline ratio (pass: ≤ 2); o error in brackets")
    print("%-20s %-9s %-7s %-7s %-9s %-5s " % ("case", "dtype", "output", "merges", "diagonal", "warps")
          + " ".join("%-7s" % n for n in NAMES))
    for r in acc:
        if "error" in r:
            print(r["case"], r["dtype"], r["out_prec"], r["merge_prec"], r["diag"], r["warps"], r["error"])
            continue
        base = r.get("base")
        cells = [f"{r['err'][n] / base[n]:.2f}" if base else f"{r['err'][n]:.1e}" for n in NAMES]
        print("%-20s %-9s %-7s %-7s %-9s %-5s " % (r["case"][:20], r["dtype"], r["out_prec"], r["merge_prec"],
                                                  r["diag"], r["warps"]) +
              " ".join("%-7s" % c for c in cells) + f"  [{r['err']['o']:.3e}]")
    print("\n| B, T, H, HV | output / merges / diagonal / pre-pass warps | split fwd ms | fwd+bwd ms "
          "| output kernel ms | kkt_solve ms | pre-pass ms |\n|---|---|---|---|---|---|---|")
    for r in rows:
        cells = " | ".join(f"{r[k]:.3f}" if k in r else r.get("error", "–")[:30]
                           for k in ("fwd_ms", "fwdbwd_ms", "output_ms", "kkt_solve_ms", "prepass_ms"))
        print(f"| {', '.join(map(str, r['shape']))} | {r['out_prec']} / {r['merge_prec']} / {r['diag']} / "
              f"{r['warps']} | {cells} |")


if __name__ == "__main__":
    main()
