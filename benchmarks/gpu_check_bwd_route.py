"""GPU check of the backward's routing (``gated_delta/dispatch.hopper_backward_blocker``): the Hopper backward
against the Triton backward at small shapes, which calibrate its threshold (HOPPER_BWD_MIN_WORK).

Per shape (gpu_check_hopper_bwd's timing inputs: bf16, K = V = 128, the anchors' gates, h0 and dht): do_bench
medians (ms) of ``hopper.backward.chunk_gated_delta_rule_bwd_hopper`` (its planned segments) and of
``triton_bwd.chunk_gated_delta_rule_bwd_triton``, the faster one, the path the dispatch picks, and every gradient's
relative L2 Hopper against Triton (both bf16: ≈ 4e-3 is rounding). A table last; JSON to --out after each shape.

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/gpu_check_bwd_route.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
SHAPES = [  # (B, T, H, HV): at and around the dispatch's threshold
    (1, 4096, 16, 16), (2, 4096, 16, 16), (4, 4096, 16, 16), (1, 8192, 16, 16), (1, 16384, 16, 16),
    (1, 8192, 2, 8), (1, 16384, 2, 8), (2, 2048, 16, 16),
]


def measure(B: int, T: int, H: int, HV: int) -> dict:
    import triton
    from gpu_check_core import rel
    from gpu_check_hopper_bwd import row_inputs

    from linattn.ops.gated_delta.dispatch import choose_backward_path
    from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton
    from linattn.ops.hopper.backward import chunk_gated_delta_rule_bwd_hopper
    x = row_inputs(B, T, H, HV)
    hopper = lambda: chunk_gated_delta_rule_bwd_hopper(**x)
    triton_bwd = lambda: chunk_gated_delta_rule_bwd_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"],
                                                           x["initial_state"], None, None, x["do"], x["dht"])
    diff = {n: rel(a, b) for n, a, b in zip(GRADS, hopper(), triton_bwd())}
    ms = dict(hopper=triton.testing.do_bench(hopper), triton=triton.testing.do_bench(triton_bwd))
    path, why = choose_backward_path(x["q"], x["v"], x["g"], x["do"], None, "triton")
    return dict(B=B, T=T, H=H, HV=HV, ms=ms, faster=min(ms, key=ms.get), dispatch=path, why=why,
                hopper_vs_triton=diff)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    out = Path(args.out) / "bwd_route.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(torch.cuda.get_device_name(), flush=True)
    records = []
    for shape in SHAPES:
        try:
            record = measure(*shape)
        except Exception as error:  # one shape's failure is a record, not the end of the table
            record = dict(zip("B T H HV".split(), shape), error=f"{type(error).__name__}: {str(error)[:300]}")
        print(json.dumps(record), flush=True)
        records.append(record)
        out.write_text(json.dumps(records, indent=1))
    print(f"\n{'B,T,H,HV':<18}{'pairs':>6}{'hopper':>9}{'triton':>9}  faster  dispatch  max rel L2 hopper vs triton")
    for r in records:
        shape = f"{r['B']},{r['T']},{r['H']},{r['HV']}"
        if "error" in r:
            print(f"{shape:<18}{r['error']}")
            continue
        print(f"{shape:<18}{r['B'] * r['HV']:6d}{r['ms']['hopper']:9.3f}{r['ms']['triton']:9.3f}  {r['faster']:<7} "
              f"{r['dispatch']:<9} {max(r['hopper_vs_triton'].values()):.1e}")
    return records


if __name__ == "__main__":
    main()
