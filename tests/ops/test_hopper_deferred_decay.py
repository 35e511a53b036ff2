"""The Hopper walk's deferred state decay: the state kept over its decay since the last renormalisation, one log
scale per program, instead of multiplied by each chunk's decay element by element; and with it P's decays folded
into o's rows and V_d. Their twin (``chunk_fwd_ref._walk_ref``) is the recurrence in float64 on both branches, as
accurate in bf16 as the plain algebra's; the kernel multiplies the state only under the renormalisation branch and
forms P without exps outside it (sm_90a compile, where TileLang is installed); on the GPU the op is as accurate as
the twin with the kernel's rounding points on each of the Hopper forward's plans."""
from __future__ import annotations

import re
import shutil

import pytest
import torch

import linattn
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import chunk_fwd as hopper
from linattn.ops.hopper import chunk_fwd_ref as twins

from .test_hopper_fwd import ON_HOPPER, gpu_inputs, inputs, rel

# the walk kernels of the default launch (sm_90a compiles, no GPU): the plain walk, phase A's affine walk, and the
# two-launch forward's planned warm walk
KERNEL_VARIANTS = dict(walk=dict(), affine=dict(affine=True), warm_planned=dict(warm=True, warm_planned=True))
COMPILES = pytest.mark.skipif(not hopper.tilelang_available() or shutil.which("nvcc") is None,
                              reason="TileLang (optional) and nvcc compile the Hopper kernel")


def kernel_source(variant, BV: int = 128, **options) -> str:
    """The generated CUDA of a bf16 walk kernel (H = HV = 16, K = V = 128, two consumer warpgroups) of
    :data:`KERNEL_VARIANTS`' ``variant`` (or a dict of ``compiled_kernel``'s options), with ``options`` besides."""
    variant = KERNEL_VARIANTS[variant] if isinstance(variant, str) else variant
    return hopper.compiled_kernel(16, 16, 128, 128, BV, 128 ** -0.5, threads=256, target="sm_90a", **variant,
                                  **options).get_kernel_source()


def mixed_gates(x):
    """Per value head: one head that forgets within a chunk (−2 per token: a renormalisation every chunk), one that
    barely forgets (the inputs' gates / 16: none for hundreds of rows), the others as drawn (≈ −0.2 per token: one
    every few chunks)."""
    g = x["g"].clone()
    g[..., 0] = -2.0
    g[..., 1] = g[..., 1] / 16
    return dict(x, g=g)


@pytest.mark.parametrize("fold", [False, True], ids=["deferred", "fold_p"])
@pytest.mark.parametrize("limit", [1.0, 40.0], ids=["renorm_often", "default_limit"])
@pytest.mark.parametrize("B,T,H,HV,K,V", [(2, 1000, 2, 4, 32, 32), (1, 130, 1, 2, 16, 24)])
def test_deferred_twin_without_rounding_is_the_recurrence(limit, fold, B, T, H, HV, K, V):
    """Exact in float64 whichever branch each chunk takes: at a limit of one e-fold nearly every chunk renormalises,
    at the kernel's only the forgetting head does; partial last chunks, grouped value heads, an initial state; with
    P's decays folded into o and V_d too."""
    assert hopper.DEFERRED_DECAY_LIMIT == 40.0
    x = mixed_gates(inputs(B, T, H, HV, K, V))
    o, ht = twins.chunk_fwd_hopper_ref(**x, scale=0.2, operand_dtype=torch.float64, fold_p_decay=fold,
                                       decay_limit=limit)
    ro, rht = gated_delta_rule_reference(**x, scale=0.2)
    assert rel(o, ro) < 1e-12 and rel(ht, rht) < 1e-12


