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
@pytest.mark.parametrize("map_slots", [0, 9])
def test_segment_plan_equals_its_twin(S, w_max, skip_maps, warm_up, map_slots):
    """Segments of 300 chunks (the chunk loop's block is map_bound.BLOCK, 32: sums carry over ten blocks); per head
    a different chunk decay, so that warm-ups of 1 to ≈ 300 chunks, negligible and non-negligible segments and
    walking heads all occur; phase A's flags under each setting of the two levers."""
    LC = 300 if w_max != 77 else 77
    gen = torch.Generator().manual_seed(S * 1000 + w_max)
    per_head = torch.tensor([-400.0, -40.0, -3.0, -0.5, -0.12, -0.01, 0.0])    # the first warms up in a chunk
    bound = per_head[None, :, None] * (0.5 + torch.rand(2 * S, 7, LC, generator=gen))
    out = map_bound.segment_plan(bound, S, w_max, -30.0, skip_maps, warm_up, map_slots)
    ref = map_bound.segment_plan_ref(bound, S, w_max, -30.0, skip_maps, warm_up, map_slots)
    for name, a, b in zip(out._fields, out, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    negligible, warm, walk, skip_m = out
    # the cases cover both kinds of segment and head (without the wave-fill rule, which maps more heads: a superset)
    rule_free = map_bound.segment_plan_ref(bound, S, w_max, -30.0, skip_maps, warm_up)
    assert negligible.any() and not negligible.all() and rule_free.walk.any() and not rule_free.walk.all()
    assert (walk >= rule_free.walk).all() and (warm[~walk] == rule_free.warm[~walk]).all() and not warm[walk].any()
    if w_max > 1:
        assert rule_free.warm.max() > 1
    # 2 for the warmed heads' maps; 1 for the other negligible maps (with warm-ups, those of walking heads only)
    assert torch.equal(skip_m == 2, ~walk & warm_up)
    assert torch.equal(skip_m == 1, negligible & skip_maps & ~(~walk & warm_up))
    assert map_slots or (bool((skip_m == 2).any()) == warm_up
                         and bool((skip_m == 1).any()) >= (skip_maps and not warm_up))


def test_segment_plan_rejects_a_warm_up_longer_than_a_segment():
    with pytest.raises(ValueError, match="w_max"):
        map_bound.segment_plan(torch.zeros(2, 1, 4), 2, 5, -30.0)
    with pytest.raises(ValueError, match="map_slots"):
        map_bound.segment_plan(torch.zeros(2, 1, 4), 2, 4, -30.0, map_slots=-1)


def _warm_ups_of(chunks_to_forget, S=4, LC=64):
    """Chunk sums ``[S, HV, LC]`` (one sequence) where head h forgets in about ``chunks_to_forget[h]`` chunks (None:
    never; it walks its maps): each of its chunks sums to −31 / that count, so its warm-ups take the fewest w
    with 31·w / n > 30 (n = 60 → 59, 40 → 39, 20, 3 and 2 → themselves), and its segments' maps are negligible."""
    per_chunk = torch.tensor([-1e-3 if n is None else -31.0 / n for n in chunks_to_forget])
    return per_chunk[None, :, None].expand(S, len(chunks_to_forget), LC).contiguous()


def _plan_and_twin(bound, map_slots):
    out = map_bound.segment_plan(bound, 4, 64, -30.0, True, True, map_slots)
    ref = map_bound.segment_plan_ref(bound, 4, 64, -30.0, True, True, map_slots)
    for name, a, b in zip(out._fields, out, ref):
        assert torch.equal(a, b), name
    return out


@pytest.mark.parametrize("map_slots", [0, 4, 40, 1000])
def test_wave_fill_maps_the_longest_warm_ups_where_phase_a_has_room(map_slots):
    """One head that never forgets (it walks: 2 programs per segment, S = 4 segments of 64 chunks) and warm-ups of
    59, 20, 3 and 2 chunks (1 program per segment each: their maps' M tiles are negligible). In hundredths of a
    phase C chunk, a wave of phase A costs 64·66 = 4224 and the scan 3·230 = 690.
    * 4 slots: the walking head's 8 programs need two waves, and every other head adds one (4224), more than any
      cut in phase C's longest walk (59 → 20 chunks: 3900): only the walking head maps.
    * 40 slots (and 1000): every head's programs (24) fit in the one wave the walking head needs anyway, so every
      head maps and phase C walks no warm-up.
    * 0: no rule; only the walking head maps."""
    out = _plan_and_twin(_warm_ups_of([None, 60, 20, 3, 2]), map_slots)
    expected = {0: [1, 0, 0, 0, 0], 4: [1, 0, 0, 0, 0], 40: [1] * 5, 1000: [1] * 5}[map_slots]
    assert out.walk[1].int().tolist() == expected
    warm_ups = torch.tensor([0, 59, 20, 3, 2], dtype=torch.int32) * (1 - torch.tensor(expected, dtype=torch.int32))
    assert not out.warm[0].any() and (out.warm[1:] == warm_ups).all()
    assert torch.equal(out.skip_m == 2, ~out.walk)


def test_wave_fill_weighs_a_first_wave_against_phase_c():
    """No head walks. Warm-ups of 39, 20 and 3 chunks: a wave of phase A and the scan (4914) would save at most
    36 chunks of phase C (3600): they stay. Warm-ups of 62 and 2: mapping both costs 4914 and saves 62 chunks
    (6200): both map."""
    kept = _plan_and_twin(_warm_ups_of([40, 20, 3]), 132)
    assert not kept.walk.any() and kept.warm[1:].amax(0).tolist() == [39, 20, 3]
    taken = _plan_and_twin(_warm_ups_of([64, 2]), 132)
    assert taken.walk.all() and not taken.warm.any()
