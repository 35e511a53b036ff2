"""The TileLang pre-pass of the Hopper forward (linattn/ops/hopper/prepass.py): its blocked solve's twin against a
dense solve, its twin's outputs (gc and β head-major per segment, A_inv) against the Triton pre-pass's, the forward
around both twins against the float64 recurrence, its input checks, and its compile for sm_90a where TileLang and
nvcc are installed (the kernel runs only on the GPU: benchmarks/hopper_fwd_check.py --prepass)."""
from __future__ import annotations

import functools
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.gated_delta import torch_chunk as tc
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import chunk_fwd as hopper
from linattn.ops.hopper import chunk_fwd_ref as twins
from linattn.ops.hopper import forward as hopper_fwd
from linattn.ops.hopper import prepass


def inputs(B, T, H, HV, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    return dict(q=F.normalize(r(B, T, H, K), dim=-1), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, HV, V),
                g=F.logsigmoid(r(B, T, HV)) / 64, beta=torch.rand(B, T, HV, generator=gen, dtype=torch.float64),
                initial_state=r(B, HV, K, V) * 0.1)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def strictly_lower(B, K, seed, decay=True):
    """A = strictly_lower(β K Kᵀ ⊙ D) of ``B`` random 64-token chunks (unit keys, β in [0, 1)), float64."""
    x = inputs(1, 64 * B, 1, 1, K, 1, seed=seed)
    kc = tc.to_chunks(x["k"], 64)
    gc = tc.chunk_local_cumsum_ref(tc.to_chunks(x["g"] * (32 if decay else 0), 64))
    return (tc.to_chunks(x["beta"], 64)[..., None] * (kc @ kc.transpose(-1, -2))
            * tc.decay_matrix(gc, strict=True))


@pytest.mark.parametrize("case", ["gated", "no_decay", "ones"])
def test_blocked_inverse_is_the_dense_inverse(case):
    """The kernel's solve (diagonal 16-blocks by column substitution, the blocks below them, the lower-left
    quadrant) in float64 equals the dense triangular solve; "ones" (every A_ij = 0.999 below the diagonal: powers of
    A reach 1e17, the inverse stays O(1)) is where a series would cancel."""
    a = {"gated": lambda: strictly_lower(4, 32, seed=1),
         "no_decay": lambda: strictly_lower(4, 32, seed=2, decay=False),
         "ones": lambda: torch.full((64, 64), 0.999, dtype=torch.float64).tril(-1)}[case]()
    eye = torch.eye(64, dtype=torch.float64)
    dense = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    blocked = prepass.blocked_inverse_ref(a)
    assert rel(blocked, dense) < 1e-12
    assert torch.equal(blocked.triu(1), torch.zeros_like(blocked))


