"""GPU timing of the op's two forward paths (``triton_chunk.FORWARD_PATH``): the fused walk and the split path.

    python benchmarks/bench_forward_paths.py [--quick] [--out DIR]

"walk": pre-pass (gc, W, U, P) → one sequential kernel per (sequence, value head, V slice) that keeps the state
on chip and writes o (split into segments by the sequence-parallel planner when the programs cannot fill the SMs).
"split" (the default since run 12): pre-pass (gc, W, U) → the forward state pass (h of every chunk and V_new to
HBM; its chain per chunk is two dots, where the walk's is five) → the output, parallel over chunks.

Per shape (bf16, issue 4's table, then K = V = 64 and K = 128 V = 256): the public op's forward and forward +
backward on each path (do_bench median ms; the backward is the same code), the split path stage by stage, its
extra memory (h), and the pre-pass's work as the separate cumsum / kkt_solve / wy kernels. First: both paths' o
and final state against the float64 reference at the anchor case (B=2 T=300 H=4 K=V=128) and their first-call
time. Prediction written before any run (triton_chunk.py): split forward ≈ 0.35 ms at B=1 T=4096 H=16 (walk
0.541), ≈ 1.9 at B=8 (2.55), ≈ 2.5 at B=1 T=32768 (4.28).
Prints the table last; writes bench_forward_paths.json under --out.
"""
from __future__ import annotations

import json
import time

import torch
import triton
from bench_cli import bench_args, write_json  # noqa: E402  (this folder is on sys.path)
from gpu_check_fwd import make, rel  # noqa: E402  (this folder is on sys.path)

from linattn import chunk_gated_delta_rule
from linattn.ops.common import CHUNK
from linattn.ops.common import split_fwd as SF
from linattn.ops.common.cumsum import chunk_local_cumsum
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.common.kkt_solve import kkt_solve
from linattn.ops.common.output import output_fwd
from linattn.ops.common.state_pass import state_pass_fwd
from linattn.ops.common.wy import wy_fwd
from linattn.ops.gated_delta import triton_chunk
from linattn.ops.gated_delta.reference import gated_delta_rule_reference

torch.backends.cuda.matmul.allow_tf32 = False
SHAPES = [  # B, T, H, HV, K, V
    (1, 4096, 16, 16, 128, 128), (8, 4096, 16, 16, 128, 128), (1, 32768, 16, 16, 128, 128),
    (1, 131072, 16, 16, 128, 128), (4, 8192, 16, 32, 128, 128), (2, 16384, 32, 32, 128, 128),
    (1, 32768, 2, 8, 128, 128), (1, 32768, 16, 16, 64, 64), (1, 32768, 16, 16, 128, 256),
]
NAMES = ("q", "k", "v", "g", "beta")
PATHS = ("walk", "split")                   # "auto" (the default) picks one of them by the shape
DEFAULT_PATH = triton_chunk.FORWARD_PATH


def accuracy():
    """o and final state of both paths against the float64 reference at the anchor case, and first-call time."""
    x, _, _ = make(2, 300, 4, 4, 128, 128, None, torch.bfloat16)
    args = [x[n] for n in NAMES]
    ro, rS = gated_delta_rule_reference(*args, 128 ** -0.5, None, None)
    rows = []
    for path in PATHS:
        triton_chunk.FORWARD_PATH = path
        t0 = time.time()
        o, S = chunk_gated_delta_rule(*args, scale=128 ** -0.5, output_final_state=True)
        torch.cuda.synchronize()
        rows.append(dict(path=path, first_call_s=time.time() - t0, o=rel(o, ro), state=rel(S, rS)))
        print(json.dumps(rows[-1]), flush=True)
    triton_chunk.FORWARD_PATH = DEFAULT_PATH
    return rows


