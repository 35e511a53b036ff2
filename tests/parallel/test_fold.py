"""The affine-map fold (tree) against its sequential twin, and the plan's geometry (single process)."""
import pytest
import torch

from linattn.parallel import ShardPlan, fold_affine, fold_affine_ref
from linattn.parallel.collectives import halo_range
from linattn.parallel.fold import grad_leaving, state_entering


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 13])
def test_tree_fold_matches_sequential(n):
    gen = torch.Generator().manual_seed(n)
    M = torch.randn(n, 2, 3, 6, 6, generator=gen, dtype=torch.float64) * 0.4
    N = torch.randn(n, 2, 3, 6, 5, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(fold_affine(M, N), fold_affine_ref(M, N), atol=1e-12, rtol=1e-12)


def test_fold_is_the_chained_recurrence():
    # state_entering / grad_leaving are the forward and the reverse-transposed chains written out
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(4, 3, 3, generator=gen, dtype=torch.float64)
    N = torch.randn(4, 3, 2, generator=gen, dtype=torch.float64)
    D = torch.randn(4, 3, 2, generator=gen, dtype=torch.float64)
    h = torch.zeros(3, 2, dtype=torch.float64)
    for j in range(2):
        h = M[j] @ h + N[j]
    torch.testing.assert_close(state_entering(M, N, 2), h)
    g = D[3] + M[3].T @ torch.zeros(3, 2, dtype=torch.float64)
    g = D[2] + M[2].T @ g
    torch.testing.assert_close(grad_leaving(M, D, 1), g)


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
