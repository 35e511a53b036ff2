"""The fused Triton forward (pre-pass + one sequential kernel, issue 4) under the interpreter on the CPU.

Each kernel is checked alone against its float64 twins (``torch_chunk``: cumsum → kkt_solve → wy for the pre-pass,
state_pass_fwd → output_fwd for the sequential kernel, fed the twin's own W, U, gc), then the whole fused path
(``chunk_gated_delta_rule_fwd_triton``) against the float64 token-by-token reference and against the unfused
five-stage path that the backward still uses (``chunk_gated_delta_rule_fwd_stages``).

The split-bf16 dots ("bf16x3", ``common/dot.py``) are checked on the sequential kernel with fp32 and bf16 inputs:
its dots widen bf16 operands under the interpreter, which multiplies bf16 ``tl.dot`` operands as raw bits (triton
issue 11584). The pre-pass still feeds bf16 to ``tl.dot`` directly, so the whole bf16 forward is measured on the
GPU (benchmarks/bench_fwd.py). The grid is pruned to where a chunked kernel goes wrong, not a cross product: T = 1
(one partial chunk), 63/65 (either side of the chunk), 200 (four chunks, partial last); K/V = 60/100 (masked tails,
two V slices); K = 160 (BK = 256, BV = 32: the other register configuration); GVA; varlen with lengths 1 and 64 and
an empty sequence; an initial state; strong decay (g ≈ −100: every exp must be of a masked, non-positive argument).
"""
from __future__ import annotations

import pytest
import torch

from linattn.ops.common import CHUNK
from linattn.ops.common.fused_fwd import fused_fwd
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.common.varlen import chunk_tables
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.gated_delta.triton_chunk import chunk_gated_delta_rule_fwd_stages, chunk_gated_delta_rule_fwd_triton
from tests.ops.sm90_compile import compile_for_h200
from tests.ops.test_triton_fwd import Case, make_inputs, rel_rms, twin

pytestmark = pytest.mark.interpreter

TOLERANCES = {
    # relative RMS against the float64 twins: both kernels keep every intermediate in fp32 and products of fp16
    # inputs are exact in fp32, so fp16 inputs meet the fp32 bound (o is written in fp32 in the kernel test)
    "kernel": {torch.float32: 1e-5, torch.float16: 1e-5},
    # whole fused forward vs float64 reference, fp32 inputs (the core issue's bound)
    "forward_fp32": 1e-5,
    # whole fused forward vs the unfused path, same inputs: relative RMS. fp32: both compute the same fp32 math in
    # a different order; fp16: o is rounded to fp16 by both, so they may differ by a rounding step (2^-11)
    "vs_unfused": {torch.float32: 1e-5, torch.float16: 1e-3},
    # sequential kernel with bf16x3 dots vs float64, o written in fp32: the dot helper's own bound
    # (tests/ops/test_dot.py: 16-bit halves, ≤ 2^-14 per operand with the interpreter's truncating casts), which
    # the walk does not amplify: measured 1.9e-5 to 3.3e-5 for o, ≤ 3e-5 for the final state. Plain bf16 or tf32
    # operands would miss it (≈ 2e-3, ≈ 3e-4).
    "split_bf16": 1e-4,
}
DTYPES = [torch.float32, torch.float16]

CASES = [
    Case("T1_B2", T=1),
    Case("T63_K60_V100_h0", T=63, K=60, V=100, B=1, h0=True),
    Case("T65_GVA2x", T=65, H=2, HV=4, B=1),
    Case("T200_h0", T=200, B=1, h0=True),
    Case("T20_K160_V48", T=20, HV=1, K=160, V=48, B=1),
    Case("varlen_1_64_0_70_K60_V100_h0", lengths=(1, 64, 0, 70), K=60, V=100, h0=True),
    Case("T65_strong_decay_h0", T=65, g_mode="strong", h0=True, B=1),
]
IDS = [c.id for c in CASES]


@pytest.fixture(scope="module", params=[(c, d) for c in CASES for d in DTYPES],
                ids=[f"{c.id}-{str(d)[6:]}" for c in CASES for d in DTYPES])
