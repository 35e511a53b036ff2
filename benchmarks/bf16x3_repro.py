"""Stand-alone reproducer of the bf16x3 fault of the sequential forward walk, bisected one variant per process.

What it checks: on the H200 (Triton 3.6) ``linattn/ops/common/fused_fwd.py::fused_fwd_kernel`` dies with an illegal
memory access as soon as one of its dots uses the split-bf16 "bf16x3" of ``linattn/ops/common/dot.py``. This file
rebuilds the walk's skeleton without the package: a ``while`` loop over chunks that carries an fp32 state S
[BK, BV] in registers and does the walk's five dots per chunk at BT = 64, BK = 128,

    V = U − W S,   P = causal(Q Kᵀ),   O = Q S + P V,   S ← S + Kᵀ V,

with the split done as dot.py does it (no decay and no scale: they do not touch the dots). Each variant changes one
thing against the "dot.py chained acc" row:

- tf32 control: no split at all (must pass);
- no loop: one chunk, no ``while``;
- no acc arg: the hi/lo products summed as separate dots instead of chained through tl.dot's accumulator;
- native bf16x3: Triton's own ``input_precision="bf16x3"`` on fp32 operands instead of the split by hand;
- W bf16 (smem A): W loaded as bf16, so W S takes its A operand from shared memory, not from registers;
- 8 warps: two warp groups share N = 16 (wgmma m64n8k16);
- BV = 32 / 64: the bf16 B operands get a 64 / 128-byte swizzle instead of 32;
- MMAv3 off (``DISABLE_MMA_V3=1``): mma.sync instead of wgmma;
- ptxas -O0 (``DISABLE_PTXAS_OPT=1``), the system ptxas, and ``PTXAS_NEW`` (a newer ptxas carried to the device).

Run it on the GPU from the repository root (torch and triton only, no linattn import)::

    python3 benchmarks/bf16x3_repro.py                                  # every variant, one process each
    PTXAS_NEW=$PWD/.whl/ptxas python3 benchmarks/bf16x3_repro.py        # plus a row with that ptxas
    python3 benchmarks/bf16x3_repro.py 0 1 0 4 16                       # one variant here: MODE LOOP W_BF16 WARPS BV

Output: the Triton and ptxas versions, then one row per variant, printed as it finishes: ``OK`` with the relative
L2 difference of O and S from the tf32 control on the same data (tf32's own rounding, 2^-11, sets its size; O(1)
would mean wrong numbers without a fault), ``FAIL`` with the child's last error line ("illegal memory access" is
the fault), or ``TIMEOUT``. How to read it:

- only the split rows fail and "MMAv3 off" passes: the fault is on the wgmma path;
- a ptxas row passes where the bundled ptxas fails: an assembler miscompile (see triton-lang/triton#11781);
- BV = 32 / 64 pass while BV = 16 fails: the 32-byte-swizzled N = 16 bf16 B operand;
- nothing fails here while ``bf16x3_walk_ab.py`` fails: the trigger needs the real walk's register pressure
  (255 registers there, about 211 here), which points to ptxas again.
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl
from bf16x3_walk_ab import run_variant_table  # noqa: E402  (same folder, on sys.path)

# how product() multiplies; globals read inside a jitted function must be tl.constexpr
MODE_CHAINED = tl.constexpr(0)  # dot.py's split: the hi/lo products chained through tl.dot's accumulator
MODE_SUMMED = tl.constexpr(1)  # the same products as separate dots, added afterwards
MODE_NATIVE = tl.constexpr(2)  # Triton's input_precision="bf16x3" on fp32 operands
MODE_TF32 = tl.constexpr(3)  # plain tf32: the control, no bf16 operand anywhere

# grid: GROUPS independent walks of CHUNKS chunks each (132 = the H200's SM count, so every SM runs one)
GROUPS = 132
CHUNKS = 8
BT = 64
BK = 128
NV = 128


@triton.jit
def split_bf16(x):
    """(hi, lo) bf16 halves of fp32 x, as dot.py's ``_split_bf16``."""
    hi = x.to(tl.bfloat16)
    lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def product(a, b, MODE: tl.constexpr):
    """a @ b for an fp32 b and an fp32 or bf16 a, multiplied the way MODE says."""
    if MODE == MODE_NATIVE:
        result = tl.dot(a.to(tl.float32), b, input_precision="bf16x3")
    elif MODE == MODE_TF32:
        result = tl.dot(a.to(tl.float32), b, input_precision="tf32")
    else:
        b_hi, b_lo = split_bf16(b)
        zero = tl.zeros([a.shape[0], b.shape[1]], tl.float32)
        if a.dtype == tl.bfloat16:
            # a bf16 operand from a load is exact, so it is not split: 2 MMAs, A read from shared memory
            if MODE == MODE_CHAINED:
                result = tl.dot(a, b_hi, tl.dot(a, b_lo, zero))
            else:
                result = tl.dot(a, b_lo) + tl.dot(a, b_hi)
        else:
            # an fp32 operand is split in registers: 3 MMAs whose A comes from registers
            a_hi, a_lo = split_bf16(a)
            if MODE == MODE_CHAINED:
                result = tl.dot(a_hi, b_hi, tl.dot(a_hi, b_lo, tl.dot(a_lo, b_hi, zero)))
            else:
                result = tl.dot(a_lo, b_hi) + tl.dot(a_hi, b_lo) + tl.dot(a_hi, b_hi)
    return result


