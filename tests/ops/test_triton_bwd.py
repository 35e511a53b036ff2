"""The Triton backward of the chunked gated delta rule (linattn/ops/common/*_bwd*.py, gated_delta/triton_bwd.py).

Two levels, both under TRITON_INTERPRET=1 on the CPU (fp32 and fp16; the interpreter gets bf16 tl.dot wrong, so
bf16 is checked on the GPU by benchmarks/gpu_check_bwd.py):

* each kernel against its PyTorch twin, fed the twin's own upstream values (so a failure points at one kernel);
* the whole backward against autograd of the float64 token-by-token reference through
  (o·dO).sum() + (h_T·dh_T).sum(), and against the torch backend's hand-written backward: every gradient,
  dg, dβ and dh0 included.

Grid pruning: the interpreter is slow, so the per-kernel tests take three shapes that between them cover a chunk
tail, K and V of different non-power-of-two sizes, several K tiles, GVA and varlen; the end-to-end table adds the
edge cases (T = 1, K = V = 1, K = 256, strong / zero decay, β ∈ {0, 1}, empty and one-token sequences, no initial
state, zero dh_T). Errors are relative RMS, ‖x − ref‖ / ‖ref‖, per gradient.
"""
import pytest
import torch
import torch.nn.functional as F

from linattn.ops.gated_delta import torch_chunk as tc
from linattn.ops.gated_delta import torch_chunk_bwd_parts as tp
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.utils import triton_available, triton_interpret

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not triton_available() or (not torch.cuda.is_available() and not triton_interpret()),
                       reason="needs triton on CUDA, or TRITON_INTERPRET=1"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.37

# relative RMS error allowed, per dtype. KERNEL: one kernel vs its float64 twin on the same (rounded) inputs.
# E2E: the whole backward vs the float64 reference on the same rounded inputs. Measured here: fp32 ≤ 5e-7; fp16
# ≈ 2e-4 (storing dq/dk/dv in fp16 is most of it), ≈ 4e-4 with "input" dots: 1e-3 leaves a 2.5× margin.
TOL = {
    "kernel": {torch.float32: 1e-5, torch.float16: 1e-3},
    "e2e": {torch.float32: 1e-5, torch.float16: 1e-3},
}

KERNEL_CASES = [
    dict(id="B2-T70-H1-K32-V16", B=2, T=70, H=1, HV=1, K=32, V=16),
    dict(id="T130-H1-HV2-K100-V60", B=1, T=130, H=1, HV=2, K=100, V=60),
    dict(id="varlen-1-64-0-66-HV2", B=1, T=131, H=1, HV=2, K=20, V=40, offsets=[0, 1, 65, 65, 131]),
]

E2E_CASES = [
    dict(id="B2-T70-K32-V16", B=2, T=70, H=1, HV=1, K=32, V=16),
    dict(id="B2-T65-H1-HV2-K60-V100", B=2, T=65, H=1, HV=2, K=60, V=100),
    dict(id="T130-H2-HV4-K100-V60", B=1, T=130, H=2, HV=4, K=100, V=60),
    dict(id="T1-noh0", B=1, T=1, H=1, HV=1, K=16, V=16, h0=False),
    dict(id="T33-K1-V1", B=1, T=33, H=1, HV=1, K=1, V=1),
    dict(id="T20-K256-V8", B=1, T=20, H=1, HV=1, K=256, V=8),
    dict(id="strong-decay-g-100", B=1, T=100, H=1, HV=2, K=32, V=24, gate="strong"),
    dict(id="no-decay-g0", B=1, T=100, H=1, HV=1, K=32, V=24, gate="zero"),
    dict(id="beta-0-or-1", B=1, T=100, H=1, HV=1, K=32, V=24, beta="binary"),
    dict(id="varlen-1-64-0-64-3-HV2", B=1, T=132, H=1, HV=2, K=24, V=20, offsets=[0, 1, 65, 65, 129, 132]),
    dict(id="varlen-noh0-dht0", B=1, T=75, H=1, HV=1, K=16, V=32, offsets=[0, 70, 75], h0=False, dht=False),
]


