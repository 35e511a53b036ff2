"""GPU check of the Triton backward (linattn/ops/gated_delta/triton_bwd.py): accuracy per gradient, then time.

For each shape and dtype, and for each dot precision of the dots on fp32 intermediates (the default policy:
"tf32" for 16-bit inputs; "input": operands rounded to the 16-bit input dtype):

* err: relative RMS of every gradient against the torch backend run in float64 on the same rounded inputs
  (its backward matches autograd of the float64 reference to ~1e-15);
* floor: the error of that float64 gradient merely rounded to the gradient's dtype, and the error of the torch
  backend computing in fp32 from the same inputs; the brief asks err ≤ 2 × what PyTorch makes at that precision;
* ms: triton.testing.do_bench median of the backward alone (forward recompute included), and of the torch backend.

    python benchmarks/gpu_check_bwd.py            # on the H200
    python benchmarks/gpu_check_bwd.py --smoke    # tiny shapes; also runs on the CPU under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import os
from functools import partial

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from linattn.ops.gated_delta.torch_chunk import chunk_gated_delta_rule_bwd_torch  # noqa: E402
from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton  # noqa: E402

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
SHAPES = [  # (B, T, H, HV, K, V, varlen offsets or None)
    (2, 300, 4, 4, 128, 128, None),
    (1, 4096, 16, 32, 128, 128, None),
    (1, 8192, 8, 16, 128, 128, [0, 1, 2000, 2064, 8191, 8192]),
    (4, 2048, 8, 8, 256, 128, None),
]
SMOKE_SHAPES = [(1, 130, 1, 2, 64, 32, None), (1, 100, 1, 1, 32, 48, [0, 1, 65, 100])]


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def make(B, T, H, HV, K, V, offsets, dtype, device):
    N = B if offsets is None else len(offsets) - 1
    q = torch.randn(B, T, H, K, device=device).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, device=device).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, device=device) + 2.0)
    beta = torch.rand(B, T, HV, device=device)
    h0 = torch.randn(N, HV, K, V, device=device)
    do = torch.randn(B, T, HV, V, device=device).to(dtype)
    dht = torch.randn(N, HV, K, V, device=device)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device) if offsets is not None else None
    return (q, k, v, g, beta, K ** -0.5, h0), cu, offsets, do, dht


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, accuracy only (CPU interpreter friendly)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    dtypes = [torch.float32, torch.float16] if device == "cpu" else [torch.bfloat16, torch.float16, torch.float32]
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            torch.manual_seed(0)
            inp, cu, offs, do, dht = make(*shape, dtype, device)
            ref = chunk_gated_delta_rule_bwd_torch(*(x.double() for x in inp[:5]), inp[5], inp[6].double(), offs,
                                                   do.double(), dht.double())
            fp32 = chunk_gated_delta_rule_bwd_torch(*inp, offs, do, dht)
            floor = {n: rel(r.to(x.dtype), r) for n, r, x in zip(GRADS, ref, fp32)}
            torch_err = {n: rel(x, r) for n, x, r in zip(GRADS, fp32, ref)}
            for prec in ([None] if dtype == torch.float32 else [None, "input"]):
                got = chunk_gated_delta_rule_bwd_triton(*inp, cu, offs, do, dht, prec)
                err = {n: rel(x, r) for n, x, r in zip(GRADS, got, ref)}
                ms = ms_torch = float("nan")
                if device == "cuda" and not args.smoke:
                    ms = triton.testing.do_bench(partial(chunk_gated_delta_rule_bwd_triton, *inp, cu, offs, do, dht,
                                                         prec))
                    if prec is None:
                        ms_torch = triton.testing.do_bench(partial(chunk_gated_delta_rule_bwd_torch, *inp, offs, do,
                                                                   dht), rep=200)
                ratio = max(err[n] / max(floor[n], torch_err[n], 1e-12) for n in GRADS)
                rows.append((shape, str(dtype).split(".")[-1], prec or "default", err, floor, torch_err, ratio, ms,
                             ms_torch))
    print(f"\n{'shape (B,T,H,HV,K,V,varlen)':<36}{'dtype':<9}{'dots':<9}"
          + "".join(f"{n:>9}" for n in GRADS) + f"{'worst/ref':>10}{'ms':>9}{'torch ms':>10}")
    for shape, dt, prec, err, floor, torch_err, ratio, ms, ms_torch in rows:
        label = f"{shape[:6]}{' varlen' if shape[6] else ''}"
        print(f"{label:<36}{dt:<9}{prec:<9}" + "".join(f"{err[n]:9.1e}" for n in GRADS)
              + f"{ratio:10.2f}{ms:9.3f}{ms_torch:10.3f}")
        print(f"{'  floor: rounding / torch fp32':<54}" + "".join(f"{min(floor[n], 9.9):9.1e}" for n in GRADS))
        print(f"{'':<54}" + "".join(f"{torch_err[n]:9.1e}" for n in GRADS))
    print("\nworst/ref = max over gradients of err / max(rounding floor, torch fp32 error); the target is ≤ 2.")


if __name__ == "__main__":
    main()
