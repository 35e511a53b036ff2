"""The experimental Hopper forward (linattn/ops/hopper/chunk_fwd.py): its PyTorch twin against the float64
reference (the algebra the TileLang kernel implements: V_new from each chunk's inverse, the decay on V_new's rows,
the inclusive causal mask), the twin's bf16 rounding points, and the kernel's compile for sm_90a where TileLang is
installed (it is an optional dependency; the kernel itself runs only on the GPU: benchmarks/hopper_fwd_check.py)."""
from __future__ import annotations

import contextlib
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.ops.gated_delta import triton_chunk
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


def op_outputs_off_and_on(monkeypatch, module, switch: str, x: dict) -> list:
    """(o, final state) of the public op ("auto", no grad) on the GPU inputs ``x`` with ``module.switch`` off, then
    on: for the switches that must change no value (compare them bitwise)."""
    import linattn
    from linattn.ops.gated_delta import triton_chunk
    monkeypatch.setattr(triton_chunk, "FORWARD_PATH", "auto")
    outs = []
    for on in (False, True):
        monkeypatch.setattr(module, switch, on)
        with torch.no_grad():
            outs.append(linattn.chunk_gated_delta_rule(**x, output_final_state=True))
    return outs


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


def test_twin_scale_in_p_is_the_same_forward():
    """The stsm kernel's rounding points (chunk_fwd_hopper_hm_ref with stsm: the scale inside P before its bf16
    rounding and on Γ, not on o at the end): o as accurate as the plain twin's against float64, the final state
    untouched, and the rounding is really a different one (o differs)."""
    from linattn.ops.hopper.prepass import prepass_hopper_ref
    x = inputs(2, 300, 2, 2, 64, 64, dtype=torch.bfloat16)
    exact = {n: t.double() for n, t in x.items()}
    ro, rht = gated_delta_rule_reference(**exact, scale=0.1)    # not a power of two: the roundings differ
    pre = prepass_hopper_ref(x["k"], x["g"].float(), x["beta"].float(), beta_in_a_inv=False)[:3]
    args = (x["q"], x["k"], x["v"], *pre, 0.1, x["initial_state"].float())
    o, ht = twins.chunk_fwd_hopper_hm_ref(*args)
    o_s, ht_s = twins.chunk_fwd_hopper_hm_ref(*args, stsm=True)
    assert rel(o_s, ro) < 1.1 * rel(o, ro) and torch.equal(ht_s, ht)
    assert rel(o_s, o) > 1e-4


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
    assert "bf16" in hopper.unsupported_reason(x["q"], x["v"], None)
    xb = inputs(1, 64, 1, 1, 64, 64, dtype=torch.bfloat16)
    assert "sm_90" in hopper.unsupported_reason(xb["q"], xb["v"], None)   # a CPU tensor


