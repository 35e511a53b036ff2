"""Sequence parallelism of the backward's reverse walk (``common/seq_parallel_bwd.py``) and of its recompute's state
pass (``split_fwd.segmented_state_pass``), under the interpreter on the CPU.

Each phase alone against its float64 twin (phase A' against ``reverse_maps_ref`` per segment, fed the twin's W, gc
and dv_local; phase B' against ``reverse_scan_ref`` on random maps), the twins' A' → B' → C' against the unsegmented
float64 walk, then the segmented walk against the unsegmented kernel on the same inputs (fp32 rounding apart), the
segments' dS_out against the unsegmented walk's dh at their last chunks, and the whole backward with segments
forced against the unsegmented backward and the float64 reference.

The shapes are tiny, so the planner would never split them: the cases force segments of 1 or 2 chunks. Gates are
weak (g/64: about e^-1.6 per 2-chunk segment), so Mᵀ carries dS across segments; with the usual gates the state
forgets within a chunk and a wrong map would go unseen. The grid is what a segment can get wrong: a boundary
inside a sequence (T = 200: four chunks, the last partial), dO and dv_local columns in the widened tile's tail with
a BV slice straddling Mᵀ and D (K = 24 + V = 20 in one 64-wide slice; K = 60, V = 40), K = 160 (the walk alone:
32-wide segment tiles, the scan in row blocks), GVA (HV = 2·H), varlen
sequences shorter than a segment (1 and 64 tokens, an empty one) next to split ones, with and without dht and the
initial state. bf16 is measured on the GPU (benchmarks/gpu_check_bwd_segments.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.common import seq_parallel_bwd as spb
from linattn.ops.common.seq_parallel import affine_scan, segment_layout
from linattn.ops.common.state_pass_bwd import state_pass_bwd
from linattn.ops.gated_delta import torch_chunk as tc
from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton, recompute_forward
from linattn.ops.utils import flat_offsets, triton_available, triton_interpret
from tests.ops.test_triton_bwd import SCALE, _varlen, make_inputs, reference_grads, rel_rms, twin_pipeline

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not triton_available() or (not torch.cuda.is_available() and not triton_interpret()),
                       reason="needs triton on CUDA, or TRITON_INTERPRET=1"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    # one kernel vs its float64 twin on the same rounded inputs (test_triton_bwd.py's kernel bound)
    "kernel": {torch.float32: 1e-5, torch.float16: 1e-3},
    # segmented vs unsegmented, same inputs, fp32 outputs: the same fp32 math except the stitched dS (Mᵀ dS + D
    # instead of the walked dS); measured ≤ 4e-7 on the walk's outputs and the backward's gradients
    "vs_unsegmented": 1e-6,
    # the backward with fp16 inputs stores dq, dk, dv in fp16: a few elements may differ by one fp16 step (2^-11)
    "vs_unsegmented_fp16": 1e-3,
}

CASES = [
    dict(id="B2-T200-GVA-K24-V20-L1", B=2, T=200, H=1, HV=2, K=24, V=20, L=1),
    dict(id="T200-K60-V40-L2", B=1, T=200, H=1, HV=1, K=60, V=40, L=2),
    dict(id="varlen-1-64-0-300-130-GVA-L2", B=1, T=495, H=1, HV=2, K=24, V=20, offsets=[0, 1, 65, 65, 365, 495],
         L=2),
    dict(id="varlen-70-5-noh0-dht0-L1", B=1, T=75, H=1, HV=1, K=16, V=32, offsets=[0, 70, 75], h0=False, dht=False,
         L=1),
]

# the walk alone also at K = 160 (BK = 256: the segments' tile is 32 wide and the scan multiplies in row blocks)
WALK_CASES = CASES + [dict(id="T130-K160-V48-L1", B=1, T=130, H=1, HV=1, K=160, V=48, L=1)]


def _ids(cases):
    return [c["id"] for c in cases]


def make(case, dtype):
    torch.manual_seed(0)
    x = make_inputs(case, dtype)
    x["g"] = x["g"] / 64
    return x


def _offsets(x):
    B, T = x["q"].shape[:2]
    return x["offsets"] if x["offsets"] is not None else flat_offsets(B, T)


def _walk_inputs(x, dtype):
    """The reverse walk's inputs from the float64 twin pipeline (W rounded to dtype as the kernel tests do)."""
    ref = twin_pipeline(x, dtype)
    return ref, (x["q"], x["k"], ref["w"].to(dtype), ref["gc"].float(), x["do"], ref["dv_local"].float())