def test_the_limit_keeps_the_deferred_state_finite():
    """Without the renormalisation (an unreachable limit) a head forgetting at −2 per token drives 1 / a past
    float64's range over 1000 rows: the limit is what keeps the deferred walk right (negative control: ρ overflows,
    and the kernel's select, V_d = 0 where ρ is not finite, drops those rows' updates), and with the kernel's the
    walk at the core test's strongest decay (−100 per token) is finite and exact."""
    x = mixed_gates(inputs(1, 1000, 1, 2, 16, 16))
    o, _ = twins.chunk_fwd_hopper_ref(**x, scale=0.25, operand_dtype=torch.float64, fold_p_decay=False,
                                      decay_limit=1e9)
    assert not torch.isfinite(o).all() or rel(o, gated_delta_rule_reference(**x, scale=0.25)[0]) > 1e-4
    x["g"] = torch.full_like(x["g"], -100.0)
    o, ht = twins.chunk_fwd_hopper_ref(**x, scale=0.25, operand_dtype=torch.float64, fold_p_decay=False)
    ro, rht = gated_delta_rule_reference(**x, scale=0.25)
    assert torch.isfinite(o).all() and rel(o, ro) < 1e-12 and rel(ht, rht) < 1e-12


@pytest.mark.parametrize("fold", [False, True], ids=["deferred", "fold_p"])
def test_deferred_twin_bf16_is_as_accurate(fold):
    """With the kernel's bf16 rounding points: o and the final state as close to float64 as the plain algebra's
    (here ≈ 3.1e-3 / 1.9e-3 all three), and the roundings really fall on other values (the outputs differ)."""
    x = mixed_gates(inputs(2, 1000, 2, 4, 64, 64, dtype=torch.bfloat16))
    ro, rht = gated_delta_rule_reference(**{n: t.double() for n, t in x.items()}, scale=0.125)
    o, ht = twins.chunk_fwd_hopper_ref(**x, scale=0.125, deferred_decay=False, fold_p_decay=False)
    o_d, ht_d = twins.chunk_fwd_hopper_ref(**x, scale=0.125, fold_p_decay=fold)
    assert rel(o_d, ro) < 1.1 * rel(o, ro) and rel(ht_d, rht) < 1.1 * rel(ht, rht)
    assert rel(o_d, o) > 1e-4
    if fold:            # and not the deferred walk's numbers either: P and V_d's roundings moved
        assert rel(o_d, twins.chunk_fwd_hopper_ref(**x, scale=0.125, fold_p_decay=False)[0]) > 1e-4


def test_the_hm_twin_defers_and_folds_as_the_kernel():
    """``chunk_fwd_hopper_hm_ref`` (the kernel's twin for the segmented forward's tests) defers and folds as the
    kernel does: its default is the deferred, folded walk, not the plain algebra's numbers in bf16."""
    from linattn.ops.hopper.prepass import prepass_hopper_ref
    x = mixed_gates(inputs(1, 300, 1, 2, 32, 32, dtype=torch.bfloat16))
    pre = prepass_hopper_ref(x["k"], x["g"].float(), x["beta"].float())[:3]
    args = (x["q"], x["k"], x["v"], *pre, 0.2, x["initial_state"].float())
    default = twins.chunk_fwd_hopper_hm_ref(*args, BV=128, threads=256, num_stages=2)
    kernel = twins.chunk_fwd_hopper_hm_ref(*args, deferred_decay=True, fold_p_decay=True)
    plain = twins.chunk_fwd_hopper_hm_ref(*args, deferred_decay=False, fold_p_decay=False)
    deferred = twins.chunk_fwd_hopper_hm_ref(*args, fold_p_decay=False)
    assert all(torch.equal(a, b) for a, b in zip(default, kernel))
    assert not torch.equal(plain[1], deferred[1]) and not torch.equal(kernel[0], deferred[0])


