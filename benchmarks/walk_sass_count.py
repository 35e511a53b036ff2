"""SASS instructions per chunk in the Hopper walk's consumer loop, for the kernel's instruction-count switches
(``chunk_fwd.UNIFORM_WARPGROUP``, ``DEFERRED_DECAY``, ``FOLD_P_DECAY``): no GPU needed, TileLang and a CUDA
toolkit's nvcc are (cuobjdump: Triton's, as ``sm90.py`` finds it).

    PATH=/usr/local/cuda/bin:$PATH python benchmarks/walk_sass_count.py [--H 16 --K 128 --V 128 --BV 128]

Each variant of the default launch (``forward.LAUNCH`` with bf16 A_inv, β folded into it, async o and A_inv X) is
compiled for sm_90a by TileLang, its generated CUDA compiled again to a cubin with nvcc (as TileLang does) and
disassembled; the consumer loop is the longest backward branch of the kernel, and its instructions are counted by
opcode. "lazy" variants compile the renormalising branch out (a limit no chunk reaches): the count of a chunk that
does not renormalise. Session 23 (ptxas 13.0): plain 1027, uniform 891, deferred (lazy) 963, deferred + fold
(lazy) 840, all three (lazy) 722.
"""
import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from sm90 import CUOBJDUMP  # this folder is on sys.path

from linattn.ops.hopper import chunk_fwd
from linattn.ops.hopper.cubin import compile_sm90a

LAUNCH = dict(BV=128, threads=256, num_stages=2, async_dots=True, tma_o=True, stsm=True, a_dtype="bfloat16",
              async_o=True, async_ax=True, beta_in_a=True)
VARIANTS = {                                          # name: (compiled_kernel's switches, renormalising branch out)
    "plain": ({}, False),
    "uniform warpgroup": (dict(uniform_warpgroup=True), False),
    "deferred decay": (dict(deferred_decay=True), False),
    "deferred decay, lazy": (dict(deferred_decay=True), True),
    "deferred + fold, lazy": (dict(deferred_decay=True, fold_p_decay=True), True),
    "all three, lazy": (dict(deferred_decay=True, fold_p_decay=True, uniform_warpgroup=True), True),
}
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,5})\*/\s+(.*?);")


def sass(source: str) -> list[tuple[int, str]]:
    """(address, instruction) of the source's kernel, compiled for sm_90a with TileLang's headers."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            cubin, _ = compile_sm90a(source, Path(tmp))
        except FileNotFoundError as missing:      # nvcc not on PATH: the script's one requirement besides TileLang
            sys.exit(str(missing))
        text = subprocess.run([CUOBJDUMP, "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, text.splitlines()) if m]


def consumer_loop(code: list[tuple[int, str]]) -> list[str]:
    """The instructions between the longest conditional backward branch's target and the branch itself (the
    unconditional ones jump back from the out-of-line retries of barrier waits)."""
    best = (0, 0)
    for address, text in code:
        branch = re.search(r"^@!?U?P\d+ BRA (0x[0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            best = max(best, (start, address), key=lambda r: r[1] - r[0])
    return [text for address, text in code if best[0] <= address <= best[1]]


def opcode(text: str) -> str:
    words = text.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--BV", type=int, default=128, help="the V tile (64: the launch of rows 6's shape)")
    args = ap.parse_args()
    limit = chunk_fwd.DEFERRED_DECAY_LIMIT
    rows = []
    for name, (switches, lazy) in VARIANTS.items():
        chunk_fwd.DEFERRED_DECAY_LIMIT = float("inf") if lazy else limit
        chunk_fwd.compiled_kernel.cache_clear()
        kernel = chunk_fwd.compiled_kernel(args.H, args.H, args.K, args.V, scale=args.K ** -0.5, target="sm_90a",
                                           **dict(LAUNCH, BV=args.BV), **switches)
        loop = consumer_loop(sass(kernel.get_kernel_source()))
        counts = collections.Counter(map(opcode, loop))
        rows.append((name, len(loop), counts))
    chunk_fwd.DEFERRED_DECAY_LIMIT = limit
    print("| variant | instructions per chunk | FMUL | F2FP | R2UR | uniform (U*) | HGMMA |")
    print("|---|---|---|---|---|---|---|")
    for name, n, c in rows:
        uniform = sum(v for k, v in c.items() if k.startswith("U"))
        print(f"| {name} | {n} | {c['FMUL']} | {c['F2FP']} | {c['R2UR']} | {uniform} | {c['HGMMA']} |")


if __name__ == "__main__":
    main()
