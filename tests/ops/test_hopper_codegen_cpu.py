"""The scalar parts of the Hopper kernels' generated CUDA, run on the CPU: a snippet of TileLang's output (index
arithmetic, loops, shared-memory reads and writes; no TMA, no wgmma) is cut from the kernel source, wrapped in a C++
function with ``threadIdx`` / ``blockIdx`` as arguments and the shared buffers as arrays, compiled with the host's
C++ compiler and called through ctypes for every thread or program, and its results compared with what the Python
side means. What the GPU would otherwise be the first to check: that the code TileLang generated for a change
computes what the change says (its indices, its layouts), before a device call is spent on it.

Needs TileLang and nvcc (the kernels are compiled for sm_90a, as in test_hopper_fwd.py) and g++; skipped
otherwise."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from linattn.ops.hopper import chunk_fwd as hopper

pytestmark = pytest.mark.skipif(not hopper.tilelang_available() or shutil.which("nvcc") is None
                                or shutil.which("g++") is None, reason="needs TileLang, nvcc and g++")

PRELUDE = """
#include <cstdint>
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline float2 make_float2(float a, float b) { return {a, b}; }
"""


def build(source: str, tmp_path, name: str) -> ctypes.CDLL:
    """``source`` (after :data:`PRELUDE`) as a shared library."""
    cpp, lib = tmp_path / f"{name}.cpp", tmp_path / f"{name}.so"
    cpp.write_text(PRELUDE + source)
    done = subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-o", str(lib), str(cpp)],
                          capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:] + "\n" + source[:3000]
    return ctypes.CDLL(str(lib))


def block_from(src: str, start: str) -> str:
    """The statement that begins at ``start``'s first occurrence, up to the end of the brace-balanced block that
    opens at its first ``{`` (an ``if (…) { … }`` with its condition)."""
    s = src.index(start)
    i = src.index("{", s)
    depth = 0
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            return src[s:j + 1]
    raise AssertionError(f"unbalanced block after {start!r}")


def shared_view(shmem: np.ndarray, offsets: dict, name: str, shape) -> np.ndarray:
    """The fp32 buffer ``name`` of the kernel's shared memory (``offsets``: its byte offsets in the source) as an
    array of ``shape`` over the bytes ``shmem``."""
    start = int(offsets[name])
    return shmem[start:start + 4 * int(np.prod(shape))].view(np.float32).reshape(shape)


def ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def test_the_planned_warm_walks_prologue_finds_the_twins_warm_ups(tmp_path):
    """The warm walk with ``warm_planned``: its consumers' prologue (the loop over the chunk bounds before the
    segment) gives each program the first chunk and the chunk count that ``map_bound.warm_from_bound_ref`` says —
    one chunk of warm-up, a few, or the whole prefix — for every (sequence, segment, head)."""
    from linattn.ops.hopper.map_bound import warm_from_bound_ref
    src = hopper.compiled_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, target="sm_90a", warm=True,
                                 warm_planned=True).get_kernel_source()
    consumer = src[src.index("tl::warpgroup_reg_alloc<240>();"):]
    body = consumer[consumer.index("wv = 0;"):consumer.index(";", consumer.index("int chunks")) + 1]
    body = re.sub(r"\bint (c0\w*|chunks\w*) = ", r"*\1_out = ", body)
    body = re.sub(r"\*(c0|chunks)\w*_out", r"*\1_out", body)
    lib = build(f"""