def _ids(cases):
    return [c["id"] for c in cases]


def rel_rms(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_inputs(case, dtype):
    """Fresh random inputs; q, k, v, dO rounded to dtype (the float64 paths then see the same values)."""
    B, T, H, HV, K, V = (case[n] for n in ("B", "T", "H", "HV", "K", "V"))
    offsets = case.get("offsets")
    N = B if offsets is None else len(offsets) - 1
    kw = dict(device=DEVICE)
    q = torch.randn(B, T, H, K, **kw).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, **kw), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, **kw).to(dtype)
    g = {"strong": torch.full((B, T, HV), -100.0, **kw), "zero": torch.zeros(B, T, HV, **kw)}.get(
        case.get("gate"), F.logsigmoid(torch.randn(B, T, HV, **kw) + 2.0))
    beta = torch.rand(B, T, HV, **kw)
    if case.get("beta") == "binary":
        beta = (beta > 0.5).float()
    h0 = torch.randn(N, HV, K, V, **kw) if case.get("h0", True) else None
    do = torch.randn(B, T, HV, V, **kw).to(dtype)
    dht = torch.randn(N, HV, K, V, **kw) if case.get("dht", True) else torch.zeros(N, HV, K, V, **kw)
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE) if offsets is not None else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, do=do, dht=dht, cu_seqlens=cu, offsets=offsets)


