"""P = Q Kᵀ ⊙ D ⊙ causal computed once by the pre-pass (STORE_P) and read by the walk (LOAD_P), on the CPU.

The pre-pass's p against its float64 twin ``torch_chunk.qk_decay_ref`` (and its other outputs unchanged by q);
the walk fed p against the walk that computes P itself and against the float64 twins (fed the twin's own W, U, gc,
with p from the pre-pass on the same inputs, so the layout contract between the two kernels is checked too); the
segmented walk (seq_parallel.py, phase C reads p) the same way; then the public op on the walk (which always reads
the pre-pass's p) against the float64 reference and the walk with p withheld. A deliberately wrong p (the diagonal
dropped, what a strict mask would give) must fail each check: that proves the walk and phase C read p rather than
recomputing P.

bf16 inputs are checked for p and the walk: Q Kᵀ goes through ``dot.dot``, which widens bf16 operands under the
interpreter (exact products, as the GPU's bf16 MMA). The rest of the bf16 pre-pass (K Kᵀ in ``kkt_solve``) still
feeds bf16 to ``tl.dot`` (raw bits under the interpreter: its W and U are garbage here, and numpy warns about
overflow), so the bf16 walk takes the twin's W, U, gc, and the public op is checked on fp32 and fp16.
Cases: T = 1 (one partial chunk, B = 2); T = 130 with K ≠ V (60, 100: masked tails, two V slices), GVA HV = 2H and
an initial state; varlen with lengths 1, 64, 0 and 70 (a sequence's last chunk next to its neighbour's tokens);
strong decay (g ≈ −100: every exp must be of a masked, non-positive argument).
"""
from __future__ import annotations

import pytest
import torch

from linattn.ops.common import CHUNK
from linattn.ops.common import seq_parallel as sp
from linattn.ops.common.fused_fwd import fused_fwd
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.common.varlen import chunk_tables
from linattn.ops.gated_delta import triton_chunk
from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from tests.ops.sm90_compile import compile_for_h200
from tests.ops.test_triton_fwd import Case, make_inputs, rel_rms, twin

pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

TOLERANCES = {
    # relative RMS against the float64 twins: products of bf16 inputs are exact in fp32 accumulation and the rest
    # is fp32, so bf16 meets the fp32 bound (o written in fp32). Measured: p ≤ 5.0e-7, o ≤ 5.5e-7 (the walk
    # without p: ≤ 5.6e-7); a p with its diagonal dropped: p ≥ 0.86, o ≥ 0.18 (segmented) to 1.0
    "kernel": 1e-5,
    # walk reading p vs walk computing P, same W, U, gc: the same fp32 math except the order of the Q Kᵀ sum (the
    # pre-pass accumulates BK = 64 tiles) and p's own rounding. Measured ≤ 7.5e-7 (0 where P is diagonal: T = 1,
    # strong decay)
    "vs_recomputed": 2e-6,
    # whole forward through the public op, fp32 vs float64 reference (the core bound); fp16: vs the walk with p
    # withheld, which may differ by a rounding step of fp16's o (2^-11) in a few elements
    "forward_fp32": 1e-5,
    "forward_fp16_vs_off": 1e-3,
}
DTYPES = [torch.float32, torch.bfloat16]
CASES = [
    Case("T1_B2", T=1),
    Case("T130_K60_V100_GVA_h0", T=130, H=1, HV=2, K=60, V=100, B=1, h0=True),
    Case("varlen_1_64_0_70_h0", lengths=(1, 64, 0, 70), K=60, V=100, h0=True),
    Case("T65_strong_decay_h0", T=65, g_mode="strong", B=1, h0=True),
]


@pytest.fixture(scope="module", params=[(c, d) for c in CASES for d in DTYPES],
                ids=[f"{c.id}-{str(d)[6:]}" for c in CASES for d in DTYPES])
