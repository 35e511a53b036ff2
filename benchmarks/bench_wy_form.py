"""GPU check and timing of where the split forward forms the WY products (``split_fwd.WY_FORM``, issue 4):
"prepass" — the pre-pass writes W and U (fp32), the state pass reads them — against "state_pass" — the pre-pass
writes each chunk's inverse A_inv, the state pass forms V_new = A_inv (β ⊙ V − βΓ ⊙ (K S)) from it and the values
(state_pass.py, FROM_A_INV). split_fwd.py has the byte count and the prediction.

    python benchmarks/bench_wy_form.py [--quick] [--bv-sweep] [--out DIR]

1. accuracy: gpu_check_core's check (o, final state and every gradient vs float64, next to the rounded-PyTorch
   baseline; the bound is kernel ≤ 2 × baseline) for both forms, bf16, at five cases (--quick: two);
2. speed: the op's forward on the split path (do_bench median ms, no grad), the pre-pass and the state pass alone,
   per form, at the seven shapes of issue 4's table in bf16 and at B=8 T=4096 in fp32 (--quick: three shapes).
Prints the tables last; writes bench_wy_form.json under --out.
"""
from __future__ import annotations

import json

import torch
import triton
from bench_cli import bench_args, write_json  # noqa: E402  (this folder is on sys.path)
from gpu_check_core import CASES, NAMES, check, ratio_cells  # noqa: E402  (this folder is on sys.path)
from gpu_check_fwd import make  # noqa: E402  (this folder is on sys.path)

from linattn import chunk_gated_delta_rule
from linattn.ops.common import split_fwd as SF
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.common.state_pass import state_pass_fwd
from linattn.ops.gated_delta import triton_chunk

FORMS = ("prepass", "state_pass")
ACCURACY_CASES = ("anchor_B2_T300_K128", "T1", "K128_V256", "varlen_K128", "T32768_K128")
SHAPES = [(1, 4096, 16, 16, torch.bfloat16), (8, 4096, 16, 16, torch.bfloat16), (1, 32768, 16, 16, torch.bfloat16),
          (1, 131072, 16, 16, torch.bfloat16), (4, 8192, 16, 32, torch.bfloat16), (2, 16384, 32, 32, torch.bfloat16),
          (1, 32768, 2, 8, torch.bfloat16), (8, 4096, 16, 16, torch.float32)]
D = 128


class form:
    """split_fwd.WY_FORM (and the split path) for a with-block; restored after."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.old = SF.WY_FORM, triton_chunk.FORWARD_PATH
        SF.WY_FORM, triton_chunk.FORWARD_PATH = self.name, "split"

    def __exit__(self, *exc):
        SF.WY_FORM, triton_chunk.FORWARD_PATH = self.old


def accuracy(names):
    rows = []
    for case in (c for c in CASES if c[0] in names):
        for f in FORMS:
            with form(f):
                try:
                    row = check(case, torch.bfloat16, use_token_ref=case[2] <= 1000)
                except Exception as e:  # a form that fails is a row, not the end
                    row = dict(case=case[0], dtype="bfloat16", error=f"{type(e).__name__}: {e}"[:300])
            row["form"] = f
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return rows


def speed(B, T, H, HV, dt):
    x, _, _ = make(B, T, H, HV, D, D, None, dt)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    rows = []
    for f in FORMS:
        row = dict(shape=(B, T, H, HV), dtype=str(dt).split(".")[-1], form=f)
        try:
            with form(f), torch.no_grad():
                row["fwd_ms"] = triton.testing.do_bench(
                    lambda: chunk_gated_delta_rule(q, k, v, g, beta, scale=D ** -0.5, output_final_state=True))
                store = SF.store_dtype(dt)
                if f == "state_pass":
                    row["prepass_ms"] = triton.testing.do_bench(lambda: fused_prepass(g, k, v, beta, write_wy=False))
                    gc, a_inv = fused_prepass(g, k, v, beta, write_wy=False)
                    row["state_pass_ms"] = triton.testing.do_bench(
                        lambda gc=gc, a=a_inv, s=store: state_pass_fwd(k, None, v, gc, None, store_dtype=s, a_inv=a,
                                                                       beta=beta))
                else:
                    row["prepass_ms"] = triton.testing.do_bench(lambda: fused_prepass(g, k, v, beta))
                    gc, w, u = fused_prepass(g, k, v, beta)
                    row["state_pass_ms"] = triton.testing.do_bench(
                        lambda gc=gc, w=w, u=u, s=store: state_pass_fwd(k, w, u, gc, None, store_dtype=s))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    return rows


def bv_row(B, T, H, HV):
    """The A_inv-form state pass alone at V tiles 16 / 32 / 64 at one shape (bf16)."""
    x, _, _ = make(B, T, H, HV, D, D, None, torch.bfloat16)
    k, v, g, beta = (x[n] for n in ("k", "v", "g", "beta"))
    gc, a_inv = fused_prepass(g, k, v, beta, write_wy=False)
    row = dict(shape=(B, T, H, HV))
    for bv in (16, 32, 64):
        row[f"bv{bv}_ms"] = triton.testing.do_bench(
            lambda bv=bv: state_pass_fwd(k, None, v, gc, None, store_dtype=torch.bfloat16, a_inv=a_inv, beta=beta,
                                         block_v=bv))
    print(json.dumps(row), flush=True)
    return row


def bv_sweep():
    """bv_row where the form runs (≥ 64 pairs): run 18 measured the state pass at the launcher's 64 with 255
    registers and 0.94 M spill requests (ncu) at B=8 T=4096 H=16."""
    rows = []
    for shape in ((8, 4096, 16, 16), (4, 8192, 16, 32), (2, 16384, 32, 32)):
        rows.append(bv_row(*shape))
        torch.cuda.empty_cache()
    return rows


def main():
    a = bench_args("two accuracy cases and three shapes", bv_sweep="only the A_inv state pass at V tiles 16/32/64")
    if a.bv_sweep:
        write_json(a.out, "bench_wy_form_bv.json", bv_sweep())
        return
    acc = accuracy(ACCURACY_CASES[:2] if a.quick else ACCURACY_CASES)
    rows = [r for s in (SHAPES[:3] if a.quick else SHAPES) for r in speed(*s)]
    write_json(a.out, "bench_wy_form.json", dict(accuracy=acc, speed=rows))

    print("\nrelative L2 vs float64 (bf16), kernel / baseline ratio (pass: ≤ 2); o error in brackets")
    print("%-20s %-11s " % ("case", "WY form") + " ".join("%-7s" % n for n in NAMES))
    for r in acc:
        if "error" in r:
            print(r["case"], r["form"], r["error"])
            continue
        cells = ratio_cells(r)
        print("%-20s %-11s " % (r["case"][:20], r["form"]) + " ".join("%-7s" % c for c in cells)
              + f"  [{r['err']['o']:.3e}]")
    print("\n| B, T, H, HV | dtype | WY form | split fwd ms | pre-pass ms | state pass ms |\n|---|---|---|---|---|---|")
    for r in rows:
        cells = " | ".join(f"{r[k]:.3f}" if k in r else r.get("error", "–")[:40]
                           for k in ("fwd_ms", "prepass_ms", "state_pass_ms"))
        print(f"| {', '.join(map(str, r['shape']))} | {r['dtype']} | {r['form']} | {cells} |")


if __name__ == "__main__":
    main()
