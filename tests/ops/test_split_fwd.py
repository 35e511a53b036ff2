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
from linattn.ops.common.split_fwd import segment_offsets, split_fwd
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


def run(x, offsets, L):
    scale = x["q"].shape[-1] ** -0.5
    ci = co = None
    if offsets:
        ci, co = chunk_tables(offsets, CHUNK, "cpu")
    gc, w, u = fused_prepass(x["g"], x["k"], x["v"], x["beta"], x["cu_seqlens"], ci)
    return split_fwd(x["q"], x["k"], w, u, gc, scale, x["initial_state"], torch.float32, x["cu_seqlens"], offsets,
                     ci, co, segment_chunks=L)


@pytest.mark.parametrize("case, L", CASES, ids=[f"{c.id}-L{L}" for c, L in CASES])
def test_segmented_split_forward_matches_reference(case, L):
    torch.manual_seed(0)
    x, offsets = make_inputs(case, torch.float32)
    before = {n: t.clone() for n, t in x.items() if t is not None}
    o, ht = run(x, offsets, L)
    assert all(torch.equal(x[n], t) for n, t in before.items()), "an input was modified"
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    ro, rht = gated_delta_rule_reference(*args, case.K ** -0.5, x["initial_state"], offsets)
    assert rel_rms(o, ro) <= TOL, f"o: {rel_rms(o, ro):.2e}"
    assert rel_rms(ht, rht) <= TOL, f"final state: {rel_rms(ht, rht):.2e}"
    o1, ht1 = run(x, offsets, None)   # unsegmented (the planner does not split these lengths)
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
