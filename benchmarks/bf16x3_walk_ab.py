"""A/B of the real sequential forward kernel with "bf16x3" dots under Triton and ptxas knobs, one process per variant.

What it checks: on the H200 (Triton 3.6) ``linattn/ops/common/fused_fwd.py::fused_fwd_kernel`` dies with an illegal
memory access when its output dots (DOT_PREC) or its state dots (STATE_PREC) use the split-bf16 "bf16x3" of
``linattn/ops/common/dot.py``, while tf32 and tf32x3 run. ``launch_walk`` refuses "bf16x3" on CUDA, so this script
launches the kernel itself, by keyword (a new kernel argument stops it with a message instead of a wrong launch).
The data is run 8's anchor case: B=2, T=300 (a ragged last chunk), H=4, K=V=128, BT=64, BK=128, h0 given. Each row
changes one thing against "bf16x3 out" (DOT_PREC=bf16x3, STATE_PREC=tf32, BV=16, 4 warps):

- bf16x3 state: the state dots instead; BV = 32 / 64: a wider state slice (the bf16 B operands' swizzle grows);
- 8 warps; MMAv3 off (``DISABLE_MMA_V3=1``: mma.sync instead of wgmma);
- ptxas -O0 (``DISABLE_PTXAS_OPT=1``), the system ptxas, ``PTXAS_NEW`` (a newer ptxas carried to the device);
- T=320: no ragged tail, to rule out an out-of-bounds global access there;
- P loaded: LOAD_P, the default forward's path since P comes from the pre-pass (random causal P here).

Run it on the GPU from the repository root (torch, triton and this checkout)::

    python3 benchmarks/bf16x3_walk_ab.py                                # every variant, one process each
    PTXAS_NEW=$PWD/.whl/ptxas python3 benchmarks/bf16x3_walk_ab.py      # plus three rows with that ptxas
    python3 benchmarks/bf16x3_walk_ab.py bf16x3 tf32 16 4 [T] [LOAD_P]  # one variant here (under compute-sanitizer)

Output: the Triton and ptxas versions, then one row per variant, printed as it finishes: ``OK`` with the relative
L2 difference of o and ht from the default (tf32x3 out, tf32 state) on the same data (o is bf16, so bf16 rounding
bounds it from below), ``FAIL`` with the child's last error line ("illegal memory access" is the fault), or
``TIMEOUT``. How to read it:

- a ptxas row passes where the bundled ptxas fails, or ptxas -O0 passes: an assembler miscompile
  (see triton-lang/triton#11781);
- BV = 32 / 64 pass while BV = 16 fails: the 32-byte-swizzled N = 16 bf16 B operand in Triton's Hopper lowering;
- MMAv3 off passes: the fault is on the wgmma path (then separate the two causes above with the ptxas rows);
- T=320 passes while T=300 fails: the ragged tail;
- under compute-sanitizer the first report names the memory space: __shared__ (operand addressing), __global__
  (a tail access) or __local__ (a spill miscompile).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import triton

# the checkout's root, so that linattn imports from this working tree when run as benchmarks/bf16x3_walk_ab.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linattn.ops.common.fused_fwd import fused_fwd_kernel  # noqa: E402

# run 8's anchor case; B·H = 8 (sequence, head) pairs is what made the launcher pick BV = 16 there
B, H, K, V = 2, 4, 128, 128
BT, BK = 64, 128
DEFAULT_PRECISIONS = ("tf32x3", "tf32")
CHILD_TIMEOUT_S = 300


def random_tensor(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda") * 0.1


def make_inputs(T: int) -> dict[str, torch.Tensor]:
    """The kernel's tensors, as the pre-pass would give them: bf16 q, k; fp32 w, u, gc, h0 and P [B, T, H, BT]."""
    torch.manual_seed(0)
    x = {}
    x["q"] = random_tensor(B, T, H, K).bfloat16()
    x["k"] = random_tensor(B, T, H, K).bfloat16()
    x["w"] = random_tensor(B, T, H, K)
    x["u"] = random_tensor(B, T, H, V)
    x["h0"] = random_tensor(B, H, K, V)
    x["gc"] = -(torch.rand(B, T, H, device="cuda") * 0.05).cumsum(1)
    # P rows hold the chunk's columns 0..BT-1; only the causal part (column ≤ position in the chunk) is nonzero
    causal = torch.arange(BT, device="cuda")[None, :] <= (torch.arange(T, device="cuda") % BT)[:, None]
    x["p"] = random_tensor(B, T, H, BT) * causal[None, :, None, :]
    return x