def twin_pipeline(x, dtype):
    """Every stage of the backward through the float64 twins, per sequence, back in the kernels' layout.

    w and v_new are rounded to dtype where they are made, as a forward storing them in the input dtype would, so
    kernel and twin read the same values."""
    q, k, v, g, beta, do = (x[n].double() for n in ("q", "k", "v", "g", "beta", "do"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    offsets = x["offsets"]
    seqs = [(b, 0, T) for b in range(B)] if offsets is None else [(0, a, e) for a, e in zip(offsets[:-1], offsets[1:])]
    tok = {}
    chunk = {"h": [[] for _ in range(B)], "dh": [[] for _ in range(B)]}
    dh0s = []
    for n, (b, bos, eos) in enumerate(seqs):
        h0 = x["h0"][n].double() if x["h0"] is not None else q.new_zeros(HV, K, V)
        dht = x["dht"][n].double()
        if eos == bos:
            dh0s.append(dht)
            continue
        s = [t[b:b + 1, bos:eos] for t in (q, k, v, g, beta, do)]
        s[0], s[1] = s[0].repeat_interleave(G, 2), s[1].repeat_interleave(G, 2)
        qc, kc, vc, gc_raw, bc, doc = (tc.to_chunks(t) for t in s)
        gc = tc.chunk_local_cumsum_ref(gc_raw)
        A_inv = tc.kkt_solve_ref(kc, bc, gc)
        w, u = tc.wy_ref(A_inv, kc, vc, bc, gc)
        w = w.to(dtype).double()
        h, v_new, _ = tc.state_pass_fwd_ref(w, u, kc, gc, h0[None])
        v_new = v_new.to(dtype).double()
        dv_local = tp.local_bwd_dv_ref(qc, kc, gc, doc, SCALE)
        dh, dv_new, dh0 = tc.state_pass_bwd_ref(qc, kc, w, gc, doc, dht[None], SCALE)
        dq, dk_p, dbeta_p, dg_p, dA_inv_p = tp.local_bwd_dqk_ref(qc, kc, bc, gc, A_inv, h, v_new, doc, dh, dv_new,
                                                                 SCALE)
        dk, dv, dbeta, dg = tp.local_bwd_wy_ref(kc, vc, bc, gc, A_inv, dv_new, dA_inv_p, dk_p, dbeta_p, dg_p)
        named = dict(gc=gc, A_inv=A_inv, w=w, v_new=v_new, dv_local=dv_local, dv_new=dv_new, dq=dq, dk_p=dk_p,
                     dbeta_p=dbeta_p, dg_p=dg_p, dA_inv_p=dA_inv_p, dk=dk, dv=dv, dbeta=dbeta, dg=dg)
        for name, val in named.items():
            if name not in tok:
                tok[name] = torch.zeros(B, T, *val.shape[1:2], *val.shape[4:], dtype=torch.float64, device=DEVICE)
            tok[name][b:b + 1, bos:eos] = tc.from_chunks(val, eos - bos)
        chunk["h"][b].append(h.permute(0, 2, 1, 3, 4)[0])
        chunk["dh"][b].append(dh.permute(0, 2, 1, 3, 4)[0])
        dh0s.append(dh0[0])
    for name in ("h", "dh"):
        tok[name] = torch.stack([torch.cat(c, 0) for c in chunk[name]])
    tok["dh0"] = torch.stack(dh0s)
    return tok


def _varlen(x):
    from linattn.ops.common.varlen import chunk_tables
    if x["offsets"] is None:
        return None, None, None
    return (x["cu_seqlens"], *chunk_tables(x["offsets"], 64, DEVICE))


def _check(got: dict, want: dict, tol: float):
    errs = {name: rel_rms(got[name], want[name]) for name in got}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative RMS above {tol:g}: {bad} (all: {errs})"


# ----------------------------------------------------------------------------------------------------------------
# each kernel against its twin
# ----------------------------------------------------------------------------------------------------------------
# dot_prec None is the default policy: fp32 operands ("ieee", or "tf32" for 16-bit inputs, which the interpreter
# computes in fp32); "input" rounds the operands of the dots on fp32 intermediates to the 16-bit input dtype.
DTYPES = [pytest.param(torch.float32, None, id="fp32"), pytest.param(torch.float16, None, id="fp16"),
          pytest.param(torch.float16, "input", id="fp16-input-dots")]


@pytest.mark.parametrize("dtype, dot_prec", DTYPES)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_ids(KERNEL_CASES))
def test_local_bwd_dv_vs_twin(case, dtype, dot_prec):
    from linattn.ops.common.local_bwd_dv import local_bwd_dv
    x = make_inputs(case, dtype)
    ref = twin_pipeline(x, dtype)
    cu, chunk_indices, _ = _varlen(x)
    dv_local = local_bwd_dv(x["q"], x["k"], ref["gc"].float(), x["do"], SCALE, cu, chunk_indices, dot_prec)
    _check({"dv_local": dv_local}, ref, TOL["kernel"][dtype])


@pytest.mark.parametrize("dtype, dot_prec", DTYPES)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_ids(KERNEL_CASES))
def test_state_pass_bwd_vs_twin(case, dtype, dot_prec):
    from linattn.ops.common.state_pass_bwd import state_pass_bwd
    x = make_inputs(case, dtype)
    ref = twin_pipeline(x, dtype)
    cu, _, chunk_offsets = _varlen(x)
    dh, dv_new, dh0 = state_pass_bwd(x["q"], x["k"], ref["w"].to(dtype), ref["gc"].float(), x["do"],
                                     ref["dv_local"].float(), x["dht"], SCALE, cu, chunk_offsets, ref["h"].shape[1],
                                     dot_prec)
    _check({"dh": dh, "dv_new": dv_new, "dh0": dh0}, ref, TOL["kernel"][dtype])