def off_boundary(x: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """A contiguous copy of ``x`` whose data starts ``elements`` past a 16-byte boundary (a flat buffer cut there)."""
    flat = torch.empty(x.numel() + 16, dtype=x.dtype, device=x.device)
    start = (-flat.data_ptr() // x.element_size()) % (16 // x.element_size()) + elements
    y = flat[start:start + x.numel()].view(x.shape)
    y.copy_(x)
    return y


def test_inputs_off_a_16_byte_boundary_take_the_triton_paths(monkeypatch):
    """hopper_plan: with the device and dtype gates passed (as on an sm_90 GPU with TileLang), the Hopper launch for
    aligned inputs; None (the Triton paths) where q, v or one of the others starts off a 16-byte boundary."""
    from linattn.ops.hopper import forward as hopper_forward
    x = inputs(1, 64, 1, 1, 64, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(hopper, "unsupported_reason", lambda q, v, cu_seqlens: None)
    monkeypatch.setattr(triton_chunk, "num_sms", lambda device: 132)
    monkeypatch.setattr(hopper_forward, "plan", lambda *a, **kw: dict(hopper_forward.LAUNCH))

    class OnGpu:
        """A CPU tensor as hopper_plan sees it on the GPU: the device gate passes; shape, dtype and address its."""
        def __init__(self, t):
            self.t, self.shape, self.dtype, self.device = t, t.shape, t.dtype, torch.device("cuda", 0)

        def data_ptr(self):
            return self.t.data_ptr()
    others = [x["k"], x["g"].float(), x["beta"].float(), x["initial_state"].float()]
    assert hopper.misaligned(x["q"], x["v"], *others, None) is None
    assert triton_chunk.hopper_plan(OnGpu(x["q"]), OnGpu(x["v"]), None, 1, others=tuple(others)) == \
        hopper_forward.LAUNCH
    for i in range(len(others)):
        moved = list(others)
        moved[i] = off_boundary(others[i])
        assert torch.equal(moved[i], others[i]) and moved[i].is_contiguous()
        assert hopper.misaligned(x["q"], x["v"], *moved) == 2 + i
        assert triton_chunk.hopper_plan(OnGpu(x["q"]), OnGpu(x["v"]), None, 1, others=tuple(moved)) is None
    assert triton_chunk.hopper_plan(OnGpu(off_boundary(x["q"])), OnGpu(x["v"]), None, 1) is None
    assert hopper.misaligned(off_boundary(x["v"], 8)) is None          # 8 bf16 elements: 16 bytes on


@pytest.mark.interpreter
def test_hopper_forward_path_falls_back_where_the_kernel_cannot_run(monkeypatch):
    """triton_chunk.FORWARD_PATH = "hopper" on inputs the kernel does not take (here: CPU tensors under the
    interpreter) runs the "auto" path: the same output and final state."""
    x = inputs(2, 70, 1, 2, 16, 16, dtype=torch.float32)
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=x["initial_state"].float(), output_final_state=True, backend="triton")
    o_auto, ht_auto = linattn.chunk_gated_delta_rule(*args, **kw)
    monkeypatch.setattr(triton_chunk, "FORWARD_PATH", "hopper")
    o_h, ht_h = linattn.chunk_gated_delta_rule(*args, **kw)
    assert torch.equal(o_h, o_auto) and torch.equal(ht_h, ht_auto)


def test_hopper_launch_needs_programs_that_fill_the_card():
    """The "auto" path takes the Hopper forward only where its programs fill the SMs: BV=128 first, then 64 (more
    programs), else None (the Triton paths, which split long sequences). Issue 4's rows on 132 SMs."""
    from linattn.ops.hopper.forward import LAUNCH, hopper_launch
    assert hopper_launch(8, 16, 128, 132) == LAUNCH                  # B=8 T=4096 H=16: 128 programs
    assert hopper_launch(4, 32, 128, 132) == LAUNCH                  # 4×8192 HV=32
    assert hopper_launch(2, 32, 128, 132) == dict(LAUNCH, BV=64)     # 2×16384 H=32: 64 at BV=128, 128 at 64
    assert hopper_launch(1, 16, 128, 132) is None                    # B=1 H=16: 32 programs at most
    assert hopper_launch(1, 8, 128, 132) is None
    assert hopper_launch(16, 16, 64, 132) == dict(LAUNCH, BV=64)     # K = V = 64: BV=128 does not divide V
    assert hopper_launch(4, 16, 256, 132) == LAUNCH                  # V = 256: two tiles per head


def test_hopper_plan_decides_cpu_and_fp32_without_the_hopper_modules(monkeypatch):
    """hopper_plan answers None for CPU, fp16 and fp32 inputs before importing anything of ops/hopper."""
    x = inputs(1, 64, 1, 1, 64, 64, dtype=torch.bfloat16)
    for path in ("auto", "hopper"):
        monkeypatch.setattr(triton_chunk, "FORWARD_PATH", path)
        assert triton_chunk.hopper_plan(x["q"], x["v"], None, 1) is None
        assert triton_chunk.hopper_plan(x["q"].float(), x["v"].float(), None, 1) is None


def test_segment_count_fills_the_card_with_views():
    """The segmented Hopper forward (FORWARD_PATH = "hopper" where the plain kernel cannot fill the SMs): the fewest
    power-of-two segments per sequence that fill the card, dividing T's chunks, ≥ MIN_SEGMENT_CHUNKS each."""
    from linattn.ops.hopper.forward import segment_count
    assert segment_count(1, 16, 128, 32768, 132) == 8          # 16 → 128 programs of BV=128
    assert segment_count(1, 8, 128, 32768, 132) == 16          # 2/8 heads
    assert segment_count(1, 16, 128, 131072, 132) == 8
    assert segment_count(1, 16, 128, 4096, 132) == 4           # 64 chunks: 4 segments of 16 chunks
    assert segment_count(1, 16, 128, 4096 + 64, 132) is None   # 65 chunks: no equal segments
    assert segment_count(1, 16, 128, 1000, 132) is None        # T not a multiple of 64
    assert segment_count(1, 1, 128, 2048, 132) is None         # 32 chunks: 2 segments of 16 cannot fill 132 SMs


def test_plan_takes_segments_where_the_kernel_alone_cannot_fill_the_card(monkeypatch):
    """hopper.forward.plan (what hopper_plan runs on sm_90): the unsegmented kernel where it fills the SMs, else the
    segmented forward (under "auto" only with SEGMENTED_AUTO; below MIN_SEGMENTED_HEAD_TOKENS rows without its
    levers, with SMALL_SEGMENTED), else None under "auto" and the unsegmented kernel at its fitted launch when
    forced."""
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper.forward import LAUNCH, plan
    monkeypatch.setattr(hopper_fwd, "SMALL_PLAN_IN_WALK", False)                           # its own test below
    monkeypatch.setattr(hopper_fwd, "SEGMENTED_AUTO", False)
    assert plan(1, 16, 128, 32768, 132, False) is None                                     # "auto": no segments
    assert plan(1, 16, 128, 32768, 132, True) == dict(LAUNCH, segments=8)                  # forced: segments
    monkeypatch.setattr(hopper_fwd, "SEGMENTED_AUTO", True)
    for forced in (False, True):
        assert plan(8, 16, 128, 4096, 132, forced) == LAUNCH                               # fills: no segments
        assert plan(1, 16, 128, 32768, 132, forced) == dict(LAUNCH, segments=8)            # 8 × 16 programs
        assert plan(1, 8, 128, 32768, 132, forced) == dict(LAUNCH, segments=16)            # 2¹⁸ rows: enough work
    monkeypatch.setattr(hopper_fwd, "SMALL_SEGMENTED", False)
    assert plan(1, 16, 128, 4096, 132, False) is None                                      # 2¹⁶ rows: the split
    monkeypatch.setattr(hopper_fwd, "SMALL_SEGMENTED", True)
    small = dict(LAUNCH, BV=64, segments=4, skip_maps=False, warm_up=False)     # 2¹⁶ rows: host-bound, 4 launches
    assert plan(1, 16, 128, 4096, 132, False) == small
    assert plan(1, 16, 128, 4096, 132, True) == dict(LAUNCH, BV=64, segments=4)            # 4 × 16 × 2 programs
    assert plan(1, 16, 128, 1000, 132, False) is None                                      # T: no equal segments
    assert plan(1, 16, 128, 1000, 132, True) == LAUNCH
    assert plan(1, 16, 192, 1000, 132, True) == dict(LAUNCH, BV=64)


def test_plan_with_wide_segments_cuts_where_only_the_narrow_tile_fills(monkeypatch):
    """WIDE_SEGMENTS: where BV=128's programs do not fill the card but BV=64's do (and the shape has 2¹⁸ rows or
    more), two segments at BV=128 instead of the unsegmented kernel at BV=64; elsewhere the plan as without it."""
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper.forward import LAUNCH, plan
    shapes = [(2, 32, 128, 16384), (8, 16, 128, 4096), (1, 16, 128, 32768), (2, 32, 64, 16384), (2, 32, 128, 1000),
              (1, 32, 128, 4096)]
    without = {shape: plan(*shape, 132, False) for shape in shapes}
    assert without[(2, 32, 128, 16384)] == dict(LAUNCH, BV=64)                 # 128 programs at BV=64
    monkeypatch.setattr(hopper_fwd, "WIDE_SEGMENTS", True)
    assert plan(2, 32, 128, 16384, 132, False) == dict(LAUNCH, segments=2)      # 2 × 2 × 32 programs at BV=128
    assert plan(2, 32, 128, 16384, 132, True) == dict(LAUNCH, segments=2)
    # unchanged: BV=128 fills the card; segmented already; V=64 (no wide tile); T not a multiple of 64 · 2
    for shape in ((8, 16, 128, 4096), (1, 16, 128, 32768), (2, 32, 64, 16384), (2, 32, 128, 1000)):
        assert plan(*shape, 132, False) == without[shape], shape
    assert plan(2, 32, 128, 4096, 132, False) == dict(LAUNCH, segments=2)       # 2¹⁸ rows: segments of 32 chunks
    assert plan(1, 32, 128, 4096, 132, False) == without[(1, 32, 128, 4096)]    # 2¹⁷ rows: as without


@ON_HOPPER
@pytest.mark.parametrize("gates", ["drawn", "slow"])
def test_wide_segments_through_the_op_on_the_gpu(monkeypatch, gates):
    """bf16 B=2 T=4096 H=HV=32 K=V=128 through the op ("auto": the unsegmented kernel at BV=64, or with
    WIDE_SEGMENTS two segments at BV=128): as accurate as the unsegmented kernel against the float64 recurrence
    (within 15%; both within 1e-2), at the drawn gates (every head warms up) and slow ones (/ 65536: every head walks
    its maps); the plan with it segments this shape on this card."""
    from linattn.ops.hopper import forward as hopper_fwd
    x = gpu_inputs(2, 4096, 32, 32, 128, 128, seed=7)
    if gates == "slow":
        x["g"] = x["g"] / 65536
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    (o_off, h_off), (o_on, h_on) = op_outputs_off_and_on(monkeypatch, hopper_fwd, "WIDE_SEGMENTS", x)
    off, on = (rel(o_off, ro), rel(h_off, rht)), (rel(o_on, ro), rel(h_on, rht))
    assert max(off + on) < 1e-2, (off, on)
    assert on[0] < 1.15 * off[0] and on[1] < 1.15 * off[1], (off, on)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert hopper_fwd.plan(2, 32, 128, 4096, sms, False).get("segments") == 2      # as monkeypatched: on


@pytest.mark.parametrize("narrow_first", [False, True])
def test_split_heads_order_puts_one_walk_on_the_side_stream_and_joins(monkeypatch, narrow_first):
    """split_heads_order: the narrow walk on the side stream and the wide one on the caller's, or the other way
    round with SPLIT_HEADS_NARROW_FIRST; the caller's stream joins after both are launched."""
    from linattn.ops.hopper import forward as hopper_fwd
    events, where = [], ["caller"]

    @contextlib.contextmanager
    def side():
        where[0] = "side"
        yield
        where[0] = "caller"

    monkeypatch.setattr(hopper_fwd, "critical_fork", lambda device: (side(), lambda: events.append("join")))
    monkeypatch.setattr(hopper_fwd, "SPLIT_HEADS_NARROW_FIRST", narrow_first)
    hopper_fwd.split_heads_order(lambda: events.append(("narrow", where[0])),
                                 lambda: events.append(("wide", where[0])), torch.device("cpu"))
    placed = dict(e for e in events if e != "join")
    assert placed == ({"narrow": "caller", "wide": "side"} if narrow_first else {"narrow": "side", "wide": "caller"})
    assert events[-1] == "join" and len(events) == 3


def test_plan_with_split_heads_routes_each_head_where_only_the_narrow_tile_fills(monkeypatch):
    """SPLIT_HEADS: where WIDE_SEGMENTS would cut into two segments, the plan names the split walks instead (each
    head's route decided on the device); where T has no two equal segments of whole chunks, or where WIDE_SEGMENTS
    would not cut, the plan is as without it."""
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper.forward import LAUNCH, plan
    shapes = [(2, 32, 128, 16384), (8, 16, 128, 4096), (1, 16, 128, 32768), (2, 32, 64, 16384), (2, 32, 128, 1000),
              (1, 32, 128, 4096), (2, 32, 128, 4096)]
    without = {shape: plan(*shape, 132, False) for shape in shapes}
    monkeypatch.setattr(hopper_fwd, "SPLIT_HEADS", True)
    for forced in (False, True):
        assert plan(2, 32, 128, 16384, 132, forced) == dict(LAUNCH, segments=2, split_heads=True)
    assert plan(2, 32, 128, 4096, 132, False) == dict(LAUNCH, segments=2, split_heads=True)     # 2¹⁸ rows
    for shape in shapes[1:6]:
        assert plan(*shape, 132, False) == without[shape], shape
    # 65 chunks (2¹⁸ rows and more): no two equal segments, so the narrow tile unsegmented, as without the switch
    assert plan(2, 32, 128, 4160, 132, False) == dict(LAUNCH, BV=64)


def test_split_heads_cold_test_bounds_every_warm_heads_warm_up():
    """map_bound.cold_heads_ref (the route both split walks compute): a head it does not call cold finds every
    segment's warm-up within the cap (warm_from_bound_ref's w ≤ ⌊LC · cap⌋), and the heads whose windows sum at or
    above the threshold are cold; at bounds that never fall (no forgetting) every head is cold."""
    from linattn.ops.hopper.map_bound import cold_heads_ref, warm_from_bound_ref
    gen = torch.Generator().manual_seed(4)
    B, S, HV, LC, cap = 2, 4, 6, 16, 0.375
    bound = -torch.rand(B * S, HV, LC, generator=gen) * torch.tensor([0.5, 2, 4, 8, 16, 64])[:, None] + 0.3
    cold = cold_heads_ref(bound, S, cap, -30.0)
    w, _ = warm_from_bound_ref(bound, S, -30.0)
    w = w.view(B, S, HV)[:, 1:]
    assert cold.any() and (~cold).any(), cold
    assert (w.amax(dim=1)[~cold] <= LC * 24 // 64).all()
    assert cold[:, 0].all() and not cold[:, -1].any()           # 6 chunks of ≈ −0.25 each against ≈ −32 each
    assert cold_heads_ref(bound.abs(), S, cap, -30.0).all()


@ON_HOPPER
@pytest.mark.parametrize("gates", ["drawn", "slow", "mixed"])
def test_split_heads_on_the_gpu(gates):
    """forward_hopper(split_heads=True) at B=2 T=4096 H=HV=32 K=V=128 in bf16: within the bf16 bound of the float64
    recurrence and as accurate as the unsegmented kernel at BV=64 (within 15%); each head's o is the walk its
    route names (map_bound.cold_heads_ref on the pre-pass's bounds): a warm head's bitwise the planned warm walk's
    at two segments and BV=128, a cold head's the unsegmented walk's at BV=64 (another kernel: to 1e-3). Drawn gates:
    every head warm; slow (/ 65536): every head cold; mixed: the odd heads slow, so both launches write into one o."""
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper.map_bound import cold_heads_ref
    x = gpu_inputs(2, 4096, 32, 32, 128, 128, seed=7)
    if gates == "slow":
        x["g"] = x["g"] / 65536
    elif gates == "mixed":
        x["g"][..., 1::2] /= 65536
    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [128 ** -0.5, x["initial_state"]]
    with torch.no_grad():
        o, ht = hopper_fwd.forward_hopper(*args, segments=2, split_heads=True, **hopper_fwd.LAUNCH)
        o_wide, ht_wide = hopper_fwd.forward_hopper(*args, segments=2, plan_in_walk=True, **hopper_fwd.LAUNCH)
        o_narrow, ht_narrow = hopper_fwd.forward_hopper(*args, **dict(hopper_fwd.LAUNCH, BV=64))
        bound = hopper_fwd.run_prepass(x["k"], x["v"], x["g"], x["beta"], 2)[3]
    cold = cold_heads_ref(bound, 2, hopper_fwd.SPLIT_HEADS_CAP, hopper_fwd.NEGLIGIBLE_M_LOG2)      # [B, HV]
    expected = {"drawn": (0, 64), "slow": (64, 0)}.get(gates)
    if expected is not None:
        assert (int(cold.sum()), int((~cold).sum())) == expected, cold
    else:
        assert cold[:, 1::2].all() and not cold[:, ::2].any(), cold
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    assert rel(o, ro) < 1e-2 and rel(ht, rht) < 1e-2
    assert rel(o, ro) < 1.15 * rel(o_narrow, ro) and rel(ht, rht) < 1.15 * rel(ht_narrow, rht)
    for b in range(2):
        for h in range(32):
            if cold[b, h]:
                assert rel(o[b, :, h], o_narrow[b, :, h]) < 1e-3 and rel(ht[b, h], ht_narrow[b, h]) < 1e-3, (b, h)
            else:
                assert torch.equal(o[b, :, h], o_wide[b, :, h]) and torch.equal(ht[b, h], ht_wide[b, h]), (b, h)


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


def test_plan_under_capture_picks_by_gpu_time(monkeypatch):
    """Under CUDA graph capture, with SEGMENTED_WHEN_CAPTURED, "auto" segments small shapes too, with the levers
    (the host's cost is paid once); without the flag, or eagerly, the small shape keeps the split."""
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper.forward import LAUNCH, plan
    monkeypatch.setattr(hopper_fwd, "SEGMENTED_AUTO", True)
    monkeypatch.setattr(hopper_fwd, "SMALL_SEGMENTED", False)
    monkeypatch.setattr(hopper_fwd, "SMALL_PLAN_IN_WALK", False)
    monkeypatch.setattr(hopper_fwd, "SEGMENTED_WHEN_CAPTURED", False)
    assert plan(1, 16, 128, 4096, 132, False, capturing=True) is None
    monkeypatch.setattr(hopper_fwd, "SEGMENTED_WHEN_CAPTURED", True)
    assert plan(1, 16, 128, 4096, 132, False, capturing=False) is None
    assert plan(1, 16, 128, 4096, 132, False, capturing=True) == dict(LAUNCH, BV=64, segments=4)
    assert plan(1, 16, 128, 1000, 132, False, capturing=True) is None                      # T: no equal segments


@pytest.mark.parametrize("threads,min_blocks", [(256, 1), (256, 2), (128, 1), (128, 2), (128, 3), (384, 1)])
def test_consumer_registers_fit_what_the_program_holds_at_launch(threads, min_blocks):
    """setmaxnreg.inc takes registers from the program's own pool and waits until it holds enough, so the split
    must fit the registers ptxas gives each thread at launch under __launch_bounds__(threads + 128, min_blocks) (64K
    per SM over the programs, in steps of 8): the producer's 24 and the consumers' share within them, as large as it
    can be, a multiple of 8 in setmaxnreg's [24, 256]. Run 28's two programs per SM asked 112 of a pool that held
    ≤ 108 and hung; TileLang's own split at one program per SM is 24 / 240."""
    at_launch = min(256, 65536 // (min_blocks * (threads + 128)) // 8 * 8)
    c = hopper.consumer_registers(threads, min_blocks)
    assert c % 8 == 0 and 24 <= c <= 256
    assert 128 * 24 + threads * c <= (threads + 128) * at_launch
    assert c == 256 or 128 * 24 + threads * (c + 8) > (threads + 128) * at_launch
    assert hopper.consumer_registers(256, 1) == 240 and hopper.consumer_registers(256, 2) == 104
    assert hopper.consumer_registers(128, 2) == 232


def test_two_programs_per_sm_where_they_fill_two_per_sm(monkeypatch):
    """TWO_PER_SM: BV=64, one consumer warpgroup, one load stage, two programs per SM where B·HV·V/64 programs fill
    two per SM (rows 2 and 5 of issue 4: 256 programs on 132 SMs); elsewhere the one-per-SM launches as before."""
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper.forward import LAUNCH, hopper_launch
    monkeypatch.setattr(hopper_fwd, "TWO_PER_SM", True)
    two = dict(LAUNCH, BV=64, threads=128, num_stages=1, min_blocks=2)
    assert hopper_launch(8, 16, 128, 132) == two and hopper_launch(4, 32, 128, 132) == two
    assert hopper_launch(2, 32, 128, 132) == dict(LAUNCH, BV=64)                      # 128 programs: one per SM
    assert hopper_launch(1, 16, 128, 132) is None
    monkeypatch.setattr(hopper_fwd, "TWO_PER_SM", False)
    assert hopper_launch(8, 16, 128, 132) == LAUNCH


def test_plan_takes_the_two_launch_segmented_forward_for_small_shapes(monkeypatch):
    """SMALL_PLAN_IN_WALK: below MIN_SEGMENTED_HEAD_TOKENS "auto" segments with the warm-ups planned in the walk
    (before SMALL_SEGMENTED's four launches); larger shapes and the forced path keep the levers."""
    from linattn.ops.hopper import forward as hopper_fwd
    from linattn.ops.hopper.forward import LAUNCH, plan
    monkeypatch.setattr(hopper_fwd, "SEGMENTED_AUTO", True)
    monkeypatch.setattr(hopper_fwd, "SMALL_SEGMENTED", True)
    monkeypatch.setattr(hopper_fwd, "SMALL_PLAN_IN_WALK", True)
    assert plan(1, 16, 128, 4096, 132, False) == dict(LAUNCH, BV=64, segments=4, plan_in_walk=True)
    assert plan(1, 16, 128, 4096, 132, True) == dict(LAUNCH, BV=64, segments=4)
    assert plan(1, 16, 128, 32768, 132, False) == dict(LAUNCH, segments=8)
    monkeypatch.setattr(hopper_fwd, "SMALL_PLAN_IN_WALK", False)
    assert plan(1, 16, 128, 4096, 132, False)["warm_up"] is False                          # SMALL_SEGMENTED's


def small_call_recording_plans(monkeypatch, plan_in_walk: bool, when_captured: bool, seed: int = 0):
    """B=1 T=4096 H=16 through the op ("auto") with SMALL_PLAN_IN_WALK and SEGMENTED_WHEN_CAPTURED set: (the inputs,
    the list that collects the keywords of every forward_hopper call, the call)."""
    from linattn.ops.hopper import forward as hopper_fwd
    monkeypatch.setattr(hopper_fwd, "SMALL_PLAN_IN_WALK", plan_in_walk)
    monkeypatch.setattr(hopper_fwd, "SEGMENTED_WHEN_CAPTURED", when_captured)
    monkeypatch.setattr(triton_chunk, "FORWARD_PATH", "auto")
    x = gpu_inputs(1, 4096, 16, 16, 128, 128, seed=seed)
    plans = []
    real = hopper_fwd.forward_hopper
    monkeypatch.setattr(hopper_fwd, "forward_hopper", lambda *a, **kw: plans.append(kw) or real(*a, **kw))
    return x, plans, lambda: linattn.chunk_gated_delta_rule(**x, output_final_state=True)


@ON_HOPPER
def test_a_captured_small_call_takes_the_segmented_forward(monkeypatch):
    """B=1 T=4096 H=16 through the op captured in a CUDA graph, with SEGMENTED_WHEN_CAPTURED: the replay runs the
    segmented forward with its levers, bitwise what the same plan writes eagerly, and the eager call keeps the
    split."""
    from linattn.ops.hopper import forward as hopper_fwd
    # eager small calls: the split
    x, plans, call = small_call_recording_plans(monkeypatch, plan_in_walk=False, when_captured=True)
    with torch.no_grad():
        eager = call()
        assert plans == []                                                 # eager: the split
        small = hopper_fwd.MIN_SEGMENTED_HEAD_TOKENS
        monkeypatch.setattr(hopper_fwd, "MIN_SEGMENTED_HEAD_TOKENS", 0)   # the same plan eagerly (its kernels warm)
        want = call()
        assert plans[-1].get("segments") == 4 and "skip_maps" not in plans[-1]
        monkeypatch.setattr(hopper_fwd, "MIN_SEGMENTED_HEAD_TOKENS", small)
        _, captured = warm_up_capture_replay(call)
    assert len(plans) == 2 and plans[0] == plans[1]                        # the capture took the segmented plan
    assert all(torch.equal(a, b) for a, b in zip(captured, want))
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    for o, ht in (captured, eager):       # the core issue's bf16 bound (the split's error is the smaller)
        assert rel(o, ro) < 5e-3 and rel(ht, rht) < 5e-3


@ON_HOPPER
@pytest.mark.parametrize("routes", [False, True], ids=["plain", "routed"])
def test_a_captured_small_call_replays_the_two_launch_forward(monkeypatch, routes):
    """SMALL_PLAN_IN_WALK (SEGMENTED_WHEN_CAPTURED off): B=1 T=4096 H=16 through the op takes the two-launch plan
    eagerly and under capture alike (nothing in it waits on the host), and the replay writes the eager call's
    numbers bitwise, within the bf16 bound of the float64 recurrence. With routes (prepared_route.ROUTES) the eager
    call runs the plain forward, the warm-up its prepared call (which records the route), and the capture takes the
    route: forward_hopper sees two calls, not three."""
    from linattn.ops.gated_delta import prepared_route
    from linattn.ops.hopper import prepared
    monkeypatch.setattr(prepared_route, "ROUTES", routes)
    monkeypatch.setattr(prepared_route, "_routes", {})     # no route nor prepared call from an earlier test
    monkeypatch.setattr(prepared, "_prepared", {})
    x, plans, call = small_call_recording_plans(monkeypatch, plan_in_walk=True, when_captured=False, seed=5)
    with torch.no_grad():
        eager = call()
        _, captured = warm_up_capture_replay(call)
    assert len(plans) == (2 if routes else 3) and plans[0].get("plan_in_walk") is True
    assert all(plan == plans[0] for plan in plans)
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    assert rel(eager[0], ro) < 5e-3 and rel(eager[1], rht) < 5e-3


@ON_HOPPER
def test_a_capture_whose_segmented_kernels_never_ran_eagerly(monkeypatch):
    """What a user's warm-up leaves (torch.compile's CUDA graphs too): eager calls of a small shape run the split,
    so under SEGMENTED_WHEN_CAPTURED the segmented forward's kernels are first built, loaded and launched inside the
    capture. The capture must succeed and replay within the bf16 bound. Meaningful only in a process where no
    Hopper kernel of this shape ran before: run it alone first (``-k never_ran_eagerly``)."""
    from linattn.ops.hopper import forward as hopper_fwd
    monkeypatch.setattr(hopper_fwd, "SMALL_PLAN_IN_WALK", False)              # eager small calls: the split
    monkeypatch.setattr(hopper_fwd, "SEGMENTED_WHEN_CAPTURED", True)
    monkeypatch.setattr(triton_chunk, "FORWARD_PATH", "auto")
    x = gpu_inputs(1, 2048, 32, 32, 128, 128, seed=1)

    def call():
        return linattn.chunk_gated_delta_rule(**x, output_final_state=True)
    with torch.no_grad():
        eager, captured = warm_up_capture_replay(call)                     # the warm-up: the split
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    for o, ht in (captured, eager):
        assert rel(o, ro) < 5e-3 and rel(ht, rht) < 5e-3
    assert not torch.equal(captured[0], eager[0])                          # two paths, not one twice


@ON_HOPPER
@pytest.mark.parametrize("slow_heads", [False, True], ids=["forgetting", "slow_heads"])
def test_the_two_launch_segmented_forward_on_the_gpu(slow_heads):
    """forward_hopper(segments=4, plan_in_walk=True) at B=1 T=4096 H=16 in bf16: within the bf16 bound of the float64
    recurrence and, where every head forgets, close to the five-launch segmented forward (the same warm-ups, up to
    where a sum in another order crosses the threshold). With slow heads (g/256: no warm-up within the sequence)
    their segments walk from the sequence's start, and the result is still the recurrence's."""
    from linattn.ops.hopper import forward as hopper_fwd
    x = gpu_inputs(1, 4096, 16, 16, 128, 128, seed=3)
    if slow_heads:
        x["g"][..., ::2] /= 256
    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [128 ** -0.5, x["initial_state"]]
    launch = hopper_fwd.plan(1, 16, 128, 4096, torch.cuda.get_device_properties(0).multi_processor_count, True)
    assert launch["segments"] == 4
    with torch.no_grad():
        o2, ht2 = hopper_fwd.forward_hopper(*args, plan_in_walk=True, **launch)
        o5, ht5 = hopper_fwd.forward_hopper(*args, **launch)
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    assert rel(o2, ro) < 5e-3 and rel(ht2, rht) < 5e-3
    if not slow_heads:      # the same warm-ups; slow heads take maps in one and the whole prefix in the other, two
        assert rel(o2, o5) < 1e-3 and rel(ht2, ht5) < 1e-3      # bf16 roundings as far from each other as from float64
    else:
        assert rel(o5, ro) < 5e-3


@ON_HOPPER
def test_two_programs_per_sm_on_the_gpu():
    """forward_hopper at TWO_PER_SM_LAUNCH (BV=64, one stage, two programs per SM) against LAUNCH, B=8 T=1024 H=16 in
    bf16: the same products per element, so equal up to the dots' accumulation order; within the bf16 bound."""
    from linattn.ops.hopper import forward as hopper_fwd
    x = gpu_inputs(8, 1024, 16, 16, 128, 128, seed=4)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [128 ** -0.5, x["initial_state"]]
    with torch.no_grad():
        o2, ht2 = hopper_fwd.forward_hopper(*args, **hopper_fwd.TWO_PER_SM_LAUNCH)
        o1, ht1 = hopper_fwd.forward_hopper(*args, **hopper_fwd.LAUNCH)
    ro, rht = gated_delta_rule_reference(**x, scale=128 ** -0.5)
    assert rel(o2, ro) < 5e-3 and rel(ht2, rht) < 5e-3
    assert rel(o2, o1) < 1e-3 and rel(ht2, ht1) < 1e-3


@pytest.mark.interpreter
def test_a_kernel_that_does_not_compile_sends_the_op_to_triton_once(monkeypatch):
    """Where TileLang imports but cannot build the kernel (no CUDA toolkit, ...), the op warns once, returns the
    Triton forward's result, and turns the Hopper path away from then on (unsupported_reason says why)."""
    from linattn.ops.hopper import forward as hopper_fwd
    monkeypatch.setattr(hopper, "COMPILE_FAILED", None)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise hopper.HopperCompileError("nvcc: not found")

    x = inputs(1, 70, 1, 2, 16, 16, dtype=torch.float32)
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=x["initial_state"].float(), output_final_state=True, backend="triton")
    o_ref, ht_ref = linattn.chunk_gated_delta_rule(*args, **kw)
    monkeypatch.setattr(triton_chunk, "hopper_plan",
                        lambda *a, **kw: None if hopper.COMPILE_FAILED else dict(hopper_fwd.LAUNCH))
    monkeypatch.setattr(hopper_fwd, "forward_hopper", failing)
    with pytest.warns(RuntimeWarning, match="did not compile"):
        o, ht = linattn.chunk_gated_delta_rule(*args, **kw)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    assert "nvcc" in hopper.COMPILE_FAILED and len(calls) == 1
    o2, _ = linattn.chunk_gated_delta_rule(*args, **kw)            # no second attempt, no second warning
    assert torch.equal(o2, o_ref) and len(calls) == 1


def test_launcher_calls_the_executable_only_where_it_can(monkeypatch):
    """DIRECT_LAUNCH calls the tvm_ffi executable of a kernel without outputs to allocate, under the default
    launcher; a kernel whose wrapper allocates outputs, another launcher, or the switch off keep the kernel."""
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
    for name, value in (("DIRECT_LAUNCH", False), ("EXECUTION_BACKEND", "cython")):
        monkeypatch.setattr(hopper, name, value)
        hopper.launcher.cache_clear()
        assert hopper.launcher(plain) is plain
        monkeypatch.undo()
    hopper.launcher.cache_clear()


def test_kernel_takes_bf16_only():
    x = inputs(1, 64, 1, 1, 64, 64, dtype=torch.float32)
    gc = torch.zeros(1, 64, 1)
    with pytest.raises(TypeError, match="bf16"):
        walk_launch.chunk_fwd_hopper(x["q"], x["k"], x["v"], gc, x["beta"], torch.zeros(1, 64, 1, 64), 0.125, None)


def test_out_tensors_of_the_wrong_layout_say_why_before_any_compile():
    """``out``: o and the final state written into the caller's tensors; a wrong shape, dtype or a strided view is a
    ValueError (checked before the kernel is compiled: none is here)."""
    x = inputs(2, 64, 1, 1, 64, 64, dtype=torch.bfloat16)
    gc = hopper.head_major(torch.zeros(2, 64, 1))
    a_inv = torch.zeros(2, 64, 1, 64, dtype=torch.bfloat16)
    args = (x["q"], x["k"], x["v"], gc, gc.clone(), a_inv, 0.125, None)
    o, ht = torch.empty_like(x["v"]), torch.empty(2, 1, 64, 64)
    strided = torch.empty(2, 64, 1, 128, dtype=torch.bfloat16)[..., :64]
    for bad in ((o[:1], ht), (o, ht.double()), (strided, ht)):
        with pytest.raises(ValueError, match="out must be"):
            walk_launch.chunk_fwd_hopper_hm(*args, out=bad)
    with pytest.raises(ValueError, match="not with warm_chunks"):
        walk_launch.chunk_fwd_hopper_hm(*args, out=(o, ht), warm_chunks=torch.zeros(2, 1, dtype=torch.int32))


@pytest.mark.skipif(not hopper.tilelang_available() or shutil.which("nvcc") is None,
                    reason="TileLang (optional) and nvcc compile the Hopper kernel")
@pytest.mark.parametrize("head_split, BV", [(2, 64), (1, 128)])
def test_head_split_route_loads_divide_nothing(head_split, BV):
    """The head split's cold test: its loads unrolled by ROUTE_UNROLL, each addressed without a division or
    remainder by the symbolic sizes (run 39: a program that walks nothing held its SM ≈ 25 µs when each load's
    address and guard divided by L/64 in 64 bits)."""
    src = walk_launch.warm_kernel(32, 32, 128, 128, BV, 128 ** -0.5, 256, 2, False, torch.float32, torch.bfloat16,
                                  True, True, True, -30.0, 1, True, head_split=head_split, split_cap=0.375,
                                  target="sm_90a").get_kernel_source()
    route = src[src.index("for (int jb = 0;"):src.index("window = (window + condval);")]
    assert f"for (int u = 0; u < {hopper.ROUTE_UNROLL}; ++u)" in route and "ctl[" in route
    body = re.sub(r"/\*.*?\*/", "", route[route.index("++jb) {") + len("++jb) {"):])     # the literals' comments
    assert "/" not in body and "%" not in body


@pytest.mark.skipif(not hopper.tilelang_available() or shutil.which("nvcc") is None,
                    reason="TileLang (optional) and nvcc compile the Hopper kernel")
def test_kernel_compiles_for_sm90a_with_wgmma_and_tma():
    """Five bf16 wgmma dots per chunk and A_inv X at tf32 on mma.sync (fp32 A_inv), or six wgmma (bf16 A_inv); with
    async_dots the first three are waited for one by one (K S first, for X)."""
    srcs = {(a, asy): hopper.compiled_kernel(16, 16, 128, 128, 64, 128 ** -0.5, target="sm_90a", a_dtype=a,
                                             async_dots=asy).get_kernel_source()
            for a, asy in (("float32", False), ("bfloat16", True))}
    assert all("tma_load" in src for src in srcs.values())
    assert srcs["float32", False].count("wgmma_ss<") == 5 and "kTensorFloat32" in srcs["float32", False]
    assert srcs["bfloat16", True].count("wgmma_ss<") == 6 and "wait_wgmma<2>" in srcs["bfloat16", True]
    assert "wait_wgmma" not in srcs["float32", False]
    # tma_o: o's tile leaves through shared memory by TMA instead of per-thread global stores
    tma_o = hopper.compiled_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, target="sm_90a",
                                   a_dtype="bfloat16", async_dots=True, tma_o=True).get_kernel_source()
    assert "tma_store(o_desc" in tma_o and "tma_store" not in srcs["bfloat16", True]
    # stsm (the default launch): X, P, V_new and ρ ⊙ V_new leave their accumulators by stmatrix, no per-thread
    # stores of bf16 pairs into those tiles; the scale is in P's exponent and Γ's factor, no pass over o
    stsm = hopper.compiled_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, target="sm_90a",
                                  a_dtype="bfloat16", async_dots=True, tma_o=True, stsm=True).get_kernel_source()
    for tile in ("Xs", "Ps", "Vns", "Vds"):
        # a store of one element or one pair into the tile by its own index: "((bfloat16_t*)Ps)[i] = " or
        # "*(uint1*)(((bfloat16_t*)Xs) + i) = "
        per_thread = rf"(\(\(bfloat16_t\*\){tile}\)\[[^;]*\] = |\*\(uint1\*\)\(\(\(bfloat16_t\*\){tile}\) \+)"
        assert re.search(per_thread, tma_o) and not re.search(per_thread, stsm)
        assert f"ptx_stmatrix_m8n8_x4((&(((bfloat16_t*){tile})" in stsm
    scaled_gamma = r"Gam\[[^\]]*\] \* 0x1\.6a09e667f3bcdp-4f"                      # Γ · 128^-0.5
    assert re.search(scaled_gamma, stsm) and not re.search(scaled_gamma, tma_o)
    assert "+ -0x1.3687a9f1af2b1p+1f" in stsm                                       # gc + ln(128^-0.5)
    # beta_in_a (A_inv diag(β) from the pre-pass): β neither loaded (no TMA descriptor) nor multiplied
    no_beta = hopper.compiled_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, target="sm_90a",
                                     a_dtype="bfloat16", async_dots=True, tma_o=True, stsm=True,
                                     beta_in_a=True).get_kernel_source()
    assert "beta_desc" in stsm and "Beta[" in stsm and "beta_desc" not in no_beta and "Beta[" not in no_beta
    affine = hopper.compiled_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, target="sm_90a",
                                    use_initial_state=False, a_dtype="bfloat16", async_dots=True,
                                    affine=True).get_kernel_source()
    # phase A: the state's three dots (K S, A_inv X, the update), no query loads, no output
    assert affine.count("wgmma_ss<") == 3 and "q_desc" not in affine and "o_desc" not in affine
    # the maps' skip (skip_m, the kernel's ctl: 1 the M tiles, 2 every tile): producer and consumers both take
    # their loop count from it; the output walk never reads it
    assert affine.count("ctl[") == 4 and "== 2)" in affine and all("ctl[" not in src for src in srcs.values())
    # the warm walk (phase C with warm-ups): its loop count and first chunk from ctl, o stored by TMA under a
    # condition (the warm-up's chunks write nothing), gc / β rows per segment (symbolic L)
    warm = hopper.compiled_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, target="sm_90a",
                                  a_dtype="bfloat16", async_dots=True, warm=True).get_kernel_source()
    assert "int chunks = ((L >> 6) + ctl[" in warm and "tma_store(o_desc" in warm and "int L," in warm
    # warm_planned (the two-launch segmented forward): every role finds w itself from the chunk bounds (ctl fp32,
    # [B·S, HV, LC]) — the same loop in the producer and the consumers —, the register split asked for explicitly
    # (TileLang drops it when the producer stores to a local: the consumers then stayed at 168 and spilled), the
    # sequence's h0 read only where the walk starts at the sequence's start
    planned = hopper.compiled_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, target="sm_90a",
                                     a_dtype="bfloat16", async_dots=True, warm=True, stsm=True,
                                     warm_planned=True).get_kernel_source()
    assert "const float* __restrict__ ctl" in planned and "int LC," in planned and "int B," in planned
    assert planned.count("while (1)") == 2 and planned.count("-0x1.ep+4f") == 2            # threshold −30
    assert "warpgroup_reg_dealloc<24>()" in planned and "warpgroup_reg_alloc<240>()" in planned
    assert re.search(r"if \(c0(_\d+)? == 0\) \{", planned) and "int chunks = ((L >> 6) + wv);" in planned
    assert "warpgroup_reg_dealloc<24>()" in warm and "while (1)" not in warm
    # min_blocks = 2 (forward.TWO_PER_SM_LAUNCH: BV=64, one consumer warpgroup, one stage): launch bounds for two
    # programs per SM, the consumers' registers within what the program holds at launch (consumer_registers: 128
    # per thread at launch, 128·24 + 128·232 ≤ 256·128), and the shared memory of one program (the last buffer's
    # offset + its 8 KB) under half the SM's 228 KB
    two = hopper.compiled_kernel(16, 16, 128, 128, 64, 128 ** -0.5, threads=128, num_stages=1, target="sm_90a",
                                 a_dtype="bfloat16", async_dots=True, tma_o=True, stsm=True, beta_in_a=True,
                                 async_o=True, async_ax=True, min_blocks=2).get_kernel_source()
    assert "__launch_bounds__(256, 2)" in two and "warpgroup_reg_alloc<232>()" in two
    assert max(int(n) for n in re.findall(r"buf_dyn_shmem \+ (\d+)\)", two)) + 8192 <= 113 * 1024
    # async_o (ASYNC_O_STORE): o's store is not waited for where it is issued; the wait for its read of the tile
    # comes before the next chunk's stmatrix into the tile, and once more after the loop
    lazy = hopper.compiled_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, target="sm_90a",
                                  a_dtype="bfloat16", async_dots=True, tma_o=True, stsm=True,
                                  async_o=True).get_kernel_source()
    issue = lazy.index("tma_store(o_desc")
    assert "tma_store_wait" not in lazy[issue:lazy.index("}", lazy.index("tma_store_arrive()", issue))]
    assert lazy.count("tma_store_wait<0, true>()") == 2 and stsm.count("tma_store_wait<0, true>()") == 1
    before = lazy[lazy.index("tma_store_wait<0, true>()"):lazy.index("ptx_stmatrix_m8n8_x4((&(((bfloat16_t*)Os)")]
    assert before.count("__sync_thread_partial") == 1 and "ptx_stmatrix" not in before
    # async_ax (ASYNC_AX): A_inv X is left running (Q S and Q Kᵀ waited for: one group may stay in flight) while P's
    # mask and o's factor are applied and P stored; V_new waited for before its tiles are stored
    ax = hopper.compiled_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, target="sm_90a",
                                a_dtype="bfloat16", async_dots=True, tma_o=True, stsm=True, async_o=True,
                                async_ax=True).get_kernel_source()
    issue = ax.index("desc_a_3, (&(((bfloat16_t*)As)")
    mask, of_scaled = ax.index("condval = (QK[", issue), ax.index("*(float2*)(Of + ", issue)
    wait_all = ax.index("wait_wgmma<0>()", issue)
    assert "warpgroup_wait" not in ax[issue:wait_all]
    assert issue < ax.index("wait_wgmma<1>()", issue) < mask < ax.index("bfloat16_t*)Ps)", issue) < of_scaled
    assert of_scaled < wait_all < ax.index("ptx_stmatrix_m8n8_x4((&(((bfloat16_t*)Vns)", issue)
    v_read = ax.index("*(uint1*)(Vr + ")
    assert v_read < ax.index("wait_wgmma<2>()") and lazy.index("*(uint1*)(Vr + ") > lazy.index("wait_wgmma<2>()")
    i = lazy.index("desc_a_3, (&(((bfloat16_t*)As)")
    assert lazy.index("warpgroup_wait<0>()", i) < lazy.index("condval = (QK[", i)    # without it: waited for first


