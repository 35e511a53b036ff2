"""``hopper/map_bound.py``'s Triton kernels against their PyTorch twins (the interpreter on the CPU): the bound's
chunk sums, and the plan made from them — with segments longer than the plan's loop block, so that its running
sums carry across blocks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.hopper import map_bound


@pytest.mark.parametrize("T,H,HV,K,S", [(64 * 5 + 17, 2, 4, 48, 1), (64, 1, 1, 128, 1), (1, 2, 2, 16, 1),
                                        (64 * 6, 1, 2, 32, 3)])
def test_chunk_bounds_equal_their_twin(T, H, HV, K, S):
    """A partial last chunk, grouped value heads, K below its power-of-two block, a sequence cut into segments;
    keys of norms up to 2 and β up to 1.5 (the growth term counts), decays of mixed strength."""
    gen = torch.Generator().manual_seed(T)
    k = F.normalize(torch.randn(2, T, H, K, generator=gen), dim=-1) * torch.rand(2, T, H, 1, generator=gen) * 2
    g = F.logsigmoid(torch.randn(2, T, HV, generator=gen)) * torch.rand(HV, generator=gen) * 3
    beta = torch.rand(2, T, HV, generator=gen) * 1.5
    out, ref = map_bound.chunk_bounds(k, g, beta, S), map_bound.chunk_bounds_ref(k, g, beta, S)
    assert out.shape == ref.shape == (2 * S, HV, -(-T // 64) // S) and out.dtype == torch.float32
    assert (out.double() - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())
    growth = (1 - beta * k.square().sum(-1).repeat_interleave(HV // H, 2)).abs() > 1
    assert T < 64 or (growth.any() and not growth.all())     # the growth term counts, somewhere
    if S > 1:   # segment s of sequence b is row b·S + s: its chunks are the sequence's s·LC, ...
        whole = map_bound.chunk_bounds_ref(k, g, beta)
        assert torch.equal(ref.view(2, S, HV, -1).permute(0, 2, 1, 3).reshape(2, HV, -1), whole)


@pytest.mark.parametrize("S,w_max", [(2, 300), (3, 1), (3, 77), (5, 130)])
@pytest.mark.parametrize("skip_maps,warm_up", [(False, False), (True, False), (True, True), (False, True)])
def test_segment_plan_equals_its_twin(S, w_max, skip_maps, warm_up):
    """Segments of 300 chunks (the loops' block is 128: sums carry over three blocks); per head a different chunk
    decay, so that warm-ups of 1 to ≈ 300 chunks, negligible and non-negligible segments and walking heads all
    occur; phase A's flags under each setting of the two levers."""
    LC = 300 if w_max != 77 else 77
    gen = torch.Generator().manual_seed(S * 1000 + w_max)
    per_head = torch.tensor([-400.0, -40.0, -3.0, -0.5, -0.12, -0.01, 0.0])    # the first warms up in a chunk
    bound = per_head[None, :, None] * (0.5 + torch.rand(2 * S, 7, LC, generator=gen))
    out = map_bound.segment_plan(bound, S, w_max, -30.0, skip_maps, warm_up)
    ref = map_bound.segment_plan_ref(bound, S, w_max, -30.0, skip_maps, warm_up)
    for name, a, b in zip(out._fields, out, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    negligible, warm, walk, skip_m = out
    assert negligible.any() and not negligible.all() and walk.any() and not walk.all()
    if w_max > 1:
        assert warm.max() > 1
    # 2 for the warmed heads' maps; 1 for the other negligible maps (with warm-ups, those of walking heads only)
    assert torch.equal(skip_m == 2, ~walk & warm_up)
    assert torch.equal(skip_m == 1, negligible & skip_maps & ~(~walk & warm_up))
    assert bool((skip_m == 2).any()) == warm_up and bool((skip_m == 1).any()) >= (skip_maps and not warm_up)


def test_segment_plan_rejects_a_warm_up_longer_than_a_segment():
    with pytest.raises(ValueError, match="w_max"):
        map_bound.segment_plan(torch.zeros(2, 1, 4), 2, 5, -30.0)