@pytest.mark.parametrize("dtype, dot_prec", DTYPES)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_ids(KERNEL_CASES))
def test_local_bwd_dqk_vs_twin(case, dtype, dot_prec):
    from linattn.ops.common.local_bwd_dqk import local_bwd_dqk
    x = make_inputs(case, dtype)
    ref = twin_pipeline(x, dtype)
    cu, chunk_indices, _ = _varlen(x)
    f = {n: ref[n].float() for n in ("gc", "A_inv", "h", "dh", "dv_new")}
    dq, dk, dbeta, dg, dA_inv = local_bwd_dqk(x["q"], x["k"], x["beta"], f["gc"], f["A_inv"], f["h"],
                                              ref["v_new"].to(dtype), x["do"], f["dh"], f["dv_new"], SCALE, cu,
                                              chunk_indices, dot_prec)
    assert dbeta.shape[0] == -(-case["K"] // 64)          # one partial per K tile of 64
    got = dict(dq=dq, dk_p=dk, dbeta_p=dbeta.sum(0), dg_p=dg.sum(0), dA_inv_p=dA_inv.sum(0))
    _check(got, ref, TOL["kernel"][dtype])


@pytest.mark.parametrize("dtype, dot_prec", DTYPES)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_ids(KERNEL_CASES))
def test_local_bwd_wy_vs_twin(case, dtype, dot_prec):
    from linattn.ops.common.local_bwd_wy import local_bwd_wy
    x = make_inputs(case, dtype)
    ref = twin_pipeline(x, dtype)
    cu, chunk_indices, _ = _varlen(x)

    def split(t):   # two K-tile partials that add up to the twin's total: the kernel must sum them
        part = torch.randn_like(t) * t.std()
        return torch.stack([part, t - part]).float()

    dk_in = ref["dk_p"].float()
    dk_in_copy = dk_in.clone()
    dk, dv, dbeta, dg = local_bwd_wy(x["k"], x["v"], x["beta"], ref["gc"].float(), ref["A_inv"].float(),
                                     ref["dv_new"].float(), split(ref["dA_inv_p"]), split(ref["dbeta_p"]),
                                     split(ref["dg_p"]), dk_in, cu, chunk_indices, dot_prec)
    assert dk.data_ptr() == dk_in.data_ptr() and not torch.equal(dk_in, dk_in_copy)   # completed in place
    assert dv.dtype == dtype
    _check(dict(dk=dk, dv=dv, dbeta=dbeta, dg=dg), ref, TOL["kernel"][dtype])


# The backward recompute's bf16 stores (h and V_new for bf16 inputs; forced here on fp32 inputs, whose dots the
# interpreter runs right): local_bwd_dqk fed bf16 h and V_new stays within one bf16 rounding (toward zero under the
# interpreter: ≤ 2^-8 per element) of its fp32-fed result.
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_ids(KERNEL_CASES))
def test_bf16_backward_stores_round_only_what_dqk_reads(case):
    from linattn.ops.common.local_bwd_dqk import local_bwd_dqk
    from linattn.ops.common.state_pass_bwd import state_pass_bwd
    x = make_inputs(case, torch.float32)
    ref = twin_pipeline(x, torch.float32)
    cu, chunk_indices, chunk_offsets = _varlen(x)
    f = {n: ref[n].float() for n in ("gc", "A_inv", "h", "w", "dv_local", "v_new")}
    dh, dv_new, dh0 = state_pass_bwd(x["q"], x["k"], f["w"], f["gc"], x["do"], f["dv_local"], x["dht"], SCALE, cu,
                                     chunk_offsets, ref["h"].shape[1])
    assert dh.dtype == torch.float32
    head = (x["q"], x["k"], x["beta"], f["gc"], f["A_inv"])
    want = local_bwd_dqk(*head, f["h"], f["v_new"], x["do"], dh, dv_new, SCALE, cu, chunk_indices)
    got = local_bwd_dqk(*head, f["h"].bfloat16(), f["v_new"].bfloat16(), x["do"], dh, dv_new, SCALE, cu,
                        chunk_indices)
    for name, g, w in zip(("dq", "dk", "dbeta", "dg", "dA_inv"), got, want):
        err = rel_rms(g, w)
        assert 1e-6 < err <= 2.0 ** -8, f"{name} with bf16 h / V_new vs fp32: {err:.2e}"


# Given the initial state, local_bwd_dqk fed a bf16 h reads the first chunk's h exactly (h[first] is the initial
# state: checked on the fp32 walk), so sequences of one chunk come out as with fp32 stores (V_new fp32 here) — T = 1,
# where h is all initial state, would otherwise carry its rounding into dg — and longer ones change only in that
# chunk's terms.
@pytest.mark.parametrize("case", [dict(id="one-chunk-B2-T40-HV2", B=2, T=40, H=1, HV=2, K=32, V=16),
                                  dict(id="varlen-1-64-0-135-HV2", B=1, T=200, H=1, HV=2, K=20, V=40,
                                       offsets=[0, 1, 65, 65, 200])], ids=lambda c: c["id"])
