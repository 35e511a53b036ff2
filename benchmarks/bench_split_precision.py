"""GPU check and timing of cheaper precisions for two groups of fp32 products of the forward (16-bit inputs):
the split forward's output dots (``split_fwd.OUTPUT_PREC_BF16``, bf16 inputs) and the in-chunk solve's block
merges (``kkt_solve.MERGE_PREC_BF16``, shared by the pre-pass and the backward's recompute).

    python benchmarks/bench_split_precision.py [--quick] [--out DIR]

Why (run 12): at B=8 T=4096 H=16 the split forward's stages sum to 2.05 ms timed alone but the op takes 2.48; the
op runs the output kernel at tf32x3 (o 1.73e-3 at the anchor case, tf32 2.0e-3), the stage timing used tf32. And
the solve (kkt_solve alone 0.52 ms of the pre-pass's 0.90) runs its six levels of 16×16 merges at "ieee": 552 FFMA
of its ~3800 SASS instructions. "bf16x3" (common/dot.py) keeps a bf16 Q whole: Q S is two bf16 MMAs, P V_new
three, ≈ 2^-16 per product — about half of tf32x3's tensor-core time. Static sm_90 SASS (compile_all.py --set,
bf16, B=1 H=16): output kernel tf32x3 4248 instructions / 52 HGMMA / 2664 spill bytes per thread, bf16x3 3328 / 24
/ 1568, tf32 3112 / 20 / 1796; kkt_solve merges ieee 3800 instructions / 552 FFMA, tf32x3 5280 / 272 HMMA / 352
SHFL (layout shuffles), bf16x3 4056 / 176 HMMA / 208 SHFL. Prediction written before any run: output
kernel at bf16x3 ≈ 0.6 of its tf32x3 time (split forward 2.48 → ≈ 2.2 ms at B=8); merges on tensor cores take
kkt_solve 0.52 → ≈ 0.4 ms and the pre-pass 0.90 → ≈ 0.8; every error within 2× of the rounded-PyTorch baseline.
Measured (run 12, --quick: output variants only): output kernel 0.981 → 0.397 ms at bf16x3, split forward 2.508 →
1.916 at B=8, o error unchanged (1.731e-3) — now the default. Run 13 (full run): bf16x3 merges kkt_solve 0.522 →
0.493 ms at B=8, errors unchanged — the default for bf16 (fp16 keeps "ieee" merges: kkt_solve.py says why).

1. accuracy: gpu_check_core's check (o, final state, every gradient vs float64 next to the baseline) at the anchor
   case and T=32768 K=128, bf16 (fp16 too for the merges: they apply to every 16-bit input), per variant;
2. speed per variant: the op's forward on the split path and forward + backward (do_bench median ms), the output
   kernel and kkt_solve alone, at B=1 T=4096, B=8 T=4096, B=1 T=32768 (H=16, K=V=128).
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
from linattn.ops.common import kkt_solve as KS
from linattn.ops.common import split_fwd as SF
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.common.output import output_fwd
from linattn.ops.common.state_pass import state_pass_fwd
from linattn.ops.gated_delta import triton_chunk

VARIANTS = [  # (OUTPUT_PREC_BF16, MERGE_PREC_BF16); the first was the default until run 12, the second until 13
    ("tf32x3", "ieee"), ("bf16x3", "ieee"), ("tf32", "ieee"), ("tf32x3", "tf32x3"), ("tf32x3", "bf16x3"),
    ("bf16x3", "tf32x3"),
]
ACCURACY_CASES = ("anchor_B2_T300_K128", "T32768_K128")
SHAPES = [(1, 4096, 16, 16), (8, 4096, 16, 16), (1, 32768, 16, 16)]
D = 128


class variant:
    """Set the two module settings (and the split path) for a with-block; restore them after."""

    def __init__(self, out_prec, merge_prec):
        self.new = (out_prec, merge_prec)

    def __enter__(self):
        self.old = (SF.OUTPUT_PREC_BF16, KS.MERGE_PREC_BF16, triton_chunk.FORWARD_PATH)
        SF.OUTPUT_PREC_BF16, KS.MERGE_PREC_BF16 = self.new
        triton_chunk.FORWARD_PATH = "split"

    def __exit__(self, *exc):
        SF.OUTPUT_PREC_BF16, KS.MERGE_PREC_BF16, triton_chunk.FORWARD_PATH = self.old


def accuracy(names, variants):
    rows = []
    for case in (c for c in CASES if c[0] in names):
        for out_prec, merge_prec in variants:
            # fp16 reads neither setting since run 13 (its merges are "ieee", its output dots tf32x3)
            dtypes = (torch.bfloat16,)
            for dt in dtypes:
                with variant(out_prec, merge_prec):
                    try:
                        row = check(case, dt, use_token_ref=case[2] <= 1000)
                    except Exception as e:  # a variant that fails is a row, not the end
                        row = dict(case=case[0], dtype=str(dt).split(".")[-1], error=f"{type(e).__name__}: {e}"[:300])
                row.update(out_prec=out_prec, merge_prec=merge_prec)
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
    for out_prec, merge_prec in variants:
        row = dict(shape=(B, T, H, HV), out_prec=out_prec, merge_prec=merge_prec)
        with variant(out_prec, merge_prec):
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
    a = bench_args("the anchor case, three variants and the first two shapes only")
    variants = VARIANTS[:3] if a.quick else VARIANTS
    acc = accuracy(ACCURACY_CASES[:1] if a.quick else ACCURACY_CASES, variants)
    rows = [r for s in (SHAPES[:2] if a.quick else SHAPES) for r in speed(*s, variants)]
    write_json(a.out, "bench_split_precision.json", dict(accuracy=acc, speed=rows))

    print("\nrelative L2 vs float64, kernel / baseline ratio (pass: ≤ 2); o error in brackets")
    print("%-20s %-9s %-7s %-7s " % ("case", "dtype", "output", "merges") + " ".join("%-7s" % n for n in NAMES))
    for r in acc:
        if "error" in r:
            print(r["case"], r["dtype"], r["out_prec"], r["merge_prec"], r["error"])
            continue
        base = r.get("base")
        cells = [f"{r['err'][n] / base[n]:.2f}" if base else f"{r['err'][n]:.1e}" for n in NAMES]
        print("%-20s %-9s %-7s %-7s " % (r["case"][:20], r["dtype"], r["out_prec"], r["merge_prec"]) +
              " ".join("%-7s" % c for c in cells) + f"  [{r['err']['o']:.3e}]")
    print("\n| B, T, H, HV | output / merges | split fwd ms | fwd+bwd ms | output kernel ms | kkt_solve ms | "
          "pre-pass ms |\n|---|---|---|---|---|---|---|")
    for r in rows:
        cells = " | ".join(f"{r[k]:.3f}" if k in r else r.get("error", "–")[:30]
                           for k in ("fwd_ms", "fwdbwd_ms", "output_ms", "kkt_solve_ms", "prepass_ms"))
        print(f"| {', '.join(map(str, r['shape']))} | {r['out_prec']} / {r['merge_prec']} | {cells} |")


if __name__ == "__main__":
    main()