@pytest.mark.skipif(not hopper.tilelang_available() or shutil.which("nvcc") is None,
                    reason="TileLang (optional) and nvcc compile the Hopper kernel")
def test_async_dots_cannot_race_the_load_pipeline():
    """The invariant written at the kernel's dots, on the generated CUDA of the default launch: TileLang hands a
    staged buffer back to the producer after its last use in program order (for Q, the *issue* of the async Q Kᵀ),
    so every buffer's refill for chunk c + 2 must wait behind the one released last in chunk c — the producer's
    first wait — and that release must come after the body's last wgmma wait (the synchronous state update)."""
    src = hopper.compiled_kernel(16, 16, 128, 128, 128, 128 ** -0.5, threads=256, target="sm_90a",
                                 a_dtype="bfloat16", beta_dtype="bfloat16", async_dots=True, tma_o=True,
                                 stsm=True).get_kernel_source()
    producer, consumer = re.split(r"for \(int c_1 = 0;", src, maxsplit=1)
    producer = producer[producer.index("for (int c = 0;"):]
    first_wait = re.search(r"mbarrier\[\(\(c & 1\) \+ (\d+)\)\]\.wait", producer).group(1)
    body = consumer[:consumer.index("mbarrier[((c_1 & 1) + %s)].arrive()" % first_wait) + 1]
    releases = re.findall(r"mbarrier\[\(\(c_1 & 1\) \+ (\d+)\)\]\.arrive\(\)", consumer)
    assert releases and releases[-1] == first_wait                  # the producer waits first on the last release
    last_wait = max(body.rfind("warpgroup_wait<0>"), body.rfind("wait_wgmma<0>"))
    last_issue = body.rfind("wgmma_ss<")
    assert 0 <= last_issue < last_wait                              # every dot of the chunk done before it


