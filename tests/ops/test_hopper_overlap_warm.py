"""Phase C's warmed segments beside phase A (``hopper/forward.py``'s ``OVERLAP_WARM``, ``chunk_fwd_hopper_hm``'s
``warm_subset``): the twin's two halves make up its whole warm walk, the segmented forward around the twin is
bitwise the same with the switch on (every ``torch.empty`` NaN, so a row neither half wrote shows), the compiled
sm_90a source's guards where TileLang is installed, and on the GPU the op's outputs bitwise those without it."""
from __future__ import annotations

import re

import pytest
import torch

import linattn
from linattn.ops.gated_delta import triton_chunk
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import chunk_fwd_ref as twins
from linattn.ops.hopper import forward as hopper_fwd
from linattn.ops.hopper import walk_launch
from linattn.ops.hopper.prepass import prepass_hopper_ref

from .test_hopper_deferred_decay import COMPILES, kernel_source
from .test_hopper_fwd import ON_HOPPER, gpu_inputs
from .test_hopper_lean_segments import poisoned
from .test_hopper_warm_up import S, rel, three_heads, twins_recording_calls


def test_the_twins_two_halves_make_up_its_warm_walk():
    """The lean warm walk's twin with warm_subset 1 (the segments whose warm-up is above zero), then 2 (the others),
    into one pair of NaN tensors: together bitwise the whole walk; each half alone leaves exactly the other's rows
    and final states NaN."""
    x = three_heads()
    q, k, v, g, beta = (x[n].float() for n in ("q", "k", "v", "g", "beta"))
    pre = prepass_hopper_ref(k, g, beta, S, torch.float32, False)[:3]
    warm = torch.tensor([[0, 0, 0]] + [[1, 2, 0]] * (S - 1), dtype=torch.int32)     # head 2 walks its maps
    h0 = torch.zeros(S, 3, 16, 16)
    h0[:, 2] = torch.randn(S, 16, 16)
    h0[0] = x["initial_state"].float()[0]
    whole = twins.chunk_fwd_hopper_hm_ref(q, k, v, *pre, 0.25, h0, warm_chunks=warm, lean=True)
    out = (torch.full_like(whole[0], float("nan")), torch.full_like(whole[1], float("nan")))
    twins.chunk_fwd_hopper_hm_ref(q, k, v, *pre, 0.25, h0, warm_chunks=warm, lean=True, warm_subset=1, out=out)
    L = q.shape[1] // S
    assert out[0][:, :L].isnan().all() and out[0][:, L:, 2].isnan().all()      # the unwarmed rows: not yet
    assert not out[0][:, L:, :2].isnan().any()
    assert out[1][:, 2].isnan().all() and not out[1][:, :2].isnan().any()      # head 2's last segment: not yet
    twins.chunk_fwd_hopper_hm_ref(q, k, v, *pre, 0.25, h0, warm_chunks=warm, lean=True, warm_subset=2, out=out)
    assert torch.equal(out[0], whole[0]) and torch.equal(out[1], whole[1])


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
def test_overlapped_forward_is_bitwise_the_lean_forward(monkeypatch, with_state):
    """forward_hopper(segments=4) around the twin, fp32, three heads (two warm up, one walks its maps), every
    torch.empty NaN: with OVERLAP_WARM, o and the final state equal the float64 recurrence and, bitwise, the lean
    forward's without it; phase C came as two calls, the unwarmed half (on the critical stream) before the warmed
    one, into the same tensors."""
    x = three_heads()
    state = x["initial_state"].float() if with_state else None
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")] + [0.25, state]
    kw = dict(a_inv_dtype=torch.float32, segments=S, BV=16)
    ro, rht = gated_delta_rule_reference(**dict(x, initial_state=x["initial_state"] if with_state else None),
                                         scale=0.25)
    calls = twins_recording_calls(monkeypatch)
    monkeypatch.setattr(hopper_fwd, "LEAN_SEGMENTS", True)
    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    lean = hopper_fwd.forward_hopper(*args, **kw)
    calls.clear()
    monkeypatch.setattr(hopper_fwd, "OVERLAP_WARM", True)
    o, ht = hopper_fwd.forward_hopper(*args, **kw)
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    assert torch.equal(o, lean[0]) and torch.equal(ht, lean[1])
    assert [c.get("affine", False) for c in calls] == [True, False, False]
    assert [c.get("warm_subset") for c in calls[1:]] == [2, 1]
    assert calls[1]["out"][0] is calls[2]["out"][0] and calls[1]["out"][1] is calls[2]["out"][1]


