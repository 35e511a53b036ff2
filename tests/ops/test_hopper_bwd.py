"""The Hopper backward's host chain (linattn/ops/hopper/backward.py) and its fused walk (chunk_bwd.py) on the CPU:

* the recompute (Triton stages, interpreter, fp32) gives the twin's gc, T (without β) and states entering each
  chunk, in the layouts the walk reads;
* the host's sums of the walk's partials (head-major dg, dβ; per-slice, per-value-head dq, dk), one launch, equal
  the twin's (the same bits as the host ops they replace where the order is the same);
* bad inputs raise clear errors;
* the walk compiles for sm_90a at K = V = 128 (BV = 64) and K = V = 64 (BV = 64, 32): shared memory within the
  227 KB of a CTA, no spill, no serialised wgmma (where TileLang and nvcc are installed).
The kernel's numbers on the GPU: tests/ops/test_hopper_bwd_ref.py (ON_HOPPER), benchmarks/gpu_check_hopper_bwd.py.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linattn.ops.hopper import backward, chunk_fwd
from linattn.ops.hopper import chunk_bwd_ref as bwd

from .test_hopper_bwd_ref import GRADS, make_inputs, max_rel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # the Triton recompute: the interpreter on the CPU


@pytest.mark.interpreter
def test_recompute_gives_the_twins_saved_tensors():
    """gc, T and h from the Triton stages (fp32 inputs under the interpreter) against the forward twin's (checkpoints
    at every chunk: the states entering each chunk): the same tensors up to h's and T's bf16 rounding."""
    x = {n: t.float().to(DEVICE) for n, t in make_inputs(1, 150, 1, 2, 32).items()}
    gc, a_inv, h = backward.recompute(x["k"], x["v"], x["g"], x["beta"], x["h0"])
    _, _, saved = bwd.forward_for_backward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], 1.0, x["h0"], 1, None)
    assert h.dtype == a_inv.dtype == torch.bfloat16 and h.shape == (1, 3, 2, 32, 32)
    # past T the host pads gc with zeros, the twin with each chunk's last value: the walk masks those rows either way
    assert max_rel(backward.head_major_chunks(gc)[..., :150], saved.gc[..., :150]) < 1e-6
    # one bf16 rounding each, which the interpreter makes by truncation (≤ 2⁻⁷ relative): a chunk or head out of
    # place would be O(1)
    assert max_rel(a_inv, saved.a_inv) < 2 ** -7
    assert max_rel(h.transpose(1, 2), saved.checkpoints) < 2 ** -7


@pytest.mark.interpreter
def test_gradients_from_partials_equal_the_twins_sum():
    """The twin's V-sliced partials in the walk's layouts (dg, dβ head-major and padded to whole chunks), added by
    the host's one launch: the twin's own sums, to float64 rounding (GVA: 4 value heads on 2 qk heads, T = 100 not
    a multiple of 64)."""
    x = make_inputs(2, 100, 2, 4, 32)
    _, _, saved = bwd.forward_for_backward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.2, x["h0"], 2, None)
    parts = bwd.chunk_bwd_v_slices_ref(x["q"], x["k"], x["v"], x["do"], x["dht"], saved, 0.2, 16, None, "exact")
    head_major = lambda p: torch.stack([backward.head_major_chunks(s) for s in p.unbind(0)])
    dq, dk, dg, dbeta = backward.gradients_from_partials(
        parts.dq.to(DEVICE), parts.dk.to(DEVICE), head_major(parts.dg).to(DEVICE), head_major(parts.dbeta).to(DEVICE),
        x["g"].to(DEVICE), torch.float64, torch.float64, 2)
    twin = bwd.sum_partials_ref(parts, 2)
    errors = {n: max_rel(a.cpu(), b) for n, a, b in zip(GRADS, (dq, dk, twin[2], dg, dbeta, twin[5]), twin)}
    assert max(errors.values()) < 1e-14, errors


def _walk_partials(NV, B, T, H, HV, K, seed=0):
    """Random partials in the walk's layouts (dg, dβ head-major, padded to whole chunks with values the sums must
    not read) and gates with every fifth one below the floor."""
    from linattn.ops.utils import MIN_LOG_DECAY
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    Lp = -(-T // 64) * 64
    g = -r(B, T, HV).abs()
    g.view(-1)[::5] = MIN_LOG_DECAY - 1
    return [t.to(DEVICE) for t in (r(NV, B, T, HV, K), r(NV, B, T, HV, K), r(NV, B, HV, Lp), r(NV, B, HV, Lp), g)]


@pytest.mark.interpreter
@pytest.mark.parametrize("NV,H,HV,K", [(2, 2, 4, 32), (1, 1, 1, 48), (4, 1, 4, 16), (2, 1, 3, 48)],
                         ids=["halves_gva", "one_K48", "quarters_gva4", "halves_hv3_K48"])
def test_partial_sums_equal_their_twin(NV, H, HV, K):
    """common/partial_sum.py's one launch against its twin, the same fp32 bits: dq, dk and dg, dβ (head-major →
    token-major, dg zero below the gate floor); rows and tokens past a program's block masked (B·T·H not a multiple
    of its rows, T = 37 of a 64-wide padded row; K = 48, HV = 3 not powers of two)."""
    from linattn.ops.common.partial_sum import partial_sums, partial_sums_ref
    from linattn.ops.utils import MIN_LOG_DECAY
    args = _walk_partials(NV, 2, 37, H, HV, K)
    got = partial_sums(*args, H, torch.float32, torch.float32)
    twin = partial_sums_ref(*args, H, torch.float32, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got, twin))
    g = args[4]
    assert (got[2][g < MIN_LOG_DECAY] == 0).all() and (got[2][g >= MIN_LOG_DECAY] != 0).all()


@pytest.mark.interpreter
def test_partial_sums_cast_to_the_gradients_dtypes():
    """bf16 dq, dk and dβ: the twin's, to one bf16 unit in the last place (the interpreter rounds fp32 → bf16 by
    truncation, the GPU to nearest even); dg stays in g's dtype."""
    from linattn.ops.common.partial_sum import partial_sums, partial_sums_ref
    args = _walk_partials(2, 2, 37, 2, 4, 32)
    got = partial_sums(*args, 2, torch.bfloat16, torch.bfloat16)
    twin = partial_sums_ref(*args, 2, torch.bfloat16, torch.bfloat16)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
    assert torch.equal(got[2], twin[2])
    for a, b in zip(got[:2] + got[3:], twin[:2] + twin[3:]):
        assert ((a.float() - b.float()).abs() <= 2 ** -7 * b.float().abs()).all()