extern "C" void prologue(int by, int T, int L, int LC, int BS, const float* ctl, int* c0_out, int* chunks_out) {{
  struct {{ int y; }} blockIdx = {{by}};
  int wv; float run;
  {body}
}}""", tmp_path, "prologue")
    B, S, HV, LC = 2, 4, 16, 8
    L = LC * 64
    rng = np.random.default_rng(0)
    # per head a chunk bound: strong (one chunk suffices), medium (three), weak (never: the whole prefix)
    kind = rng.integers(0, 3, size=(B, HV))
    base = np.choose(kind, [-40.0, -12.0, -0.2]).astype(np.float32)
    bound = (base[:, None, :, None] * rng.uniform(0.8, 1.2, size=(B, S, HV, LC))).astype(np.float32)
    bound = np.ascontiguousarray(bound.reshape(B * S, HV, LC))
    warm, from_start = warm_from_bound_ref(torch.from_numpy(bound), S, -30.0)
    c0, chunks = ctypes.c_int(), ctypes.c_int()
    for by in range(B * S * HV):
        lib.prologue(by, S * L, L, LC, B * S, ptr(bound), ctypes.byref(c0), ctypes.byref(chunks))
        s, hv = (by // HV) % S, by % HV
        w = int(warm[by // HV, hv])
        assert (c0.value, chunks.value) == (s * LC - w, LC + w), (by, s, hv, kind[by // HV // S, hv])
    first = torch.arange(B * S)[:, None] % S > 0          # the segments that can warm up at all
    assert (warm == 1).any() and ((warm >= 2) & (warm <= 4) & ~from_start).any() and (from_start & first).any()


MMA_EMULATION = r"""
#include <barrier>
#include <cstring>
#include <thread>
#include <vector>
// tl::mma_sync (m16n8k8, tf32 operands, fp32 accumulators) and the 64-thread named barrier, emulated with one
// std::thread per lane: each lane posts its fragments, the warp waits, each lane computes its own C from every
// lane's A and B by the PTX fragment layouts, and the warp waits again. tf32: the low 13 bits ignored
namespace tl {
enum class DataType { kTensorFloat32, kFloat32 };
static std::barrier<>* warp_barrier[2];
static std::barrier<>* block_barrier;
static unsigned A_[2][32][4], B_[2][32][2];
thread_local int lane_, warp_;
static float tf32(unsigned u) { u &= 0xffffe000u; float f; std::memcpy(&f, &u, 4); return f; }
template <DataType, DataType, DataType, int, int, int, bool, bool>
void mma_sync(float* c, const unsigned* a, const unsigned* b) {
  std::memcpy(A_[warp_][lane_], a, 16); std::memcpy(B_[warp_][lane_], b, 8);
  warp_barrier[warp_]->arrive_and_wait();
  for (int e = 0; e < 4; ++e) {
    int row = lane_ / 4 + 8 * (e / 2), col = 2 * (lane_ % 4) + e % 2;
    double acc = c[e];
    for (int k = 0; k < 8; ++k) {   // A(row, k): lane 4·(row % 8) + k % 4, register (k / 4)·2 + row / 8
      float av = tf32(A_[warp_][4 * (row % 8) + k % 4][(k / 4) * 2 + row / 8]);
      float bv = tf32(B_[warp_][4 * col + k % 4][k / 4]);   // B(k, col): lane 4·col + k % 4, register k / 4
      acc += (double)av * bv;
    }
    c[e] = (float)acc;
  }
  warp_barrier[warp_]->arrive_and_wait();
}
inline void __sync_thread_partial(int, int) { block_barrier->arrive_and_wait(); }
}
"""


def test_the_mma_step_4_computes_the_blocks_below_the_diagonal(tmp_path):
    """The pre-pass's step 4 (one warp per half, m16n8k8 tf32 mma.sync): from A_10 / A_32 stored
    untransposed and T_00, T_11 / T_22, T_33 in T_lo / T_hi it writes Y1 = A_10 T_00 and T_10 = −T_11 Y1 (and the
    second half's). The generated CUDA runs on the CPU with the mma emulated (``MMA_EMULATION``: the PTX fragment
    layouts, tf32 truncation), one thread per lane; the results equal float64 products of the tf32-truncated
    operands, so every fragment index is the one the layouts need. T_hi's rows are 36 words apart, T_lo's 40."""
    from linattn.ops.hopper import prepass
    D = prepass.D
    src = prepass.compiled_kernel(16, 16, 128, "float32", target="sm_90a").get_kernel_source()
    first = block_from(src, "if (((int)threadIdx.x) < 64) {\n    #pragma unroll\n    for (int e = 0;")
    rest = src[src.index(first) + len(first):]
    assert rest.lstrip().startswith("__syncthreads();")
    second = block_from(rest, "if (((int)threadIdx.x) < 64)")
    assert first.count("tl::mma_sync<") == second.count("tl::mma_sync<") == 1   # in 2 × 2 (k-step, n-tile) loops
    offsets = dict(re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", src))
    decls = "".join(f"  char* {n} = shmem + {offsets[n]};\n" for n in ("Ao", "Tq", "Y1"))

    def body(code):
        return f"""{{
  tl::lane_ = tid % 32; tl::warp_ = tid / 32;
  struct {{ int x; }} threadIdx = {{tid}};
{decls}  float af[4]; float bf[2]; float cf[8];
  {code}
}}"""
    lib = build(MMA_EMULATION + f"""