def case(request):
    torch.manual_seed(0)
    c, dtype = request.param
    x, offsets = make_inputs(c, dtype)
    scale = c.K ** -0.5
    ci = chunk_tables(offsets, CHUNK, "cpu")[0] if offsets else None
    return c, x, offsets, ci, scale, twin(x, offsets, scale), dtype


def f32(t):
    return t.float().contiguous()


def test_prepass_matches_twin(case):
    _, x, _, ci, _, ref, dtype = case
    gc, w, u = fused_prepass(x["g"], x["k"], x["v"], x["beta"], x["cu_seqlens"], ci)
    tol = TOLERANCES["kernel"][dtype]
    for name, t in (("gc", gc), ("w", w), ("u", u)):
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        assert rel_rms(t, ref[name]) <= tol, f"{name}: {rel_rms(t, ref[name]):.2e}"


def test_prepass_writes_a_inv_instead_of_w_and_u(case):
    """write_wy=False (the split path's pre-pass from WY_IN_STATE_PASS_MIN_PAIRS pairs on): gc and the chunks'
    inverses in kkt_solve's layout, nothing else."""
    _, x, _, ci, _, ref, dtype = case
    out = fused_prepass(x["g"], x["k"], x["v"], x["beta"], x["cu_seqlens"], ci, write_wy=False)
    assert len(out) == 2
    tol = TOLERANCES["kernel"][dtype]
    for name, t in zip(("gc", "A_inv"), out):
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        assert rel_rms(t, ref[name]) <= tol, f"{name}: {rel_rms(t, ref[name]):.2e}"
    with pytest.raises(ValueError, match="only with W and U"):
        fused_prepass(x["g"], x["k"], x["v"], x["beta"], x["cu_seqlens"], ci, q=x["q"], write_wy=False)


def test_prepass_compiles_for_h200():
    """The solve's stacked [4, 16, 16] diagonal substitution (3-D dot, permute / reshape / split) through the GPU
    backend's layouts, which the interpreter skips: the fused pre-pass without p (the split path's) compiles for
    sm_90 (bf16, K = V = 128)."""
    res = compile_for_h200(
        "import sm90 as c; from linattn.ops.common.fused_prepass import fused_prepass_kernel",
        "[tuple(c.compile_kernel(fused_prepass_kernel, dict(c.prepass_consts(128, False), STORE_A_INV=a)))[:4] "
        "for a in (False, True)]")
    for regs, _, _, _ in res:
        assert 0 < regs <= 255, res


def test_sequential_kernel_matches_twin(case):
    """Fed the twin's W, U, gc: o and the final state equal state_pass_fwd_ref → output_fwd_ref."""
    _, x, _, _, scale, ref, dtype = case
    o, ht = fused_fwd(x["q"], x["k"], f32(ref["w"]), f32(ref["u"]), f32(ref["gc"]), scale, x["initial_state"],
                      torch.float32, x["cu_seqlens"])
    tol = TOLERANCES["kernel"][dtype]
    assert o.shape == ref["o"].shape and rel_rms(o, ref["o"]) <= tol, f"o: {rel_rms(o, ref['o']):.2e}"
    assert ht.dtype == torch.float32 and rel_rms(ht, ref["ht"]) <= tol, f"ht: {rel_rms(ht, ref['ht']):.2e}"


def test_fused_forward_matches_reference_and_unfused(case):
    c, x, offsets, _, scale, _, dtype = case
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    before = [t.clone() for t in args]
    o, ht = chunk_gated_delta_rule_fwd_triton(*args, scale, x["initial_state"], x["cu_seqlens"], offsets, path="walk")
    assert all(torch.equal(a, b) for a, b in zip(args, before)), "an input was modified"
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    st = chunk_gated_delta_rule_fwd_stages(*args, scale, x["initial_state"], x["cu_seqlens"], offsets)
    tol = TOLERANCES["vs_unfused"][dtype]
    assert rel_rms(o, st.o) <= tol, f"o vs unfused: {rel_rms(o, st.o):.2e}"
    assert rel_rms(ht, st.final_state) <= TOLERANCES["vs_unfused"][torch.float32]
    if dtype == torch.float32:
        ro, rht = gated_delta_rule_reference(*args, scale, x["initial_state"], offsets)
        assert rel_rms(o, ro) <= TOLERANCES["forward_fp32"], f"o: {rel_rms(o, ro):.2e}"
        assert rel_rms(ht, rht) <= TOLERANCES["forward_fp32"], f"ht: {rel_rms(ht, rht):.2e}"