def _sequences(x):
    B, T = x["q"].shape[:2]
    return [(b, 0, T) for b in range(B)] if x["offsets"] is None else [
        (0, a, e) for a, e in zip(x["offsets"][:-1], x["offsets"][1:])]


# ----------------------------------------------------------------------------------------------------------------
# twins
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("L", [1, 2, 3])
def test_twin_segmented_walk_equals_the_walk(L):
    """A' → B' → C' of the float64 twins = ``state_pass_bwd_ref`` (dh, dv_new, dh0), 4 chunks in 1-3 segments."""
    torch.manual_seed(0)
    B, HV, NT, C, K, V = 1, 2, 4, 64, 12, 10
    d = dict(dtype=torch.float64)
    q, k = torch.randn(B, HV, NT, C, K, **d), F.normalize(torch.randn(B, HV, NT, C, K, **d), dim=-1)
    w, do = torch.randn(B, HV, NT, C, K, **d) / 8, torch.randn(B, HV, NT, C, V, **d)
    gc = tc.chunk_local_cumsum_ref(F.logsigmoid(torch.randn(B, HV, NT, C, **d)) / 64)
    dht = torch.randn(B, HV, K, V, **d)
    want = tc.state_pass_bwd_ref(q, k, w, gc, do, dht, SCALE)
    got = spb.segmented_bwd_ref(q, k, w, gc, do, dht, SCALE, L)
    for name, a, b in zip(("dh", "dv_new", "dh0"), got, want):
        assert rel_rms(a, b) < 1e-12, name


# ----------------------------------------------------------------------------------------------------------------
# phase A' and phase B' against their twins
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES[:3], ids=_ids(CASES[:3]))
def test_reverse_maps_vs_twin(case, dtype):
    x = make(case, dtype)
    ref, (q, k, w, gc, do, dvl) = _walk_inputs(x, dtype)
    L = case["L"]
    layout = segment_layout(_offsets(x), L, 64, DEVICE)
    flat = [t.reshape(1, -1, *t.shape[2:]) for t in (q, k, w, gc, do, dvl)]
    maps = spb.reverse_maps(*flat, SCALE, layout)
    G = case["HV"] // case["H"]
    K = case["K"]
    s = 0
    for b, bos, eos in _sequences(x):
        seq = [t[b:b + 1, bos:eos].double() for t in (x["q"], x["k"], ref["w"], x["g"], x["do"])]
        seq[0], seq[1] = seq[0].repeat_interleave(G, 2), seq[1].repeat_interleave(G, 2)
        qc, kc, wc, gr, doc = (tc.to_chunks(t) for t in seq)
        gcc = tc.chunk_local_cumsum_ref(gr)   # from the chunked gates: padding keeps the last token's cumsum
        nt = qc.shape[2]
        for c0 in range(0, max(nt, 1), L):
            Mt, D = spb.reverse_maps_ref(*(t[:, :, c0:c0 + L] for t in (qc, kc, wc, gcc, doc)), SCALE)
            got = maps[s]
            assert rel_rms(got[..., :K], Mt[0]) <= TOL["kernel"][dtype], (s, "M")
            if D.abs().sum() > 0:
                assert rel_rms(got[..., K:], D[0]) <= TOL["kernel"][dtype], (s, "D")
            else:
                assert torch.equal(got[..., K:], torch.zeros_like(got[..., K:])), (s, "D of an empty segment")
            s += 1
    assert s == layout.num_segments


@pytest.mark.parametrize("nseg", [[1, 3, 2], [4]], ids=["varlen-1-3-2", "one-sequence-4"])
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "no-dht"])
def test_reverse_scan_vs_twin(nseg, with_dht):
    torch.manual_seed(0)
    HV, K, V = 2, 20, 24
    NS, N = sum(nseg), len(nseg)
    maps = torch.randn(NS, HV, K, K + V, device=DEVICE) / K ** 0.5
    dht = torch.randn(N, HV, K, V, device=DEVICE) if with_dht else None
    first = torch.tensor([0] + list(torch.tensor(nseg).cumsum(0)), dtype=torch.int32, device=DEVICE)
    got = affine_scan(maps, dht, V, N, first, 1, BV=16, reverse=True)
    for n in range(N):
        a, e = first[n].item(), first[n + 1].item()
        m = maps[a:e].double()
        start = dht[n].double() if with_dht else torch.zeros(HV, K, V, dtype=torch.float64, device=DEVICE)
        want = spb.reverse_scan_ref(m[..., :K], m[..., K:], start)
        assert rel_rms(got[a:e], want) <= TOL["kernel"][torch.float32], n