static void phase1(int tid, char* shmem) {body(first)}
static void phase2(int tid, char* shmem) {body(second)}
extern "C" void step4(char* shmem) {{
  std::barrier<> w0(32), w1(32), all(64);
  tl::warp_barrier[0] = &w0; tl::warp_barrier[1] = &w1; tl::block_barrier = &all;
  for (auto phase : {{phase1, phase2}}) {{
    std::vector<std::thread> lanes;
    for (int tid = 0; tid < 64; ++tid) lanes.emplace_back(phase, tid, shmem);
    for (auto& lane : lanes) lane.join();
  }}
}}""", tmp_path, "step4_mma")
    rng = np.random.default_rng(2)
    shmem = np.zeros(64 * 1024, dtype=np.uint8)

    def view(name, shape):
        return shared_view(shmem, offsets, name, shape)

    def tf32(a):
        return (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(
            np.float32).astype(np.float64)
    Ao, Y1 = view("Ao", (2, D, D + 4)), view("Y1", (2, D, D + 8))
    flat = view("Tq", (2 * 2 * D * (2 * D + 8),))        # T_lo's rows 40 words apart, T_hi's 36
    strides = [2 * D + 8, 2 * D + 4]
    Tq = [np.lib.stride_tricks.as_strided(flat[h * 2 * D * (2 * D + 8):], (2 * D, 2 * D), (4 * strides[h], 4))
          for h in range(2)]
    tri = lambda: np.tril(rng.standard_normal((D, D)), -1).astype(np.float32) + np.eye(D, dtype=np.float32)  # noqa
    A10 = [rng.standard_normal((D, D)).astype(np.float32) for _ in range(2)]
    Tdd = [tri() for _ in range(4)]
    for h in range(2):
        Ao[h, :, :D] = A10[h]                           # step 2's untransposed store: Ao[h, i, j] = A_10[i, j]
        Tq[h][:D, :D] = Tdd[2 * h]
        Tq[h][D:, D:2 * D] = Tdd[2 * h + 1]
    lib.step4(ptr(shmem))
    for h in range(2):
        y1 = tf32(A10[h]) @ tf32(Tdd[2 * h])
        np.testing.assert_allclose(Y1[h, :, :D], y1, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(Tq[h][D:, :D], -(tf32(Tdd[2 * h + 1]) @ tf32(Y1[h, :, :D])), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(Tq[h][D:, D:2 * D], Tdd[2 * h + 1])          # T_11 read, not written


def test_the_source_snapshot_tool_builds_the_default_launches_kernels():
    """``tests/ops/hopper_sources.py`` (the CPU proof that a refactor leaves the default kernels' CUDA byte for byte
    as it was) names every default configuration (the forward's 73, the backward recompute's 40) and builds one
    walk's, one pre-pass's and one states walk's source through the launchers, with the uniform-warpgroup rewrite
    where the walk applies it; the launchers' no-op launch leaves nothing behind."""
    from . import hopper_sources
    names = [name for name, _ in hopper_sources.configurations()]
    assert len(names) == len(set(names)) and len(names) == 113
    assert {"walk_H16_HV16_K128_V128_BV128_beta-float32_planned-warm_lean_h0",
            "states_H2_HV8_K128_V128_BV128_warm_lean", "states_H16_HV16_K128_V128_BV128_maps_lean",
            "states_H16_HV16_K128_V128_BV128_maps_lean_m-only",
            "prepass_H2_HV8_K128_beta-float32_segments2", "states_H16_HV16_K128_V128_BV128_h0",
            "prepass_H16_HV16_K128_beta-bfloat16_no-beta-in-T"} <= set(names)
    built = dict(hopper_sources.sources("walk_H16_HV16_K64_V64_BV64_beta-float32_affine_skip-m_lean,"
                                        "prepass_H16_HV16_K64_beta-float32_segments1,"
                                        "states_H16_HV16_K64_V64_BV64_h0"))
    walk, pre, states = built.values()
    assert "gdn_chunk_fwd" in walk and "linattn_warpgroup" in walk and "gdn_prepass" in pre
    assert "linattn_warpgroup" not in pre
    assert "linattn_warpgroup" in states and "tma_store(o_desc" in states and "q_desc" not in states
