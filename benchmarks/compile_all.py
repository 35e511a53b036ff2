"""Registers, spills and shared memory of EVERY Triton kernel the chunked op launches, forward and backward, at the
launch configuration the public op picks on an H200 — on any machine, no GPU needed.

Two steps in two processes (the interpreter replaces the kernels that the compile step needs):

1. record (under TRITON_INTERPRET=1): run ``chunk_gated_delta_rule`` forward + backward on the Triton backend with
   the kernels' launches intercepted, not executed (the outputs stay uninitialised: only the launch plan matters);
   note each kernel's constexprs, argument types and num_warps;
2. compile (without the interpreter): compile each recorded launch for sm_90 with Triton's ptxas (sm90.py), and
   count its static SASS instructions by family (cuobjdump): tensor-core MMAs, fp32 FMAs (where an "ieee" dot's
   work goes), spill traffic (LDL/STL), shuffles and barriers — a CPU-side hint of where a kernel's time goes.

    python benchmarks/compile_all.py [--dtype bf16|fp32|fp16] [--B 1 --H 16 --HV 16 --D 128] [--gate]
    python benchmarks/compile_all.py --decode fp32|bf16 --B 64 --H 16 --HV 32     # one serving step instead
    python benchmarks/compile_all.py --forward split  # force a forward path (default "auto": the op's own pick)
    python benchmarks/compile_all.py --launch-options '{"local_bwd_dqk": {"num_stages": 1}}'   # over the defaults

Launch plans depend on B·HV (tiles chosen to fill 132 SMs), not on T; the default is the issue-4 table's first row.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

# the constexprs a table row shows: tiles, precisions and the mode flags that change a kernel's resources
SHOWN = ("BT", "BK", "BV", "BHV", "DOT_PREC", "STATE_PREC", "OUT_PREC", "INV_PREC", "MERGE_PREC",
         "NUM_STAGES", "LOAD_P", "STORE_P", "SEGMENTED", "AFFINE", "USE_STATE_INDICES")
TYPES = {"torch.bfloat16": "*bf16", "torch.float16": "*fp16", "torch.float32": "*fp32", "torch.int32": "*i32",
         "torch.int64": "*i64"}


def record(a) -> list:
    """Step 1: the launches of one forward + backward, as JSON-able dicts."""
    import torch
    import triton.runtime.interpreter as interp

    launches, seen = [], set()

    def intercept(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        names = list(self.arg_names)
        types, consts = {}, {}
        for name, value in zip(names, args):
            if value is None:
                consts[name] = None
            elif isinstance(value, torch.Tensor):
                types[name] = TYPES[str(value.dtype)]
            elif isinstance(value, bool):
                types[name] = "i1"
            elif isinstance(value, int):
                types[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            elif isinstance(value, float):
                types[name] = "fp32"
        num_warps = kwargs.get("num_warps", 4)
        consts.update({k: v for k, v in kwargs.items() if k in names})  # the constexprs (launch options are not)
        if "INTERPRET" in consts:
            consts["INTERPRET"] = False  # the compile step builds the GPU kernel
        options = {k: kwargs[k] for k in ("maxnreg", "num_stages") if k in kwargs}  # common.launch_options
        key = (fn.__module__, fn.__name__, json.dumps(consts, sort_keys=True, default=str), num_warps,
               json.dumps(options, sort_keys=True))
        if key not in seen:
            seen.add(key)
            launches.append(dict(module=fn.__module__, name=fn.__name__, consts=consts, types=types,
                                 num_warps=num_warps, options=options))

    interp.InterpretedFunction.run = intercept
    from linattn.ops import common
    table = {**common.LAUNCH_OPTIONS, **json.loads(a.launch_options)}
    with common.launch_options_override(table):
        run_op(a)
    return launches


def run_op(a) -> None:
    """One forward + backward of the op (or one decode step) on the Triton backend, for the record step."""
    import torch

    import linattn
    from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    T = 256
    q = torch.randn(a.B, T, a.H, a.D, dtype=dt, requires_grad=True)
    k = torch.randn(a.B, T, a.H, a.D, dtype=dt, requires_grad=True)
    v = torch.randn(a.B, T, a.HV, a.D, dtype=dt, requires_grad=True)
    g = (-torch.rand(a.B, T, a.HV)).requires_grad_(True)
    beta = torch.rand(a.B, T, a.HV, dtype=dt, requires_grad=True)
    extra = dict(A_log=torch.zeros(a.HV), dt_bias=torch.zeros(a.HV), use_qk_l2norm_in_kernel=True,
                 use_beta_sigmoid_in_kernel=True) if a.gate else {}
    if a.decode:
        # one serving step over a state pool: B sequences, Tq = 1, gates and norms fused, pool in --decode's dtype
        pool = torch.zeros(a.B, a.HV, a.D, a.D, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[a.decode])
        linattn.gated_delta_rule_decode(q[:, :1].detach(), k[:, :1].detach(), v[:, :1].detach(), g[:, :1].detach(),
                                        beta[:, :1].detach(), pool, torch.arange(a.B, dtype=torch.int32),
                                        A_log=torch.zeros(a.HV), dt_bias=torch.zeros(a.HV),
                                        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                        backend="triton")
        return
    o, _ = chunk_gated_delta_rule_on_path(a.forward, q, k, v, g, beta, output_final_state=True, backend="triton",
                                          **extra)
    torch.autograd.grad(o.float().sum(), (q, k, v, g, beta))


def compile_all(launches: list, top_ops: int = 0) -> None:
    """Step 2: compile every recorded launch for sm_90 and print one table (and, with ``top_ops``, each kernel's most
    frequent SASS opcodes after it)."""
    from sm90 import SASS_FAMILIES, compile_sm90  # noqa: E402  (this folder is on sys.path)
    shown_sass = ("total", "HGMMA", "HMMA", "FFMA", "LDL", "STL", "SHFL", "BAR")
    print("| kernel | key constexprs (launch options) | warps | registers | spill bytes | shared bytes | SASS "
          + " / ".join(shown_sass) + " |")
    print("|---|---|---|---|---|---|---|")
    assert set(shown_sass) - {"total"} <= set(SASS_FAMILIES)
    most = []
    for launch in launches:
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        consts, types = launch["consts"], launch["types"]
        r = compile_sm90(kernel, consts, lambda name, types=types: types.get(name, "i32"), launch["num_warps"],
                         **launch.get("options", {}))
        most.append(r.sass["ops"])
        shown = {k: v for k, v in consts.items() if k in SHOWN} | launch.get("options", {})
        print(f"| {launch['name']} | {', '.join(f'{k}={v}' for k, v in shown.items())} | {launch['num_warps']} | "
              f"{r.registers} | {r.spill_bytes} | {r.shared_bytes} | "
              + " / ".join(str(r.sass[k]) for k in shown_sass) + " |", flush=True)
    if top_ops:
        print()
        for launch, ops in zip(launches, most):
            print(f"{launch['name']}: " + ", ".join(f"{op} {n}" for op, n in list(ops.items())[:top_ops]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--HV", type=int, default=16)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--gate", action="store_true", help="in-op gate, beta sigmoid and q/k L2 norm (pre-processing)")
    ap.add_argument("--decode", choices=("fp32", "bf16"), help="instead: one decode step over a pool of this dtype")
    ap.add_argument("--forward", choices=("auto", "walk", "split"), default="auto",
                    help="the op's forward path (chunk_gated_delta_rule_on_path)")
    ap.add_argument("--launch-options", default="{}",
                    help='launch options over common.LAUNCH_OPTIONS, as JSON, e.g. '
                         '\'{"local_bwd_dqk": {"num_stages": 1, "maxnreg": 168}}\'')
    ap.add_argument("--ops", type=int, default=0, metavar="N", help="also print each kernel's N most frequent SASS "
                                                                    "opcodes (static counts)")
    ap.add_argument("--record-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.record_only:
        print(json.dumps(record(a)))
        return
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__, "--record-only", *sys.argv[1:]], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the compile step needs the real kernels")
    what = f"decode step, {a.decode} pool" if a.decode else ("+ in-op pre-processing" if a.gate else "")
    print(f"{a.dtype}, B={a.B} H={a.H} HV={a.HV} K=V={a.D} {what}")
    compile_all(json.loads(done.stdout.strip().splitlines()[-1]), a.ops)


if __name__ == "__main__":
    main()