def test_bf16_backward_stores_read_the_exact_initial_state(case):
    from linattn.ops.common.local_bwd_dqk import local_bwd_dqk
    from linattn.ops.common.state_pass_bwd import state_pass_bwd
    from linattn.ops.common.varlen import chunk_tables
    x = make_inputs(case, torch.float32)
    ref = twin_pipeline(x, torch.float32)
    cu, chunk_indices, chunk_offsets = _varlen(x)
    f = {n: ref[n].float() for n in ("gc", "A_inv", "h", "w", "dv_local", "v_new")}
    dh, dv_new, _ = state_pass_bwd(x["q"], x["k"], f["w"], f["gc"], x["do"], f["dv_local"], x["dht"], SCALE, cu,
                                   chunk_offsets, ref["h"].shape[1])
    # where each sequence's first chunk sits in the [B, NT] (or [1, total chunks]) layout of h
    firsts = ([(n, n, 0) for n in range(case["B"])] if cu is None else
              [(n, 0, c0) for n, (c0, s_, e_) in enumerate(zip(chunk_tables(x["offsets"], 64, DEVICE)[1].tolist(),
                                                              x["offsets"], x["offsets"][1:])) if e_ > s_])
    for n, b, first in firsts:
        assert torch.equal(f["h"][b, first], x["h0"][n])
    head = (x["q"], x["k"], x["beta"], f["gc"], f["A_inv"])
    want = local_bwd_dqk(*head, f["h"], f["v_new"], x["do"], dh, dv_new, SCALE, cu, chunk_indices)
    rounded = (*head, f["h"].bfloat16(), f["v_new"], x["do"], dh, dv_new, SCALE, cu, chunk_indices)
    plain = local_bwd_dqk(*rounded)
    exact = local_bwd_dqk(*rounded, h0=x["h0"])
    for name, w, p, e in zip(("dq", "dk", "dbeta", "dg", "dA_inv"), want, plain, exact):
        if cu is None:  # one chunk per sequence: every stored h is an initial state, so the result is fp32's
            assert rel_rms(e, w) <= 1e-5 < rel_rms(p, w), (name, rel_rms(e, w), rel_rms(p, w))
        else:  # the later chunks of the last sequence keep their rounding: closer, not equal
            assert rel_rms(e, w) < rel_rms(p, w) <= 2.0 ** -8, (name, rel_rms(e, w), rel_rms(p, w))


def test_bf16_backward_stores_compile_for_h200():
    """The GPU side the interpreter skips, compiled for sm_90 (bf16 inputs, K = V = 128, the launches' warps):
    dq/dk reading bf16 h and V_new (two of its V-loop dots become bf16 MMAs and its pipelined tiles shrink)."""
    from tests.ops.sm90_compile import compile_for_h200
    res = compile_for_h200(
        "import sm90 as c; "
        "from linattn.ops.common.state_pass_bwd import state_pass_bwd_kernel; "
        "from linattn.ops.common.local_bwd_dqk import local_bwd_dqk_kernel",
        "[tuple(c.compile_kernel(state_pass_bwd_kernel, c.state_pass_bwd_consts(128, 64), num_warps=4))[:4], "
        "tuple(c.compile_kernel(local_bwd_dqk_kernel, c.dqk_consts(128), num_warps=8, "
        "bf16_args=('h', 'v_new')))[:4], "
        "tuple(c.compile_kernel(local_bwd_dqk_kernel, c.dqk_consts(128), num_warps=8))[:4]]")
    (walk_regs, _, _, _), (regs, _, shared, _), (_, _, shared_fp32, _) = res
    assert 0 < walk_regs <= 255 and 0 < regs <= 255, res
    assert shared < shared_fp32, res  # the bf16 tiles take less shared memory


