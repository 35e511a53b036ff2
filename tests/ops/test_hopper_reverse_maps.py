"""hopper/reverse_maps.py: the capped reverse warm-ups, the segments' maps and the reverse scan (the gradients of the
states leaving the segments where the gates keep the state longer than a segment). The twins in float64 against the
reference's own gradients; the scan's Triton kernel under the interpreter against its twin; the capped warm-ups'
sm_90a build."""
from __future__ import annotations

import re

import pytest
import torch

from linattn.ops.hopper import chunk_bwd_ref as bwd
from linattn.ops.hopper import chunk_fwd_ref as fwd_twins
from linattn.ops.hopper import reverse_maps, segments
from linattn.ops.hopper.map_bound import chunk_bounds_ref

from .test_hopper_bwd import COMPILES
from .test_hopper_bwd_ref import EXACT_TOL, exact_segment_state_grads, make_inputs, max_rel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def state_grads_with_maps(x: dict, scale: float, S: int) -> tuple[torch.Tensor, ...]:
    """(dS_out from the capped warm-ups, the maps and the scan; the capped warm-ups' own output; the map flags), all
    ``[B·S, ...]``, the twins in x's dtype (float64, no rounding): the chain ``segments.warm_state_grads`` runs."""
    _, _, saved = bwd.forward_for_backward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["h0"], 2, None)
    bound = chunk_bounds_ref(x["k"], x["g"], x["beta"])
    warm = bwd.reverse_warm_ups_hopper_ref(x["q"], x["k"], x["do"], saved.gc, saved.beta, saved.a_inv, bound,
                                           x["dht"], scale, S, None, capped=True)
    flags = bwd.reverse_warm_map_flags_ref(bound, S)
    seg = lambda t: segments.as_segments(t, S)
    gc_s, beta_s = (segments.head_major_as_segments(t, S) for t in (saved.gc, saved.beta))
    _, maps = fwd_twins.chunk_fwd_hopper_hm_ref(seg(x["k"]), seg(x["k"]), seg(x["v"]), gc_s, beta_s, seg(saved.a_inv),
                                                1.0, None, affine=True, skip_m=flags, lean=True, beta_in_a_inv=False,
                                                m_only=True)
    return reverse_maps.reverse_map_scan_ref(warm, maps, flags, S), warm, flags


@pytest.mark.parametrize("decay", ["fast", "slow"])
def test_capped_warm_ups_maps_and_scan_give_the_segments_state_gradients(decay):
    """Float64, two sequences of 8 chunks in 4 segments, GVA, against the reference's gradient of the state leaving
    each segment (autograd through the token recurrence: an independent path). Slow decay (the anchors' gates /
    1024): no warm-up falls below −30 within its one-segment cap, so segments 1 and 2 take their maps (flag 3) and
    the scan gives dS_out exactly; the capped warm-ups alone (each segment's own term D) are far from it. Fast decay
    (g ≈ −0.35 per token): every warm-up stops after one chunk, no map is walked, the scan changes nothing, and dS_out
    is within 2⁻³⁰ of ‖dS‖."""
    x = make_inputs(2, 512, 1, 2, 32, "slow" if decay == "slow" else "anchor", seed=6)
    if decay == "fast":
        x["g"] = -0.35 * (1 + 0.1 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(7),
                                                dtype=torch.float64))
    got, warm, flags = state_grads_with_maps(x, 32 ** -0.5, 4)
    exact = exact_segment_state_grads(x, 32 ** -0.5, 4)
    assert got.shape == exact.shape == (8, 2, 32, 32)
    if decay == "slow":
        assert flags.tolist() == [[2, 2], [3, 3], [3, 3], [2, 2]] * 2
        assert max_rel(got, exact) < EXACT_TOL, max_rel(got, exact)
        assert max_rel(warm, exact) > 1e-2           # the scan did the work
    else:
        assert (flags == 2).all() and torch.equal(got, warm)
        assert 0 < max_rel(got, exact) < 2.0 ** -30


