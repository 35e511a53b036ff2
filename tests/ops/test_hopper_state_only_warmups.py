"""A warm-up's chunk that runs the state's steps alone (``chunk_fwd.STATE_ONLY_WARMUPS``, ``build_kernel``'s
``state_only_warmups``): where the switch applies (the warm walks of the default launch); the compiled sm_90a source
where TileLang and nvcc are installed (one branch around each chunk's steps, the warm-up's without o's three dots,
the kernel otherwise unchanged, and ptxas neither spilling nor serialising a wgmma: a dot left running where two
branches join makes it serialise every wgmma of the kernel); and on the GPU the op's outputs bitwise those of the
walk without it, at gates where the warm-ups are long."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from linattn.ops.hopper import chunk_fwd as hopper
from linattn.ops.hopper.cubin import compile_sm90a

from .test_hopper_deferred_decay import COMPILES, kernel_source, mixed_gates
from .test_hopper_fwd import ON_HOPPER, gpu_inputs, op_outputs_off_and_on

# the warm walks (o by TMA, async o and A_inv X, the instruction switches of the default launch): phase C of the
# five-launch forward, and the two-launch forward's walk that plans its own warm-ups
WARM_WALKS = {"five_launch": dict(warm=True, lean=True, tma_o=True, async_o=True, async_ax=True),
              "two_launch": dict(warm=True, warm_planned=True, lean=True, tma_o=True, async_o=True, async_ax=True)}
SWITCHES = dict(deferred_decay=True, fold_p_decay=True, uniform_warpgroup=True)


def test_the_switch_applies_only_where_the_branch_is_written(monkeypatch):
    """On for the warm walks of the default launch; off where a chunk's steps differ from the ones the branch was
    written for (sync dots, no stmatrix steps, A_inv X waited for, no fold) and for a head_split 2 walk, whose every
    chunk writes o; off everywhere while the switch is."""
    monkeypatch.setattr(hopper, "STATE_ONLY_WARMUPS", True)
    assert hopper.warmup_switch(True, True, 0) and hopper.warmup_switch(True, True, 1)
    assert not hopper.warmup_switch(True, True, 2)
    assert not hopper.warmup_switch(False, True, 0) and not hopper.warmup_switch(True, False, 0)
    for needed in ("ASYNC_AX", "DEFERRED_DECAY", "FOLD_P_DECAY"):
        with monkeypatch.context() as m:
            m.setattr(hopper, needed, False)
            assert not hopper.warmup_switch(True, True, 0), needed
    monkeypatch.setattr(hopper, "STATE_ONLY_WARMUPS", False)
    assert not hopper.warmup_switch(True, True, 0)


def ptxas_report(source: str, tmp_path: Path) -> str:
    """ptxas's verbose report (and warnings) for a TileLang kernel's CUDA, compiled for sm_90a as TileLang does."""
    return compile_sm90a(source, tmp_path)[1]


@COMPILES
@pytest.mark.parametrize("walk", list(WARM_WALKS))
def test_a_warm_up_chunk_compiles_to_the_state_steps_alone(walk, tmp_path):
    """With the switch the chunk's steps are compiled twice, once whole and once as the warm-up's: K S, A_inv X and
    the update (three more wgmma sites, no more o stores); the producer's loads are the same five tiles, now on one
    barrier per stage. ptxas keeps every wgmma asynchronous (no C7514 / C7515 serialisation) and spills nothing.
    The plain walk, which has no warm-up, compiles as without the switch."""
    on = kernel_source(WARM_WALKS[walk], **SWITCHES, state_only_warmups=True)
    off = kernel_source(WARM_WALKS[walk], **SWITCHES)
    assert on.count("wgmma_ss<") == off.count("wgmma_ss<") + 3
    assert on.count("tl::tma_store(o_desc") == off.count("tl::tma_store(o_desc")
    assert on.count("tl::tma_load(") == off.count("tl::tma_load(")
    assert re.search(r"if \(\(chunks(_\d+)? - \(L >> 6\)\) <= cr(_\d+)?\) \{", on)     # the step's branch
    assert len(re.findall(r"mbarrier\[\d+\]\.init\(", on)) == 4                        # full and empty, 2 stages
    report = ptxas_report(on, tmp_path)
    assert "serialized" not in report and re.search(r"\b0 bytes spill stores, 0 bytes spill loads", report), report
    plain = dict(tma_o=True, async_o=True, async_ax=True)
    assert kernel_source(plain, **SWITCHES, state_only_warmups=True) == kernel_source(plain, **SWITCHES)


@ON_HOPPER
@pytest.mark.parametrize("gates", ["mixed", "slow"])
@pytest.mark.parametrize("B,T", [(1, 16384), (1, 4096)], ids=["five_launch", "two_launch"])
def test_state_only_warmups_are_bitwise_the_plain_walk_on_the_gpu(monkeypatch, gates, B, T):
    """bf16 H=16 K=V=128 through the op ("auto": the five-launch and the two-launch segmented forwards) with
    STATE_ONLY_WARMUPS off and on, at gates with long warm-ups (mixed: one head barely forgets; slow: / 64): o and the
    final state bitwise equal (the state's steps are the same), and the switch took effect (a kernel compiled with
    it)."""
    compiled_with = []
    plain = hopper.compiled_kernel

    def recording(*args, **kwargs):
        compiled_with.append(kwargs.get("state_only_warmups", False))
        return plain(*args, **kwargs)

    monkeypatch.setattr(hopper, "compiled_kernel", recording)
    x = gpu_inputs(B, T, 16, 16, 128, 128, seed=8)
    x = mixed_gates(x) if gates == "mixed" else dict(x, g=x["g"] / 64)
    outs = op_outputs_off_and_on(monkeypatch, hopper, "STATE_ONLY_WARMUPS", x)
    assert any(compiled_with)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