def test_local_bwd_wy_refuses_an_unknown_inverse_precision():
    from linattn.ops.common.local_bwd_wy import local_bwd_wy
    x = make_inputs(KERNEL_CASES[0], torch.float16)
    ref = twin_pipeline(x, torch.float16)
    args = [x["k"], x["v"], x["beta"], ref["gc"].float(), ref["A_inv"].float(), ref["dv_new"].float(),
            ref["dA_inv_p"][None].float(), ref["dbeta_p"][None].float(), ref["dg_p"][None].float(),
            ref["dk_p"].float()]
    with pytest.raises(ValueError, match="inverse_prec"):
        local_bwd_wy(*args, inverse_prec="tf32")


def test_twin_parts_compose_to_local_bwd_ref():
    """local_bwd_dqk_ref ∘ local_bwd_wy_ref == local_bwd_ref + chunk_local_cumsum_bwd_ref (float64)."""
    B, HV, NT, C, K, V = 1, 2, 2, 64, 20, 12
    d = dict(dtype=torch.float64)
    q, k = torch.randn(B, HV, NT, C, K, **d), F.normalize(torch.randn(B, HV, NT, C, K, **d), dim=-1)
    v, do = torch.randn(B, HV, NT, C, V, **d), torch.randn(B, HV, NT, C, V, **d)
    g, beta = F.logsigmoid(torch.randn(B, HV, NT, C, **d)), torch.rand(B, HV, NT, C, **d)
    h0, dht = torch.randn(B, HV, K, V, **d), torch.randn(B, HV, K, V, **d)
    _, _, (gc, A_inv, w, h, v_new) = tc.chunk_fwd_ref(q, k, v, g, beta, SCALE, h0)
    dh, dv_new, _ = tc.state_pass_bwd_ref(q, k, w, gc, do, dht, SCALE)
    want = tc.local_bwd_ref(q, k, v, beta, gc, A_inv, w, h, v_new, do, dh, dv_new, SCALE)
    dq, dk, dbeta, dg, dA_inv = tp.local_bwd_dqk_ref(q, k, beta, gc, A_inv, h, v_new, do, dh, dv_new, SCALE)
    dk, dv, dbeta, dg = tp.local_bwd_wy_ref(k, v, beta, gc, A_inv, dv_new, dA_inv, dk, dbeta, dg)
    got = (dq, dk, dv, dbeta, dg)
    want = (*want[:4], tc.chunk_local_cumsum_bwd_ref(want[4]))
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg"), got, want):
        assert rel_rms(a, b) < 1e-13, name


# ----------------------------------------------------------------------------------------------------------------
# the whole backward
# ----------------------------------------------------------------------------------------------------------------
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def reference_grads(x):
    """Autograd of the float64 token-by-token reference through (o·dO).sum() + (h_T·dh_T).sum()."""
    leaves = {n: x[n].double().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    h0 = x["h0"].double().requires_grad_() if x["h0"] is not None else None
    o, ht = gated_delta_rule_reference(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], SCALE,
                                       h0, x["offsets"])
    ((o * x["do"].double()).sum() + (ht * x["dht"].double()).sum()).backward()
    grads = [leaves[n].grad for n in ("q", "k", "v", "g", "beta")] + [h0.grad if h0 is not None else None]
    return dict(zip(GRADS, grads))


def _as_dict(grads):
    return {n: t for n, t in zip(GRADS, grads) if t is not None}


# the "input" dots are checked kernel by kernel above; end to end on a few shapes (the interpreter is slow)
E2E_GRID = ([pytest.param(c, dtype, prec, id=f"{c['id']}-{p.id}") for c in E2E_CASES for p in DTYPES[:2]
             for dtype, prec in [p.values]]
            + [pytest.param(E2E_CASES[i], torch.float16, "input", id=f"{E2E_CASES[i]['id']}-fp16-input-dots")
               for i in (2, 6, 9)])


