"""GPU check and timing of the pre-pass's and the split forward's cheaper variants (bf16 and fp16 inputs): the split
forward's output dots (``split_fwd.OUTPUT_PREC_BF16``), the in-chunk solve's block merges
(``kkt_solve.MERGE_PREC_BF16``), the fused pre-pass's warps (``fused_prepass.PREPASS_WARPS``) and the dtypes the
split stores h, V_new (``split_fwd.STORE_BF16``) and W, U (``split_fwd.WU_STORE_BF16``) in — the solve is
shared by the pre-pass and the backward's recompute.

    python benchmarks/bench_split_precision.py [--quick] [--out DIR]

Run 12 (--quick: output variants): output kernel 0.981 → 0.397 ms at bf16x3, split forward 2.508 → 1.916 at B=8
T=4096 H=16, o error unchanged (1.731e-3) — the default since. Run 13 (the merge variants): bf16x3 merges kkt_solve
0.522 → 0.493 ms at B=8, errors unchanged — the default for bf16 since (tf32x3 merges 0.60 ms). Run 14: the four
diagonal blocks inverted as one [4, 16, 16] stack (one block per warp) against one substitution per block (every
warp ran all four): kkt_solve 0.501 → 0.265 ms at B=8, pre-pass 0.859 → 0.619, split forward 1.855 → 1.623,
fwd+bwd 7.98 → 7.50, every error unchanged — the only way since (the per-block code is deleted). The pre-pass at
2 warps: per block it was faster (0.717 ms), with the stack slower than 4 (0.670 vs 0.619 at B=8; fwd+bwd at B=1
1.48 vs 1.61, the only row it wins), so 4 stays.

Run 15 (the stores; prediction in brackets): h and V_new in bf16 (``split_fwd.STORE_BF16 = "bf16"``): state pass
0.615 → 0.499 ms (≈ 0.50), output kernel 0.398 → 0.288 (≈ 0.28), split forward 1.623 → 1.394 (≈ 1.39) at B=8,
fwd+bwd 7.53 → 7.29; o's error 1.73e-3 → 2.43e-3 (≈ 2.0e-3), the final state and every gradient unchanged — the
default for bf16 since. W and U in bf16 on top (``split_fwd.WU_STORE_BF16``): pre-pass 0.615 → 0.562, split
forward 1.394 → 1.322 at B=8, but 2.045 → 2.194 at B=1 T=32768 (state pass 1.125 → 1.330) and the final state's
error 1.05e-3 → 1.98e-3 — rejected.

Run 17: the solve's merges by halves against the sixteen 16×16 block merges before (kkt_solve.py has the numbers:
kkt_solve −5%, pre-pass −2%, the forward unchanged, errors identical; the block code is deleted), and the solve's
register cap: uncapped, the pre-pass 0.589 → 0.652 ms at B=8 — 168 stays.

1. accuracy: gpu_check_core's check (o, final state, every gradient vs float64 next to the baseline) at the anchor
   case and T=32768 K=128, in bf16 and, for a variant of the warps (which every 16-bit input runs), fp16;
2. speed per variant: the op's forward on the split path and forward + backward (do_bench median ms), the output
   kernel, the state pass, kkt_solve and the fused pre-pass alone, at B=1 T=4096, B=8 T=4096, B=1 T=32768
   (H=16, K=V=128).
Prints the tables last; writes bench_split_precision.json under --out.
"""
from __future__ import annotations

import json

import torch
import triton
from bench_cli import bench_args, write_json  # noqa: E402  (this folder is on sys.path)
from gpu_check_core import CASES, NAMES, check, ratio_cells  # noqa: E402  (this folder is on sys.path)
from gpu_check_fwd import make  # noqa: E402  (this folder is on sys.path)

from linattn import chunk_gated_delta_rule
from linattn.ops import common
from linattn.ops.common import fused_prepass as FP
from linattn.ops.common import kkt_solve as KS
from linattn.ops.common import split_fwd as SF
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.common.output import output_fwd
from linattn.ops.common.state_pass import state_pass_fwd
from linattn.ops.gated_delta import triton_chunk

# (OUTPUT_PREC_BF16, MERGE_PREC_BF16, PREPASS_WARPS, STORE_BF16, WU_STORE_BF16, solve maxnreg): defaults first; the
# last: the register cap of kkt_solve and the pre-pass (common.LAUNCH_OPTIONS, None: no cap)
VARIANTS = [
    ("bf16x3", "bf16x3", 4, "bf16", "fp32", 168), ("bf16x3", "bf16x3", 4, "bf16", "fp32", None),
    ("bf16x3", "bf16x3", 4, "bf16", "bf16", 168),
]
ACCURACY_CASES = ("anchor_B2_T300_K128", "T32768_K128")
SHAPES = [(1, 4096, 16, 16), (8, 4096, 16, 16), (1, 32768, 16, 16)]
D = 128