def test_map_flags_mark_the_capped_warm_ups():
    """A head that forgets within one segment's chunks takes no map; one that does not takes the next segment's
    map, except where its warm-up reaches the sequence's end (the last two segments) or is the first segment's own
    (never read). Bounds per chunk: head 0 −40 (forgets at once), head 1 −10 (below −30 after four chunks: within
    a segment of 4, not within one of 2), head 2 0 (never)."""
    per_head = torch.tensor([-40.0, -10.0, 0.0])
    bound = per_head[None, :, None].expand(1, 3, 16).contiguous()
    assert bwd.reverse_warm_map_flags_ref(bound, 4).tolist() == [[2, 2, 2], [2, 2, 3], [2, 2, 3], [2, 2, 2]]
    assert bwd.reverse_warm_map_flags_ref(bound, 8).tolist() == [[2, 2, 2]] + [[2, 3, 3]] * 6 + [[2, 2, 2]]
    warm = bwd.reverse_warm_ups_ref(bound, bwd.segment_cuts(16, 4), cap=4)[:, 0]
    assert warm.tolist() == [[1, 4, 4]] * 3 + [[0, 0, 0]]


@pytest.mark.interpreter
@pytest.mark.parametrize("K,V", [(32, 64), (64, 32)])
def test_scan_kernel_equals_its_twin(K, V):
    """reverse_map_scan (Triton, the interpreter; fp32) against its twin on random W, maps and flags (two sequences
    of 5 segments, 3 heads): updated in place where a later segment's flag is 3, left alone elsewhere; unwalked
    maps (NaN: the lean affine walk leaves them unwritten) never read."""
    gen = torch.Generator().manual_seed(0)
    S, rows, HV = 5, 10, 3
    ds = torch.randn(rows, HV, K, V, generator=gen)
    maps = torch.randn(rows, HV, K, K, generator=gen) / K ** 0.5
    flags = torch.where(torch.rand(rows, HV, generator=gen) < 0.6, 3, 2).int()
    flags[::S] = 2
    maps[flags == 2] = float("nan")
    want = reverse_maps.reverse_map_scan_ref(ds, torch.nan_to_num(maps), flags, S)
    got = ds.clone().to(DEVICE)
    reverse_maps.reverse_map_scan(got, maps.to(DEVICE), flags.to(DEVICE), S)
    walked = (flags == 3).roll(-1, 0)           # rows whose next segment's map the scan applies
    walked[S - 1::S] = False
    assert walked.any() and (~walked).any()
    assert torch.equal(got.cpu()[~walked], ds[~walked])
    assert torch.allclose(got.cpu(), want, rtol=2e-3, atol=2e-3)      # tf32 products on a GPU
    assert not torch.allclose(ds[walked], want[walked], rtol=1e-1, atol=1e-1)


def test_scan_checks_its_arguments():
    ds = torch.zeros(6, 2, 16, 16)
    maps, flags = torch.zeros(6, 2, 16, 16), torch.zeros(6, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="dividing"):
        reverse_maps.reverse_map_scan(ds, maps, flags, 4)
    with pytest.raises(ValueError, match="maps"):
        reverse_maps.reverse_map_scan(ds, maps[..., :8], flags, 3)
    with pytest.raises(TypeError, match="int32"):
        reverse_maps.reverse_map_scan(ds, maps, flags.long(), 3)


@COMPILES
def test_capped_warm_ups_compile_for_sm90a(tmp_path):
    """The capped warm-ups' build for sm_90a: the uncapped one's 8 dots and loads, one more output (the map flags,
    written once per segment and head), no spill."""
    from linattn.ops.hopper import chunk_bwd
    from linattn.ops.hopper.cubin import compile_sm90a, ptxas_summary
    kernel = chunk_bwd.compiled_warm_kernel(2, 4, 128, 128, 128 ** -0.5, 64, "sm_90a", capped=True)
    source = kernel.get_kernel_source()
    assert source.count("tl::wgmma_ss<tl::DataType::kBFloat16") == 8
    assert len(re.findall(r"map_flags\[", source)) == 1
    uncapped = chunk_bwd.compiled_warm_kernel(2, 4, 128, 128, 128 ** -0.5, 64, "sm_90a").get_kernel_source()
    assert "map_flags[" not in uncapped
    ptxas = ptxas_summary(compile_sm90a(source, tmp_path)[1])
    assert ptxas["spill_stores"] == ptxas["spill_loads"] == 0 and not ptxas["wgmma_serialised"], ptxas