def test_warm_subset_needs_the_lean_warm_walk():
    """warm_subset only splits the lean warm walk with its warm-ups given: elsewhere a ValueError before any
    compile, as for an out of the wrong shape."""
    B, T, H, K = 1, 256, 1, 64
    q = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    gc = torch.zeros(B * 4, H, T // 4)
    a_inv = torch.zeros(B, T, H, 64, dtype=torch.bfloat16)
    warm = torch.zeros(B * 4, H, dtype=torch.int32)
    h0 = torch.zeros(B * 4, H, K, K)
    with pytest.raises(ValueError, match="warm_subset"):
        walk_launch.chunk_fwd_hopper_hm(q, q, q, gc, gc, a_inv, 0.125, h0, warm_chunks=warm, warm_subset=1)
    with pytest.raises(ValueError, match="warm_subset"):
        walk_launch.chunk_fwd_hopper_hm(q, q, q, gc, gc, a_inv, 0.125, None, warm_subset=2, lean=True)
    with pytest.raises(ValueError, match="out must be"):
        walk_launch.chunk_fwd_hopper_hm(q, q, q, gc, gc, a_inv, 0.125, h0, warm_chunks=warm, warm_subset=1,
                                        lean=True, out=(q, h0))


@COMPILES
def test_the_halves_kernels_guard_their_walks_and_final_states():
    """sm_90a source: each half's lean warm walk sets its loop count to zero where the program's warm-up is on the
    other side of zero, both the producer's loop and the consumers' run to that count (unequal counts would hang the
    pipeline), and a last segment writes its final state only where it walked; the warmed half never reads h0; the
    whole walk has no such guard."""
    warm = dict(warm=True, async_o=True, async_ax=True, lean=True)
    whole, warmed, unwarmed = (kernel_source(dict(warm, warm_subset=s)) for s in (0, 1, 2))
    ctl = r"ctl\[\(\(int64_t\)\(\(int\)blockIdx\.y\)\)\]"
    selects = {1: rf"if \(\(0 < {ctl}\)\) \{{\s*condval = chunks;\s*\}} else \{{\s*condval = 0;",
               2: rf"if \(\({ctl} == 0\)\) \{{\s*condval = chunks;\s*\}} else \{{\s*condval = 0;"}
    for subset, src in ((1, warmed), (2, unwarmed)):
        assert re.search(selects[subset], src) and not re.search(selects[3 - subset], src), subset
        count = re.search(r"int (\w+) = condval;", src).group(1)
        loops = re.findall(r"for \(int cr\w* = 0; cr\w* < (\w+); \+\+cr\w*\)", src)
        assert len(loops) == 2 and set(loops) == {count}, (subset, loops)
        assert re.search(rf"== \(\(T / L\) - 1\)\) && \(0 < {count}\)\) \{{", src), subset
    # the warmed half reads no h0 at all: it runs while the scan may still be writing the entering states
    assert re.search(r"\bh0\b", warmed) is None and re.search(r"\bh0\b", unwarmed) and re.search(r"\bh0\b", whole)
    assert not any(re.search(pattern, whole) for pattern in selects.values())
    assert "&& (0 < chunks" not in whole
    with pytest.raises(ValueError, match="warm_subset"):
        kernel_source(dict(warm, lean=False, warm_subset=1))


def maps_and_warm_ups(x):
    """Gates under which the five-launch forward takes both roads: one head forgets within a chunk (−2 per token),
    two barely forget (the drawn gates, ≈ −0.2 per token, / 1024 and / 64: a segment's warm-up of 32 chunks cannot
    reach 2⁻³⁰, so they walk their maps), the others warm up from their drawn gates."""
    g = x["g"].clone()
    g[..., 0] = -2.0
    g[..., 1] = g[..., 1] / 1024
    g[..., 2] = g[..., 2] / 64
    return dict(x, g=g)


@ON_HOPPER
@pytest.mark.parametrize("shape,gates", [((1, 16384, 16, 16), "drawn"), ((1, 16384, 16, 16), "mixed"),
                                         ((1, 32768, 2, 8), "mixed")],
                         ids=["segmented", "segmented_mixed", "row7_mixed"])
def test_overlapped_warm_walks_are_bitwise_the_lean_forward_on_the_gpu(monkeypatch, shape, gates):
    """bf16 K=V=128 through the op ("auto": the five-launch segmented forward, every head warming up, or two walking
    their maps) with OVERLAP_WARM off, on, and on again (the prepared call, routed): o and the final state bitwise
    equal (the same programs, in two launches on two streams), and the plan did send heads to their maps."""
    monkeypatch.setattr(triton_chunk, "FORWARD_PATH", "auto")
    x = gpu_inputs(*shape, 128, 128, seed=5)
    x = maps_and_warm_ups(x) if gates == "mixed" else x
    outs = []
    for on in (False, True, True):
        monkeypatch.setattr(hopper_fwd, "OVERLAP_WARM", on)
        with torch.no_grad():
            outs.append(linattn.chunk_gated_delta_rule(**x, output_final_state=True))
    torch.cuda.synchronize()
    for o, ht in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(ht, outs[0][1])
    if gates == "mixed":             # both roads taken: some heads walk their maps, the others warm up
        B, T, _, HV = shape
        S = hopper_fwd.segment_count(B, HV, 128, T, torch.cuda.get_device_properties(0).multi_processor_count)
        flags = hopper_fwd.segment_flags(x["k"], x["g"], x["beta"], S, skip_maps=True, warm_up=True)
        assert flags.walk.any() and not flags.walk.all()