@COMPILES
@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
def test_the_kernel_multiplies_the_state_only_to_renormalise(variant):
    """sm_90a source of the default launch (and of phase A's and the two-launch walk's kernels): no per-element
    multiply of the state by e^{g_last} in the chunk loop; the state is multiplied under ``if (renorm)`` and once
    before it is written."""
    deferred = kernel_source(variant)
    assert not re.search(r"make_float4\(expf\(g_last\)", deferred)
    branch = deferred[deferred.rindex("if (renorm) {"):]        # the last: the state's (the first picks ρ's exponent)
    assert "expf((la + g_last))" in branch[:branch.index("} else {")] and "la = (la + g_last);" in branch
    assert "make_float4(expf(la)" in deferred                   # S = a S' before the final state is stored
    assert deferred.count("bool renorm = ((la + g_last) < -0x1.4p+5f") == 1        # the limit, 40 e-folds


@COMPILES
def test_the_folded_kernel_forms_p_without_exps_beside_the_update():
    """sm_90a source of the default launch: P's exp per element only in the renormalising branch (the other masks
    Q Kᵀ alone); P V_d there is issued after the consumers' barrier on V_d's tile and not waited for before the
    state's update is issued; o's factor and store come after the update."""
    src = kernel_source("walk")
    assert src.count("expf((Gsc[") == 1 and re.search(r"condval_\d+ = QK\[i_\d+\];", src)
    p_vd = re.search(r"initialize_wgmma_descriptor<[^>]*>\((desc_b_\d+), \(&\(\(\(bfloat16_t\*\)Vds\)", src)
    before, after = src[:p_vd.start()], src[p_vd.end():]
    assert "(bfloat16_t*)Ps)[0]" in before[before.rindex("GmmaDescriptor"):]          # the dot is P V_d
    last_vd_store = before.rindex("ptx_stmatrix_m8n8_x4((&(((bfloat16_t*)Vds)")
    assert "__sync_thread_partial(3, 256)" in before[last_vd_store:]
    update = after.index("wgmma_ss<", after.index("warpgroup_commit_batch()"))
    assert "warpgroup_wait" not in after[:update] and "(bfloat16_t*)Ks)" in after[:update]
    assert after.index("tma_store(o_desc", update) > after.index("warpgroup_wait<0>()", update)


@ON_HOPPER
@pytest.mark.parametrize("gates", ["drawn", "mixed", "slow"])
@pytest.mark.parametrize("B,T", [(8, 1024), (1, 16384), (1, 4096)], ids=["unsegmented", "segmented", "two_launch"])
def test_deferred_decay_through_the_op_on_the_gpu(gates, B, T):
    """bf16 H=16 K=V=128 through the op ("auto": the unsegmented kernel at 8 × 1024, the five-launch segmented
    forward at 1 × 16384, the two-launch one at 1 × 4096): as accurate against the float64 recurrence as the
    kernel's twin with its rounding points and the plain algebra's twin (within 15%; all within 1e-2, where the bf16
    error is 2–4e-3). Gates as drawn (≈ −0.2 per token), mixed (one head forgetting within a chunk, one barely:
    both branches in one launch) and slow (/ 64: few renormalisations)."""
    x = gpu_inputs(B, T, 16, 16, 128, 128, seed=6)
    if gates == "mixed":
        x = mixed_gates(x)
    elif gates == "slow":
        x["g"] = x["g"] / 64
    scale = 128 ** -0.5
    ro, rht = gated_delta_rule_reference(**x, scale=scale)
    with torch.no_grad():
        o, ht = linattn.chunk_gated_delta_rule(**x, output_final_state=True)
    twin = {fold: twins.chunk_fwd_hopper_ref(**x, scale=scale, round_a_inv=True, deferred_decay=fold,
                                             fold_p_decay=fold) for fold in (False, True)}
    errors = {"op": (rel(o, ro), rel(ht, rht)), **{fold: (rel(a, ro), rel(b, rht)) for fold, (a, b) in twin.items()}}
    # a sanity bound (a wrong kernel is off by O(1)); the claim is the next line: as accurate as its twins
    assert all(e < 1e-2 for pair in errors.values() for e in pair), errors
    bound = [max(errors[False][i], errors[True][i]) * 1.15 for i in range(2)]
    assert errors["op"][0] < bound[0] and errors["op"][1] < bound[1], errors