@pytest.mark.interpreter
def test_partial_sums_keep_the_previous_order():
    """fp32 partials of two slices: the one launch gives the bits of the host ops it replaces (the row sums'
    kernel, slices outer and heads inner; torch's sum over the slices, slice to T, transpose and mask for dg, dβ)."""
    from linattn.ops.common.partial_sum import partial_sums
    from linattn.ops.utils import MIN_LOG_DECAY
    dq_p, dk_p, dg_p, db_p, g = _walk_partials(2, 2, 37, 2, 4, 32, seed=1)
    dq, dk, dg, dbeta = partial_sums(dq_p, dk_p, dg_p, db_p, g, 2, torch.float32, torch.float32)
    rows = lambda p: (p[0].view(2, 37, 2, 2, 32)[..., 0, :] + p[0].view(2, 37, 2, 2, 32)[..., 1, :]
                      + p[1].view(2, 37, 2, 2, 32)[..., 0, :] + p[1].view(2, 37, 2, 2, 32)[..., 1, :])
    tokens = lambda p: p.sum(0)[..., :37].transpose(1, 2)
    assert torch.equal(dq, rows(dq_p)) and torch.equal(dk, rows(dk_p))
    assert torch.equal(dg, tokens(dg_p).masked_fill(g < MIN_LOG_DECAY, 0)) and torch.equal(dbeta, tokens(db_p))


def test_partial_sums_compile_for_h200_like_a_row_sum():
    """The one launch for sm_90 (row 5's sizes: G = 2, HV = 32): no spill, and registers
    of a plain row sum (≤ 64 per thread; the old dq/dk kernel took 48-54), so that the gate programs' transpose
    costs the row sums no occupancy."""
    from tests.ops.sm90_compile import compile_for_h200
    types = {"dq": "*bf16", "dk": "*bf16", "dbeta": "*bf16", "dq_parts": "*fp32", "dk_parts": "*fp32",
             "dg_parts": "*fp32", "dbeta_parts": "*fp32", "g": "*fp32", "dg": "*fp32"}
    consts = ("dict(NV=2, G=2, K=128, HV=32, BT=p.BT, BK=128, BR=p.ROW_ELEMENTS // 128, BH=32, "
              "BTOK=p.GATE_ELEMENTS // 32, FLOOR=-104.0)")     # the launcher's tiles
    registers, spills = compile_for_h200(
        "import sm90; from linattn.ops.common import partial_sum as p",
        f"tuple(sm90.compile_sm90(p.partial_sums_kernel, {consts}, lambda n: {types!r}.get(n, 'i32'), 4)[:2])")
    assert spills == 0 and registers <= 64, (registers, spills)


