"""The layers and the hybrid model with context parallelism on 2 and 4 gloo processes against one process: the
short convolution's halo, the sliding window's K/V halo (and full attention's), the GDN / GLA state maps, the loss
share; shards shorter than a halo, an empty shard, packed sequences crossing boundaries. Float64: the split
changes only the summation order."""
import pytest

from .cases import layer_cases
from .distributed import run_distributed

CASES_2 = {
    "gdn-packed-crossing": dict(kind="gdn", shape=(1, 90), lengths=[41, 49], cu_seqlens=[0, 30, 90]),
    "swa-unpacked": dict(kind="swa", shape=(2, 40), lengths=[23, 17]),
    "model-unpacked": dict(kind="model", shape=(2, 48), lengths=[20, 28]),
    "model-packed-checkpointing": dict(kind="model-checkpointing", shape=(1, 64), lengths=[30, 34],
                                       cu_seqlens=[0, 12, 64]),
}
CASES_4 = {
    "gla-packed-short-shard": dict(kind="gla", shape=(1, 80), lengths=[30, 2, 0, 48], cu_seqlens=[0, 31, 80]),
    "full-attention-packed": dict(kind="full", shape=(1, 60), lengths=[15, 15, 15, 15], cu_seqlens=[0, 20, 60]),
    "model-packed-empty-short": dict(kind="model", shape=(1, 96), lengths=[40, 0, 3, 53],
                                     cu_seqlens=[0, 10, 70, 96]),
}


@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["2-ranks", "4-ranks"])
def test_matches_one_process(world, cases):
    run_distributed(layer_cases, world, cases)