@pytest.mark.interpreter
@pytest.mark.parametrize("T,S", [(200, 1), (256, 4)])
def test_twin_outputs_are_the_triton_prepass_outputs_per_segment(T, S):
    """What the fused kernel reads: gc and β head-major per segment (Tp-padded with zeros) and A_inv — the twin of
    the TileLang pre-pass against forward.run_prepass on the Triton pre-pass (interpreter, fp32 inputs)."""
    x = {n: t.float() for n, t in inputs(2, T, 1, 2, 16, 16).items()}
    gc_tr, beta_tr, a_inv, no_bound = hopper_fwd.run_prepass(x["k"], x["v"], x["g"], x["beta"], S, "triton",
                                                             torch.float32)
    gc_hm, beta_hm, a_inv_tl, bound = prepass.prepass_hopper_ref(x["k"], x["g"], x["beta"], S,
                                                                 a_inv_dtype=torch.float32, beta_in_a_inv=False)
    assert no_bound is None and bound.shape == (2 * S, 2, -(-T // S // 64)) and bound.dtype == torch.float32
    assert gc_hm.shape == (2 * S, 2, hopper.padded_length(T // S)) and beta_hm.dtype == x["beta"].dtype
    assert torch.allclose(gc_hm, gc_tr, atol=1e-6, rtol=0)
    assert torch.equal(beta_hm, beta_tr)
    assert a_inv_tl.shape == a_inv.shape and rel(a_inv_tl, a_inv) < 1e-5
    assert prepass.prepass_hopper_ref(x["k"], x["g"], x["beta"], S)[2].dtype == torch.bfloat16   # the kernel's
    # β folded into A_inv's columns: A_inv diag(β), column j of a chunk's A_inv times the chunk's β_j
    a_beta = prepass.prepass_hopper_ref(x["k"], x["g"], x["beta"], S, a_inv_dtype=torch.float32,
                                        beta_in_a_inv=True)[2]
    by_chunk = tc.to_chunks(a_inv_tl, 64) * tc.to_chunks(x["beta"], 64)[..., None, :]
    assert torch.allclose(a_beta, tc.from_chunks(by_chunk, T), rtol=1e-6, atol=0)
    assert not torch.allclose(a_beta, a_inv_tl, rtol=1e-2, atol=0)


@pytest.mark.interpreter
@pytest.mark.parametrize("beta_in_a_inv", [False, True], ids=["a_inv", "a_inv_beta"])
@pytest.mark.parametrize("T,segments", [(200, None), (256, 4)])
def test_forward_on_the_tilelang_prepass_twin_equals_the_triton_prepass(monkeypatch, T, segments, beta_in_a_inv):
    """forward_hopper(prepass="tilelang") around the twins of both kernels (fp32 inputs, the pre-pass twin's A_inv
    left in fp32 so that only the layout is tested; weak gates so that the segments' entering states matter): o and
    the final state equal the float64 recurrence and the forward on the Triton pre-pass — also with β folded into
    A_inv (prepass.BETA_IN_A_INV: the kernel's X then has no β), which the Triton pre-pass never does."""
    monkeypatch.setattr(prepass, "BETA_IN_A_INV", beta_in_a_inv)
    monkeypatch.setattr(hopper_fwd, "chunk_fwd_hopper_hm", twins.chunk_fwd_hopper_hm_ref)
    monkeypatch.setattr(hopper_fwd, "prepass_hopper",
                        functools.partial(prepass.prepass_hopper_ref, a_inv_dtype=torch.float32))
    x = inputs(2, T, 1, 2, 16, 16)
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")] + [0.25, x["initial_state"].float()]
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    o, ht = hopper_fwd.forward_hopper(*args, a_inv_dtype=torch.bfloat16, segments=segments, BV=16,
                                      prepass="tilelang")
    o_tr, ht_tr = hopper_fwd.forward_hopper(*args, a_inv_dtype=torch.float32, segments=segments, BV=16,
                                            prepass="triton")
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    assert rel(o, o_tr) < 1e-5 and rel(ht, ht_tr) < 1e-5


def test_inputs_the_prepass_does_not_take_say_why():
    x = {n: t.float() for n, t in inputs(1, 128, 1, 2, 16, 16).items()}
    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [0.25, None]
    with pytest.raises(ValueError, match="bf16 A_inv"):
        hopper_fwd.forward_hopper(*args, a_inv_dtype=torch.float32, prepass="tilelang")
    with pytest.raises(ValueError, match="prepass must be one of"):
        hopper_fwd.forward_hopper(*args, prepass="cuda")
    with pytest.raises(TypeError, match="bf16 keys"):
        prepass.prepass_hopper(x["k"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="multiple of 256"):
        prepass.prepass_hopper(x["k"].bfloat16(), x["g"], x["beta"], segments=4)
    with pytest.raises(ValueError, match=r"\[B, T, HV\]"):
        prepass.prepass_hopper_ref(x["k"], x["g"][:, :64], x["beta"])


@pytest.mark.skipif(not hopper.tilelang_available() or shutil.which("nvcc") is None,
                    reason="TileLang (optional) and nvcc compile the Hopper pre-pass")
def test_prepass_compiles_for_sm90a():
    """K Kᵀ as one bf16 wgmma, the quadrant's two dots at tf32 on mma.sync, A_inv written by TMA, and the column
    solve as straight-line FMAs on shared memory (no shuffles in it)."""
    src = prepass.compiled_kernel(16, 16, 128, "float32", target="sm_90a").get_kernel_source()
    assert src.count("wgmma_ss<") == 1 and "tma_store" in src
    assert src.count("mma_sync<tl::DataType::kTensorFloat32") == 4
    solve = src[src.index("if (((int)threadIdx.x) < 64) {\n    #pragma unroll"):]
    solve = solve[:solve.index("__syncthreads()")]
    assert "shfl" not in solve and "x[i_4] = (x[i_4] - " in solve
    # BETA_IN_A_INV's kernel: A_inv's three written quadrants times β, read per column pair in the store loop
    beta = prepass.compiled_kernel(16, 16, 128, "float32", target="sm_90a", beta_in_a=True).get_kernel_source()
    assert beta.count("(float2*)(((float*)bs)") == 3 and "(float2*)(((float*)bs)" not in src
    # the map bound: the two warps the solve leaves idle, one token each, from the diagonal blocks' diagonals
    # (Ad[17 i] = β_i ‖k_i‖²), summed by warp shuffles; after the barrier one thread adds the halves and writes it
    terms = src[src.index("} else {\n    bl[0] = tl::warp_reduce_sum("):]
    assert "((float*)Ad)[((((int)threadIdx.x) * 17) - 1088)]" in terms.split("\n")[1]
    written = terms[terms.index("__syncthreads();"):]
    assert written.index("if (((int)threadIdx.x) == 64) {") < written.index("bound[") < \
        written.index("__syncthreads", 1)
    # A's blocks stored branch-free: each block under its own predicate, the exponent −∞ above the diagonal
    blocks = src[src.index("float a = "):src.index("__syncthreads", src.index("float a = "))]
    assert "exp2f(" in blocks and ": -CUDART_INF_F)" in blocks and "else" not in blocks
    # MIN_BLOCKS_PER_SM: the registers fitted for that many resident programs; 1 leaves ptxas its own count
    assert "__launch_bounds__(128, 1)" in src
    fitted = prepass.compiled_kernel(16, 16, 128, "float32", target="sm_90a", min_blocks=8).get_kernel_source()
    assert "__launch_bounds__(128, 8)" in fitted
    # TMA_KEYS: the key tile by two TMA boxes (64 columns each) behind one mbarrier, not per-thread loads
    assert "tma_load(k_desc" not in src
    tma = prepass.compiled_kernel(16, 16, 128, "float32", target="sm_90a", tma_keys=True).get_kernel_source()
    assert tma.count("tma_load(k_desc") == 1 and "arrive_and_expect_tx(16384)" in tma
    # A_ROW_PAD: the 16-blocks' rows 20 words apart (17 padded rows per diagonal block: 340), the diagonal 21 apart
    padded = prepass.compiled_kernel(16, 16, 128, "float32", target="sm_90a", a_row_pad=4).get_kernel_source()
    assert "(((int)threadIdx.x) * 17) - 1088)]" not in padded
    assert "* 340) + ((((int)threadIdx.x) & 15) * 21)) - 1360)]" in padded
    assert padded.count("__syncthreads()") == src.count("__syncthreads()")     # a layout only: the same barriers
    # T_ROW_PAD: T_lo, T_hi and Y2 in linear layouts, rows 40 words apart: step 5's B operands read at k·40 + n (no
    # swizzle), and one barrier fewer (step 4's store of T_10 next to its reads of T_11 is provably disjoint now)
    t_pad = prepass.compiled_kernel(16, 16, 128, "float32", target="sm_90a", t_row_pad=8).get_kernel_source()
    b_loads = re.findall(r"B_local(?:_1)?\[j_\d\] = \(\(float\*\)(Tq|Y2)\)\[([^;]*)\];", t_pad)
    assert len(b_loads) == 2 and all("* 40)" in index and "& 1) * 16)" not in index for _, index in b_loads)
    assert t_pad.count("__syncthreads()") == src.count("__syncthreads()") - 1
    # STEP4_BLOCKED: step 4 on threads 0–63 only, 2 × 4 accumulators each; per m one 8-byte read of A's column (A_10
    # / A_32 stored transposed, T_11 / T_33 transposed into Ad[1], Ad[3] from the solving threads' registers) and
    # one 16-byte read of T's row (of Y1 in the second product); the other two warps wait at the barrier between
    # the products, and no barrier sits inside the branch (only 64 threads would reach it)
    kw = dict(target="sm_90a", beta_in_a=True, min_blocks=8, tma_keys=True, a_row_pad=4, t_row_pad=8)
    plain = prepass.compiled_kernel(16, 16, 128, "float32", **kw).get_kernel_source()
    blocked = prepass.compiled_kernel(16, 16, 128, "float32", step4_blocked=True, **kw).get_kernel_source()
    step4 = blocked[blocked.index("if (((int)threadIdx.x) < 64) {", blocked.index("bound[")):]
    first, second = step4.split("__syncthreads();", 1)
    second = second[:second.index("}\n  }")]
    assert "*(float2*)(((float*)Ao)" in first and "*(float4*)(((float*)Tq)" in first and "(float*)Y1)" in first
    assert "*(float2*)(((float*)Ad)" in second and "*(float4*)(((float*)Y1)" in second and "(float*)Tq)" in second
    assert "__syncthreads" not in second and "*(float4*)(((float*)Ad)" in first   # T_11ᵀ written before the barrier
    assert blocked.count("__syncthreads()") == plain.count("__syncthreads()")
    # A_BEFORE_STORES: step 2's elements computed in K Kᵀ's registers from registers alone (β_i, gc_i per row and gc_j
    # per column loaded once, after the dot), then stored to A's blocks in a loop of their own; the barrier before
    # those stores (A's blocks reuse the keys' shared memory) and no other
    split = prepass.compiled_kernel(16, 16, 128, "float32", step4_blocked=True, a_before_stores=True,
                                    **kw).get_kernel_source()
    elements = split[split.index("float Gcol[16];"):]
    elements = elements[elements.index("warpgroup_wait<0>()"):elements.index("float a = ")]
    loop = elements[elements.index("KK[i_3] = "):]
    assert "Gr[i_1] = ((float*)gcs)[" in elements
    assert "*(float2*)(Gcol + (i_2 * 2)) = *(float2*)(((float*)gcs)" in elements
    assert "((float*)" not in loop.split(";")[0] and "Gcol[" in loop and loop.count("__syncthreads()") == 1
    assert split.count("__syncthreads()") == blocked.count("__syncthreads()")
    # T_HI_ROW_PAD: step 5's second dot reads T_hi by ldmatrix at rows 36 words apart, its first T_lo one word per
    # lane at rows 40 apart; a layout only (the same barriers)
    t_hi = prepass.compiled_kernel(16, 16, 128, "float32", step4_blocked=True, a_before_stores=True, t_hi_row_pad=4,
                                   **kw).get_kernel_source()
    ldmatrix = re.findall(r"ptx_ldmatrix_x4\(\(&\(\(\(float\*\)(\w+)\)\[([^;]*)\]\)\)", t_hi)
    assert [(buf, "* 36)" in index, "+ 1280)" in index) for buf, index in ldmatrix] == [("Ahl", True, False),
                                                                                       ("Tq", True, True)]
    assert re.search(r"B_local\[j_1\] = \(\(float\*\)Tq\)\[[^;]*\* 40\)", t_hi)
    assert t_hi.count("__syncthreads()") == split.count("__syncthreads()")
    # STEP6_BETA: step 6's β per column from registers, loaded once (4 pairs a thread), not reloaded per store
    s6 = prepass.compiled_kernel(16, 16, 128, "float32", step4_blocked=True, a_before_stores=True, step6_beta=True,
                                 **kw).get_kernel_source()
    loads = re.findall(r"\*\(float2\*\)\((B[lh]) \+ \(i_\d+ \* 2\)\) = \*\(float2\*\)\(\(\(float\*\)bs\)", s6)
    assert loads == ["Bl", "Bh"]
    loop = s6[s6.index(";", s6.index("(Bh + (i_")):s6.index("tl::tma_store(a_inv_desc")]
    assert "bs)" not in loop and loop.count("(Bl + ") == 2 and loop.count("(Bh + ") == 1
    assert s6.count("__syncthreads()") == split.count("__syncthreads()")
