"""The TileLang pre-pass of the Hopper forward (linattn/ops/hopper/prepass.py): its blocked solve's twin against a
dense solve, its twin's outputs (gc and β head-major per segment, A_inv) against the Triton pre-pass stage's, the
forward around the twins against the float64 recurrence, its input checks, and its compile for sm_90a where TileLang
and nvcc are installed (the kernel runs only on the GPU: benchmarks/gpu_check_core.py --forward-path hopper)."""
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

from .hopper_twins import hand_plan


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
    the TileLang pre-pass against the Triton pre-pass's gc and A_inv laid out the same way (interpreter, fp32
    inputs)."""
    from linattn.ops.common.fused_prepass import fused_prepass
    x = {n: t.float() for n, t in inputs(2, T, 1, 2, 16, 16).items()}
    gc, a_inv = fused_prepass(x["g"], x["k"], x["v"], x["beta"], write_wy=False, store_dtype=torch.float32)
    gc_tr, beta_tr = (hopper.head_major(t.reshape(2 * S, T // S, 2)) for t in (gc, x["beta"]))
    gc_hm, beta_hm, a_inv_tl, bound = prepass.prepass_hopper_ref(x["k"], x["g"], x["beta"], S,
                                                                 a_inv_dtype=torch.float32, beta_in_a_inv=False)
    assert bound.shape == (2 * S, 2, -(-T // S // 64)) and bound.dtype == torch.float32
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
@pytest.mark.parametrize("T,segments", [(200, None), (256, 4)])
def test_forward_on_the_tilelang_prepass_twin_is_the_recurrence(monkeypatch, T, segments):
    """forward_hopper around the twins of both kernels (fp32 inputs, the pre-pass twin's A_inv diag(β) left in fp32
    so that only the layout is tested; weak gates so that the segments' entering states matter): o and the final
    state equal the float64 recurrence, unsegmented and in four segments."""
    monkeypatch.setattr(hopper_fwd, "chunk_fwd_hopper_hm", twins.chunk_fwd_hopper_hm_ref)
    monkeypatch.setattr(hopper_fwd, "prepass_hopper",
                        functools.partial(prepass.prepass_hopper_ref, a_inv_dtype=torch.float32))
    x = inputs(2, T, 1, 2, 16, 16)
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")] + [0.25, x["initial_state"].float()]
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    o, ht = hopper_fwd.forward_hopper(hand_plan(segments or 1, BV=16), *args)
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5


def full_forgets(g: torch.Tensor) -> torch.Tensor:
    """``g`` with full forgets: −inf at one token of every head, −3e38 at two more (their sum overflows to −inf)."""
    g = g.clone()
    T = g.shape[1]
    g[:, T // 3] = -float("inf")
    g[:, T // 2] = g[:, T // 2 + 1] = -3e38
    return g


@pytest.mark.parametrize("T,S", [(200, 1), (256, 2)])
def test_full_forgets_give_the_recurrences_finite_answer(T, S):
    """A log decay of −inf (or −3e38 twice) is a valid full forget: the pre-pass twin reads it as the floor
    (LOG_DECAY_FLOOR, whose e^g is already 0 in fp32), so its outputs are finite and bitwise those of the gates
    clamped there, and the walk's twin on them gives the float64 recurrence's answer (its state restarts at the
    forget)."""
    x = inputs(2, T, 1, 2, 16, 16)
    x["g"] = full_forgets(x["g"])
    pre = prepass.prepass_hopper_ref(x["k"], x["g"], x["beta"], S, a_inv_dtype=torch.float64)
    clamped = prepass.prepass_hopper_ref(x["k"], x["g"].clamp_min(prepass.LOG_DECAY_FLOOR), x["beta"], S,
                                         a_inv_dtype=torch.float64)
    assert all(torch.isfinite(t).all() for t in pre) and all(torch.equal(a, b) for a, b in zip(pre, clamped))
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    assert torch.isfinite(ro).all() and torch.isfinite(rht).all()
    whole = prepass.prepass_hopper_ref(x["k"], x["g"], x["beta"], 1, a_inv_dtype=torch.float64)
    o, ht = twins.chunk_fwd_hopper_hm_ref(x["q"], x["k"], x["v"], *whole[:3], 0.25, x["initial_state"])
    assert rel(o, ro) < 1e-12 and rel(ht, rht) < 1e-12


ON_HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or not hopper.tilelang_available() or
                               torch.cuda.get_device_capability()[0] != 9,
                               reason="the Hopper pre-pass runs on sm_90 only")


@ON_HOPPER
def test_full_forgets_in_the_prepass_on_the_gpu():
    """The TileLang pre-pass with −inf and −3e38 gates: every output finite and bitwise those of the gates clamped
    at LOG_DECAY_FLOOR (one max per token where the kernel reads g), and the walk on them within the bf16 bound of
    the float64 recurrence."""
    x = {n: t.cuda() for n, t in inputs(2, 1000, 2, 4, 128, 128).items()}
    x["g"] = full_forgets(x["g"])
    low = {n: t.to(torch.bfloat16) if n in ("q", "k", "v") else t.float() for n, t in x.items()}
    pre = prepass.prepass_hopper(low["k"], low["g"], low["beta"])
    clamped = prepass.prepass_hopper(low["k"], low["g"].clamp_min(prepass.LOG_DECAY_FLOOR), low["beta"])
    assert all(torch.isfinite(t.float()).all() for t in pre) and all(torch.equal(a, b) for a, b in zip(pre, clamped))
    from linattn.ops.hopper.walk_launch import chunk_fwd_hopper_hm
    o, ht = chunk_fwd_hopper_hm(low["q"], low["k"], low["v"], *pre[:3], 128 ** -0.5, low["initial_state"], BV=128)
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    assert rel(o, ro) < 1e-2 and rel(ht, rht) < 1e-2, (rel(o, ro), rel(ht, rht))


def test_inputs_the_prepass_does_not_take_say_why():
    x = {n: t.float() for n, t in inputs(1, 128, 1, 2, 16, 16).items()}
    with pytest.raises(TypeError, match="bf16 keys"):
        prepass.prepass_hopper(x["k"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="multiple of 256"):
        prepass.prepass_hopper(x["k"].bfloat16(), x["g"], x["beta"], segments=4)
    with pytest.raises(ValueError, match=r"\[B, T, HV\]"):
        prepass.prepass_hopper_ref(x["k"], x["g"][:, :64], x["beta"])


@pytest.mark.skipif(not hopper.tilelang_available() or shutil.which("nvcc") is None,
                    reason="TileLang (optional) and nvcc compile the Hopper pre-pass")
def test_prepass_compiles_for_sm90a():
    """The pre-pass's sm_90a source, step by step: the keys by TMA, K Kᵀ as one bf16 wgmma, A's elements from
    registers then its blocks branch-free, the column solve as straight-line FMAs (no shuffles) beside the map bound,
    step 4 and the quadrant's two dots at tf32 on mma.sync, A_inv diag(β) from registers written by TMA; its padded
    layouts and its launch bounds."""
    src = prepass.compiled_kernel(16, 16, 128, "float32", target="sm_90a").get_kernel_source()
    # 1. the key tile by two TMA boxes (64 columns each) behind one mbarrier, not per-thread loads; each gate read
    # as g < −104 ? −104 : g (LOG_DECAY_FLOOR), a select that keeps a NaN gate NaN (max(g, −104) would drop it)
    assert src.count("tma_load(k_desc") == 1 and "arrive_and_expect_tx(16384)" in src
    assert "if ((gi < -0x1.ap+6f/*-1.040000e+02*/)) {" in src and "max(g[" not in src
    # 2. the chunk's first non-finite row (gc, β ‖k‖²) by a shared atomic min on the diagonal's bad elements; gc's
    # rows from it rewritten as NaN; A_inv's rows from it NaN
    assert src.count("AtomicMin(") == 1 and "isfinite(" in src and "] = CUDART_NAN_F;" in src
    # 2. one wgmma; the elements from registers alone (β_i, gc_i per row and gc_j per column loaded once)
    assert src.count("wgmma_ss<") == 1
    assert "Gr[i_1] = ((float*)gcs)[" in src and "*(float2*)(Gcol + (i_2 * 2)) = *(float2*)(((float*)gcs)" in src
    # 3. the column solve: FMAs on shared memory, no shuffles; meanwhile the two idle warps' map bound, one token
    # each, from the diagonal blocks' diagonals (rows 20 words apart in 17-row blocks: Ad[340 d + 21 i]), summed
    # by warp shuffles; after the barrier one thread adds the halves and writes it
    solve = src[src.index("if (((int)threadIdx.x) < 64) {\n    #pragma unroll"):]
    solve = solve[:solve.index("__syncthreads()")]
    assert "shfl" not in solve and re.search(r"x\[i_\d\] = \(x\[i_\d\] - ", solve)
    terms = src[src.index("} else {\n    bl[0] = tl::warp_reduce_sum("):]
    assert "* 340) + ((((int)threadIdx.x) & 15) * 21)) - 1360)]" in terms.split("\n")[1]
    written = terms[terms.index("__syncthreads();"):]
    assert written.index("if (((int)threadIdx.x) == 64) {") < written.index("bound[") < \
        written.index("__syncthreads", 1)
    # 4 and 5: two m16n8k8 sites in step 4, four in step 5's two 32 × 32 dots; step 5 reads T_hi by ldmatrix at
    # rows 36 words apart, T_lo one word per lane at rows 40 apart
    assert src.count("mma_sync<tl::DataType::kTensorFloat32") == 6
    ldmatrix = re.findall(r"ptx_ldmatrix_x4\(\(&\(\(\(float\*\)(\w+)\)\[([^;]*)\]\)\)", src)
    assert [(buf, "* 36)" in index, "+ 1280)" in index) for buf, index in ldmatrix] == [("Ahl", True, False),
                                                                                       ("Tq", True, True)]
    assert re.search(r"B_local\[j_1\] = \(\(float\*\)Tq\)\[[^;]*\* 40\)", src)
    # 6. β per column from registers, loaded once (4 pairs a thread), not reloaded per store; A_inv by TMA
    loads = re.findall(r"\*\(float2\*\)\((B[lh]) \+ \(i_\d+ \* 2\)\) = \*\(float2\*\)\(\(\(float\*\)bs\)", src)
    assert loads == ["Bl", "Bh"]
    loop = src[src.index(";", src.index("(Bh + (i_")):src.index("tl::tma_store(a_inv_desc")]
    assert "bs)" not in loop and loop.count("(Bl + ") == 2 and loop.count("(Bh + ") == 1
    # the registers fitted for 7 resident programs
    assert "__launch_bounds__(128, 7)" in src