def test_role_split_kernel_takes_a_bf16_a_inv_only():
    x = inputs(1, 64, 1, 1, 64, 64, dtype=torch.bfloat16)
    hm = torch.zeros(1, 1, 64)
    with pytest.raises(TypeError, match="role-split kernel takes a bf16 a_inv"):
        walk_launch.chunk_fwd_hopper_hm(x["q"], x["k"], x["v"], hm, hm, torch.zeros(1, 64, 1, 64), 0.125, None,
                                   roles=True)


@pytest.mark.skipif(not hopper.tilelang_available() or shutil.which("nvcc") is None,
                    reason="TileLang (optional) and nvcc compile the Hopper kernel")
def test_role_split_kernel_compiles_with_its_roles_apart():
    """The role-split kernel (chunk_fwd_roles.py) for sm_90a: six wgmma dots (state: the update; delta: K S and
    A_inv X; output: Q Kᵀ, Q S, P V_new), six TMA loads per stage from the producer, the roles' register budgets,
    its affine walk (phase A) without the output role, and no block-wide barrier once the roles have split (a
    __syncthreads() inside one role's branch would wait for threads that never reach it: a hang; within a role,
    TileLang syncs its 128 threads by named barriers)."""
    from linattn.ops.hopper import chunk_fwd_roles
    src = chunk_fwd_roles.compiled_kernel_roles(16, 16, 128, 128, 128, 128 ** -0.5, False, "bfloat16",
                                                target="sm_90a").get_kernel_source()
    roles = src[src.index("if (((int)threadIdx.x) < 128) {"):]
    assert src.count("wgmma_ss<") == 6 and src.count("tl::tma_load(") == 6
    assert f"warpgroup_reg_alloc<{chunk_fwd_roles.STATE_REGS}>" in roles
    assert f"warpgroup_reg_dealloc<{chunk_fwd_roles.PRODUCER_REGS}>" in roles
    assert "__syncthreads()" not in roles and "__sync_thread_partial" in roles
    affine = chunk_fwd_roles.compiled_kernel_roles(16, 16, 128, 128, 128, 128 ** -0.5, False, "bfloat16", True,
                                                   target="sm_90a").get_kernel_source()
    # phase A: the state's three dots on the state and delta roles, no query loads, no output, the same rule
    assert affine.count("wgmma_ss<") == 3 and affine.count("tl::tma_load(") == 5 and "q_desc" not in affine
    assert "__syncthreads()" not in affine[affine.index("if (((int)threadIdx.x) < 128) {"):]


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
