"""Composing affine state maps against the sequential fold, and the plan's geometry (single process)."""
import pytest
import torch

from linattn.parallel import ShardPlan, compose, fold_affine_ref
from linattn.parallel.collectives import halo_range
from linattn.parallel.fold import identity_map, transpose_map


def _maps(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 3, 6, 6 + 5, generator=gen, dtype=torch.float64) * 0.4


def test_fold_is_the_chained_recurrence():
    maps = _maps(3)
    h = torch.zeros(2, 3, 6, 5, dtype=torch.float64)
    for m in maps:
        h = m[..., :6] @ h + m[..., 6:]
    torch.testing.assert_close(fold_affine_ref(maps), h)
    assert fold_affine_ref(maps[:0]).abs().sum() == 0


@pytest.mark.parametrize("n", [1, 2, 5])
def test_composition_is_the_fold(n):
    # what the scan over ranks computes: the N part of the composed map is the fold from a zero state
    maps = _maps(n, seed=n)
    acc = identity_map(maps[0])
    for m in maps:
        acc = compose(m, acc)
    torch.testing.assert_close(acc[..., 6:], fold_affine_ref(maps), atol=1e-12, rtol=1e-12)
    # associativity: ((c ∘ b) ∘ a) == (c ∘ (b ∘ a)), the property the log-depth scan rests on
    if n == 5:
        a, b, c = maps[0], maps[1], maps[2]
        torch.testing.assert_close(compose(compose(c, b), a), compose(c, compose(b, a)), atol=1e-12, rtol=1e-12)


def test_transposed_map_folds_the_gradient():
    # dh_out of rank 0 with three later ranks: D_1 + M_1ᵀ (D_2 + M_2ᵀ D_3)
    maps, D = _maps(4), torch.randn(4, 2, 3, 6, 5, dtype=torch.float64)
    M = maps[..., :6]
    want = D[1] + M[1].mT @ (D[2] + M[2].mT @ D[3])
    later = transpose_map(maps[1:], D[1:]).flip(0)
    torch.testing.assert_close(fold_affine_ref(later), want)


def test_plan_geometry():
    plan = ShardPlan.from_lengths([70, 0, 5, 125], [0, 10, 150, 200], rank=2)
    assert (plan.start, plan.end) == (70, 75)
    assert plan.continues() and plan.carries()
    assert plan.continues(1) and plan.carries(1)                  # the empty shard passes the state through
    assert [(s.seq, s.start, s.end) for s in plan.segments] == [(1, 0, 5)]
    assert plan.positions().tolist() == [60, 61, 62, 63, 64]
    assert halo_range(plan, 3, 3) == (72, 75) and halo_range(plan, 3, 100) == (10, 75)
    assert plan.sources(68, 75) == [(0, 68, 70), (2, 70, 75)]
    edge = ShardPlan.from_lengths([40, 40, 48], [0, 40, 40, 100, 128], rank=1)
    assert not edge.continues() and edge.carries() and not edge.carries(2)
    with pytest.raises(ValueError, match="end at T"):
        ShardPlan.from_lengths([4, 4], [0, 5], rank=0)


def _op_inputs(T=40, requires_grad=False):
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, T, 2, 8, generator=gen), torch.randn(1, T, 2, 8, generator=gen)
    v = torch.randn(1, T, 2, 8, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, 2, generator=gen) + 3)
    beta = torch.rand(1, T, 2, generator=gen)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta)]


def test_one_rank_plan_is_the_op_without_a_process_group():
    # a one-shard plan has no open boundary: no communication, so no process group is needed
    from linattn import chunk_gated_delta_rule
    from linattn.parallel import context_parallel_gated_delta_rule
    x = _op_inputs()
    cu = [0, 15, 40]
    plan = ShardPlan.from_lengths([40], cu, rank=0)
    want = chunk_gated_delta_rule(*x, output_final_state=True, cu_seqlens=torch.tensor(cu),
                                  use_qk_l2norm_in_kernel=True, backend="torch")
    with torch.no_grad():
        got = context_parallel_gated_delta_rule(*_op_inputs(requires_grad=True), plan=plan, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, backend="torch")
    assert got[0].grad_fn is None
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_bad_input_is_a_clear_error():
    from linattn.parallel import context_parallel_gated_delta_rule
    x = _op_inputs()
    with pytest.raises(ValueError, match="this rank's shard"):
        context_parallel_gated_delta_rule(*x, plan=ShardPlan.from_lengths([39], rank=0))
    with pytest.raises(ValueError, match="initial_state must be"):
        context_parallel_gated_delta_rule(*x, plan=ShardPlan.from_lengths([40], [0, 10, 40], rank=0),
                                          initial_state=torch.zeros(1, 2, 8, 8))
    with pytest.raises(ValueError, match="rank 2 outside"):
        ShardPlan.from_lengths([4, 4], rank=2)
