"""The Hopper forward's walk (linattn/ops/hopper/chunk_fwd.py): its PyTorch twin against the float64
reference (the algebra the TileLang kernel implements: V_new from each chunk's inverse, the decay on V_new's rows,
the inclusive causal mask), the twin's bf16 rounding points, and the kernel's compile for sm_90a where TileLang is
installed (it is an optional dependency; the kernel itself runs only on the GPU:
benchmarks/gpu_check_core.py --forward-path hopper)."""
from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import chunk_fwd as hopper
from linattn.ops.hopper import chunk_fwd_ref as twins
from linattn.ops.hopper import walk_launch


def inputs(B, T, H, HV, K, V, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    x = dict(q=F.normalize(r(B, T, H, K), dim=-1), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, HV, V),
             g=F.logsigmoid(r(B, T, HV)) / 4, beta=torch.rand(B, T, HV, generator=gen, dtype=torch.float64),
             initial_state=r(B, HV, K, V) * 0.1)
    return {n: t.to(dtype) if n in ("q", "k", "v") else t for n, t in x.items()}


# the GPU tests of the Hopper forward: an sm_90 card with TileLang
ON_HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or not hopper.tilelang_available() or
                               torch.cuda.get_device_capability()[0] != 9,
                               reason="the Hopper forward runs on sm_90 only")


def gpu_inputs(B, T, H, HV, K, V, seed=0):
    """:func:`inputs` on the GPU as the op takes them: q, k, v in bf16, the gates, β and the initial state fp32."""
    return {n: (t if n in ("q", "k", "v") else t.float()).cuda()
            for n, t in inputs(B, T, H, HV, K, V, dtype=torch.bfloat16, seed=seed).items()}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("B,T,H,HV,K,V", [(2, 150, 2, 2, 32, 48), (1, 64, 1, 2, 16, 16), (1, 1, 2, 4, 16, 24),
                                          (1, 200, 1, 1, 16, 16)])
def test_twin_without_rounding_is_the_recurrence(B, T, H, HV, K, V):
    """Partial last chunks (150, 200, 1), one full chunk, grouped value heads: exact in float64."""
    x = inputs(B, T, H, HV, K, V)
    o, ht = twins.chunk_fwd_hopper_ref(**x, scale=K ** -0.5, operand_dtype=torch.float64)
    ro, rht = gated_delta_rule_reference(**x, scale=K ** -0.5)
    assert rel(o, ro) < 1e-12 and rel(ht, rht) < 1e-12


def test_twin_with_strong_decay_stays_finite():
    x = inputs(1, 130, 1, 1, 16, 16)
    x["g"] = torch.full_like(x["g"], -100.0)
    o, ht = twins.chunk_fwd_hopper_ref(**x, scale=0.25, operand_dtype=torch.float64)
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel(o, ro) < 1e-12 and rel(ht, rht) < 1e-12


def test_twin_with_full_forgets_is_the_recurrence():
    """Log decays of −inf and −3e38 (full forgets; the pre-pass reads them at its floor): the twin's float64 walk is
    finite and gives the recurrence's answer."""
    from .test_hopper_prepass import full_forgets
    x = inputs(1, 200, 1, 2, 16, 16)
    x["g"] = full_forgets(x["g"])
    o, ht = twins.chunk_fwd_hopper_ref(**x, scale=0.25, operand_dtype=torch.float64)
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    assert torch.isfinite(o).all() and rel(o, ro) < 1e-12 and rel(ht, rht) < 1e-12


def test_twin_bf16_rounding_points():
    """With the kernel's bf16 operands (bf16 q/k/v, fp32 work): errors of bf16 size against float64, and the rounding
    is really applied (the bf16 twin differs from the unrounded one)."""
    x = inputs(2, 300, 2, 2, 64, 64, dtype=torch.bfloat16)
    exact = {n: t.double() for n, t in x.items()}
    ro, rht = gated_delta_rule_reference(**exact, scale=0.125)
    o, ht = twins.chunk_fwd_hopper_ref(**x, scale=0.125)
    o32, ht32 = twins.chunk_fwd_hopper_ref(**x, scale=0.125, operand_dtype=torch.float32)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert rel(o, ro) < 8e-3 and rel(ht, rht) < 8e-3
    assert rel(ht32, rht) < 1e-5 and rel(ht, ht32) > 1e-4


