"""Context-parallel gated delta rule (and gated linear attention) on 2 and 4 gloo processes against one process.

The case table covers what the split must get right: an unpacked batch with whole-sequence initial states and the
layer's raw gates; packed sequences crossing shard boundaries with unequal shards; an empty shard (the state passes
through it); a boundary that falls exactly between sequences and a zero-length sequence; grouped value heads;
float32; the norm-bound cut of the entering map (map_tolerance). Every case checks o, the final states and the
gradients of every input.
"""
import pytest
import torch

from .cases import op_cases
from .distributed import run_distributed

F64, F32 = torch.float64, torch.float32

CASES_2 = {
    "unpacked-h0-rawgate": dict(shape=(2, 100, 2, 2, 8, 8), lengths=[37, 63], h0=True, raw_gate=True, dtype=F64),
    "packed-crossing-h0-gva": dict(shape=(1, 160, 2, 4, 8, 16), lengths=[90, 70], cu_seqlens=[0, 30, 130, 160],
                                   h0=True, dtype=F64),
    # strong decay: the entering state's map is cut after ~15 tokens (error <= 1e-13 * |h_in|)
    "unpacked-map-tolerance": dict(shape=(1, 100, 2, 2, 8, 8), lengths=[40, 60], h0=True, decay_shift=-2.0,
                                   map_tolerance=1e-13, dtype=F64),
    "gla-packed-f32": dict(op="gla", shape=(1, 96, 2, 2, 8, 8), lengths=[50, 46], cu_seqlens=[0, 20, 96],
                           h0=True, dtype=F32),
}
CASES_4 = {
    "packed-empty-unequal-h0": dict(shape=(1, 200, 1, 2, 16, 16), lengths=[70, 0, 5, 125],
                                    cu_seqlens=[0, 10, 150, 200], h0=True, dtype=F64),
    "packed-boundary-at-seq-edge-empty-seq": dict(shape=(1, 128, 2, 2, 8, 8), lengths=[40, 40, 48, 0],
                                                  cu_seqlens=[0, 40, 40, 100, 128], h0=True, dtype=F64),
    "unpacked-f32-rawgate": dict(shape=(2, 160, 2, 2, 16, 16), lengths=[64, 20, 60, 16], raw_gate=True,
                                 dtype=F32),
}


# one set of processes per world size: starting them (importing torch) costs more than the cases
@pytest.mark.parametrize("world, cases", [(2, CASES_2), (4, CASES_4)], ids=["2-ranks", "4-ranks"])
def test_matches_one_process(world, cases):
    run_distributed(op_cases, world, cases)
