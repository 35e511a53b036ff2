"""GPU check and timing of the backward's cheaper variants for bf16 inputs: the dtype its largest intermediates are
stored in — h and V_new from the recompute's state pass (``triton_bwd.RECOMPUTE_STORE_BF16``) and dh from the
reverse walk (``triton_bwd.DH_STORE_BF16``).

    python benchmarks/bench_bwd_precision.py [--quick] [--out DIR]

History: run 12 measured the WY backward's inverse products here, "ieee" against "tf32x3"
(``local_bwd_wy.INVERSE_DOT_PREC``): WY 2.107 → 1.499 ms at B=8 T=4096 H=16, fwd+bwd 9.61 → 9.00, every gradient
the same to two digits — "tf32x3" since (docs/performance.md run 12; the ieee/tf32x3 sweep is in git history).

Run 16 measured h, V_new and dh in bf16 against the eighth session's prediction (triton_bwd.py has it, the byte
count and the numbers): both stay fp32. h / V_new in bf16 won at the three cases of that run and all three shapes,
but rounds the initial state (at T=1 the stored h is the initial state): T=1's dg 3.1e-3 against a baseline of
8.7e-5, caught by gpu_check_core after the switch. T1 is now one of the cases, and dh alone in bf16 (fp32 / bf16)
one of the variants. The rule: take a variant if every gradient stays within 2× of the rounded-PyTorch baseline and
fwd+bwd gains at all three shapes.

Run 17: dh alone in bf16 failed T=1 too (dg 8.4× its baseline). Since then local_bwd_dqk reads the first chunk's h
and the last chunk's dh exactly (from the initial state and dh_T) when they are stored in bf16: the next run of this
script decides the stores by the rule above (triton_bwd.py has the prediction).

1. accuracy: gpu_check_core's check (o, final state, every gradient vs float64 next to the baseline) at the anchor
   case, T=1, K=V=64 T=4096 and T=32768 K=128, bf16 (the stores change nothing for fp16 and fp32 inputs);
2. speed per variant: the public op's forward + backward (do_bench median ms, and its peak extra memory) and the
   three stages the stores touch alone — the recompute (cumsum, solve, WY, state pass), the reverse walk, dq/dk —
   at B=1 T=4096, B=8 T=4096, B=1 T=32768 (H=16, K=V=128).
Prints the tables last; writes bench_bwd_precision.json under --out.
"""
from __future__ import annotations

import json
from unittest import mock

import torch
import triton
from bench_cli import bench_args, write_json  # noqa: E402  (this folder is on sys.path)
from bench_launch_options import stage_inputs  # noqa: E402
from gpu_check_core import CASES, NAMES, check, ratio_cells  # noqa: E402  (this folder is on sys.path)

from linattn import chunk_gated_delta_rule
from linattn.ops.common import CHUNK
from linattn.ops.common.local_bwd_dqk import local_bwd_dqk
from linattn.ops.common.state_pass_bwd import state_pass_bwd
from linattn.ops.gated_delta import triton_bwd as TB