@pytest.mark.parametrize("BV", [32, 64])
def test_sequential_kernel_wider_v_slices(BV):
    """The launcher picks BV from the SM count (16 on the CPU's tiny shapes): check the wider slices too."""
    c = Case("T65_K60_V100_h0", T=65, K=60, V=100, B=1, h0=True)
    x, offsets = make_inputs(c, torch.float32)
    scale = c.K ** -0.5
    ref = twin(x, offsets, scale)
    o, ht = fused_fwd(x["q"], x["k"], f32(ref["w"]), f32(ref["u"]), f32(ref["gc"]), scale, x["initial_state"],
                      torch.float32, BV=BV)
    assert rel_rms(o, ref["o"]) <= TOLERANCES["kernel"][torch.float32]
    assert rel_rms(ht, ref["ht"]) <= TOLERANCES["kernel"][torch.float32]


def store_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 as the interpreter's stores round it: toward zero (the GPU rounds to nearest, half the
    error), so the bound below holds for either."""
    return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


SPLIT_PARAMS = [(c, d, p) for c in CASES for d, p in ((torch.float32, ("bf16x3", "bf16x3")),
                                                       (torch.bfloat16, ("bf16x3", "bf16x3")),
                                                       (torch.bfloat16, (None, None)))]


@pytest.mark.parametrize("c,dtype,prec", SPLIT_PARAMS,
                         ids=[f"{c.id}-{str(d)[6:]}-{p[0] or 'default'}" for c, d, p in SPLIT_PARAMS])
def test_sequential_kernel_split_bf16_dots(c, dtype, prec):
    """dot_prec = state_prec = "bf16x3" on fp32 and bf16 inputs, and bf16 inputs at the default precisions (the
    interpreter ignores Triton's precisions: those are fp32 dots here, held to the fp32 bound). Fed the float64
    twin's W, U, gc; compared with the float64 token-by-token reference on the same (bf16-rounded) inputs.
    With a bf16 o, the error may add the rounding of o itself: bounded by rounding the reference the same way."""
    torch.manual_seed(0)
    x, offsets = make_inputs(c, dtype)
    scale = c.K ** -0.5
    ref = twin(x, offsets, scale)
    args = [x[n].double() for n in ("q", "k", "v", "g", "beta")]
    ro, rht = gated_delta_rule_reference(*args, scale, x["initial_state"], offsets)
    walk = lambda out_dtype: fused_fwd(x["q"], x["k"], f32(ref["w"]), f32(ref["u"]), f32(ref["gc"]), scale,
                                       x["initial_state"], out_dtype, x["cu_seqlens"], dot_prec=prec[0],
                                       state_prec=prec[1])
    tol = TOLERANCES["split_bf16"] if prec[0] == "bf16x3" else TOLERANCES["kernel"][torch.float32]
    o, ht = walk(torch.float32)
    assert rel_rms(o, ro) <= tol, f"o: {rel_rms(o, ro):.2e}"
    assert rel_rms(ht, rht) <= tol, f"ht: {rel_rms(ht, rht):.2e}"
    if dtype == torch.bfloat16:
        o16, _ = walk(torch.bfloat16)
        assert o16.dtype == torch.bfloat16
        floor = rel_rms(store_bf16(ro), ro)
        assert rel_rms(o16, ro) <= floor + tol, f"bf16 o: {rel_rms(o16, ro):.2e} (rounding floor {floor:.2e})"


def test_bad_dot_precision():
    x, _ = make_inputs(Case("T1", T=1, B=1), torch.float32)
    w, u, gc = torch.zeros(1, 1, 2, 32), torch.zeros(1, 1, 2, 32), torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="state_prec"):
        fused_fwd(x["q"], x["k"], w, u, gc, 1.0, None, torch.float32, state_prec="bf16x6")