def test_twin_bf16_a_inv_costs_little():
    """A_inv and X rounded to bf16 (the kernel's bf16 A_inv: one wgmma instead of tf32 mma.sync) adds a bounded part
    to the errors that the other bf16 rounding points already cost (here o 2.9e-3 → 3.3e-3, the final state
    1.7e-3 → 2.5e-3: FlashQLA's figures, which rounds A_inv so too), and the rounding happens (the outputs differ)."""
    x = inputs(2, 300, 2, 2, 64, 64, dtype=torch.bfloat16)
    exact = {n: t.double() for n, t in x.items()}
    ro, rht = gated_delta_rule_reference(**exact, scale=0.125)
    o, ht = twins.chunk_fwd_hopper_ref(**x, scale=0.125)
    o_a, ht_a = twins.chunk_fwd_hopper_ref(**x, scale=0.125, round_a_inv=True)
    assert rel(o_a, ro) < 1.25 * rel(o, ro) and rel(ht_a, rht) < 1.6 * rel(ht, rht)
    assert rel(ht_a, ht) > 1e-5


@pytest.mark.parametrize("T", [1, 65, 300, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_major_rows_are_tma_copyable(T, dtype):
    """gc and β go to the kernel as [B, HV, Tp]: the values, then zeros, rows a multiple of 16 bytes, contiguous,
    one Tp for both dtypes (the kernel binds both to one symbol)."""
    x = torch.randn(2, T, 3).to(dtype)
    y = hopper.head_major(x)
    assert y.is_contiguous() and y.shape[-1] == hopper.padded_length(T) and y.shape[-1] % 8 == 0
    assert (y.shape[-1] * y.element_size()) % 16 == 0 and 0 <= y.shape[-1] - T < 8
    assert torch.equal(y[:, :, :T], x.transpose(1, 2)) and not y[:, :, T:].any()


def test_unsupported_inputs_say_why():
    x = inputs(1, 64, 1, 1, 64, 64, dtype=torch.float32)
    assert "bf16" in hopper.unsupported_reason(x["q"], x["v"])
    xb = inputs(1, 64, 1, 1, 64, 64, dtype=torch.bfloat16)
    assert "sm_90" in hopper.unsupported_reason(xb["q"], xb["v"])   # a CPU tensor


def off_boundary(x: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """A contiguous copy of ``x`` whose data starts ``elements`` past a 16-byte boundary (a flat buffer cut there)."""
    flat = torch.empty(x.numel() + 16, dtype=x.dtype, device=x.device)
    start = (-flat.data_ptr() // x.element_size()) % (16 // x.element_size()) + elements
    y = flat[start:start + x.numel()].view(x.shape)
    y.copy_(x)
    return y


def test_inputs_off_a_16_byte_boundary_take_the_triton_paths(monkeypatch):
    """plan.plan_inputs: with the device and dtype gates passed (as on an sm_90 GPU with TileLang), a plan for
    aligned inputs; None (the Triton paths), with the reason, where q, v or one of the others starts off a 16-byte
    boundary."""
    from linattn.ops.hopper import plan as hopper_plan
    x = inputs(8, 64, 16, 16, 64, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(hopper_plan, "unsupported_reason", lambda q, v: None)
    monkeypatch.setattr(hopper_plan, "num_sms", lambda device: 132)
    others = [x["k"], x["g"].float(), x["beta"].float(), x["initial_state"].float()]
    assert hopper.misaligned(x["q"], x["v"], *others, None) is None
    found, _ = hopper_plan.plan_inputs(x["q"], x["v"], tuple(others), None, None)
    assert found is not None
    for i in range(len(others)):
        moved = list(others)
        moved[i] = off_boundary(others[i])
        assert torch.equal(moved[i], others[i]) and moved[i].is_contiguous()
        assert hopper.misaligned(x["q"], x["v"], *moved) == 2 + i
        found, why = hopper_plan.plan_inputs(x["q"], x["v"], tuple(moved), None, None)
        assert found is None and "16-byte" in why
    assert hopper_plan.plan_inputs(off_boundary(x["q"]), x["v"], (), None, None)[0] is None
    assert hopper_plan.input_blocker(x["q"], x["v"], x["v"], None) is None           # the backward's do, dht
    assert "16-byte" in hopper_plan.input_blocker(x["q"], x["v"], off_boundary(x["v"]))
    assert hopper.misaligned(off_boundary(x["v"], 8)) is None          # 8 bf16 elements: 16 bytes on


@pytest.mark.interpreter
def test_hopper_forward_path_falls_back_where_the_kernel_cannot_run():
    """The forced "hopper" path on inputs the kernel does not take (here: CPU tensors under the interpreter) runs
    the "auto" path: the same output and final state."""
    from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path
    x = inputs(2, 70, 1, 2, 16, 16, dtype=torch.float32)
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=x["initial_state"].float(), output_final_state=True, backend="triton")
    o_auto, ht_auto = linattn.chunk_gated_delta_rule(*args, **kw)
    o_h, ht_h = chunk_gated_delta_rule_on_path("hopper", *args, **kw)
    assert torch.equal(o_h, o_auto) and torch.equal(ht_h, ht_auto)


def warm_up_capture_replay(call):
    """``call()`` once on a side stream (the usual warm-up before a capture), then captured in a CUDA graph and
    replayed: (the warm-up's result, the replay's outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    return warm, captured


@pytest.mark.parametrize("threads", [256, 128, 384])
def test_consumer_registers_fit_what_the_program_holds_at_launch(threads):
    """setmaxnreg.inc takes registers from the program's own pool and waits until it holds enough, so the split
    must fit the registers ptxas gives each thread at launch under __launch_bounds__(threads + 128, 1) (64K per SM,
    in steps of 8): the producer's 24 and the consumers' share within them, as large as it can be, a multiple of 8
    in setmaxnreg's [24, 256]. TileLang's own split at 256 consumer threads is 24 / 240."""
    at_launch = min(256, 65536 // (threads + 128) // 8 * 8)
    c = hopper.consumer_registers(threads)
    assert c % 8 == 0 and 24 <= c <= 256
    assert 128 * 24 + threads * c <= (threads + 128) * at_launch
    assert c == 256 or 128 * 24 + threads * (c + 8) > (threads + 128) * at_launch
    assert hopper.consumer_registers(256) == 240


@ON_HOPPER
def test_a_captured_small_call_replays_the_two_launch_forward(monkeypatch):
    """B=1 T=4096 H=16 through the op takes the two-launch plan (the planned warm walk) eagerly and under capture
    alike (nothing in it waits on the host), and the replay writes the eager call's numbers bitwise, within the bf16
    bound of the float64 recurrence. The eager call runs the plain forward, the warm-up its prepared call (which
    records the route), and the capture takes the route: forward_hopper sees two calls, not three."""
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper import prepared, route
    monkeypatch.setattr(route, "_routes", {})       # no route nor prepared call from an earlier test
    monkeypatch.setattr(prepared, "_prepared", {})
    x = gpu_inputs(1, 4096, 16, 16, 128, 128, seed=5)
    plans = []
    real = hopper_fwd.forward_hopper
    monkeypatch.setattr(hopper_fwd, "forward_hopper", lambda plan, *a, **kw: plans.append(plan) or real(plan, *a, **kw))

    def call():
        return linattn.chunk_gated_delta_rule(**x, output_final_state=True)
    with torch.no_grad():
        eager = call()
        _, captured = warm_up_capture_replay(call)
    assert len(plans) == 2 and plans[0].planned_walk and plans[0].segments == 4
    assert all(plan == plans[0] for plan in plans)
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    assert rel(eager[0], ro) < 5e-3 and rel(eager[1], rht) < 5e-3


@ON_HOPPER
@pytest.mark.parametrize("slow_heads", [False, True], ids=["forgetting", "slow_heads"])
def test_the_two_launch_segmented_forward_on_the_gpu(slow_heads):
    """forward_hopper(segments=4, plan_in_walk=True) at B=1 T=4096 H=16 in bf16: within the bf16 bound of the float64
    recurrence and, where every head forgets, close to the five-launch segmented forward (the same warm-ups, up to
    where a sum in another order crosses the threshold). With slow heads (g/256: no warm-up within the sequence)
    their segments walk from the sequence's start, and the result is still the recurrence's."""
    import dataclasses

    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper import plan as hopper_plan
    x = gpu_inputs(1, 4096, 16, 16, 128, 128, seed=3)
    if slow_heads:
        x["g"][..., ::2] /= 256
    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [128 ** -0.5, x["initial_state"]]
    planned = hopper_plan.plan(1, 16, 128, 4096, torch.cuda.get_device_properties(0).multi_processor_count)
    assert planned.segments == 4 and planned.planned_walk
    with torch.no_grad():
        o2, ht2 = hopper_fwd.forward_hopper(planned, *args)
        o5, ht5 = hopper_fwd.forward_hopper(dataclasses.replace(planned, planned_walk=False), *args)
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    assert rel(o2, ro) < 5e-3 and rel(ht2, rht) < 5e-3
    if not slow_heads:      # the same warm-ups; slow heads take maps in one and the whole prefix in the other, two
        assert rel(o2, o5) < 1e-3 and rel(ht2, ht5) < 1e-3      # bf16 roundings as far from each other as from float64
    else:
        assert rel(o5, ro) < 5e-3


def test_launcher_calls_the_executable_only_where_it_can():
    """The tvm_ffi executable of a kernel without outputs to allocate; a kernel whose wrapper allocates outputs, or
    one without an executable, is called itself."""
    class Adapter:
        def __init__(self, result_idx):
            self.result_idx = result_idx

        def _get_executable(self):
            return "executable"

    class Kernel:
        def __init__(self, result_idx=()):
            self.adapter = Adapter(list(result_idx))

    plain, with_outputs, bare = Kernel(), Kernel([7]), object()
    hopper.launcher.cache_clear()
    assert hopper.launcher(plain) == "executable"
    assert hopper.launcher(with_outputs) is with_outputs and hopper.launcher(bare) is bare
    hopper.launcher.cache_clear()


def test_kernel_takes_bf16_only():
    x = inputs(1, 64, 1, 1, 64, 64, dtype=torch.float32)
    gc = torch.zeros(1, 64, 1)
    with pytest.raises(TypeError, match="bf16"):
        walk_launch.chunk_fwd_hopper(x["q"], x["k"], x["v"], gc, x["beta"], torch.zeros(1, 64, 1, 64), 0.125, None)


def test_walk_inputs_it_does_not_take_say_why_before_any_compile():
    """An A_inv that is not the pre-pass's bf16 one, a V tile that does not divide V, skip_m outside the affine walk,
    an initial state for the affine walk, and a warm walk given neither or both of its controls: a TypeError or
    ValueError before the kernel is compiled (none is here)."""
    x = inputs(2, 64, 1, 1, 64, 64, dtype=torch.bfloat16)
    gc = hopper.head_major(torch.zeros(2, 64, 1))
    a_inv = torch.zeros(2, 64, 1, 64, dtype=torch.bfloat16)
    args = (x["q"], x["k"], x["v"], gc, gc.clone())
    with pytest.raises(TypeError, match="bf16 A_inv"):
        walk_launch.chunk_fwd_hopper_hm(*args, a_inv.float(), 0.125, None, BV=64)
    with pytest.raises(ValueError, match="multiples of BV"):
        walk_launch.chunk_fwd_hopper_hm(*args, a_inv, 0.125, None, BV=128)
    with pytest.raises(ValueError, match="skip_m applies to the affine walk"):
        walk_launch.chunk_fwd_hopper_hm(*args, a_inv, 0.125, None, BV=64, skip_m=torch.zeros(2, 1))
    with pytest.raises(ValueError, match="no initial state"):
        walk_launch.chunk_fwd_hopper_hm(*args, a_inv, 0.125, torch.zeros(2, 1, 64, 64), BV=64, affine=True)
    with pytest.raises(ValueError, match="give warm_chunks, or warm_bound with warm_threshold"):
        walk_launch.chunk_fwd_hopper_hm(*args, a_inv, 0.125, None, BV=64, warm_bound=torch.zeros(2, 1, 1))


@pytest.mark.skipif(not hopper.tilelang_available() or shutil.which("nvcc") is None,
                    reason="TileLang (optional) and nvcc compile the Hopper kernel")
def test_kernel_compiles_for_sm90a_with_wgmma_and_tma():
    """The default launch's walks for sm_90a, step by step: the loads by TMA, the dots on wgmma, the element-wise
    steps through stmatrix, o by TMA, and each walk's control (phase A's maps, the warm walks' warm-ups)."""
    def source(BV=128, **options):
        return hopper.compiled_kernel(16, 16, 128, 128, BV, 128 ** -0.5, threads=256, target="sm_90a",
                                      **options).get_kernel_source()
    src = source()
    # six dots and the P V_d of a chunk that does not renormalise (seven wgmma sites); K S waited for first (X needs
    # only it) with Q S and Q Kᵀ in flight; no tf32 A_inv X; BV = 64 compiles too
    assert "tma_load" in src and src.count("wgmma_ss<") == 7 and "wait_wgmma<2>" in src
    assert "kTensorFloat32" not in src and source(BV=64).count("wgmma_ss<") == 7
    # X, P, V_new and ρ ⊙ V_new leave their accumulators by stmatrix, no per-thread stores of bf16 pairs into those
    # tiles; the scale is in P's exponent and Γ's factor, no pass over o
    for tile in ("Xs", "Ps", "Vns", "Vds"):
        per_thread = rf"(\(\(bfloat16_t\*\){tile}\)\[[^;]*\] = |\*\(uint1\*\)\(\(\(bfloat16_t\*\){tile}\) \+)"
        assert not re.search(per_thread, src) and f"ptx_stmatrix_m8n8_x4((&(((bfloat16_t*){tile})" in src
    assert re.search(r"Gam\[[^\]]*\] \* 0x1\.6a09e667f3bcdp-4f", src)                # Γ · 128^-0.5
    assert "+ -0x1.3687a9f1af2b1p+1f" in src                                        # gc + ln(128^-0.5)
    # A_inv diag(β) from the pre-pass: β neither loaded (no TMA descriptor) nor multiplied
    assert "beta_desc" not in src and "Beta[" not in src
    # o's TMA store is not waited for where it is issued; the wait for its read of the tile comes before the next
    # chunk's stmatrix into the tile, and once more after the loop
    issue = src.index("tma_store(o_desc")
    assert "tma_store_wait" not in src[issue:src.index("}", src.index("tma_store_arrive()", issue))]
    before = src[src.index("tma_store_wait<0, true>()"):src.index("ptx_stmatrix_m8n8_x4((&(((bfloat16_t*)Os)")]
    assert before.count("__sync_thread_partial") == 1 and "ptx_stmatrix" not in before
    # A_inv X is left running (Q S and Q Kᵀ waited for: one group may stay in flight) while P's mask and decays and
    # o's factor are applied and P stored; V_new waited for before its tiles are stored; V's tile read into
    # registers while K S runs
    issue = src.index("desc_a_3, (&(((bfloat16_t*)As)")
    order = [src.index(key, issue) for key in ("wait_wgmma<1>()", "if (renorm)", "(QK[", "bfloat16_t*)Ps)",
                                                 "*(float2*)(Of + ", "wait_wgmma<0>()", "bfloat16_t*)Vns)")]
    assert order == sorted(order) and "warpgroup_wait" not in src[issue:order[-2]]
    assert src.index("*(uint1*)(Vr + ") < src.index("wait_wgmma<2>()")
    # a non-finite v: per element one add (Σ |v|) and nothing else; the atomic only on the branch taken where that
    # sum is not finite, a barrier between it and the read of the first bad row (the barrier before A_inv X); no
    # barrier of its own (the atomic is a call the planner does not see): 13 in the loop, as without it
    sum_at, atom = src.index("Vsum[0] = (Vsum[0] + fabsf("), src.index("linattn_atomic_min((")
    assert sum_at < src.index("if (!isfinite(Vsum[0]))") < atom < src.index("int bad = ")
    assert "__sync_thread_partial" in src[atom:src.index("int bad = ")] and src.count("linattn_atomic_min((") == 1
    loop = src[src.index("for (int c_1 = 0;"):]
    assert loop.count("__sync_thread_partial") == 13, loop.count("__sync_thread_partial")
    # phase A: the state's three dots (K S, A_inv X, the update), no query loads, no output; the maps' skip (skip_m,
    # the kernel's ctl: 1 the M tiles, 2 every tile): producer and consumers both take their loop count from it; the
    # output walk never reads it. M alone (the reverse maps' build): one K tile at BV = K, so no program tests which
    # kind of tile it walks
    affine = source(use_initial_state=False, affine=True)
    assert affine.count("wgmma_ss<") == 3 and "q_desc" not in affine and "o_desc" not in affine
    assert affine.count("ctl[") == 6 and "== 3)" not in affine and "ctl[" not in src
    m_only = source(use_initial_state=False, affine=True, m_only=True, lean=True, beta_in_a_inv=False)
    assert m_only.count("wgmma_ss<") == 3 and "blockIdx.x" not in m_only and "blockIdx.x" in affine
    # the warm walk (phase C with warm-ups): its loop count and first chunk from ctl, o stored by TMA under a
    # condition (the warm-up's chunks write nothing), gc rows per segment (symbolic L)
    warm = source(warm=True, lean=True)
    assert "int chunks = ((L >> 6) + ctl[" in warm and "tma_store(o_desc" in warm and "int L," in warm
    # the planned warm walk (the two-launch segmented forward): every role finds w itself from the chunk bounds (ctl
    # fp32, [B·S, HV, LC]) — the same loop in the producer and the consumers —, the register split asked for
    # explicitly (TileLang drops it when the producer stores to a local: the consumers then stay at 168 and spill),
    # the sequence's h0 read only where the walk starts at the sequence's start
    planned = source(warm=True, warm_planned=True, lean=True)
    assert "const float* __restrict__ ctl" in planned and "int LC," in planned and "int B," in planned
    assert planned.count("while (1)") == 2 and planned.count("-0x1.ep+4f") == 2            # threshold −30
    assert "warpgroup_reg_dealloc<24>()" in planned and "warpgroup_reg_alloc<240>()" in planned
    assert re.search(r"if \(c0(_\d+)? == 0\) \{", planned) and "int chunks = ((L >> 6) + wv);" in planned
    assert "warpgroup_reg_dealloc<24>()" in warm and "while (1)" not in warm


@pytest.mark.skipif(not hopper.tilelang_available() or shutil.which("nvcc") is None,
                    reason="TileLang (optional) and nvcc compile the Hopper kernel")
def test_async_dots_cannot_race_the_load_pipeline():
    """The invariant written at the kernel's dots, on the generated CUDA of the default launch: TileLang hands a
    staged buffer back to the producer after its last use in program order (for Q, the *issue* of the async Q Kᵀ),
    so every buffer's refill for chunk c + 2 must wait behind the one released last in chunk c — the producer's
    first wait — and that release must come after the body's last wgmma wait (the synchronous state update)."""
    src = hopper.compiled_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, target="sm_90a",
                                 beta_dtype="bfloat16").get_kernel_source()
    producer, consumer = re.split(r"for \(int c_1 = 0;", src, maxsplit=1)
    producer = producer[producer.index("for (int c = 0;"):]
    first_wait = re.search(r"mbarrier\[\(\(c & 1\) \+ (\d+)\)\]\.wait", producer).group(1)
    body = consumer[:consumer.index("mbarrier[((c_1 & 1) + %s)].arrive()" % first_wait) + 1]
    releases = re.findall(r"mbarrier\[\(\(c_1 & 1\) \+ (\d+)\)\]\.arrive\(\)", consumer)
    assert releases and releases[-1] == first_wait                  # the producer waits first on the last release
    last_wait = max(body.rfind("warpgroup_wait<0>"), body.rfind("wait_wgmma<0>"))
    last_issue = body.rfind("wgmma_ss<")
    assert 0 <= last_issue < last_wait                              # every dot of the chunk done before it


@ON_HOPPER
def test_inputs_off_a_16_byte_boundary_run_on_the_gpu():
    """Through the public op on the H200: inputs that start off a 16-byte boundary (each a contiguous view of a flat
    buffer cut at an odd element) take the Triton paths and give what the aligned inputs give, within the bf16
    bound of two algorithms; and the aligned inputs are left as they were."""
    x = gpu_inputs(1, 4096, 16, 16, 128, 128)
    with torch.no_grad():
        o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True)
        moved = {n: off_boundary(t) for n, t in x.items()}
        assert all(hopper.misaligned(t) == 0 for t in moved.values())
        o_m, ht_m = linattn.chunk_gated_delta_rule(**moved, output_final_state=True)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(o_m, o) < 1e-2 and rel(ht_m, ht) < 1e-2, (rel(o_m, o), rel(ht_m, ht))