class variant:
    """Set the six settings (and the split path) for a with-block; restore them after."""

    def __init__(self, out_prec, merge_prec, warps, store, wu_store, cap):
        self.new = (out_prec, merge_prec, warps, store, wu_store)
        self.cap = cap

    def __enter__(self):
        self.old = (SF.OUTPUT_PREC_BF16, KS.MERGE_PREC_BF16, FP.PREPASS_WARPS, SF.STORE_BF16, SF.WU_STORE_BF16,
                    triton_chunk.FORWARD_PATH)
        self.old_options = {n: dict(common.LAUNCH_OPTIONS.get(n, {})) for n in SOLVE_KERNELS}
        SF.OUTPUT_PREC_BF16, KS.MERGE_PREC_BF16, FP.PREPASS_WARPS, SF.STORE_BF16, SF.WU_STORE_BF16 = self.new
        for n in SOLVE_KERNELS:
            common.LAUNCH_OPTIONS[n] = {"maxnreg": self.cap} if self.cap else {}
        triton_chunk.FORWARD_PATH = "split"

    def __exit__(self, *exc):
        (SF.OUTPUT_PREC_BF16, KS.MERGE_PREC_BF16, FP.PREPASS_WARPS, SF.STORE_BF16, SF.WU_STORE_BF16,
         triton_chunk.FORWARD_PATH) = self.old
        common.LAUNCH_OPTIONS.update(self.old_options)


SOLVE_KERNELS = ("kkt_solve", "fused_prepass")


def accuracy(names, variants):
    rows = []
    for case in (c for c in CASES if c[0] in names):
        for out_prec, merge_prec, warps, store, wu_store, cap in variants:
            # fp16 reads only the warps (its merges are "ieee", its output dots tf32x3, its store fp32)
            dtypes = (torch.bfloat16, torch.float16) if warps != FP.PREPASS_WARPS else (torch.bfloat16,)
            for dt in dtypes:
                with variant(out_prec, merge_prec, warps, store, wu_store, cap):
                    try:
                        row = check(case, dt, use_token_ref=case[2] <= 1000)
                    except Exception as e:  # a variant that fails is a row, not the end
                        row = dict(case=case[0], dtype=str(dt).split(".")[-1], error=f"{type(e).__name__}: {e}"[:300])
                row.update(out_prec=out_prec, merge_prec=merge_prec, warps=warps, store=store, wu_store=wu_store,
                           cap=cap)
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
    rows = []
    for out_prec, merge_prec, warps, store, wu_store, cap in variants:
        row = dict(shape=(B, T, H, HV), out_prec=out_prec, merge_prec=merge_prec, warps=warps, store=store,
                   wu_store=wu_store, cap=cap)
        wu_dtype = SF.wu_store_dtype(k.dtype, wu_store)
        gc, w, u = fused_prepass(g, k, v, beta, store_dtype=wu_dtype)
        h, v_new, _ = state_pass_fwd(k, w, u, gc, None, store_dtype=SF.store_dtype(k.dtype, store))
        with variant(out_prec, merge_prec, warps, store, wu_store, cap):
            try:
                with torch.no_grad():
                    row["fwd_ms"] = triton.testing.do_bench(f)
                row["fwdbwd_ms"] = triton.testing.do_bench(lambda: torch.autograd.grad(f()[0], ins, do))
                row["output_ms"] = triton.testing.do_bench(
                    lambda p=out_prec, h=h, v_new=v_new, gc=gc: output_fwd(q, k, v_new, h, gc, D ** -0.5, v.dtype,
                                                                           dot_prec=p))
                row["state_pass_ms"] = triton.testing.do_bench(
                    lambda s=store, w=w, u=u, gc=gc: state_pass_fwd(k, w, u, gc, None,
                                                                   store_dtype=SF.store_dtype(k.dtype, s)))
                row["kkt_solve_ms"] = triton.testing.do_bench(lambda gc=gc: KS.kkt_solve(k, beta, gc, HV))
                row["prepass_ms"] = triton.testing.do_bench(lambda d=wu_dtype: fused_prepass(g, k, v, beta,
                                                                                             store_dtype=d))
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
    print("%-20s %-9s %-7s %-7s %-5s %-5s %-5s %-5s " % ("case", "dtype", "output", "merges", "warps", "h", "W/U",
                                                      "cap")
          + " ".join("%-7s" % n for n in NAMES))
    for r in acc:
        if "error" in r:
            print(r["case"], r["dtype"], r["out_prec"], r["merge_prec"], r["warps"], r["store"], r["wu_store"],
                  r["cap"], r["error"])
            continue
        cells = ratio_cells(r)
        print("%-20s %-9s %-7s %-7s %-5s %-5s %-5s %-5s " % (
            r["case"][:20], r["dtype"], r["out_prec"], r["merge_prec"], r["warps"], r["store"], r["wu_store"],
            r["cap"]) +
              " ".join("%-7s" % c for c in cells) + f"  [{r['err']['o']:.3e}]")
    print("\n| B, T, H, HV | output / merges / pre-pass warps / h store / W,U store / solve cap "
          "| split fwd ms | fwd+bwd ms "
          "| output kernel ms | state pass ms | kkt_solve ms | pre-pass ms |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = " | ".join(f"{r[k]:.3f}" if k in r else r.get("error", "–")[:30]
                           for k in ("fwd_ms", "fwdbwd_ms", "output_ms", "state_pass_ms", "kkt_solve_ms", "prepass_ms"))
        print(f"| {', '.join(map(str, r['shape']))} | {r['out_prec']} / {r['merge_prec']} / {r['warps']} / "
              f"{r['store']} / {r['wu_store']} / {r['cap']} | {cells} |")


if __name__ == "__main__":
    main()
