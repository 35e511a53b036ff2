"""``hopper/map_bound.py``'s Triton kernels against their PyTorch twins (the interpreter on the CPU): the bound's
chunk sums, and the plan made from them — with segments longer than the plan's loop block, so that its running
sums carry across blocks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.hopper import map_bound


@pytest.mark.parametrize("T,H,HV,K", [(64 * 5 + 17, 2, 4, 48), (64, 1, 1, 128), (1, 2, 2, 16)])
def test_chunk_bounds_equal_their_twin(T, H, HV, K):
    """A partial last chunk, grouped value heads, K below its power-of-two block; keys of norms up to 2 and β up
    to 1.5 (the growth term counts), decays of mixed strength."""
    gen = torch.Generator().manual_seed(T)
    k = F.normalize(torch.randn(2, T, H, K, generator=gen), dim=-1) * torch.rand(2, T, H, 1, generator=gen) * 2
    g = F.logsigmoid(torch.randn(2, T, HV, generator=gen)) * torch.rand(HV, generator=gen) * 3
    beta = torch.rand(2, T, HV, generator=gen) * 1.5
    out, ref = map_bound.chunk_bounds(k, g, beta), map_bound.chunk_bounds_ref(k, g, beta)
    assert out.shape == ref.shape == (2, HV, -(-T // 64)) and out.dtype == torch.float32
    assert (out.double() - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())
    growth = (1 - beta * k.square().sum(-1).repeat_interleave(HV // H, 2)).abs() > 1
    assert T < 64 or (growth.any() and not growth.all())     # the growth term counts, somewhere


@pytest.mark.parametrize("S,w_max", [(2, 300), (3, 1), (3, 77), (5, 130)])
def test_segment_plan_equals_its_twin(S, w_max):
    """Segments of 300 chunks (the loops' block is 128: sums carry over three blocks); per head a different chunk
    decay, so that warm-ups of 1 to ≈ 300 chunks, negligible and non-negligible segments and walking heads all
    occur."""
    NC = 300 * S if w_max != 77 else 77 * S
    gen = torch.Generator().manual_seed(S * 1000 + w_max)
    per_head = torch.tensor([-40.0, -3.0, -0.5, -0.12, -0.01, 0.0])
    bound = per_head[None, :, None] * (0.5 + torch.rand(2, 6, NC, generator=gen))
    out = map_bound.segment_plan(bound, S, w_max, -30.0)
    ref = map_bound.segment_plan_ref(bound, S, w_max, -30.0)
    for name, a, b in zip(("negligible", "warm", "walk"), out, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    negligible, warm, walk = out
    assert negligible.any() and not negligible.all() and walk.any() and not walk.all()
    if w_max > 1:
        assert warm.max() > 1


def test_segment_plan_rejects_a_warm_up_longer_than_a_segment():
    with pytest.raises(ValueError, match="w_max"):
        map_bound.segment_plan(torch.zeros(1, 1, 8), 2, 5, -30.0)
