"""The Hopper backward's host chain (linattn/ops/hopper/backward.py) and its fused walk (chunk_bwd.py) on the CPU:

* the recompute (Triton stages, interpreter, fp32) gives the twin's gc, T (without β) and states entering each
  chunk, in the layouts the walk reads;
* the host's sums of the walk's partials (head-major dg, dβ; per-slice, per-value-head dq, dk) equal the twin's;
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
def test_sum_partials_equals_the_twins_sum():
    """The twin's V-sliced partials in the walk's layouts (dg, dβ head-major and padded to whole chunks), added by
    the host: the twin's own sums, to float64 rounding (GVA: 4 value heads on 2 qk heads, T = 100 not a multiple
    of 64)."""
    x = make_inputs(2, 100, 2, 4, 32)
    _, _, saved = bwd.forward_for_backward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.2, x["h0"], 2, None)
    parts = bwd.chunk_bwd_v_slices_ref(x["q"], x["k"], x["v"], x["do"], x["dht"], saved, 0.2, 16, None, "exact")
    head_major = lambda p: torch.stack([backward.head_major_chunks(s) for s in p.unbind(0)])
    dq, dk, dg, dbeta = backward.sum_partials(parts.dq.to(DEVICE), parts.dk.to(DEVICE), head_major(parts.dg),
                                              head_major(parts.dbeta), 2, 100, torch.float64)
    twin = bwd.sum_partials_ref(parts, 2)
    errors = {n: max_rel(a.cpu(), b) for n, a, b in zip(GRADS, (dq, dk, twin[2], dg, dbeta, twin[5]), twin)}
    assert max(errors.values()) < 1e-14, errors


@pytest.mark.interpreter
@pytest.mark.parametrize("NV,H,HV,K", [(2, 2, 4, 32), (1, 1, 1, 48), (2, 1, 4, 16)], ids=["halves_gva", "one", "gva4"])
def test_partial_sum_equals_its_twin(NV, H, HV, K):
    """common/partial_sum.py: the slices' and the group's partials added in the twin's order, the same fp32 bits;
    rows past a program's block masked (B·T·H not a multiple of the rows per program; K = 48 not a power of two)."""
    from linattn.ops.common.partial_sum import partial_sum, partial_sum_ref
    parts = torch.randn(NV, 2, 37, HV, K, device=DEVICE)
    assert torch.equal(partial_sum(parts, H, torch.float32), partial_sum_ref(parts, H, torch.float32))
    with pytest.raises(ValueError, match="multiple"):
        partial_sum(parts, 3, torch.float32)


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