# ----------------------------------------------------------------------------------------------------------------
# the segmented walk against the unsegmented one
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", WALK_CASES, ids=_ids(WALK_CASES))
def test_segmented_walk_equals_unsegmented(case, dtype):
    x = make(case, dtype)
    _, args = _walk_inputs(x, dtype)
    cu, _, chunk_offsets = _varlen(x)
    offsets = _offsets(x)
    nt = sum(-(-(e - b) // 64) for b, e in zip(offsets[:-1], offsets[1:])) if cu is not None else -(-case["T"] // 64)
    before = [t.clone() for t in args]
    want = state_pass_bwd(*args, x["dht"], SCALE, cu, chunk_offsets, nt)
    got = spb.state_pass_bwd_seq_parallel(*args, x["dht"], SCALE, cu, chunk_offsets, nt, offsets,
                                          segment_chunks=case["L"])
    assert all(torch.equal(a, b) for a, b in zip(args, before)), "an input was modified"
    for name, a, b in zip(("dh", "dv_new", "dh0"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_rms(a, b) <= TOL["vs_unsegmented"], (name, rel_rms(a, b))
    # a segment length covering every sequence runs the unsegmented walk itself
    same = spb.state_pass_bwd_seq_parallel(*args, x["dht"], SCALE, cu, chunk_offsets, nt, offsets,
                                           segment_chunks=10 ** 6)
    assert all(torch.equal(a, b) for a, b in zip(same, want))


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=_ids([CASES[0], CASES[2]]))
def test_segment_grads_are_the_walks_dh_at_each_segment_end(case):
    """The reusable API: dS_out of segment s is the unsegmented walk's dh at the segment's last chunk (dht for an
    empty sequence's segment)."""
    x = make(case, torch.float32)
    _, args = _walk_inputs(x, torch.float32)
    cu, _, chunk_offsets = _varlen(x)
    offsets = _offsets(x)
    L = case["L"]
    layout = segment_layout(offsets, L, 64, DEVICE)
    flat = [t.reshape(1, -1, *t.shape[2:]) for t in args]
    dS_out = spb.segment_grads(*flat, x["dht"], SCALE, layout)
    nt_total = sum(-(-(e - b) // 64) for b, e in zip(offsets[:-1], offsets[1:]))
    dh = state_pass_bwd(*flat, x["dht"], SCALE, layout.cu_seqlens, torch.tensor(
        [0] + list(torch.tensor([-(-(e - b) // 64) for b, e in zip(offsets[:-1], offsets[1:])]).cumsum(0)),
        dtype=torch.int32, device=DEVICE), nt_total)[0][0]
    seg_cu = layout.seg_cu_seqlens.tolist()
    seg_c0 = layout.seg_chunk_offsets.tolist()
    firsts = layout.segment_first.tolist()
    for n in range(len(offsets) - 1):
        for s in range(firsts[n], firsts[n + 1]):
            if seg_cu[s + 1] == seg_cu[s]:
                want = x["dht"][n]
            else:
                want = dh[seg_c0[s + 1] - 1]
            assert rel_rms(dS_out[s], want) <= TOL["vs_unsegmented"], (n, s)


# ----------------------------------------------------------------------------------------------------------------
# the recompute and the whole backward
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=_ids([CASES[0], CASES[2]]))
def test_recompute_with_segments_equals_unsegmented(case):
    """The recompute's state pass through phases A, B, C (split_fwd.segmented_state_pass): h and V_new as the
    unsegmented state pass writes them, to fp32 rounding."""
    from linattn.ops.common.varlen import chunk_tables
    x = make(case, torch.float32)
    cu = x["cu_seqlens"]
    ci, co = chunk_tables(x["offsets"], 64, DEVICE) if cu is not None else (None, None)
    nt = ci.shape[0] if cu is not None else -(-case["T"] // 64)
    args = (x["k"], x["v"], x["g"], x["beta"], x["h0"], cu, ci, co, nt)
    want = recompute_forward(*args)
    got = recompute_forward(*args, offsets=x["offsets"], segment_chunks=case["L"])
    for name, a, b in zip(("gc", "A_inv", "w", "v_new", "h"), got, want):
        assert a.shape == b.shape and rel_rms(a, b) <= TOL["vs_unsegmented"], (name, rel_rms(a, b))
    assert not torch.equal(got[4], want[4])   # the segmented path ran (its stitched states round differently)


BWD_GRID = [pytest.param(c, d, id=f"{c['id']}-{str(d)[6:]}") for c in CASES for d in (torch.float32, torch.float16)]


@pytest.mark.parametrize("case, dtype", BWD_GRID)
def test_backward_with_segments_equals_unsegmented(case, dtype):
    x = make(case, dtype)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["h0"], x["cu_seqlens"], x["offsets"], x["do"],
            x["dht"])
    want = chunk_gated_delta_rule_bwd_triton(*args)
    got = chunk_gated_delta_rule_bwd_triton(*args, segment_chunks=case["L"])
    tol = TOL["vs_unsegmented"] if dtype == torch.float32 else TOL["vs_unsegmented_fp16"]
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    for name, a, b in zip(names, got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and rel_rms(a, b) <= tol, (name, rel_rms(a, b))
    if dtype == torch.float32:   # and against the float64 reference (test_triton_bwd.py's end-to-end bound)
        ref = reference_grads(x)
        for name, a in zip(names, got):
            if a is not None:
                assert rel_rms(a, ref[name]) <= 1e-5, (name, rel_rms(a, ref[name]))


def test_bad_segment_length_is_refused():
    x = make(CASES[0], torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["h0"], None, None, x["do"], x["dht"])
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="segment_chunks"):
            chunk_gated_delta_rule_bwd_triton(*args, segment_chunks=bad)


# ----------------------------------------------------------------------------------------------------------------
# the planner
# ----------------------------------------------------------------------------------------------------------------
# (id, chunks per sequence, HV, expected L) at K = V = 128 on 132 SMs (264 slots of two programs). The unsplit
# walk takes BV = 16 where its pairs cannot fill the SMs; the segments run BV = 64 and phase A' costs
# REVERSE_MAP_COST = 4 chunks. B=1 T=32768 HV=8 (512 chunks, 64 programs unsplit: 512): L = 32 gives phase C'
# 8·2·16 = 256 programs, one wave: 32; phase A' 512 programs, two waves: 4·32·2 = 256; phase B' 16: 304 against
# 512·0.9. At HV = 16 the same split costs twice the programs, so no L saves 10% (B=1 T=32768: L = 64 costs
# 64 + 4·64·2 + 8 = 584 against 512).
PLAN_CASES = [
    ("B1_T32768_HV16", [512], 16, None),
    ("B1_T131072_HV16", [2048], 16, None),
    ("B1_T32768_H2_HV8", [512], 8, 32),
    ("B1_T32768_HV4", [512], 4, 32),
    ("B1_T4096_HV16", [64], 16, None),
    ("B2_T4096_HV16", [64] * 2, 16, None),
    ("B8_T4096_HV16_fills_the_card", [64] * 8, 16, None),
    ("B4_T8192_HV32_fills_the_card", [128] * 4, 32, None),
    ("B1_T960_too_short", [15], 16, None),
]


@pytest.mark.parametrize("chunks, HV, expected", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_plan_reverse_segments(chunks, HV, expected):
    assert spb.plan_reverse_segments(chunks, HV, 128, 128, 132) == expected


def test_segmented_kernels_compile_for_h200():
    """The GPU side the interpreter skips, compiled for sm_90 (bf16 inputs, K = V = 128, 4 warps): the reverse walk
    in its MAPS mode at the segments' tile (BV = 64), and the reverse scan."""
    from tests.ops.sm90_compile import compile_for_h200
    res = compile_for_h200(
        "import sm90 as c; "
        "from linattn.ops.common.state_pass_bwd import state_pass_bwd_kernel; "
        "from linattn.ops.common.seq_parallel import affine_scan_kernel, _scan_launch",
        "[tuple(c.compile_kernel(state_pass_bwd_kernel, c.state_pass_bwd_consts(128, 64, maps=True), "
        "num_warps=4))[:4], "
        "tuple(c.compile_kernel(affine_scan_kernel, {k: v for k, v in _scan_launch(16, 128, 128, 1, 16, True, True, "
        "False, False, 'tf32x3', False, 4, True)[1].items() if k != 'num_warps'}, num_warps=4))[:4]]")
    for regs, _, _, _ in res:
        assert 0 < regs <= 255, res
