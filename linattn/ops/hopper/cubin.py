"""A TileLang kernel's generated CUDA compiled for sm_90a without a GPU, with TileLang's headers, as TileLang itself
compiles it: what the tests' ptxas checks (spills, serialised wgmma) read. Needs TileLang (optional) and nvcc on PATH."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def tilelang_includes() -> list[Path]:
    """The include folders TileLang's generated CUDA needs (its templates and CUTLASS's)."""
    import tilelang
    root = Path(tilelang.__file__).parent
    return [root / "src", root / "src" / "cuda", root / "3rdparty" / "cutlass" / "include"]


def compile_sm90a(source: str, directory: Path, nvcc: str | None = None) -> tuple[Path, str]:
    """(the cubin, ptxas's verbose report and warnings) of ``source`` compiled in ``directory`` for sm_90a with
    TileLang's flags (``-O3 --use_fast_math``). Raises ``FileNotFoundError`` without nvcc, and
    ``subprocess.CalledProcessError`` (nvcc's output in it) where the source does not compile."""
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc not found: put a CUDA toolkit's bin on PATH")
    directory = Path(directory)
    cu, cubin = directory / "kernel.cu", directory / "kernel.cubin"
    cu.write_text(source)
    result = subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-std=c++17", "-O3", "--use_fast_math", "-w",
                             *[f"-I{p}" for p in tilelang_includes()], "-Xptxas", "-v", "-o", str(cubin), str(cu)],
                            capture_output=True, text=True, check=True)
    return cubin, result.stdout + result.stderr


def launch_shared_bytes(kernel) -> int:
    """The dynamic shared memory (bytes) a compiled TileLang kernel launches with: the last integer literal of the
    launch arguments in its host source (tvm_ffi's: grid, block, then the shared bytes)."""
    import re
    return int(re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\);", kernel.get_host_source())[-1])


def ptxas_summary(report: str) -> dict:
    """Registers, spill store and load bytes, and whether any wgmma is serialised (C7512), from ptxas's report."""
    import re
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    registers = re.search(r"Used (\d+) registers", report)
    return dict(registers=int(registers[1]) if registers else None, spill_stores=int(spills[1]) if spills else None,
                spill_loads=int(spills[2]) if spills else None, wgmma_serialised="C7512" in report)


def barriers_in_element_loops(source: str) -> list[int]:
    """Line numbers (1-based) of the warpgroup barriers (``__sync_thread_partial``, ``__syncthreads``) that a
    TileLang kernel's generated CUDA places inside an unrolled element loop: TileLang's sync pass puts one in each
    iteration where it cannot prove that a pass's shared-memory reads and writes are disjoint, which serialises the
    pass (a load, its math and its store per element, around a barrier)."""
    lines = source.splitlines()
    found, loops = [], []           # loops: the brace depth each open unrolled loop's body starts at
    depth = 0
    for number, line in enumerate(lines, 1):
        if ("__sync_thread_partial" in line or "__syncthreads" in line) and loops:
            found.append(number)
        unrolled = line.strip().startswith("for (") and number > 1 and lines[number - 2].strip() == "#pragma unroll"
        for char in line:
            if char == "{":
                depth += 1
                if unrolled:
                    loops.append(depth)
                    unrolled = False
            elif char == "}":
                if loops and loops[-1] == depth:
                    loops.pop()
                depth -= 1
    return found
