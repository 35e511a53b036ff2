"""A warm-up's chunk runs the state's steps alone (``chunk_fwd.chunk_step_macro``'s ``outputs``): the compiled
sm_90a source of the warm walks, where TileLang and nvcc are installed: one branch around each chunk's steps, the
warm-up's without o's three dots, the loads and o's stores as the plain walk's, and ptxas neither spilling nor
serialising a wgmma (a dot left running where two branches join makes it serialise every wgmma of the kernel)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from linattn.ops.hopper.cubin import compile_sm90a

from .test_hopper_deferred_decay import COMPILES, kernel_source

# the warm walks: phase C of the five-launch forward, and the two-launch forward's walk that plans its own warm-ups
WARM_WALKS = {"five_launch": dict(warm=True, lean=True), "two_launch": dict(warm=True, warm_planned=True, lean=True)}


def ptxas_report(source: str, tmp_path: Path) -> str:
    """ptxas's verbose report (and warnings) for a TileLang kernel's CUDA, compiled for sm_90a as TileLang does."""
    return compile_sm90a(source, tmp_path)[1]


@COMPILES
@pytest.mark.parametrize("walk", list(WARM_WALKS))
def test_a_warm_up_chunk_compiles_to_the_state_steps_alone(walk, tmp_path):
    """The chunk's steps are compiled twice, once whole (the plain walk's) and once as the warm-up's: K S, A_inv X and
    the update (three more wgmma sites than the plain walk, no more o stores); the producer's loads are the plain
    walk's five tiles, on one barrier per stage. ptxas keeps every wgmma asynchronous (no C7514 / C7515
    serialisation) and spills nothing."""
    warm, plain = kernel_source(WARM_WALKS[walk]), kernel_source("walk")
    assert warm.count("wgmma_ss<") == plain.count("wgmma_ss<") + 3
    assert warm.count("tl::tma_store(o_desc") == plain.count("tl::tma_store(o_desc")
    assert warm.count("tl::tma_load(") == plain.count("tl::tma_load(")
    assert re.search(r"if \(\(chunks(_\d+)? - \(L >> 6\)\) <= cr(_\d+)?\) \{", warm)     # the step's branch
    assert len(re.findall(r"mbarrier\[\d+\]\.init\(", warm)) == 4                        # full and empty, 2 stages
    report = ptxas_report(warm, tmp_path)
    assert "serialized" not in report and re.search(r"\b0 bytes spill stores, 0 bytes spill loads", report), report