@triton.jit
def chunk_step(w, q, k, u, o, S, rows, cols_k, cols_v, NV, BK: tl.constexpr, MODE: tl.constexpr):
    """One chunk of the walk (rows: its BT rows): store its O block and return the state leaving it."""
    U = tl.load(u + rows[:, None] * NV + cols_v[None, :])
    W = tl.load(w + rows[:, None] * BK + cols_k[None, :])
    V = U - product(W, S, MODE)
    Q = tl.load(q + rows[:, None] * BK + cols_k[None, :])
    Kt = tl.load(k + rows[None, :] * BK + cols_k[:, None])
    # P is an fp32 MMA result that becomes the split A operand of P V: the walk's MMA → bf16 → MMA chain
    P = tl.where(rows[:, None] >= rows[None, :], tl.dot(Q, Kt), 0.0)
    O = product(Q, S, MODE) + product(P, V, MODE)
    tl.store(o + rows[:, None] * NV + cols_v[None, :], O)
    return S + product(Kt, V, MODE)


@triton.jit
def walk_kernel(w, q, k, u, o, s, NT, NV, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, MODE: tl.constexpr,
                LOOP: tl.constexpr):
    """Program (i_v, group): walk the group's NT chunks over columns [i_v·BV, (i_v + 1)·BV) of the state s."""
    rows = tl.program_id(1) * NT * BT + tl.arange(0, BT)
    cols_k = tl.arange(0, BK)
    cols_v = tl.program_id(0) * BV + tl.arange(0, BV)
    state_ptrs = s + tl.program_id(1) * BK * NV + cols_k[:, None] * NV + cols_v[None, :]
    S = tl.load(state_ptrs)
    if LOOP:
        # a sequential while loop with the fp32 state carried in registers, as in fused_fwd_kernel
        i = 0
        while i < NT:
            S = chunk_step(w, q, k, u, o, S, rows + i * BT, cols_k, cols_v, NV, BK, MODE)
            i += 1
    else:
        S = chunk_step(w, q, k, u, o, S, rows, cols_k, cols_v, NV, BK, MODE)
    tl.store(state_ptrs, S)


def random_tensor(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * 0.1).to(dtype)


def relative_difference(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x - ref).norm() / ref.norm()).item()


def run_one_variant(mode: int, loop: int, w_bf16: int, num_warps: int, bv: int) -> None:
    """Child process: run the variant, then the tf32 control on the same data, and print their difference."""
    torch.manual_seed(0)
    n_rows = GROUPS * CHUNKS * BT
    w = random_tensor(n_rows, BK, dtype=torch.bfloat16 if w_bf16 else torch.float32)
    u = random_tensor(n_rows, NV)
    s0 = random_tensor(GROUPS, BK, NV)
    q = random_tensor(n_rows, BK, dtype=torch.bfloat16)
    k = random_tensor(n_rows, BK, dtype=torch.bfloat16)
    results = []
    for m in (mode, MODE_TF32.value):
        o = torch.empty_like(u)
        s = s0.clone()
        walk_kernel[(NV // bv, GROUPS)](w, q, k, u, o, s, CHUNKS, NV, BT, BK, bv, m, loop, num_warps=num_warps)
        # synchronize here so that a fault is reported by this launch, not by a later call
        torch.cuda.synchronize()
        results.append((o, s))
    (o, s), (o_ref, s_ref) = results
    print(f"OK rel-diff vs tf32 o {relative_difference(o, o_ref):.1e} S {relative_difference(s, s_ref):.1e}")


def variants(system_ptxas: str | None) -> list[tuple[str, list[int], dict[str, str]]]:
    """(label, child arguments MODE LOOP W_BF16 WARPS BV, extra environment) of every row."""
    base = [MODE_CHAINED.value, 1, 0, 4, 16]
    rows = [
        ("tf32 control", [MODE_TF32.value, 1, 0, 4, 16], {}),
        ("dot.py chained acc", base, {}),
        ("  no loop", [MODE_CHAINED.value, 0, 0, 4, 16], {}),
        ("  no acc arg", [MODE_SUMMED.value, 1, 0, 4, 16], {}),
        ("  native bf16x3", [MODE_NATIVE.value, 1, 0, 4, 16], {}),
        ("  W bf16 (smem A)", [MODE_CHAINED.value, 1, 1, 4, 16], {}),
        ("  8 warps (N=8 wgmma)", [MODE_CHAINED.value, 1, 0, 8, 16], {}),
        ("  BV=32", [MODE_CHAINED.value, 1, 0, 4, 32], {}),
        ("  BV=64", [MODE_CHAINED.value, 1, 0, 4, 64], {}),
        # both knobs are in Triton's cache-invalidating set, so the child recompiles under them
        ("  MMAv3 off", base, {"DISABLE_MMA_V3": "1"}),
        ("  ptxas -O0", base, {"DISABLE_PTXAS_OPT": "1"}),
    ]
    if system_ptxas and os.path.exists(system_ptxas):
        rows.append(("  system ptxas", base, {"TRITON_PTXAS_PATH": system_ptxas}))
    if os.environ.get("PTXAS_NEW"):
        rows.append(("  PTXAS_NEW", base, {"TRITON_PTXAS_PATH": os.environ["PTXAS_NEW"]}))
    return rows


def main() -> None:
    run_variant_table(variants, __file__, "MODE LOOP W16 WARPS BV")

if __name__ == "__main__":
    if len(sys.argv) > 1:
        run_one_variant(*map(int, sys.argv[1:6]))
    else:
        main()