def case(request):
    torch.manual_seed(0)
    c, dtype = request.param
    x, offsets = make_inputs(c, dtype)
    scale = c.K ** -0.5
    ci = chunk_tables(offsets, CHUNK, "cpu")[0] if offsets else None
    ref = twin(x, offsets, scale)
    gc, w, u, p = fused_prepass(x["g"], x["k"], x["v"], x["beta"], x["cu_seqlens"], ci, q=x["q"])
    f32 = {n: ref[n].float().contiguous() for n in ("gc", "w", "u")}
    return c, x, offsets, ci, scale, ref, f32, (gc, w, u, p), dtype


def positions(T: int, offsets) -> torch.Tensor:
    """Position of every token inside its chunk (chunks restart at each sequence start)."""
    bos = torch.tensor(offsets or [0, T])
    t = torch.arange(T)
    return (t - bos[torch.searchsorted(bos, t, right=True) - 1]) % CHUNK


def drop_diagonal(p: torch.Tensor, offsets) -> torch.Tensor:
    """p with each row's diagonal entry zeroed: the P a strict causal mask (> instead of ≥) would give."""
    T = p.shape[1]
    bad = p.clone()
    bad[:, torch.arange(T), :, positions(T, offsets)] = 0
    return bad


def walk(x, f32, scale, p=None, **kw):
    return fused_fwd(x["q"], x["k"], f32["w"], f32["u"], f32["gc"], scale, x["initial_state"], torch.float32,
                     x["cu_seqlens"], p=p, **kw)


# ----------------------------------------------------------------------------------------------------------------
# the pre-pass
# ----------------------------------------------------------------------------------------------------------------
def test_prepass_p_matches_twin(case):
    """p equals qk_decay_ref; everything above the diagonal (past the sequence end included) is exactly 0; gc, W
    and U are bit-for-bit what the pre-pass writes without q (STORE_P touches nothing else)."""
    _, x, offsets, ci, _, ref, _, (gc, w, u, p), _ = case
    B, T = x["q"].shape[:2]
    assert p.dtype == torch.float32 and p.shape == ref["p"].shape == (B, T, x["v"].shape[2], CHUNK)
    assert torch.isfinite(p).all(), "a row of p was not written (the allocation is NaN-poisoned)"
    err = rel_rms(p, ref["p"])
    assert err <= TOLERANCES["kernel"], f"p: {err:.2e}"
    upper = torch.arange(CHUNK)[None, :] > positions(T, offsets)[:, None]            # [T, BT]
    assert (p.transpose(1, 2)[:, :, upper] == 0).all(), "p is not 0 above the diagonal"
    for name, a, b in zip(("gc", "w", "u"), (gc, w, u),
                          fused_prepass(x["g"], x["k"], x["v"], x["beta"], x["cu_seqlens"], ci)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=f"{name} changed with q")
    # the check can fail: a strict mask is caught
    assert rel_rms(drop_diagonal(p, offsets), ref["p"]) > 100 * TOLERANCES["kernel"]


# ----------------------------------------------------------------------------------------------------------------
# the walk, plain and segmented
# ----------------------------------------------------------------------------------------------------------------
def test_walk_with_p_matches_recomputed_and_twin(case):
    """Fed the twin's W, U, gc and the pre-pass's p: o equals the walk without p to fp32 rounding and the float64
    twin; the final state does not involve P, so it is bit-for-bit the same. A wrong p shows in o."""
    _, x, offsets, _, scale, ref, f32, (*_, p), _ = case
    o0, ht0 = walk(x, f32, scale)
    o, ht = walk(x, f32, scale, p)
    assert torch.equal(ht, ht0)
    assert rel_rms(o, o0) <= TOLERANCES["vs_recomputed"], f"o vs recomputed P: {rel_rms(o, o0):.2e}"
    assert rel_rms(o, ref["o"]) <= TOLERANCES["kernel"], f"o: {rel_rms(o, ref['o']):.2e}"
    assert rel_rms(ht, ref["ht"]) <= TOLERANCES["kernel"], f"ht: {rel_rms(ht, ref['ht']):.2e}"
    o_bad, _ = walk(x, f32, scale, drop_diagonal(p, offsets))
    assert rel_rms(o_bad, ref["o"]) > 100 * TOLERANCES["kernel"], "the walk did not read p"


