"""The Triton forward of chunk_gated_delta_rule, stage by stage and whole, under the interpreter on the CPU.

Stage tests feed each Triton stage the float64 twin's own upstream intermediates (rounded to fp32), so a stage is
checked alone against its ``<stage>_ref`` in torch_chunk.py. The whole forward goes through the public API with
``backend="triton"`` and is compared with the float64 token-by-token reference and with the torch backend.

bf16 is not tested here: the interpreter multiplies bf16 ``tl.dot`` operands as raw bits (triton issue 11584); the
GPU script benchmarks/gpu_check_fwd.py measures bf16. Shapes are tiny because the interpreter is slow: the case
tables pick the sizes where chunked kernels go wrong (T = 1, 63, 65, 130; K, V not powers of two, K ≠ V; K > 128,
which switches the state pass to BV = 32 and makes the K loops run three tiles; V > 64, two V tiles) rather than a
cross product.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.ops.common import CHUNK
from linattn.ops.common.cumsum import chunk_local_cumsum
from linattn.ops.common.kkt_solve import kkt_solve
from linattn.ops.common.output import output_fwd
from linattn.ops.common.state_pass import state_pass_fwd
from linattn.ops.common.varlen import chunk_tables, chunk_tables_ref
from linattn.ops.common.wy import wy_fwd
from linattn.ops.gated_delta import dispatch, triton_chunk
from linattn.ops.gated_delta import torch_chunk as tc
from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.gated_delta.triton_chunk import chunk_gated_delta_rule_fwd_stages

pytestmark = pytest.mark.interpreter

TOLERANCES = {
    # relative RMS against the float64 twin, per stage: every stage writes fp32, and products of fp16 inputs are
    # exact in fp32, so fp16 inputs meet the fp32 bound too (the output stage is checked with an fp32 output)
    "stage": {torch.float32: 1e-5, torch.float16: 1e-5},
    # whole forward through the public API: fp32, relative RMS against float64 (issue 2)
    "forward_fp32": 1e-5,
    # whole forward, fp16 inputs: at most this multiple of the torch backend's error from the same fp16 inputs
    # (both compute in fp32 and round o to fp16, which dominates), with the fp32 bound as a floor
    "forward_fp16_vs_torch": 2.0,
}
DTYPES = [torch.float32, torch.float16]


@dataclass
class Case:
    id: str
    T: int = 65
    H: int = 1
    HV: int = 2
    K: int = 32
    V: int = 32
    B: int = 2
    lengths: tuple | None = None     # varlen: packed sequence lengths (B becomes 1)
    h0: bool = False
    g_mode: str = "normal"           # normal | zero | strong
    beta_mode: str = "rand"          # rand | zero | one


def make_inputs(c: Case, dtype: torch.dtype):
    B, T = (1, sum(c.lengths)) if c.lengths else (c.B, c.T)
    N = len(c.lengths) if c.lengths else B
    q = torch.randn(B, T, c.H, c.K).to(dtype)
    k = F.normalize(torch.randn(B, T, c.H, c.K), dim=-1).to(dtype)    # ‖k‖ ≤ 1 as in models: a stable recurrence
    v = torch.randn(B, T, c.HV, c.V).to(dtype)
    g = {"normal": F.logsigmoid(torch.randn(B, T, c.HV)),
         "zero": torch.zeros(B, T, c.HV),
         "strong": torch.full((B, T, c.HV), -100.0) + torch.rand(B, T, c.HV)}[c.g_mode]
    beta = {"rand": torch.rand(B, T, c.HV), "zero": torch.zeros(B, T, c.HV),
            "one": torch.ones(B, T, c.HV)}[c.beta_mode]
    h0 = torch.randn(N, c.HV, c.K, c.V) if c.h0 else None
    offsets = [0, *torch.tensor(c.lengths).cumsum(0).tolist()] if c.lengths else None
    cu = torch.tensor(offsets, dtype=torch.int32) if offsets else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu), offsets


def rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def twin(x: dict, offsets, scale: float) -> dict:
    """Run the torch twin stage by stage in float64, sequence by sequence, and return every intermediate in the
    Triton layout: token-major ``[B, T, HV, ...]``, h ``[B, NT, HV, K, V]`` (varlen: B = 1, NT = NT_total); p (the
    chunk's P = Q Kᵀ ⊙ D ⊙ causal, row t of its chunk) ``[B, T, HV, 64]`` like A_inv."""
    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    h0 = x["initial_state"]
    seqs = [(b, 0, T) for b in range(B)] if offsets is None else list(zip([0] * (len(offsets) - 1), offsets[:-1],
                                                                         offsets[1:]))
    out = {n: [] for n in ("gc", "A_inv", "w", "u", "v_new", "o", "p", "h", "ht")}
    for n, (b, bos, eos) in enumerate(seqs):
        S = h0[n].double() if h0 is not None else torch.zeros(HV, K, V, dtype=torch.float64)
        if eos == bos:
            out["ht"].append(S)
            continue
        L = eos - bos
        qs, ks = (t[b:b + 1, bos:eos].repeat_interleave(HV // H, 2) for t in (q, k))
        qc, kc, vc, gch, bc = (tc.to_chunks(t) for t in (qs, ks, v[b:b + 1, bos:eos], g[b:b + 1, bos:eos],
                                                          beta[b:b + 1, bos:eos]))
        gc = tc.chunk_local_cumsum_ref(gch)
        A_inv = tc.kkt_solve_ref(kc, bc, gc)
        w, u = tc.wy_ref(A_inv, kc, vc, bc, gc)
        h, v_new, ht = tc.state_pass_fwd_ref(w, u, kc, gc, S[None])
        o = tc.output_fwd_ref(qc, kc, v_new, h, gc, scale)
        p = tc.qk_decay_ref(qc, kc, gc)
        for name, t in (("gc", gc), ("A_inv", A_inv), ("w", w), ("u", u), ("v_new", v_new), ("o", o), ("p", p)):
            out[name].append(tc.from_chunks(t, L))
        out["h"].append(h.permute(0, 2, 1, 3, 4))
        out["ht"].append(ht[0])
    cat = 0 if offsets is None else 1          # batch axis, or the packed token / chunk axis
    res = {n: torch.cat(out[n], cat) for n in ("gc", "A_inv", "w", "u", "v_new", "o", "p", "h")}
    res["ht"] = torch.stack(out["ht"])
    return res


# ----------------------------------------------------------------------------------------------------------------
# stages against their twins
# ----------------------------------------------------------------------------------------------------------------
STAGE_CASES = [
    Case("T65_K60_V100_GVA_h0", K=60, V=100, h0=True),
    Case("T130_K64_V16", T=130, H=2, HV=2, K=64, V=16, B=1),
    Case("T70_K160_V48", T=70, HV=1, K=160, V=48, B=1),
    Case("varlen_1_64_0_65_h0", lengths=(1, 64, 0, 65), h0=True),
    Case("T63_strong_decay", T=63, g_mode="strong", h0=True),
]


@pytest.fixture(scope="module", params=[(c, d) for c in STAGE_CASES for d in DTYPES],
                ids=[f"{c.id}-{str(d)[6:]}" for c in STAGE_CASES for d in DTYPES])
def stage_case(request):
    torch.manual_seed(0)
    c, dtype = request.param
    x, offsets = make_inputs(c, dtype)
    scale = c.K ** -0.5
    ref = twin(x, offsets, scale)
    tables = chunk_tables(offsets, CHUNK, "cpu") if offsets else (None, None)
    return x, offsets, tables, scale, ref, dtype


def f32(t):
    return t.float().contiguous()


def test_chunk_tables_match_twin():
    for offsets in ([0, 1, 65, 65, 130], [0, 64], [0, 0, 3], [0, 200, 201, 329]):
        idx, firsts = chunk_tables(offsets, CHUNK, "cpu")
        ridx, rfirsts = chunk_tables_ref(offsets, CHUNK)
        assert idx.dtype == torch.int32 and firsts.dtype == torch.int32
        assert [tuple(r) for r in idx.tolist()] == ridx and firsts.tolist() == rfirsts


def test_stage_cumsum(stage_case):
    x, _, (ci, _), _, ref, dtype = stage_case
    gc = chunk_local_cumsum(x["g"], x["cu_seqlens"], ci)
    assert gc.dtype == torch.float32
    assert rel_rms(gc, ref["gc"]) <= TOLERANCES["stage"][dtype]


def test_stage_kkt_solve(stage_case):
    x, _, (ci, _), _, ref, dtype = stage_case
    A_inv = kkt_solve(x["k"], x["beta"], f32(ref["gc"]), x["v"].shape[2], x["cu_seqlens"], ci)
    assert A_inv.shape == ref["A_inv"].shape and torch.isfinite(A_inv).all()
    assert rel_rms(A_inv, ref["A_inv"]) <= TOLERANCES["stage"][dtype]


# The cheaper precisions of the fp32 products (kkt_solve's block merges, the split's output dots): "bf16x3" carries
# 16 significand bits per operand on the GPU and 14 under the interpreter (it truncates to bf16), so its bound is
# tests/ops/test_dot.py's 1e-4 per product; "tf32x3" runs as fp32 under the interpreter (plumbing only here; its
# accuracy on the H200 is benchmarks/bench_split_precision.py's).
PREC_TOL = {"tf32x3": 1e-5, "bf16x3": 1e-4}


@pytest.mark.parametrize("prec", sorted(PREC_TOL))
def test_stage_kkt_solve_merge_precisions(stage_case, prec):
    x, _, (ci, _), _, ref, dtype = stage_case
    if dtype == torch.float32:
        pytest.skip("fp32 inputs merge at \"ieee\" whatever merge_prec asks (kkt_solve.merge_precision)")
    A_inv = kkt_solve(x["k"], x["beta"], f32(ref["gc"]), x["v"].shape[2], x["cu_seqlens"], ci, merge_prec=prec)
    assert torch.isfinite(A_inv).all() and rel_rms(A_inv, ref["A_inv"]) <= PREC_TOL[prec]


def test_merge_and_output_precisions():
    """The products of fp32 intermediates per input dtype: the solve's merges "bf16x3" for bf16, "ieee" for fp16
    and (whatever the override) fp32; the split's output dots "bf16x3" for bf16, dot_precision otherwise; unknown
    precisions refused."""
    from linattn.ops import common
    from linattn.ops.common import kkt_solve as KS
    from linattn.ops.common import split_fwd as SF
    assert KS.merge_precision(torch.float32, "bf16x3") == "ieee" and KS.merge_precision(torch.float32) == "ieee"
    assert KS.merge_precision(torch.bfloat16) == "bf16x3"
    assert KS.merge_precision(torch.float16) == "ieee" and KS.merge_precision(torch.float16, "bf16x3") == "bf16x3"
    with pytest.raises(ValueError, match="merge precision"):
        KS.merge_precision(torch.bfloat16, "tf64")
    with pytest.raises(ValueError, match="inverse_prec must be one of"):  # local_bwd_wy's check
        common.product_precision(torch.bfloat16, "tf32x3", "bf16x3", ("ieee", "tf32x3"), "inverse_prec")
    assert SF.output_precision(torch.bfloat16) == "bf16x3" and SF.output_precision(torch.float16) == "tf32x3"
    assert SF.output_precision(torch.float32) == common.dot_precision(torch.float32) == "tf32x3"
    assert common.dot_precision(torch.bfloat16) == "tf32"
    x, _ = make_inputs(Case("p", T=8), torch.float32)
    with pytest.raises(ValueError, match="dot_prec"):
        output_fwd(x["q"], x["k"], x["v"].float(), torch.zeros(2, 1, 2, 32, 32), None, 1.0, torch.float32,
                   dot_prec="fp8")


def test_stage_wy(stage_case):
    x, _, (ci, _), _, ref, dtype = stage_case
    w, u = wy_fwd(x["k"], x["v"], x["beta"], f32(ref["gc"]), f32(ref["A_inv"]), x["cu_seqlens"], ci)
    assert rel_rms(w, ref["w"]) <= TOLERANCES["stage"][dtype]
    assert rel_rms(u, ref["u"]) <= TOLERANCES["stage"][dtype]


def test_stage_state_pass(stage_case):
    x, _, (ci, co), _, ref, dtype = stage_case
    nt = ci.shape[0] if ci is not None else None
    h, v_new, ht = state_pass_fwd(x["k"], f32(ref["w"]), f32(ref["u"]), f32(ref["gc"]), x["initial_state"],
                                  x["cu_seqlens"], co, nt)
    tol = TOLERANCES["stage"][dtype]
    assert h.shape == ref["h"].shape and rel_rms(h, ref["h"]) <= tol
    assert rel_rms(v_new, ref["v_new"]) <= tol
    assert rel_rms(ht, ref["ht"]) <= tol


def test_stage_state_pass_from_a_inv(stage_case):
    """The state pass forming V_new = A_inv (β ⊙ V − βΓ ⊙ (K S)) per chunk (FROM_A_INV) against the twin chain
    wy_ref → state_pass_fwd_ref: the same h, V_new and final state, without W or U."""
    x, _, (ci, co), _, ref, dtype = stage_case
    nt = ci.shape[0] if ci is not None else None
    h, v_new, ht = state_pass_fwd(x["k"], None, x["v"], f32(ref["gc"]), x["initial_state"], x["cu_seqlens"], co,
                                  nt, a_inv=f32(ref["A_inv"]), beta=x["beta"])
    tol = TOLERANCES["stage"][dtype]
    assert h.shape == ref["h"].shape and rel_rms(h, ref["h"]) <= tol
    assert rel_rms(v_new, ref["v_new"]) <= tol and rel_rms(ht, ref["ht"]) <= tol
    with pytest.raises(ValueError, match="a_inv and beta together"):
        state_pass_fwd(x["k"], None, x["v"], f32(ref["gc"]), None, x["cu_seqlens"], co, nt, a_inv=f32(ref["A_inv"]))
    with pytest.raises(ValueError, match="a_inv and beta together"):
        state_pass_fwd(x["k"], f32(ref["w"]), x["v"], f32(ref["gc"]), None, x["cu_seqlens"], co, nt,
                       a_inv=f32(ref["A_inv"]), beta=x["beta"])


def test_stage_output(stage_case):
    x, _, (ci, _), scale, ref, dtype = stage_case
    o = output_fwd(x["q"], x["k"], f32(ref["v_new"]), f32(ref["h"]), f32(ref["gc"]), scale, torch.float32,
                   x["cu_seqlens"], ci)
    assert rel_rms(o, ref["o"]) <= TOLERANCES["stage"][dtype]


@pytest.mark.parametrize("prec", sorted(PREC_TOL))
def test_stage_output_precisions(stage_case, prec):
    x, _, (ci, _), scale, ref, dtype = stage_case
    o = output_fwd(x["q"], x["k"], f32(ref["v_new"]), f32(ref["h"]), f32(ref["gc"]), scale, torch.float32,
                   x["cu_seqlens"], ci, dot_prec=prec)
    assert rel_rms(o, ref["o"]) <= PREC_TOL[prec]


def test_stages_chained_match_twin(stage_case):
    """The intermediates the backward consumes, produced by the chained forward (layout contract)."""
    x, offsets, _, scale, ref, dtype = stage_case
    st = chunk_gated_delta_rule_fwd_stages(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"],
                                           x["cu_seqlens"], offsets)
    tol = TOLERANCES["stage"][dtype]
    for name in ("gc", "A_inv", "w", "u", "v_new", "h"):
        t = getattr(st, name)
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        assert rel_rms(t, ref[name]) <= tol, f"{name}: {rel_rms(t, ref[name]):.2e}"
    assert st.final_state.dtype == torch.float32 and rel_rms(st.final_state, ref["ht"]) <= tol
    assert st.o.dtype == dtype


# ----------------------------------------------------------------------------------------------------------------
# the whole forward through the public API
# ----------------------------------------------------------------------------------------------------------------
FWD_CASES = [
    Case("T1", T=1),
    Case("T63", T=63),
    Case("T65_K60_V100", K=60, V=100),
    Case("T130_K64_V16", T=130, K=64, V=16, B=1),
    Case("GVA_2x_K60_V100", H=2, HV=4, K=60, V=100, B=1),
    Case("varlen_1_64_0_65_h0", lengths=(1, 64, 0, 65), h0=True),
    Case("T130_h0", T=130, h0=True, B=1),
    Case("strong_decay_h0", T=130, g_mode="strong", h0=True, B=1),
    Case("g_zero", T=130, g_mode="zero", B=1),
    Case("beta0_h0", beta_mode="zero", h0=True),
    Case("beta1", beta_mode="one"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", FWD_CASES, ids=[c.id for c in FWD_CASES])
def test_forward_matches_reference_and_torch(case, dtype):
    check_forward(case, dtype, "auto")


def check_forward(case, dtype, forward_path):
    """The public op's triton backend on ``forward_path`` against the float64 reference (and the torch backend's
    error for fp16 / bf16), inputs untouched."""
    x, offsets = make_inputs(case, dtype)
    kw = dict(output_final_state=True, cu_seqlens=x["cu_seqlens"], initial_state=x["initial_state"])
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    before = [t.clone() for t in args]
    o, ht = chunk_gated_delta_rule_on_path(forward_path, *args, **kw, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(args, before)), "an input was modified"
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    ro, rht = gated_delta_rule_reference(*args, case.K ** -0.5, x["initial_state"], offsets)
    err_o, err_h = rel_rms(o, ro), rel_rms(ht, rht)
    if dtype == torch.float32:
        tol = TOLERANCES["forward_fp32"]
        assert err_o <= tol, f"o: {err_o:.2e}"
        assert err_h <= tol, f"final state: {err_h:.2e}"
    else:
        to, tht = linattn.chunk_gated_delta_rule(*args, **kw, backend="torch")
        f, floor = TOLERANCES["forward_fp16_vs_torch"], TOLERANCES["forward_fp32"]
        assert err_o <= max(f * rel_rms(to, ro), floor), f"o: {err_o:.2e} vs torch {rel_rms(to, ro):.2e}"
        assert err_h <= max(f * rel_rms(tht, rht), floor), f"final state: {err_h:.2e} vs torch {rel_rms(tht, rht):.2e}"


def triton_op(x: dict, forward_path="auto"):
    """(o, final state) of the public op on the Triton backend for make_inputs' tensors, forward on
    ``forward_path``."""
    return chunk_gated_delta_rule_on_path(forward_path, *(x[n] for n in ("q", "k", "v", "g", "beta")),
                                          output_final_state=True, cu_seqlens=x["cu_seqlens"],
                                          initial_state=x["initial_state"], backend="triton")


def test_float64_inputs_are_refused():
    x, _ = make_inputs(Case("x", T=8), torch.float64)
    with pytest.raises(TypeError, match="backend='torch'"):
        linattn.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], backend="triton")


# the other forward path, the walk (pre-pass → one sequential kernel writing o), through the public op: the same
# checks as the default split path's (test_forward_matches_reference_and_torch above runs the default)
WALK_CASES = [FWD_CASES[i] for i in (0, 2, 4, 5, 7)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", WALK_CASES, ids=[c.id for c in WALK_CASES])
def test_walk_forward_matches_reference_and_torch(case, dtype):
    assert dispatch.triton_path(case.B, case.HV, dtype).path == "split"  # so the test above ran the split path
    check_forward(case, dtype, "walk")
    # and against the split path on the same inputs (both fp32 state; o differs by the output dtype's rounding)
    x, _ = make_inputs(case, dtype)
    o_w, h_w = triton_op(x, "walk")
    o_s, h_s = triton_op(x, "split")
    assert rel_rms(h_s, h_w) <= TOLERANCES["forward_fp32"]
    assert rel_rms(o_s, o_w) <= (TOLERANCES["forward_fp32"] if dtype == torch.float32 else 2.0 ** -10)


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("setting,N,HV,dtype,expected", [
    ("auto", 1, 16, FP16, "split"), ("auto", 2, 32, FP32, "split"), ("auto", 8, 16, FP16, "walk"),
    ("auto", 4, 32, FP32, "split"), ("auto", 128, 64, FP32, "split"), ("auto", 127, 1, FP16, "split"),
    ("auto", 8, 16, BF16, "split"), ("auto", 64, 64, BF16, "split"), ("walk", 1, 1, BF16, "walk"),
    ("split", 64, 64, FP16, "split"), ("hopper", 8, 16, FP16, "walk"), ("hopper", 8, 16, BF16, "split")])
def test_forward_path_rule(setting, N, HV, dtype, expected):
    """"auto": bf16 always the split (its bf16x3 output kernel) and so fp32 (tf32x3 dots); fp16 the walk once
    N·HV ≥ 128 (the crossover with the tf32x3 output), else the split; "walk" / "split" as forced; "hopper" on CPU
    tensors resolves as "auto" (what runs where the Hopper kernel does not take the inputs)."""
    assert dict(dispatch.WALK_MIN_PAIRS) == {BF16: None, FP16: 128, FP32: None}
    q, v = torch.zeros(N, 1, 1, 1, dtype=dtype), torch.zeros(N, 1, HV, 1, dtype=dtype)
    g = beta = torch.zeros(N, 1, HV)
    assert dispatch.choose_forward_path(q, q, v, g, beta, None, None, None, "triton", setting).path == expected


@pytest.mark.parametrize("varlen", [False, True])
def test_auto_forward_path_reaches_both_paths(varlen, monkeypatch):
    """Through the public op, "auto" runs the split path below WALK_MIN_PAIRS pairs and the walk at or above it
    (pairs counted per sequence: varlen counts cu_seqlens' sequences, not B = 1), with the same results."""
    x, _ = make_inputs(Case("auto", B=1 if varlen else 2, T=40, H=2, HV=2, lengths=(9, 31) if varlen else None),
                       torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(output_final_state=True, cu_seqlens=x["cu_seqlens"], backend="triton")
    calls = []
    for name in ("split_fwd", "fused_fwd_seq_parallel"):
        fn = getattr(triton_chunk, name)
        monkeypatch.setattr(triton_chunk, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    outs = []
    for pairs in (5, 4):  # 2 sequences × 2 value heads = 4 pairs: split below 5, walk at 4
        walk_from = MappingProxyType({**dispatch.WALK_MIN_PAIRS, torch.float32: pairs})
        monkeypatch.setattr(dispatch, "WALK_MIN_PAIRS", walk_from)
        outs.append(linattn.chunk_gated_delta_rule(*args, **kw))
    assert calls == ["split_fwd", "fused_fwd_seq_parallel"]
    assert rel_rms(outs[0][0], outs[1][0]) <= TOLERANCES["forward_fp32"]
    assert rel_rms(outs[0][1], outs[1][1]) <= TOLERANCES["forward_fp32"]


def test_unknown_forward_path_is_refused():
    x, _ = make_inputs(Case("x", T=8), torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="forward_path"):
        chunk_gated_delta_rule_on_path("fused", *args, backend="triton")
    with pytest.raises(ValueError, match="path must be"):
        triton_chunk.chunk_gated_delta_rule_fwd_triton(*args, 1.0, None, None, None, path="fused")