def timings(B, T, H, HV, K, V):
    x, _, _ = make(B, T, H, HV, K, V, None, torch.bfloat16)
    ins = [x[n].requires_grad_(True) for n in NAMES]
    scale = K ** -0.5
    f = lambda: chunk_gated_delta_rule(*ins, scale=scale, output_final_state=True)
    do = torch.randn_like(x["v"])
    row = dict(shape=(B, T, H, HV, K, V))
    for path in PATHS:
        triton_chunk.FORWARD_PATH = path
        try:
            with torch.no_grad():
                row[f"{path}_fwd_ms"] = triton.testing.do_bench(f)
            row[f"{path}_fwdbwd_ms"] = triton.testing.do_bench(lambda: torch.autograd.grad(f()[0], ins, do))
        except Exception as e:  # one path failing at one shape is a row, not the end
            row[f"{path}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    # the split path's sequence-parallel plan (split_fwd.py): when it splits, the same path without segments too
    _, BV, _ = SF.fused_fwd_config(K, V, B * HV, SF.num_sms(x["q"].device))  # split_fwd's own plan
    row["split_segment_chunks"] = SF.plan_segments([triton.cdiv(T, CHUNK)] * B, HV, K, V, BV,
                                                   SF.num_sms(x["q"].device), affine_cost=SF.AFFINE_COST)
    if row["split_segment_chunks"] is not None:
        triton_chunk.FORWARD_PATH = "split"
        planner, SF.plan_segments = SF.plan_segments, lambda *a, **kw: None
        try:
            with torch.no_grad():
                row["split_unsegmented_fwd_ms"] = triton.testing.do_bench(f)
        finally:
            SF.plan_segments = planner
    triton_chunk.FORWARD_PATH = DEFAULT_PATH
    # the split path stage by stage, each with the stores and precision the op's default path gives them (up to
    # run 15 the output kernel ran here at dot_precision's default, not OUTPUT_PREC_BF16: 0.545 ms against 0.398
    # in the op at B=8, and h and V_new were stored in fp32 whatever STORE_BF16 said)
    with torch.no_grad():
        q, k, v, g, beta = (t.detach() for t in ins)
        wu_store, store, out_prec = SF.wu_store_dtype(q.dtype), SF.store_dtype(q.dtype), SF.output_precision(q.dtype)
        gc, w, u = fused_prepass(g, k, v, beta, store_dtype=wu_store)
        h, v_new, _ = state_pass_fwd(k, w, u, gc, None, store_dtype=store)
        row["prepass_ms"] = triton.testing.do_bench(lambda: fused_prepass(g, k, v, beta, store_dtype=wu_store))
        row["state_pass_ms"] = triton.testing.do_bench(lambda: state_pass_fwd(k, w, u, gc, None, store_dtype=store))
        row["output_ms"] = triton.testing.do_bench(
            lambda: output_fwd(q, k, v_new, h, gc, scale, v.dtype, dot_prec=out_prec))
        row["h_MB"] = h.numel() * h.element_size() / 2 ** 20
        # the pre-pass's work as the three separate stage kernels the backward's recompute runs: which part of
        # the pre-pass's time (1.13 ms at B=8 T=4096 H=16, ≈ 36 µs per program, run 11) is the solve, which W/U
        A_inv = kkt_solve(k, beta, gc, HV)
        row["cumsum_ms"] = triton.testing.do_bench(lambda: chunk_local_cumsum(g))
        row["kkt_solve_ms"] = triton.testing.do_bench(lambda: kkt_solve(k, beta, gc, HV))
        row["wy_ms"] = triton.testing.do_bench(lambda: wy_fwd(k, v, beta, gc, A_inv))
        row["chunks"] = triton.cdiv(T, CHUNK)
    print(json.dumps(row), flush=True)
    return row


def timed_rows(shapes):
    rows = []
    for s in shapes:
        rows.append(timings(*s))
        torch.cuda.empty_cache()  # the shape's tensors died with timings' frame: give the next shape the memory
    return rows


def main():
    a = bench_args("the first two shapes only")
    acc = accuracy()
    rows = timed_rows(SHAPES[:2] if a.quick else SHAPES)
    write_json(a.out, "bench_forward_paths.json", dict(accuracy=acc, rows=rows))

    print("\nanchor (bf16 B=2 T=300 H=4 vs float64): " + "; ".join(
        f"{r['path']}: o {r['o']:.3e}, state {r['state']:.3e}, first call {r['first_call_s']:.1f} s" for r in acc))
    print("\n| B, T, H, HV, K, V | walk fwd | split fwd | split: pre-pass + state pass + output | h MB "
          "| walk fwd+bwd | split fwd+bwd | stages: cumsum + kkt_solve + wy "
          "| split segments (chunks each): fwd unsegmented |\n|---|---|---|---|---|---|---|---|---|")
    cell = lambda r, key: f"{r[key]:.3f}" if key in r else r.get(key.rsplit("_", 2)[0] + "_error", "–")[:40]
    for r in rows:
        print(f"| {', '.join(map(str, r['shape']))} | {cell(r, 'walk_fwd_ms')} | {cell(r, 'split_fwd_ms')} | "
              f"{r['prepass_ms']:.3f} + {r['state_pass_ms']:.3f} + {r['output_ms']:.3f} | {r['h_MB']:.0f} | "
              f"{cell(r, 'walk_fwdbwd_ms')} | {cell(r, 'split_fwdbwd_ms')} | "
              f"{r['cumsum_ms']:.3f} + {r['kkt_solve_ms']:.3f} + {r['wy_ms']:.3f} | "
              + (f"{r['split_segment_chunks']}: {r['split_unsegmented_fwd_ms']:.3f} |"
                 if r["split_segment_chunks"] else "none |"))


if __name__ == "__main__":
    main()