@pytest.mark.parametrize("BV", [32, 64])
def test_walk_with_p_wider_v_slices(BV):
    """The CPU's tiny shapes plan BV = 16: the other slice widths read the same P tile."""
    c = Case("T130_K60_V100_GVA_h0", T=130, H=1, HV=2, K=60, V=100, B=1, h0=True)
    x, offsets = make_inputs(c, torch.float32)
    scale = c.K ** -0.5
    ref = twin(x, offsets, scale)
    f32 = {n: ref[n].float().contiguous() for n in ("gc", "w", "u")}
    p = fused_prepass(x["g"], x["k"], x["v"], x["beta"], q=x["q"])[3]
    o, ht = walk(x, f32, scale, p, BV=BV)
    o0, _ = walk(x, f32, scale, BV=BV)
    assert rel_rms(o, o0) <= TOLERANCES["vs_recomputed"]
    assert rel_rms(o, ref["o"]) <= TOLERANCES["kernel"] and rel_rms(ht, ref["ht"]) <= TOLERANCES["kernel"]


SEG_CASES = [
    (Case("T200_K60_V100_GVA_L2_h0", T=200, H=1, HV=2, K=60, V=100, B=1, h0=True), 2),
    (Case("varlen_1_64_0_200_L1_h0", lengths=(1, 64, 0, 200), h0=True), 1),
]
SEG_PARAMS = [(c, L, d) for c, L in SEG_CASES for d in DTYPES]


@pytest.mark.parametrize("c,L,dtype", SEG_PARAMS, ids=[f"{c.id}-{str(d)[6:]}" for c, _, d in SEG_PARAMS])
def test_segmented_walk_with_p(c, L, dtype):
    """Phases A → B → C with p (segments of L chunks, weak gates so the affine maps matter, as in
    test_seq_parallel.py): o equals the segmented walk without p and the float64 twin; a wrong p shows in o."""
    torch.manual_seed(0)
    x, offsets = make_inputs(c, dtype)
    x["g"] = x["g"] / 64
    scale = c.K ** -0.5
    ref = twin(x, offsets, scale)
    f32 = {n: ref[n].float().contiguous() for n in ("gc", "w", "u")}
    ci = chunk_tables(offsets, CHUNK, "cpu")[0] if offsets else None
    p = fused_prepass(x["g"], x["k"], x["v"], x["beta"], x["cu_seqlens"], ci, q=x["q"])[3]
    run = lambda p: sp.fused_fwd_seq_parallel(x["q"], x["k"], f32["w"], f32["u"], f32["gc"], scale,
                                              x["initial_state"], torch.float32, x["cu_seqlens"], offsets,
                                              segment_chunks=L, p=p)
    o0, ht0 = run(None)
    o, ht = run(p)
    assert torch.equal(ht, ht0)
    assert rel_rms(o, o0) <= TOLERANCES["vs_recomputed"], f"o vs recomputed P: {rel_rms(o, o0):.2e}"
    assert rel_rms(o, ref["o"]) <= TOLERANCES["kernel"], f"o: {rel_rms(o, ref['o']):.2e}"
    assert rel_rms(ht, ref["ht"]) <= TOLERANCES["kernel"], f"ht: {rel_rms(ht, ref['ht']):.2e}"
    o_bad, _ = run(drop_diagonal(p, offsets))
    assert rel_rms(o_bad, ref["o"]) > 100 * TOLERANCES["kernel"], "phase C did not read p"


def test_bad_p_shape():
    x, _ = make_inputs(Case("T65", T=65, B=1), torch.float32)
    w, u, gc = torch.zeros(1, 65, 2, 32), torch.zeros(1, 65, 2, 32), torch.zeros(1, 65, 2)
    with pytest.raises(ValueError, match="p must be"):
        fused_fwd(x["q"], x["k"], w, u, gc, 1.0, None, torch.float32, p=torch.zeros(1, 65, 2, 32))