def test_partial_sums_reject_bad_partials():
    from linattn.ops.common.partial_sum import partial_sums
    dq_p, dk_p, dg_p, db_p, g = _walk_partials(2, 1, 37, 1, 2, 16)
    for bad, match in [(dict(H=3), "multiple"), (dict(dk_p=dk_p[:, :, :5]), "one shape"),
                       (dict(dq_p=dq_p.bfloat16(), dk_p=dk_p.bfloat16()), "partials must be one of"),
                       (dict(dg_p=dg_p[..., :30]), "Lp"), (dict(db_p=db_p.bfloat16()), "dbeta partials"),
                       (dict(g=g[:, :5]), "g must")]:
        x = {**dict(dq_p=dq_p, dk_p=dk_p, dg_p=dg_p, db_p=db_p, g=g, H=1), **bad}
        with pytest.raises(ValueError, match=match):
            partial_sums(x["dq_p"], x["dk_p"], x["dg_p"], x["db_p"], x["g"], x["H"], torch.float32, torch.float32)


def _inputs(B=1, T=70, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16):
    x = make_inputs(B, T, H, HV, max(K, V))
    q, k = (x[n][..., :K].to(dtype) for n in ("q", "k"))
    v, do = (x[n][..., :V].to(dtype) for n in ("v", "do"))
    return dict(q=q, k=k, v=v, g=x["g"].float(), beta=x["beta"].float(), scale=K ** -0.5,
                initial_state=x["h0"][..., :K, :V].float(), do=do, dht=x["dht"][..., :K, :V].float())


@pytest.mark.parametrize("change,error,match", [
    (dict(K=32), ValueError, "K and V in"),
    (dict(V=96), ValueError, "K and V in"),
    (dict(HV=3, H=2), ValueError, "multiple"),
    (dict(dtype=torch.float32), TypeError, "bf16"),
], ids=["K32", "V96", "HV_not_a_multiple", "fp32"])
def test_bad_inputs_raise(change, error, match):
    with pytest.raises(error, match=match):
        backward.chunk_gated_delta_rule_bwd_hopper(**_inputs(**change))


def test_bad_states_gates_and_device_raise():
    x = _inputs()
    for name, bad, match in [("g", x["g"].double(), "float32"), ("beta", x["beta"][:, :5], "g and beta"),
                             ("do", x["do"][:, :5], "do must"), ("initial_state", x["initial_state"][0], "no varlen"),
                             ("dht", x["dht"][..., :5], "dht must"), ("scale", 0.0, "scale")]:
        with pytest.raises((ValueError, TypeError), match=match):
            backward.chunk_gated_delta_rule_bwd_hopper(**{**x, name: bad})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sm_90"):
            backward.chunk_gated_delta_rule_bwd_hopper(**x)


ROOT = Path(__file__).resolve().parents[2]
COMPILES = pytest.mark.skipif(not chunk_fwd.tilelang_available() or shutil.which("nvcc") is None,
                              reason="TileLang (optional) and nvcc compile the Hopper kernels")
CTA_SHARED = 227 * 1024


@COMPILES
@pytest.mark.parametrize("K,BV", [(128, 64), (64, 64), (64, 32)])
def test_reverse_walk_compiles_for_sm90a(tmp_path, K, BV):
    """The walk (V = K, two value heads per qk head) for sm_90a: its 20 dots on bf16 wgmma (none on mma.sync),
    its dynamic shared memory within a CTA's 227 KB (213 KB at K = 128), and ptxas spilling nothing and serialising
    no wgmma (C7512). No shared-memory scan template: TileLang's CumSum1D runs on threads 0–31, the producer
    warpgroup's in this warp-specialised kernel, so its scan would never run (the dg bug the GPU found)."""
    from linattn.ops.hopper import chunk_bwd
    from linattn.ops.hopper.cubin import compile_sm90a, launch_shared_bytes, ptxas_summary
    kernel = chunk_bwd.compiled_kernel(2, 4, K, K, K ** -0.5, BV, "sm_90a")  # gpu_check_hopper_bwd's
    source = kernel.get_kernel_source()
    assert source.count("tl::wgmma_ss<tl::DataType::kBFloat16") == 20 and "mma_sync" not in source
    assert "tl::CumSum" not in source
    assert launch_shared_bytes(kernel) <= CTA_SHARED, launch_shared_bytes(kernel)
    report = compile_sm90a(source, tmp_path)[1]
    ptxas = ptxas_summary(report)
    assert ptxas["spill_stores"] == ptxas["spill_loads"] == 0 and not ptxas["wgmma_serialised"], report