def kernel_arguments(x: dict, o: torch.Tensor, ht: torch.Tensor, T: int, bv: int, dot_prec: str, state_prec: str,
                     load_p: bool) -> dict:
    """fused_fwd_kernel's arguments for the plain walk (one segment per sequence, no varlen, no affine mode)."""
    args = dict(q=x["q"], k=x["k"], w=x["w"], u=x["u"], gc=x["gc"], p=x["p"] if load_p else None, o=o, h0=x["h0"],
                ht=ht, scale=K ** -0.5, cu_seqlens=None, segments=None, T=T, NSEG=1, L=0, H=H, HV=H, K=K, V=V, BT=BT,
                BK=BK, BV=bv, DOT_PREC=dot_prec, STATE_PREC=state_prec, INPUT_PREC="tf32", USE_INITIAL_STATE=True,
                IS_VARLEN=False, SEGMENTED=False, AFFINE=False, LOAD_P=load_p, INTERPRET=False,
                NUM_STAGES=0)
    missing = sorted(set(fused_fwd_kernel.arg_names) - set(args))
    if missing:
        raise SystemExit(f"fused_fwd_kernel has arguments this script does not set: {missing}")
    return {name: args[name] for name in fused_fwd_kernel.arg_names}


def relative_difference(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


def run_one_variant(dot_prec: str, state_prec: str, bv: int, num_warps: int, T: int = 300, load_p: int = 0) -> None:
    """Child process: run the variant, then the default precisions on the same data, and print their difference."""
    x = make_inputs(T)
    results = []
    for dp, sp in ((dot_prec, state_prec), DEFAULT_PRECISIONS):
        o = torch.empty(B, T, H, V, device="cuda", dtype=torch.bfloat16)
        ht = torch.empty(B, H, K, V, device="cuda")
        grid = (triton.cdiv(V, bv), B * H)
        fused_fwd_kernel[grid](**kernel_arguments(x, o, ht, T, bv, dp, sp, bool(load_p)), num_warps=num_warps)
        # synchronize here so that a fault is reported by this launch, not by a later call
        torch.cuda.synchronize()
        results.append((o.float(), ht))
    (o, ht), (o_ref, ht_ref) = results
    print(f"OK rel-diff vs default o {relative_difference(o, o_ref):.1e} ht {relative_difference(ht, ht_ref):.1e}")


def ptxas_version(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return "not found"
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    # one line reads "Cuda compilation tools, release 13.0, V13.0.88" (newer builds add a "Build ..." line after it)
    match = re.search(r"release [\d.]+, (V[\d.]+)", out)
    return match.group(1) if match else "?"


def variants(system_ptxas: str | None) -> list[tuple[str, list[str], dict[str, str]]]:
    """(label, child arguments DOT STATE BV WARPS [T] [LOAD_P], extra environment) of every row."""
    out16 = ["bf16x3", "tf32", "16", "4"]
    state16 = ["tf32x3", "bf16x3", "16", "4"]
    rows = [
        ("default", ["tf32x3", "tf32", "16", "4"], {}),
        ("bf16x3 out", out16, {}),
        ("bf16x3 state", state16, {}),
        ("bf16x3 out BV=32", ["bf16x3", "tf32", "32", "4"], {}),
        ("bf16x3 out BV=64", ["bf16x3", "tf32", "64", "4"], {}),
        ("bf16x3 out 8 warps", ["bf16x3", "tf32", "16", "8"], {}),
        # both knobs are in Triton's cache-invalidating set, so the child recompiles under them
        ("bf16x3 out MMAv3 off", out16, {"DISABLE_MMA_V3": "1"}),
        ("bf16x3 out ptxas -O0", out16, {"DISABLE_PTXAS_OPT": "1"}),
        ("bf16x3 out T=320 (no tail)", [*out16, "320"], {}),
        ("bf16x3 out P loaded", [*out16, "300", "1"], {}),
    ]
    if system_ptxas and os.path.exists(system_ptxas):
        rows.append(("bf16x3 out system ptxas", out16, {"TRITON_PTXAS_PATH": system_ptxas}))
        rows.append(("bf16x3 state system ptxas", state16, {"TRITON_PTXAS_PATH": system_ptxas}))
    if os.environ.get("PTXAS_NEW"):
        # a ptxas ≥ 13.3 carries the fix for register-input wgmma (triton-lang/triton#11781)
        env = {"TRITON_PTXAS_PATH": os.environ["PTXAS_NEW"]}
        rows.append(("bf16x3 out PTXAS_NEW", out16, env))
        rows.append(("bf16x3 state PTXAS_NEW", state16, env))
        rows.append(("bf16x3 both PTXAS_NEW", ["bf16x3", "bf16x3", "16", "4"], env))
    return rows


def run_in_subprocess(args: list, env: dict[str, str], script: str = __file__) -> str:
    """Result text of one variant of ``script`` run in a fresh process: an illegal access poisons the CUDA context
    for good. Shared with bf16x3_repro.py."""
    cmd = [sys.executable, os.path.abspath(script), *map(str, args)]
    try:
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"TIMEOUT after {CHILD_TIMEOUT_S} s"
    if proc.returncode == 0 and proc.stdout.strip():
        return proc.stdout.strip().splitlines()[-1]
    stderr = proc.stderr.splitlines()
    errors = [line for line in stderr if "error" in line.lower()] or stderr or [f"exit code {proc.returncode}"]
    return "FAIL " + errors[-1].strip()[:150]


def run_variant_table(variants, script: str = __file__, args_header: str = "args") -> None:
    """Print the Triton and ptxas versions, then run every (label, args, env) row of ``variants(system_ptxas)`` in
    its own process of ``script`` and print it as it finishes, so a call cut short by the device's time limit still
    shows the finished ones. Shared with bf16x3_repro.py."""
    system_ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    print(f"triton {triton.__version__}, bundled ptxas {triton.knobs.nvidia.ptxas.version}, "
          f"system ptxas {system_ptxas} {ptxas_version(system_ptxas)}, "
          f"PTXAS_NEW {ptxas_version(os.environ.get('PTXAS_NEW'))}")
    rows = variants(system_ptxas)
    label_width = max(len(label) for label, _, _ in rows)
    arg_texts = [" ".join(map(str, args)) for _, args, _ in rows]
    arg_width = max(len(args_header), *map(len, arg_texts))
    env_texts = [" ".join(f"{key}={value}" for key, value in env.items()) for _, _, env in rows]
    env_width = max(len("env"), *map(len, env_texts))
    print(f"{'variant':{label_width}s} | {args_header:{arg_width}s} | {'env':{env_width}s} | result", flush=True)
    for (label, args, env), arg_text, env_text in zip(rows, arg_texts, env_texts):
        result = run_in_subprocess(args, env, script)
        print(f"{label:{label_width}s} | {arg_text:{arg_width}s} | {env_text:{env_width}s} | {result}", flush=True)


def main() -> None:
    run_variant_table(variants)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        run_one_variant(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7]))
    else:
        main()