# ----------------------------------------------------------------------------------------------------------------
# the public op on the walk (p from the pre-pass) against the walk with p withheld (recomputing Q Kᵀ)
# ----------------------------------------------------------------------------------------------------------------
OP_CASES = [
    (Case("T1", T=1), None),
    (Case("GVA_2x_K60_V100_h0", T=130, H=2, HV=4, K=60, V=100, B=1, h0=True), None),
    (Case("varlen_1_64_0_65_h0", lengths=(1, 64, 0, 65), h0=True), None),
    (Case("T200_segmented_L2_h0", T=200, B=1, h0=True), 2),
]
OP_PARAMS = [(c, L, d) for c, L in OP_CASES for d in (torch.float32, torch.float16)]


@pytest.mark.parametrize("c,L,dtype", OP_PARAMS, ids=[f"{c.id}-{str(d)[6:]}" for c, _, d in OP_PARAMS])
def test_public_op_precompute_qk(c, L, dtype, monkeypatch):
    """The public op on the walk (backend="triton", L: segments forced through the planner): the walk receives the
    pre-pass's p, and o / the final state match the float64 reference (fp32) and the walk that recomputes Q Kᵀ
    (p withheld from it)."""
    torch.manual_seed(0)
    x, offsets = make_inputs(c, dtype)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(output_final_state=True, cu_seqlens=x["cu_seqlens"], initial_state=x["initial_state"],
              backend="triton")
    if L is not None:
        monkeypatch.setattr(sp, "plan_segments", lambda *a, **k: L)
    seen, walk_fn = [], triton_chunk.fused_fwd_seq_parallel

    def recomputing(*a, p=None, **k):       # the walk without the pre-pass's p, for comparison
        return walk_fn(*a, p=None, **k)

    def spy(*a, p=None, **k):
        seen.append(p)
        return walk_fn(*a, p=p, **k)

    monkeypatch.setattr(triton_chunk, "fused_fwd_seq_parallel", recomputing)
    o0, ht0 = chunk_gated_delta_rule_on_path("walk", *args, **kw)
    monkeypatch.setattr(triton_chunk, "fused_fwd_seq_parallel", spy)
    o, ht = chunk_gated_delta_rule_on_path("walk", *args, **kw)
    B, T = x["q"].shape[:2]
    assert len(seen) == 1 and seen[0] is not None and seen[0].shape == (B, T, c.HV, CHUNK), "p did not reach the walk"
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert torch.equal(ht, ht0)
    if dtype == torch.float32:
        ro, rht = gated_delta_rule_reference(*args, c.K ** -0.5, x["initial_state"], offsets)
        assert rel_rms(o, ro) <= TOLERANCES["forward_fp32"], f"o: {rel_rms(o, ro):.2e}"
        assert rel_rms(ht, rht) <= TOLERANCES["forward_fp32"], f"ht: {rel_rms(ht, rht):.2e}"
        assert rel_rms(o, o0) <= TOLERANCES["vs_recomputed"], f"o vs p withheld: {rel_rms(o, o0):.2e}"
    else:
        assert rel_rms(o, o0) <= TOLERANCES["forward_fp16_vs_off"], f"o vs p withheld: {rel_rms(o, o0):.2e}"


def test_p_kernels_compile_for_h200():
    """The walk with LOAD_P (BV = 16) and the pre-pass with STORE_P compile for sm_90 (bf16, K = V = 128) in a
    process without the interpreter, which skips the GPU backend's layouts. Spills are reported, not bounded: the
    walk spills without p too (benchmarks/compile_all.py reports every launch's)."""
    resources = compile_for_h200("import sm90 as c; "
                                 "from linattn.ops.common.fused_fwd import fused_fwd_kernel; "
                                 "from linattn.ops.common.fused_prepass import fused_prepass_kernel",
                                 "[tuple(c.compile_kernel(fused_fwd_kernel, c.walk_consts(128, 16, True)))[:4], "
                                 "tuple(c.compile_kernel(fused_prepass_kernel, c.prepass_consts(128, True)))[:4]]")
    for regs, _, _, _ in resources:
        assert 0 < regs <= 255, resources