@COMPILES
def test_gpu_script_smoke_builds_every_kernel():
    """benchmarks/gpu_check_hopper_bwd.py --smoke (as CI runs it): every walk the GPU script launches compiles for
    sm_90a without a spill (its cases' kernels are the compile test's, cached by TileLang): seven walks, the five
    accuracy cases' and the timing rows' two (H = HV = 16; H = 2, HV = 8), which the segmented cases and rows
    reuse."""
    done = subprocess.run([sys.executable, "benchmarks/gpu_check_hopper_bwd.py", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [ast.literal_eval(line) for line in done.stdout.splitlines() if line.startswith("{'config'")]
    assert len(rows) == 7 and all(r["spill_stores"] == 0 and r["shared_bytes"] <= CTA_SHARED for r in rows), rows


def _twin_walk(q, k, v, do, gc, beta, a_inv, h, dht, scale, BV):
    """chunk_bwd.chunk_bwd_hopper's contract computed by the twin (no rounding): the host chain's stand-in walk."""
    T = q.shape[1]
    pad = (0, gc.shape[-1] - T)
    saved = bwd.SavedForward(torch.nn.functional.pad(gc[..., :T], pad, mode="replicate"), beta, a_inv.float(),
                             h.transpose(1, 2).float(), 1)
    p = bwd.chunk_bwd_v_slices_ref(q, k, v, do, dht, saved, scale, BV, None, "exact")
    head_major = lambda x: torch.stack([backward.head_major_chunks(s) for s in x.unbind(0)])
    return p.dq, p.dk, p.dv, head_major(p.dg), head_major(p.dbeta), p.dh0


@pytest.mark.interpreter
def test_host_chain_around_the_twin_walk_gives_the_reference_gradients(monkeypatch):
    """The host chain (Triton recompute, layouts, partial sums, the gate floor's mask, output dtypes) with the walk
    replaced by its twin, fp32 under the interpreter (the dtype and device checks lifted): the float64 reference's
    gradients up to the bf16 h and T the recompute stores (GVA, T = 100, V halves). An O(1) layout error fails."""
    from linattn.ops.hopper import chunk_bwd

    from .test_hopper_bwd_ref import reference_grads, rel_l2
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_hopper", _twin_walk)
    monkeypatch.setattr(backward, "check_inputs", lambda *args: None)
    x = {n: t.to(DEVICE) for n, t in make_inputs(1, 100, 1, 2, 32, seed=2).items()}
    ref = reference_grads(x, 0.3, use_dht=True)
    low = {n: t.float() for n, t in x.items()}
    got = backward.chunk_gated_delta_rule_bwd_hopper(low["q"], low["k"], low["v"], low["g"], low["beta"], 0.3,
                                                     low["h0"], low["do"], low["dht"], BV=16)
    assert all(t.dtype == torch.float32 for t in got)
    errors = {n: rel_l2(a, b) for n, a, b in zip(GRADS, got, ref)}
    assert max(errors.values()) < 2e-2, errors


def _wy_from_bf16_t(k, v, beta, gc, a_inv):
    """segments.py's W from the T the walk reads (bf16-rounded): the maps and the walk then carry one operator."""
    from linattn.ops.common.wy import wy_fwd
    return wy_fwd(k, v, beta, gc, a_inv.bfloat16().float())


def _host_chain(x: dict, scale: float, segment_chunks, BV: int = 16) -> tuple[torch.Tensor, ...]:
    """The host chain on x's fp32 copies (the twin walk and the lifted checks patched in by the caller)."""
    low = {n: t.float() for n, t in x.items()}
    return backward.chunk_gated_delta_rule_bwd_hopper(low["q"], low["k"], low["v"], low["g"], low["beta"], scale,
                                                      low["h0"], low["do"], low["dht"], BV=BV,
                                                      segment_chunks=segment_chunks)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_segments", [2, 4])
def test_segmented_host_chain_equals_the_unsegmented_one(monkeypatch, num_segments):
    """hopper/segments.py: the walk (its twin) on segment views from the dS_out of the Triton maps and reverse scan,
    fp32 under the interpreter (two sequences of 4 chunks, GVA, initial state and dht). With the maps' W formed
    from the walk's bf16 T, both chains carry the same operator: the unsegmented gradients up to fp32 rounding. As
    shipped (W from the fp32 T) they differ by T's bf16 rounding, and are as close to the float64 reference as
    the unsegmented chain. A segment out of place, a wrong dS_out or a dh0 from the wrong segment is O(1)."""
    from linattn.ops.hopper import chunk_bwd, segments

    from .test_hopper_bwd_ref import reference_grads, rel_l2
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_hopper", _twin_walk)
    monkeypatch.setattr(backward, "check_inputs", lambda *args: None)
    x = {n: t.to(DEVICE) for n, t in make_inputs(2, 256, 1, 2, 32, seed=3).items()}
    whole = _host_chain(x, 0.3, None)
    split = _host_chain(x, 0.3, 4 // num_segments)
    ref = reference_grads(x, 0.3, use_dht=True)
    assert all(t.dtype == torch.float32 for t in split) and split[5].is_contiguous()
    errors = {n: rel_l2(a, b) for n, a, b in zip(GRADS, split, ref)}
    limits = {n: 1.5 * rel_l2(a, b) + 1e-6 for n, a, b in zip(GRADS, whole, ref)}
    assert all(errors[n] < limits[n] for n in GRADS), (errors, limits)
    assert max(errors.values()) < 2e-2, errors
    with monkeypatch.context() as m:
        m.setattr(segments, "wy_fwd", _wy_from_bf16_t)
        same_t = _host_chain(x, 0.3, 4 // num_segments)
    errors = {n: rel_l2(a, b) for n, a, b in zip(GRADS, same_t, whole)}
    assert max(errors.values()) < 2e-6, errors


@pytest.mark.interpreter
def test_segments_without_dht_start_from_zero(monkeypatch):
    """No dht: the last segment walks from zeros, as the unsegmented walk does (one sequence, 2 segments; the
    maps' W from the walk's bf16 T, as above)."""
    from linattn.ops.hopper import chunk_bwd, segments

    from .test_hopper_bwd_ref import rel_l2
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_hopper", _twin_walk)
    monkeypatch.setattr(segments, "wy_fwd", _wy_from_bf16_t)
    monkeypatch.setattr(backward, "check_inputs", lambda *args: None)
    x = {n: t.to(DEVICE) for n, t in make_inputs(1, 128, 1, 1, 32, seed=4).items()}
    x["dht"] = None
    low = {n: t.float() for n, t in x.items() if t is not None}
    args = [low[n] for n in ("q", "k", "v", "g", "beta")] + [0.3, low["h0"], low["do"], None]
    whole = backward.chunk_gated_delta_rule_bwd_hopper(*args, BV=16)
    split = backward.chunk_gated_delta_rule_bwd_hopper(*args, BV=16, segment_chunks=1)
    errors = {n: rel_l2(a, b) for n, a, b in zip(GRADS, split, whole)}
    assert max(errors.values()) < 1e-5, errors


def test_segment_length_forced_and_planned():
    """segment_chunks: bad values raise, ≥ T/64 walks unsegmented; the planner (its estimates): segments that fill
    the card at B=1 T=32768 (4 × 32 programs at HV=16, 8 × 16 at HV=8), none where the unsegmented walk already
    fills it (B=8 T=4096) or T is not a multiple of 64, and L always a divisor of T/64."""
    from linattn.ops.hopper import segments
    cpu = torch.device("cpu")
    length = lambda chunks, T=256: segments.segment_length(chunks, 1, T, 16, 128, 128, 64, cpu)
    for bad, match in [(0, ">= 1"), (1.5, ">= 1"), (True, ">= 1"), (3, "multiple")]:
        with pytest.raises(ValueError, match=match):
            length(bad)
    with pytest.raises(ValueError, match="multiple"):
        length(2, T=250)
    assert length(2) == 2 and length(4) is None and length(9, T=250) is None
    plan = lambda B, T, HV: segments.plan_walk_segments(B, T, HV, 128, 128, 64, 132)
    assert plan(1, 32768, 16) == 128 and plan(1, 32768, 8) == 64
    assert plan(8, 4096, 16) is None and plan(1, 32768 - 64 + 1, 16) is None and plan(1, 0, 16) is None
    for T in (4096, 32768, 131072, 64 * 509, 64 * 600):
        L = plan(1, T, 16)
        assert L is None or (T // 64) % L == 0 and L >= segments.MIN_SEGMENT_CHUNKS