@pytest.mark.parametrize("case, dtype, dot_prec", E2E_GRID)
def test_bwd_vs_reference_and_torch_backend(case, dtype, dot_prec):
    from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton
    x = make_inputs(case, dtype)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["h0"])
    before = {n: t.clone() for n, t in x.items() if isinstance(t, torch.Tensor)}
    got = chunk_gated_delta_rule_bwd_triton(*args, x["cu_seqlens"], x["offsets"], x["do"], x["dht"], dot_prec)
    for n, t in before.items():
        assert torch.equal(x[n], t), f"{n} was modified"
    assert (got[5] is None) == (x["h0"] is None)
    for name, t, src in zip(GRADS, got, ("q", "k", "v", "g", "beta", "h0")):
        if t is not None:
            assert t.shape == x[src].shape and t.dtype == x[src].dtype, name

    ref = reference_grads(x)
    _check(_as_dict(got), _as_dict(ref.values()), TOL["e2e"][dtype])
    torch_grads = tc.chunk_gated_delta_rule_bwd_torch(*args, x["offsets"], x["do"], x["dht"])
    _check(_as_dict(got), _as_dict(torch_grads), TOL["e2e"][dtype])


def test_float64_is_refused():
    from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton
    x = make_inputs(E2E_CASES[0], torch.float64)
    with pytest.raises(TypeError, match="float64"):
        chunk_gated_delta_rule_bwd_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["h0"], None, None,
                                          x["do"], x["dht"])


PUBLIC_CASES = [E2E_CASES[9], E2E_CASES[10]]   # varlen (GVA, empty and 1-token sequences); no h0, dh_T = 0


@pytest.mark.parametrize("case", PUBLIC_CASES, ids=_ids(PUBLIC_CASES))
def test_public_api_gradients(case):
    """linattn.chunk_gated_delta_rule(backend="triton"): autograd reaches every input, as the reference's does."""
    import linattn
    x = make_inputs(case, torch.float32)

    def grads(backend):
        leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
        h0 = x["h0"].clone().requires_grad_() if x["h0"] is not None else None
        o, ht = linattn.chunk_gated_delta_rule(*leaves, scale=SCALE, initial_state=h0, output_final_state=True,
                                               cu_seqlens=x["cu_seqlens"], backend=backend)
        ((o * x["do"]).sum() + (ht * x["dht"]).sum()).backward()
        return [t.grad for t in leaves] + [h0.grad if h0 is not None else None]

    _check(_as_dict(grads("triton")), _as_dict(reference_grads(x).values()), TOL["e2e"][torch.float32])


def test_backward_drops_each_intermediate_after_its_last_reader(monkeypatch):
    """Peak memory: W and the local dV are gone when local_bwd_dqk starts (the backward's peak), h, dh and V_new when
    local_bwd_wy starts (triton_bwd.chunk_gated_delta_rule_bwd_triton deletes them after their last reader)."""
    import weakref

    from linattn.ops.gated_delta import triton_bwd
    alive = {}

    def watch(name, fn, picks):
        def wrapped(*a, **kw):
            for dead in {"local_bwd_dqk": ("w", "dv_local"), "local_bwd_wy": ("h", "v_new", "dh")}.get(name, ()):
                assert alive[dead]() is None, f"{dead} still referenced when {name} starts"
            out = fn(*a, **kw)
            for key, i in picks:
                alive[key] = weakref.ref(out[i] if i is not None else out)
            return out
        monkeypatch.setattr(triton_bwd, name, wrapped)

    watch("recompute_forward", triton_bwd.recompute_forward, [("w", 2), ("v_new", 3), ("h", 4)])
    watch("local_bwd_dv", triton_bwd.local_bwd_dv, [("dv_local", None)])
    watch("state_pass_bwd_seq_parallel", triton_bwd.state_pass_bwd_seq_parallel, [("dh", 0)])
    watch("local_bwd_dqk", triton_bwd.local_bwd_dqk, [])
    watch("local_bwd_wy", triton_bwd.local_bwd_wy, [])
    x = make_inputs(KERNEL_CASES[0], torch.float32)
    got = triton_bwd.chunk_gated_delta_rule_bwd_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE, x["h0"],
                                                       x["cu_seqlens"], x["offsets"], x["do"], x["dht"])
    assert len(alive) == 5 and all(torch.isfinite(t).all() for t in got if t is not None)
