"""Intra-card sequence parallelism of the fused forward (``common/seq_parallel.py``) under the interpreter on the CPU.

Each phase alone against its float64 twin (phase A's [M | N] against ``affine_maps_ref`` per segment, fed the
twin's own W, U, gc; phase B against ``affine_scan_ref`` on random maps), then phases A → B → C against the float64
twins and against the unsegmented walk on the same inputs (exact up to fp32 rounding: o is written in fp32 there so
that fp16 inputs are held to it too), then the whole triton forward with the split forced through the planner,
against the unsegmented forward and the float64 reference. The planner and the varlen segment tables are checked
on explicit tables.

The shapes are tiny, so the planner would never split them: the cases force segments of 1 or 2 chunks. The grid is
pruned to what a segment can get wrong: a segment boundary inside a sequence (T = 65 with 1-chunk segments; 200,
300: several segments, the last one partial), the augmented K + V columns with masked tails and a BV slice
straddling M and N (K, V = 60, 100), K = 160 (BK = 256: phase B's row blocks), GVA, varlen sequences that are
shorter than a segment (lengths 1, 64, an empty one) next to split ones, an initial state, no decay (M carries
everything across segments) and strong decay (g ≈ −100 per token). Gates are weak by default (g/64: about e^-1.6
per 2-chunk segment), so M matters; with the usual logsigmoid gates the state forgets within one chunk and a wrong
M would go unseen. bf16 is measured on the GPU (benchmarks/bench_seq_parallel.py), except for the walk with
split-bf16 dots ("bf16x3", ``common/dot.py``), whose bf16 products the interpreter computes right: phases A → B → C
are checked with it on fp32 and bf16 inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from linattn.ops.common import CHUNK
from linattn.ops.common import seq_parallel as sp
from linattn.ops.common.fused_fwd import fused_fwd
from linattn.ops.gated_delta import torch_chunk as tc
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.gated_delta.triton_chunk import chunk_gated_delta_rule_fwd_triton
from tests.ops.test_triton_fwd import Case, make_inputs, rel_rms, twin

pytestmark = pytest.mark.interpreter

TOLERANCES = {
    # relative RMS against the float64 twins: every intermediate is fp32 and products of fp16 inputs are exact in
    # fp32, so fp16 inputs meet the fp32 bound (outputs are written in fp32 in these tests)
    "kernel": 1e-5,
    # segmented vs unsegmented walk, same inputs, o in fp32: the same fp32 math except the stitched state (M S + N
    # instead of the walked S), so they differ by fp32 rounding only (measured ≤ 2e-7)
    "vs_unsegmented": 1e-6,
    # whole forward: vs float64 reference (fp32 inputs, the core issue's bound); vs the unsegmented forward with
    # fp16 output, which may differ by a rounding step of fp16 (2^-11) in a few elements
    "forward_fp32": 1e-5,
    "forward_vs_unsegmented_fp16": 1e-3,
    # phases A → B → C with bf16x3 dots vs the float64 twin, o in fp32: the dot helper's bound, as in
    # test_fused_fwd.py (the stitched state adds no error beyond the dots': measured ≤ 3.5e-5)
    "split_bf16": 1e-4,
}
DTYPES = [torch.float32, torch.float16]


@dataclass
class SPCase:
    case: Case
    L: int                          # forced segment length in chunks
    decay: str = "weak"             # weak (g / 64) | as the Case says (normal, zero, strong)

    @property
    def id(self):
        return self.case.id


CASES = [
    SPCase(Case("T65_B2_L1_h0", T=65, h0=True), L=1),
    SPCase(Case("T200_K60_V100_GVA_L2_h0", T=200, H=1, HV=2, K=60, V=100, B=1, h0=True), L=2),
    SPCase(Case("T300_B2_L2_zero_decay", T=300, g_mode="zero"), L=2, decay="case"),
    SPCase(Case("T130_K160_V48_L1_h0", T=130, HV=1, K=160, V=48, B=1, h0=True), L=1),
    SPCase(Case("varlen_1_64_0_300_130_L2_h0", lengths=(1, 64, 0, 300, 130), h0=True), L=2),
    SPCase(Case("T200_strong_decay_L2_h0", T=200, g_mode="strong", B=1, h0=True), L=2, decay="case"),
]


def make(c: SPCase, dtype):
    x, offsets = make_inputs(c.case, dtype)
    if c.decay == "weak":
        x["g"] = x["g"] / 64
    return x, offsets


@pytest.fixture(scope="module", params=[(c, d) for c in CASES for d in DTYPES],
                ids=[f"{c.id}-{str(d)[6:]}" for c in CASES for d in DTYPES])
def case(request):
    torch.manual_seed(0)
    c, dtype = request.param
    x, offsets = make(c, dtype)
    scale = c.case.K ** -0.5
    ref = twin(x, offsets, scale)
    return c, x, offsets, scale, {n: ref[n].float().contiguous() for n in ("gc", "w", "u")}, ref, dtype


def _sequences(x, offsets):
    B, T = x["q"].shape[:2]
    return [(b, 0, T) for b in range(B)] if offsets is None else [(0, a, e) for a, e in zip(offsets[:-1],
                                                                                          offsets[1:])]


# ----------------------------------------------------------------------------------------------------------------
# planner and tables
# ----------------------------------------------------------------------------------------------------------------
# (id, chunks per sequence, HV, K, V, BV, expected L): K = V = 128 rows are issue 4's shapes (132 SMs, BV from
# fused_fwd_config). The model's arithmetic (264 slots): B=1 HV=8 has 64 programs, unsplit 512 chunk-times; L = 128:
# phase C 128·1 wave + phase A 0.5·128·waves(512) = 128 + phase B 4 = 260, the cheapest candidate. HV=16 has 128
# programs: at most 2.06× shorter phases, eaten by phase A, so no split saves 10%.
PLAN_CASES = [
    ("B1_T32768_HV8", [512], 8, 128, 128, 16, 128),
    ("B1_T4096_H16_no_gain", [64], 16, 128, 128, 16, None),
    ("B1_T131072_H16_no_gain", [2048], 16, 128, 128, 16, None),
    ("B1_T131072_HV2", [2048], 2, 128, 128, 16, 128),
    ("B8_T4096_H16_fills_the_card", [64] * 8, 16, 128, 128, 64, None),
    ("B2_T16384_H32_fills_the_card", [256] * 2, 32, 128, 128, 32, None),
    ("B1_T960_too_short", [15], 16, 128, 128, 16, None),
    ("varlen_one_long_many_short", [1024] + [2] * 20, 4, 64, 64, 16, 23),
]


@pytest.mark.parametrize("chunks,HV,K,V,BV,expected", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_plan_segments(chunks, HV, K, V, BV, expected):
    assert sp.plan_segments(chunks, HV, K, V, BV, 132) == expected


def test_plan_segments_bounds():
    """Never shorter than MIN_SEGMENT_CHUNKS, never more than MAX_SEGMENTS per sequence, and no split once the
    unsplit grid fills occupancy·SMs."""
    for nt in (8, 17, 100, 1000, 100000):
        for hv in (1, 4, 32):
            L = sp.plan_segments([nt], hv, 128, 128, 16, 132)
            assert L is None or (sp.MIN_SEGMENT_CHUNKS <= L < nt and -(-nt // L) <= sp.MAX_SEGMENTS)
    assert sp.plan_segments([100000], 33, 128, 128, 16, 132) is None          # half the slots: a split cannot pay
    assert sp.plan_segments([100000], 66, 128, 128, 16, 132) is None


def test_segment_tables():
    offsets = [0, 1, 65, 65, 365, 495]          # chunks 1, 1, 0, 5, 3
    seg, first = sp.segment_tables(offsets, 2, CHUNK, "cpu")
    assert seg.dtype == first.dtype == torch.int32
    assert seg.tolist() == [[0, 0, 1], [1, 0, 1], [2, 0, 0], [3, 0, 2], [3, 2, 4], [3, 4, 5], [4, 0, 2], [4, 2, 3]]
    assert first.tolist() == [0, 1, 2, 3, 6, 8]


# ----------------------------------------------------------------------------------------------------------------
# phases against their twins
# ----------------------------------------------------------------------------------------------------------------
def test_affine_maps_match_twin(case):
    """Phase A alone, fed the twin's W, U, gc: each segment's [M | N] equals affine_maps_ref on its chunks."""
    c, x, offsets, scale, f32, ref, dtype = case
    HV, K, V = c.case.HV, c.case.K, c.case.V
    seqs = _sequences(x, offsets)
    L = c.L
    if offsets is not None:
        segments, _ = sp.segment_tables(offsets, L, CHUNK, "cpu")
        nseg, cuts = 1, [(n, a, b) for n, a, b in segments.tolist()]
    else:
        nt = -(-seqs[0][2] // CHUNK)
        segments, nseg = None, -(-nt // L)
        cuts = [(n, s * L, min(s * L + L, nt)) for n in range(len(seqs)) for s in range(nseg)]
    mn = torch.empty(len(cuts), HV, K, K + V)
    sp.launch_walk(x["q"], x["k"], f32["w"], f32["u"], f32["gc"], None, None, mn, scale, x["cu_seqlens"], 16, 4,
                   None, None, CHUNK, len(cuts), segments, nseg, L, segmented=True, affine=True)
    for s, (n, a, e) in enumerate(cuts):
        b, bos, eos = seqs[n]
        # gc from the padded raw gates (a padded token keeps the gate of the last real one), not padded gc
        wc, uc = (tc.to_chunks(ref[name][b:b + 1, bos:eos])[:, :, a:e] for name in ("w", "u"))
        gcc = tc.chunk_local_cumsum_ref(tc.to_chunks(x["g"][b:b + 1, bos:eos].double()))[:, :, a:e]
        kc = tc.to_chunks(x["k"][b:b + 1, bos:eos].double().repeat_interleave(HV // c.case.H, 2))[:, :, a:e]
        M, N = sp.affine_maps_ref(wc, uc, kc, gcc)
        assert rel_rms(mn[s, :, :, :K], M[0]) <= TOLERANCES["kernel"], f"M of segment {s}"
        assert rel_rms(mn[s, :, :, K:], N[0]) <= TOLERANCES["kernel"], f"N of segment {s}"


SCAN_CASES = [
    ("equal_N2_nseg3_K60_V100_h0", 60, 100, 2, None, True),
    ("varlen_1_1_3_K160_V48", 160, 48, 3, [0, 1, 2, 5], False),
    ("varlen_1_4_K32_V32_h0", 32, 32, 2, [0, 1, 5], True),
    ("equal_N1_nseg3_K128_V128_h0", 128, 128, 1, None, True),      # the Hopper forward's whole map: [128, 128]
]


@pytest.mark.parametrize("whole_map", [False, True], ids=["row_blocks", "whole_map"])
@pytest.mark.parametrize("K,V,N,first,h0", [c[1:] for c in SCAN_CASES], ids=[c[0] for c in SCAN_CASES])
def test_affine_scan_matches_twin(K, V, N, first, h0, whole_map):
    """Phase B alone on random maps (M contractive, as a decaying walk's is): M_s by row blocks with the state
    re-read after each step, or (``whole_map``, K ≤ 128) as one tile with the state kept in registers and the next
    map prefetched; at tf32x3 and at tf32 (the interpreter's tf32 dot is fp32: the rounding is the GPU test's)."""
    if whole_map and K > 128:
        with pytest.raises(ValueError, match="whole_map holds"):
            sp.affine_scan(torch.zeros(3, 2, K, K + V), None, V, 1, None, 3, BV=16, whole_map=True)
        return
    HV = 2
    NS = first[-1] if first else 3 * N
    M = torch.randn(NS, HV, K, K) * (0.5 / K ** 0.5)
    Nm = torch.randn(NS, HV, K, V)
    h0t = torch.randn(N, HV, K, V) if h0 else None
    mn = torch.cat([M, Nm], -1).contiguous()
    seg_first = torch.tensor(first, dtype=torch.int32) if first else None
    h_in = sp.affine_scan(mn, h0t, V, N, seg_first, 3, BV=16, whole_map=whole_map,
                          precision="tf32" if whole_map else "tf32x3")
    bounds = list(zip(first[:-1], first[1:])) if first else [(3 * n, 3 * n + 3) for n in range(N)]
    for n, (a, b) in enumerate(bounds):
        start = h0t[n].double() if h0 else torch.zeros(HV, K, V, dtype=torch.float64)
        want, _ = sp.affine_scan_ref(M[a:b].double(), Nm[a:b].double(), start)
        assert rel_rms(h_in[a:b], want) <= TOLERANCES["kernel"], f"sequence {n}"


@pytest.mark.parametrize("whole_map", [False, True], ids=["row_blocks", "whole_map"])
def test_affine_scan_skips_the_maps_flagged_2(whole_map):
    """Where skip is 2 (a warmed head's map in the Hopper forward) the scan reads neither M_s nor N_s (NaN here;
    ``whole_map``'s prefetch masks them out too) and the next segment enters at zero; flags 0 and 1 read the map as
    it is."""
    HV, K, V, S = 2, 32, 32, 4
    M = torch.randn(2 * S, HV, K, K) * (0.5 / K ** 0.5)
    Nm = torch.randn(2 * S, HV, K, V)
    skip = torch.zeros(2 * S, HV, dtype=torch.int32)
    skip[1, 0] = skip[S + 2, 1] = 2
    skip[2, 0] = 1
    mn = torch.cat([M, Nm], -1)
    mn[skip == 2] = float("nan")
    h0 = torch.randn(2, HV, K, V)
    h_in = sp.affine_scan(mn, h0, V, 2, None, S, BV=16, skip=skip, whole_map=whole_map)
    M[skip == 2] = 0
    Nm[skip == 2] = 0
    for n in range(2):
        want, _ = sp.affine_scan_ref(M[n * S:(n + 1) * S].double(), Nm[n * S:(n + 1) * S].double(), h0[n].double())
        assert torch.isfinite(h_in).all() and rel_rms(h_in[n * S:(n + 1) * S], want) <= TOLERANCES["kernel"]
    assert h_in[2, 0].eq(0).all() and h_in[S + 3, 1].eq(0).all() and not h_in[3, 0].eq(0).all()
    with pytest.raises(ValueError, match="skip must be int32"):
        sp.affine_scan(mn, h0, V, 2, None, S, BV=16, skip=skip.bool())
    with pytest.raises(ValueError, match="precision must be one of"):
        sp.affine_scan(mn, h0, V, 2, None, S, BV=16, precision="ieee")


@pytest.mark.parametrize("whole_map", [False, True], ids=["row_blocks", "whole_map"])
def test_affine_scan_with_skip_writes_leaves_the_skipped_entries_unwritten(monkeypatch, whole_map):
    """``skip_writes`` (the Hopper forward's LEAN_SEGMENTS): the entering state after a map flagged 2 is not written
    (the buffer's NaN stays), every other entry is the plain scan's, bitwise."""
    HV, K, V, S = 2, 32, 32, 4
    M = torch.randn(2 * S, HV, K, K) * (0.5 / K ** 0.5)
    skip = torch.zeros(2 * S, HV, dtype=torch.int32)
    skip[1, 0] = skip[S + 2, 1] = 2
    mn = torch.cat([M, torch.randn(2 * S, HV, K, V)], -1)
    h0 = torch.randn(2, HV, K, V)
    plain = sp.affine_scan(mn, h0, V, 2, None, S, BV=16, skip=skip, whole_map=whole_map)
    empty = torch.empty
    monkeypatch.setattr(sp.torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    lean = sp.affine_scan(mn, h0, V, 2, None, S, BV=16, skip=skip, skip_writes=True, whole_map=whole_map)
    unwritten = torch.zeros(2 * S, HV, dtype=torch.bool)
    unwritten[2, 0] = unwritten[S + 3, 1] = True
    assert lean[unwritten].isnan().all() and torch.equal(lean[~unwritten], plain[~unwritten])


def test_segmented_walk_matches_twin_and_unsegmented(case):
    """Phases A → B → C fed the twin's W, U, gc: o and the final state equal the float64 twin (state_pass_fwd_ref →
    output_fwd_ref) and the unsegmented walk to fp32 rounding."""
    c, x, offsets, scale, f32, ref, _ = case
    args = (x["q"], x["k"], f32["w"], f32["u"], f32["gc"], scale, x["initial_state"], torch.float32,
            x["cu_seqlens"])
    o, ht = sp.fused_fwd_seq_parallel(*args, offsets, segment_chunks=c.L)
    o0, ht0 = fused_fwd(*args)
    assert o.shape == ref["o"].shape and ht.shape == ref["ht"].shape
    assert rel_rms(o, ref["o"]) <= TOLERANCES["kernel"], f"o: {rel_rms(o, ref['o']):.2e}"
    assert rel_rms(ht, ref["ht"]) <= TOLERANCES["kernel"], f"ht: {rel_rms(ht, ref['ht']):.2e}"
    assert rel_rms(o, o0) <= TOLERANCES["vs_unsegmented"], f"o vs unsegmented: {rel_rms(o, o0):.2e}"
    assert rel_rms(ht, ht0) <= TOLERANCES["vs_unsegmented"], f"ht vs unsegmented: {rel_rms(ht, ht0):.2e}"


SPLIT_CASES = [CASES[0], CASES[1], CASES[4]]          # a boundary per chunk, masked K/V tails with GVA, varlen
SPLIT_PARAMS = [(c, d) for c in SPLIT_CASES for d in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("c,dtype", SPLIT_PARAMS, ids=[f"{c.id}-{str(d)[6:]}" for c, d in SPLIT_PARAMS])
def test_segmented_walk_split_bf16_dots(c, dtype):
    """Phases A → B → C with dot_prec = state_prec = "bf16x3", fed the twin's W, U, gc (computed in float64 from the
    same, possibly bf16-rounded, inputs): o and the final state equal the float64 twin to the split's precision."""
    torch.manual_seed(0)
    x, offsets = make(c, dtype)
    scale = c.case.K ** -0.5
    ref = twin(x, offsets, scale)
    f32 = {n: ref[n].float().contiguous() for n in ("gc", "w", "u")}
    o, ht = sp.fused_fwd_seq_parallel(x["q"], x["k"], f32["w"], f32["u"], f32["gc"], scale, x["initial_state"],
                                      torch.float32, x["cu_seqlens"], offsets, segment_chunks=c.L,
                                      dot_prec="bf16x3", state_prec="bf16x3")
    assert rel_rms(o, ref["o"]) <= TOLERANCES["split_bf16"], f"o: {rel_rms(o, ref['o']):.2e}"
    assert rel_rms(ht, ref["ht"]) <= TOLERANCES["split_bf16"], f"ht: {rel_rms(ht, ref['ht']):.2e}"


def test_segmented_fwd_ref_matches_unsegmented_twin():
    """The twin of A → B → C equals the unsegmented twin in float64 (L = 2 of 5 chunks, weak decay, h0)."""
    torch.manual_seed(0)
    B, HV, NT, C, K, V = 1, 2, 5, 16, 8, 12
    k = torch.nn.functional.normalize(torch.randn(B, HV, NT, C, K, dtype=torch.float64), dim=-1)
    q, v = torch.randn(B, HV, NT, C, K, dtype=torch.float64), torch.randn(B, HV, NT, C, V, dtype=torch.float64)
    gc = tc.chunk_local_cumsum_ref(-torch.rand(B, HV, NT, C, dtype=torch.float64) / 16)
    beta = torch.rand(B, HV, NT, C, dtype=torch.float64)
    w, u = tc.wy_ref(tc.kkt_solve_ref(k, beta, gc), k, v, beta, gc)
    h0 = torch.randn(B, HV, K, V, dtype=torch.float64)
    o, ht = sp.segmented_fwd_ref(q, k, w, u, gc, 0.3, h0, 2)
    h, v_new, ht0 = tc.state_pass_fwd_ref(w, u, k, gc, h0)
    assert torch.allclose(o, tc.output_fwd_ref(q, k, v_new, h, gc, 0.3), atol=1e-12)
    assert torch.allclose(ht, ht0, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# the whole forward through the planner
# ----------------------------------------------------------------------------------------------------------------
def test_forward_segmented(case, monkeypatch):
    """chunk_gated_delta_rule_fwd_triton(path="walk") with the planner forced to split: equals the unsegmented
    forward and (fp32) the float64 reference; inputs are left untouched."""
    c, x, offsets, scale, _, _, dtype = case
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    before = [t.clone() for t in args]
    run = lambda: chunk_gated_delta_rule_fwd_triton(*args, scale, x["initial_state"], x["cu_seqlens"], offsets,
                                                   path="walk")
    monkeypatch.setattr(sp, "plan_segments", lambda *a, **kw: None)
    o0, ht0 = run()
    monkeypatch.setattr(sp, "plan_segments", lambda *a, **kw: c.L)
    o, ht = run()
    assert all(torch.equal(a, b) for a, b in zip(args, before)), "an input was modified"
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    tol = TOLERANCES["vs_unsegmented"] if dtype == torch.float32 else TOLERANCES["forward_vs_unsegmented_fp16"]
    assert rel_rms(o, o0) <= tol, f"o vs unsegmented: {rel_rms(o, o0):.2e}"
    assert rel_rms(ht, ht0) <= TOLERANCES["vs_unsegmented"]
    if dtype == torch.float32:
        ro, rht = gated_delta_rule_reference(*args, scale, x["initial_state"], offsets)
        assert rel_rms(o, ro) <= TOLERANCES["forward_fp32"], f"o: {rel_rms(o, ro):.2e}"
        assert rel_rms(ht, rht) <= TOLERANCES["forward_fp32"], f"ht: {rel_rms(ht, rht):.2e}"


def test_bad_segment_length():
    x, _ = make_inputs(Case("T65", T=65, B=1), torch.float32)
    w = torch.randn(1, 65, 2, 32)
    with pytest.raises(ValueError, match="segment_chunks"):
        sp.fused_fwd_seq_parallel(x["q"], x["k"], w, x["v"], x["g"], 1.0, None, torch.float32, segment_chunks=0)