# (RECOMPUTE_STORE_BF16, DH_STORE_BF16), the default first
VARIANTS = [("fp32", "fp32"), ("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")]
ACCURACY_CASES = ("anchor_B2_T300_K128", "T1", "K64_V64_T4096", "T32768_K128")
SHAPES = [(1, 4096, 16, 16), (8, 4096, 16, 16), (1, 32768, 16, 16)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def variant(v: tuple):
    """The two store settings ``v`` = (RECOMPUTE_STORE_BF16, DH_STORE_BF16) for a with-block, restored after."""
    return mock.patch.multiple(TB, RECOMPUTE_STORE_BF16=v[0], DH_STORE_BF16=v[1])


def accuracy(names):
    rows = []
    for case in (c for c in CASES if c[0] in names):
        for v in VARIANTS:
            with variant(v):
                row = check(case, torch.bfloat16, use_token_ref=case[2] <= 1000)
            row["h_store"], row["dh_store"] = v
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return rows


def stage_times(st: dict, hs: str, dhs: str) -> dict:
    """The three stages the stores touch, alone, with h / V_new stored as ``hs`` and dh as ``dhs``."""
    q, k, v, g, beta, gc, A_inv, w, do = (st[n] for n in ("q", "k", "v", "g", "beta", "gc", "A_inv", "w", "do"))
    scale, dht, dv_local, dv_new = st["scale"], st["dht"], st["dv_local"], st["dv_new"]
    h, v_new, dh = st["h"].to(DTYPES[hs]), st["v_new"].to(DTYPES[hs]), st["dh"].to(DTYPES[dhs])
    NT = triton.cdiv(q.shape[1], CHUNK)
    return dict(
        recompute_ms=triton.testing.do_bench(
            lambda: TB.recompute_forward(k, v, g, beta, None, None, None, None, NT, store=hs)),
        reverse_walk_ms=triton.testing.do_bench(
            lambda: state_pass_bwd(q, k, w, gc, do, dv_local, dht, scale, dh_dtype=DTYPES[dhs])),
        dqk_ms=triton.testing.do_bench(
            lambda: local_bwd_dqk(q, k, beta, gc, A_inv, h, v_new, do, dh, dv_new, scale, None, None)))


def speed(B, T, H, HV):
    st = stage_inputs(B, T, H, HV)  # every stage's real inputs (fp32 stores), cast per variant
    ins = [st[n].requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    f = lambda: chunk_gated_delta_rule(*ins, scale=st["scale"], output_final_state=True)
    rows = []
    for hs, dhs in VARIANTS:
        row = dict(shape=(B, T, H, HV), h_store=hs, dh_store=dhs, **stage_times(st, hs, dhs))
        with variant((hs, dhs)):
            row["fwdbwd_ms"] = triton.testing.do_bench(lambda: torch.autograd.grad(f()[0], ins, st["do"]))
            # the op's own peak over one forward + backward, as .anchors/bench_anchors.py's peak_extra_MB (run 18:
            # 2586 MB at B=8 T=4096 H=16 with fp32 stores, ≈ 2700 predicted from run 17's 3230 and the frees)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            torch.autograd.grad(f()[0], ins, st["do"])
            torch.cuda.synchronize()
            row["peak_extra_MB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    a = bench_args("the anchor case and the first two shapes only")
    acc = accuracy(ACCURACY_CASES[:1] if a.quick else ACCURACY_CASES)
    rows = [r for s in (SHAPES[:2] if a.quick else SHAPES) for r in speed(*s)]
    write_json(a.out, "bench_bwd_precision.json", dict(accuracy=acc, speed=rows))

    print("\nrelative L2 vs float64 (bf16), kernel / baseline ratio per gradient (pass: ≤ 2)")
    print("%-22s %-5s %-5s " % ("case", "h", "dh") + " ".join("%-7s" % n for n in NAMES))
    for r in acc:
        if "error" in r:
            print(r["case"], r["h_store"], r["dh_store"], r["error"])
            continue
        cells = ratio_cells(r)
        print("%-22s %-5s %-5s " % (r["case"][:22], r["h_store"], r["dh_store"]) + " ".join("%-7s" % c for c in cells))
    print("\n| B, T, H, HV | h, V_new / dh stored | fwd+bwd ms | recompute ms | reverse walk ms | dq/dk ms | "
          "fwd+bwd peak extra MB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {', '.join(map(str, r['shape']))} | {r['h_store']} / {r['dh_store']} | {r['fwdbwd_ms']:.3f} | "
              f"{r['recompute_ms']:.3f} | {r['reverse_walk_ms']:.3f} | {r['dqk_ms']:.3f} | "
              f"{r['peak_extra_MB']:.0f} |")


if __name__ == "__main__":
    main()
