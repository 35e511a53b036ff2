"""The command line the GPU benchmarks share: ``--quick`` and ``--out DIR`` (default $OUT, else the working
directory), read after printing the device line every result log starts with; and the JSON a script leaves there."""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton


def bench_args(quick_help: str, **switches: str) -> argparse.Namespace:
    """--quick, --out and any further on/off ``switches`` (name → help; ``bv_sweep`` is ``--bv-sweep``)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help=quick_help)
    for name, text in switches.items():
        ap.add_argument("--" + name.replace("_", "-"), action="store_true", help=text)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    return a


def write_json(out_dir: str, name: str, payload) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as fh:
        json.dump(payload, fh, indent=1)
