"""The split forward with segments (common/split_fwd.py) on the CPU, under the interpreter.

Segments forced by ``segment_chunks`` (the planner only splits long sequences): phase A and B from seq_parallel.py,
phase C the state pass over the segments as pseudo-sequences, then the output kernel. Checked against the float64
token-by-token reference and against the unsegmented split forward on the same inputs, fp32 (the core bound).
Cases: equal sequences whose last chunk is partial (T = 130: three chunks, so L = 1 and 2 give 3 and 2 segments),
GVA with an initial state, K ≠ V (masked tails), and varlen with an empty sequence and sequences shorter than a
segment. A wrong pick of the final states or of the segments' entering states fails every case with h0 or with
more than one segment per sequence.
"""
from __future__ import annotations

import pytest
import torch

from linattn.ops.common import CHUNK
from linattn.ops.common.fused_prepass import fused_prepass
from linattn.ops.common.seq_parallel import segment_offsets
from linattn.ops.common.split_fwd import split_fwd
from linattn.ops.common.varlen import chunk_tables
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from tests.ops.test_triton_fwd import Case, make_inputs, rel_rms

pytestmark = pytest.mark.interpreter
TOL = 1e-5  # fp32 against float64, relative RMS (the core bound); measured ≤ 6e-7

CASES = [
    (Case("T130_B2_h0", T=130, B=2, h0=True), 1),
    (Case("T130_B2_GVA_h0", T=130, B=2, H=1, HV=2, h0=True), 2),
    (Case("T200_K60_V100", T=200, B=1, K=60, V=100, h0=True), 1),
    (Case("varlen_70_0_200_1_h0", lengths=(70, 0, 200, 1), h0=True), 1),
    (Case("varlen_70_0_200_1", lengths=(70, 0, 200, 1)), 2),
]


def run(x, offsets, L, store=None, form="prepass"):
    """split_fwd after the pre-pass: W and U written by the pre-pass (form "prepass", the op's below
    split_fwd.WY_IN_STATE_PASS_MIN_PAIRS pairs) or A_inv for the state pass ("state_pass", from there on)."""
    scale = x["q"].shape[-1] ** -0.5
    ci = co = None
    if offsets:
        ci, co = chunk_tables(offsets, CHUNK, "cpu")
    if form == "state_pass":
        gc, a_inv = fused_prepass(x["g"], x["k"], x["v"], x["beta"], x["cu_seqlens"], ci, write_wy=False)
        wy = [a_inv, x["beta"], x["v"]]
    else:
        gc, *wy = fused_prepass(x["g"], x["k"], x["v"], x["beta"], x["cu_seqlens"], ci)
    return split_fwd(x["q"], x["k"], wy, gc, scale, x["initial_state"], torch.float32, x["cu_seqlens"],
                     offsets, ci, co, segment_chunks=L, store=store)


@pytest.mark.parametrize("form", ["prepass", "state_pass"])
@pytest.mark.parametrize("case, L", CASES, ids=[f"{c.id}-L{L}" for c, L in CASES])
def test_segmented_split_forward_matches_reference(case, L, form):
    torch.manual_seed(0)
    x, offsets = make_inputs(case, torch.float32)
    before = {n: t.clone() for n, t in x.items() if t is not None}
    o, ht = run(x, offsets, L, form=form)
    assert all(torch.equal(x[n], t) for n, t in before.items()), "an input was modified"
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    ro, rht = gated_delta_rule_reference(*args, case.K ** -0.5, x["initial_state"], offsets)
    assert rel_rms(o, ro) <= TOL, f"o: {rel_rms(o, ro):.2e}"
    assert rel_rms(ht, rht) <= TOL, f"final state: {rel_rms(ht, rht):.2e}"
    o1, ht1 = run(x, offsets, None, form=form)   # unsegmented (the planner does not split these lengths)
    assert rel_rms(o, o1) <= TOL and rel_rms(ht, ht1) <= TOL


def test_segment_offsets_are_chunk_aligned_and_cover_every_sequence():
    offs = segment_offsets([0, 70, 70, 270, 271], 2, 64)
    # 70 tokens = 2 chunks: one segment; the empty sequence: one empty segment; 200 tokens = 4 chunks: two
    # segments cut at 128 tokens; 1 token: one segment
    assert offs == [0, 70, 70, 70 + 128, 270, 271]


def test_bad_segment_length_is_refused():
    x, offsets = make_inputs(Case("x", T=70, B=1), torch.float32)
    with pytest.raises(ValueError, match="segment_chunks"):
        run(x, offsets, 0)


def test_bad_wy_list_is_refused():
    x, offsets = make_inputs(Case("x", T=70, B=1), torch.float32)
    gc, w, u = fused_prepass(x["g"], x["k"], x["v"], x["beta"])
    with pytest.raises(ValueError, match=r"\[w, u\] or \[a_inv, beta, v\]"):
        split_fwd(x["q"], x["k"], [w], gc, 1.0, None, torch.float32, None, None, None, None)


def test_wy_form_follows_the_pairs():
    """The pre-pass writes A_inv for the state pass from WY_IN_STATE_PASS_MIN_PAIRS (sequence, value head) pairs
    on, W and U below, for every input dtype."""
    from linattn.ops.common import split_fwd as SF
    n = SF.WY_IN_STATE_PASS_MIN_PAIRS
    assert SF.wy_in_state_pass(1, n, torch.bfloat16) and SF.wy_in_state_pass(n // 8, 8, torch.float32)
    assert not SF.wy_in_state_pass(1, n - 1, torch.bfloat16) and not SF.wy_in_state_pass(n - 1, 1, torch.float16)


# h and V_new stored in bf16 (split_fwd.store_dtype: bf16 for bf16 inputs; here forced with ``store`` on fp32
# inputs, whose bf16 dots the interpreter cannot run): the state pass rounds only what it writes, so the final
# state is bitwise the fp32 store's, and o carries one bf16 rounding of h and V_new (the interpreter rounds toward
# zero: ≤ 2^-8 per element).
@pytest.mark.parametrize("case, L", [CASES[0], CASES[1], (CASES[3][0], None)],
                         ids=["T130_B2_h0-L1", "T130_B2_GVA_h0-L2", "varlen_70_0_200_1_h0-unsegmented"])
def test_bf16_store_rounds_only_what_the_output_reads(case, L):
    torch.manual_seed(0)
    x, offsets = make_inputs(case, torch.float32)
    o, ht = run(x, offsets, L)
    ob, htb = run(x, offsets, L, store=torch.bfloat16)
    assert torch.equal(htb, ht)
    err, ref_err = rel_rms(ob, o), 2.0 ** -8
    assert 1e-5 < err <= ref_err, f"o with bf16 h / V_new vs fp32: {err:.2e}"  # rounded, and only by the store


def test_state_pass_stores_h_and_v_new_in_the_dtype_asked():
    from linattn.ops.common.state_pass import state_pass_fwd
    torch.manual_seed(0)
    x, _ = make_inputs(Case("T130_B2_h0", T=130, B=2, h0=True), torch.float32)
    gc, w, u = fused_prepass(x["g"], x["k"], x["v"], x["beta"])
    h, v_new, ht = state_pass_fwd(x["k"], w, u, gc, x["initial_state"])
    hb, vb, htb = state_pass_fwd(x["k"], w, u, gc, x["initial_state"], store_dtype=torch.bfloat16)
    assert hb.dtype == vb.dtype == torch.bfloat16 and htb.dtype == torch.float32 and torch.equal(htb, ht)
    for got, want in ((hb, h), (vb, v_new)):
        assert (got.float() - want).abs().max() <= 2.0 ** -7 * want.abs().max()  # one rounding to bf16
        assert not torch.equal(got.float(), want)
    with pytest.raises(ValueError, match="store_dtype must be"):
        state_pass_fwd(x["k"], w, u, gc, None, store_dtype=torch.float16)


def test_store_dtypes():
    """h and V_new in bf16 for bf16 inputs only; W and U always fp32; the pre-pass refuses other store dtypes."""
    from linattn.ops.common import split_fwd as SF
    assert SF.store_dtype(torch.bfloat16) == torch.bfloat16
    assert SF.store_dtype(torch.float16) == SF.store_dtype(torch.float32) == torch.float32
    assert all(SF.wu_store_dtype(d) == torch.float32 for d in (torch.bfloat16, torch.float16, torch.float32))
    x, _ = make_inputs(Case("x", T=70, B=1), torch.float32)
    with pytest.raises(ValueError, match="store_dtype must be"):
        fused_prepass(x["g"], x["k"], x["v"], x["beta"], store_dtype=torch.float16)


def test_bf16_stores_compile_for_h200():
    """The GPU side the interpreter skips, compiled for sm_90 (K = V = 128): the output kernel with bf16 q, k, h and
    V_new (Q S one bf16 MMA, P V_new a split P against bf16 V_new); the state pass storing h and V_new in bf16, from
    W and U and from A_inv."""
    from tests.ops.sm90_compile import compile_for_h200
    res = compile_for_h200(
        "import sm90 as c; "
        "from linattn.ops.common.output import output_fwd_kernel; "
        "from linattn.ops.common.state_pass import state_pass_fwd_kernel",
        "[tuple(c.compile_kernel(output_fwd_kernel, c.output_consts(128), bf16_args=('h', 'v_new')))[:4], "
        "tuple(c.compile_kernel(state_pass_fwd_kernel, c.state_pass_consts(128, 64), "
        "bf16_args=('h', 'v_new')))[:4], "
        "tuple(c.compile_kernel(state_pass_fwd_kernel, c.state_pass_consts(128, 64, from_a_inv=True), "
        "bf16_args=('h', 'v_new', 'u')))[:4]]")
    for regs, _, _, _ in res:
        assert 0 < regs <= 255, res


@pytest.mark.parametrize("form, n", [("prepass", 2), ("state_pass", 1)])
def test_split_forward_frees_w_and_u_before_the_output_kernel(monkeypatch, form, n):
    """Peak memory: the op hands W and U (or A_inv) to split_fwd in a list that it empties, so nothing references
    them once the state pass has read them (the output kernel, h and V_new alive, no longer holds their
    2·T·HV·(K+V) fp32 values)."""
    import weakref

    from linattn.ops.common import split_fwd as SF
    from linattn.ops.gated_delta import triton_chunk
    refs = []
    prepass, output = triton_chunk.fused_prepass, SF.output_fwd

    def watched_prepass(*a, **kw):
        out = prepass(*a, **kw)
        refs.extend(weakref.ref(t) for t in out[1:])
        return out

    def watched_output(*a, **kw):
        assert len(refs) == n and all(r() is None for r in refs), "W, U or A_inv still referenced at the output"
        return output(*a, **kw)

    monkeypatch.setattr(triton_chunk, "fused_prepass", watched_prepass)
    monkeypatch.setattr(SF, "output_fwd", watched_output)
    monkeypatch.setattr(triton_chunk, "wy_in_state_pass", lambda *a: form == "state_pass")  # the form at any size
    x, offsets = make_inputs(CASES[0][0], torch.float32)
    o, ht = triton_chunk.chunk_gated_delta_rule_fwd_triton(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                           x["q"].shape[-1] ** -0.5, x["initial_state"],
                                                           x["cu_seqlens"], offsets)
    # the op's glue for either form (A_inv, β and V handed over in place of W and U) gives the reference's answer
    ro, rht = gated_delta_rule_reference(*(x[n] for n in ("q", "k", "v", "g", "beta")), x["q"].shape[-1] ** -0.5,
                                         x["initial_state"], offsets)
    assert rel_rms(o, ro) <= TOL and rel_rms(ht, rht) <= TOL


def test_v_tile_fill_rule():
    """common.fill_tile_v: the widest V tile whose programs fill the SMs; the A_inv state pass counts 90% as full
    (2×16384 H=32 on 132 SMs runs 128 programs of 64 columns, not 256 of 32)."""
    from linattn.ops.common import fill_tile_v
    assert fill_tile_v(64, 128, 64, 132) == 32 and fill_tile_v(64, 128, 64, 132, 0.9) == 64
    assert fill_tile_v(128, 128, 64, 132) == 64 and fill_tile_v(16, 128, 64, 132, 0.9) == 16
    assert fill_tile_v(64, 128, 32, 132, 0.9) == 32   # the cap holds
