"""The Hopper backward's states recompute in segments (``backward.segmented_states``: the segmented forward's plan,
phase A's maps of the states walk's operator, the scan, phase C's warm states walk) around the kernels' twins on the
CPU, the Triton plan and scan under the interpreter: h equals the unsegmented states twin's at fast gates (warm-ups),
slow gates (maps walked) and a head of each, with and without h0; the whole backward's gradients are the
unsegmented recompute's. The new kernel variants (phase A with β in X, phase C's warm states walk) compile for
sm_90a without a spill."""
from __future__ import annotations

import shutil

import pytest
import torch

from linattn.ops.hopper import backward, chunk_fwd, prepass, walk_launch
from linattn.ops.hopper import chunk_fwd_ref as twins

from .hopper_twins import hand_plan
from .test_hopper_bwd_ref import GRADS, make_inputs, max_rel, rel_l2

# the forward's segmented tests' bound (fp32 twins: fp32 rounding, and 2⁻³⁰ of the state where a warm-up or a
# skipped map stands for the entering state)
BOUND = 1e-5


def use_twins(monkeypatch, affine_walk=None) -> None:
    """The pre-pass, the affine walk (``affine_walk``: a stand-in for its twin) and the states walk replaced by their
    twins (T in bf16, as the pre-pass kernel stores it)."""
    monkeypatch.setattr(prepass, "prepass_hopper", prepass.prepass_hopper_ref)
    monkeypatch.setattr(walk_launch, "chunk_fwd_hopper_hm", affine_walk or twins.chunk_fwd_hopper_hm_ref)
    monkeypatch.setattr(walk_launch, "chunk_states_hopper", twins.chunk_states_hopper_ref)


def gated_inputs(decay: str, B: int, T: int, HV: int, K: int, seed: int = 0) -> dict:
    """make_inputs' fp32 copies, gates per ``decay``: "anchor" (the anchors' gates: warm-ups of ≈ 7 chunks),
    "slow" (their / 1024: every head walks its maps), "fast" (≈ −0.4 per token: one-chunk warm-ups, negligible
    maps), "mixed" (head 0 fast, the others slow)."""
    x = make_inputs(B, T, 1, HV, K, "slow" if decay in ("slow", "mixed") else "anchor", seed=seed)
    if decay in ("fast", "mixed"):
        fast = -0.4 - 0.05 * torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        x["g"] = x["g"].clone()
        if decay == "fast":
            x["g"] = fast[..., None].expand(B, T, HV).clone()
        else:
            x["g"][..., 0] = fast
    return {n: t.float() for n, t in x.items()}


def states_both_ways(x: dict, S: int, with_h0: bool):
    """(segmented h, unsegmented h, the plan's flags) on the twins, from :func:`backward.solve`'s outputs."""
    from linattn.ops.hopper import forward, segments
    gc_hm, beta_hm, t_inv, bound = backward.solve(x["k"], x["g"], x["beta"])
    h0 = x["h0"] if with_h0 else None
    whole, _ = twins.chunk_states_hopper_ref(x["k"], x["v"], gc_hm, beta_hm, t_inv, h0)
    split = backward.segmented_states(x["k"], x["v"], gc_hm, beta_hm, t_inv, bound, h0, S, dict(BV=16))
    flags = forward.segment_flags(segments.head_major_as_segments(bound, S), S, x["k"].device, x["k"].shape[0])
    return split, whole, flags


@pytest.mark.interpreter
@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("decay,B,T,S", [("anchor", 1, 1024, 2), ("slow", 2, 512, 4), ("mixed", 2, 512, 4)])
def test_segmented_states_equal_the_unsegmented_walk(monkeypatch, decay, B, T, S, with_h0):
    """h from the segmented recompute (fp32 twins, two value heads) against the unsegmented states twin: within
    :data:`BOUND` of its largest element at every chunk. The plan's flags show which path each case takes: warm-ups
    at the anchors' gates (8-chunk segments), every head's maps at slow gates, a walked and a skipped M at mixed
    gates."""
    use_twins(monkeypatch)
    x = gated_inputs(decay, B, T, 2, 16)
    split, whole, flags = states_both_ways(x, S, with_h0)
    assert split.shape == whole.shape == (B, T // 64, 2, 16, 16)
    assert max_rel(split, whole) < BOUND, max_rel(split, whole)
    if decay == "anchor":
        assert not flags.walk.any() and flags.warm.max() > 1, flags
    elif decay == "slow":
        assert flags.walk.all() and not flags.negligible.any(), flags
    else:       # the wave-fill rule maps the fast head too (phase A has room), its negligible M skipped
        assert flags.walk.all() and (flags.skip_m[:, 0] == 1).all() and (flags.skip_m[:, 1] == 0).all(), flags


@pytest.mark.interpreter
@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("decay", ["fast", "slow", "mixed"])
def test_planned_states_equal_the_unsegmented_walk(monkeypatch, decay, with_h0):
    """The states in two launches (``backward.planned_states``, the host-bound sizes' plan) on the twins: every
    segment finds its warm-up from the chunk bounds, the whole prefix from h0 where none is shorter (slow gates:
    exact), and h is within :data:`BOUND` of the unsegmented states twin's at every chunk (2-chunk segments: at the
anchors' gates these would all walk their prefixes, so fast gates show the warm-ups)."""
    from linattn.ops.hopper import map_bound, segments
    use_twins(monkeypatch)
    x = gated_inputs(decay, 2, 512, 2, 16)
    gc_hm, beta_hm, t_inv, bound = backward.solve(x["k"], x["g"], x["beta"])
    h0 = x["h0"] if with_h0 else None
    whole, _ = twins.chunk_states_hopper_ref(x["k"], x["v"], gc_hm, beta_hm, t_inv, h0)
    planned = backward.planned_states(x["k"], x["v"], gc_hm, beta_hm, t_inv, bound, h0, 4, dict(BV=16))
    assert planned.shape == whole.shape == (2, 8, 2, 16, 16)
    assert max_rel(planned, whole) < BOUND, max_rel(planned, whole)
    warm, from_start = map_bound.warm_from_bound_ref(segments.head_major_as_segments(bound, 4), 4, -30.0)
    if decay == "fast":         # every later segment warms up one chunk, from zero
        assert not from_start.view(2, 4, 2)[:, 1:].any() and (warm.view(2, 4, 2)[:, 1:] == 1).all(), warm
    elif decay == "slow":       # no head forgets: every segment walks its whole prefix
        assert from_start.all(), warm
    else:                       # head 0 forgets within a chunk, head 1 never
        assert not from_start.view(2, 4, 2)[:, 1:, 0].any() and from_start[:, 1].all(), warm


@pytest.mark.interpreter
def test_planned_states_need_the_sequences_initial_state(monkeypatch):
    """Negative control at slow gates: the planned walk started from zero at the sequence's start (h0 dropped)
    moves h far beyond :data:`BOUND`, so the test above sees where the prefix walks begin."""
    use_twins(monkeypatch)
    x = gated_inputs("slow", 2, 512, 2, 16)
    gc_hm, beta_hm, t_inv, bound = backward.solve(x["k"], x["g"], x["beta"])
    whole, _ = twins.chunk_states_hopper_ref(x["k"], x["v"], gc_hm, beta_hm, t_inv, x["h0"])
    planned = backward.planned_states(x["k"], x["v"], gc_hm, beta_hm, t_inv, bound, None, 4, dict(BV=16))
    assert max_rel(planned, whole) > 1e-2


@pytest.mark.interpreter
def test_segmented_states_need_the_right_maps(monkeypatch):
    """Negative controls at slow gates (the maps carry the entering state): phase A's M scaled by 0.95, or phase A
    run on the forward's operator (β in T, none in X: T itself here, so the maps miss β), moves h by far more than
    :data:`BOUND`."""
    x = gated_inputs("slow", 2, 512, 2, 16)

    def scaled_m(*args, **kwargs):
        _, mn = twins.chunk_fwd_hopper_hm_ref(*args, **kwargs)
        mn = mn.clone()
        mn[..., :args[0].shape[-1]] *= 0.95
        return None, mn

    def beta_in_t(*args, beta_in_a_inv=True, **kwargs):
        return twins.chunk_fwd_hopper_hm_ref(*args, beta_in_a_inv=True, **kwargs)

    for bad in (scaled_m, beta_in_t):
        use_twins(monkeypatch, bad)
        split, whole, _ = states_both_ways(x, 4, True)
        assert max_rel(split, whole) > 1e-3, bad.__name__


def test_segmented_states_reject_bad_segments():
    x = gated_inputs("anchor", 1, 256, 2, 16)
    k, v = x["k"], x["v"]
    for S in (1, 3):
        with pytest.raises(ValueError, match="segments need"):
            backward.segmented_states(k, v, None, None, None, None, None, S, dict(BV=16))


def test_the_planned_states_walk_checks_its_arguments():
    """chunk_states_hopper with warm_bound: its threshold, the bounds' rows and the sequences' initial state."""
    bf = torch.bfloat16
    k, v = torch.zeros(1, 256, 1, 16, dtype=bf), torch.zeros(1, 256, 2, 16, dtype=bf)
    t_inv = torch.zeros(1, 256, 2, 64, dtype=bf)
    gc, bound = torch.zeros(2, 2, 128), torch.zeros(2, 2, 2)
    cases = [(dict(warm_bound=bound), "warm_threshold"),
             (dict(warm_bound=bound, warm_threshold=-30.0, warm_chunks=torch.zeros(2, 2, dtype=torch.int32)),
              "warm_threshold"),
             (dict(warm_bound=bound[:1], warm_threshold=-30.0), "warm_bound must be"),
             (dict(warm_bound=bound.double(), warm_threshold=-30.0), "warm_bound must be"),
             (dict(warm_bound=bound, warm_threshold=-30.0, initial_state=torch.zeros(2, 2, 16, 16)),
              "sequences' initial state")]
    for kwargs, match in cases:
        h0 = kwargs.pop("initial_state", None)
        with pytest.raises(ValueError, match=match):
            walk_launch.chunk_states_hopper(k, v, gc, gc, t_inv, h0, BV=16, **kwargs)


def test_the_phase_c_states_walk_checks_its_rows():
    """chunk_states_hopper's checks of the segments' rows (bf16 inputs, shapes off by one segment)."""
    bf = torch.bfloat16
    k, v = torch.zeros(1, 256, 1, 16, dtype=bf), torch.zeros(1, 256, 2, 16, dtype=bf)
    t_inv = torch.zeros(1, 256, 2, 64, dtype=bf)
    gc = torch.zeros(2, 2, 128)
    h_in, warm = torch.zeros(2, 2, 16, 16), torch.zeros(2, 2, dtype=torch.int32)
    for args, match in [((gc[:1], gc[:1], h_in, warm), "per segment"), ((gc, gc, h_in[:1], warm), "entering state"),
                        ((gc, gc, None, warm), "entering state"), ((gc, gc, h_in, warm[:1]), "warm_chunks")]:
        with pytest.raises(ValueError, match=match):
            walk_launch.chunk_states_hopper(k, v, args[0], args[1], t_inv, args[2], BV=16, warm_chunks=args[3])
    with pytest.raises(ValueError, match="affine"):
        walk_launch.chunk_fwd_hopper_hm(k, k, v, gc[:1], gc[:1], t_inv, 1.0, None, BV=16, beta_in_a_inv=False)


def _twin_walk(*args, **out):
    from .test_hopper_bwd import _twin_walk as walk
    return walk(*args, **out)


@pytest.mark.interpreter
@pytest.mark.parametrize("decay", ["anchor", "fast"])
def test_backward_on_segmented_states_equals_the_unsegmented_recompute(monkeypatch, decay):
    """The whole host chain (twins for the recompute's kernels and the walk, fp32, two sequences of 4 chunks, h0 and
    dht, walk unsegmented) with the states recomputed in 4 segments (a hand plan: the shapes are too small to need
    them) against the same chain on the unsegmented recompute: every gradient within :data:`BOUND` (relative L2),
    both within 2e-2 of the float64 reference (the bf16 T). Anchors' gates walk the maps (1-chunk segments), fast
    gates warm up (one chunk, from zero: the entering state's e^−25 share is below fp32's rounding there, so those
    gradients come out bitwise the unsegmented ones)."""
    from linattn.ops.hopper import chunk_bwd

    from .test_hopper_bwd_ref import reference_grads
    use_twins(monkeypatch)
    warm_ups = []

    def phase_c(*args, warm_chunks=None, **kwargs):
        warm_ups.append(warm_chunks)
        return twins.chunk_states_hopper_ref(*args, warm_chunks=warm_chunks, **kwargs)

    monkeypatch.setattr(walk_launch, "chunk_states_hopper", phase_c)
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_hopper", _twin_walk)
    monkeypatch.setattr(backward, "check_inputs", lambda *args: None)
    x = gated_inputs(decay, 2, 256, 2, 32, seed=3)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [0.3, x["h0"], x["do"], x["dht"]]
    segmented = []
    monkeypatch.setattr(backward, "plan", lambda *a: segmented.append(a) or hand_plan(4))
    split = backward.chunk_gated_delta_rule_bwd_hopper(*args, BV=16, segment_chunks=4)
    monkeypatch.setattr(backward, "plan", lambda *a: None)
    whole = backward.chunk_gated_delta_rule_bwd_hopper(*args, BV=16, segment_chunks=4)
    assert len(segmented) == 1 and all(t.dtype == torch.float32 for t in split)
    assert warm_ups[1] is None and int(warm_ups[0].max()) == (1 if decay == "fast" else 0), warm_ups
    errors = {n: rel_l2(a, b) for n, a, b in zip(GRADS, split, whole)}
    assert max(errors.values()) < BOUND, errors
    ref = reference_grads({n: t.double() for n, t in x.items()}, 0.3, use_dht=True)
    assert max(rel_l2(a, b) for a, b in zip(split, ref)) < 2e-2


def test_states_take_the_forwards_plan(monkeypatch):
    """backward.states follows plan.plan: segments where the plan cuts the sequences (B=1 T=32768 HV=16: 8 segments
    at BV=128), in two launches where it plans its own warm-ups (B=1 T=4096: 4 segments at BV=64), the unsegmented
    walk where one program per sequence and head fills the card (B=8) or nothing does (T not a multiple of 64:
    BV=64)."""
    calls = []
    monkeypatch.setattr(backward, "segmented_states", lambda *a: calls.append(("segments", a[7], a[8]["BV"])))
    monkeypatch.setattr(backward, "planned_states", lambda *a: calls.append(("planned", a[7], a[8]["BV"])))
    monkeypatch.setattr(walk_launch, "chunk_states_hopper",
                        lambda *a, **kw: calls.append(("whole", kw["BV"])) or (None, None))
    for B, T in ((1, 32768), (8, 4096), (1, 32768 - 1), (1, 4096)):
        k = torch.empty(B, T, 16, 128, device="meta")
        v = torch.empty(B, T, 16, 128, device="meta")
        backward.states(k, v, None, None, None, None, None)
    assert calls == [("segments", 8, 128), ("whole", 128), ("whole", 64), ("planned", 4, 64)], calls


COMPILES = pytest.mark.skipif(not chunk_fwd.tilelang_available() or shutil.which("nvcc") is None,
                              reason="TileLang (optional) and nvcc compile the Hopper kernels")


@COMPILES
@pytest.mark.parametrize("H,HV,K,BV", [(16, 16, 128, 128), (2, 8, 128, 128), (16, 16, 64, 64)])
def test_segmented_states_kernels_compile_for_sm90a(tmp_path, H, HV, K, BV):
    """Phase A with β in X (the affine walk of the states' operator, lean maps), phase C's warm states walk and the
    planned states walk (with and without h0) for sm_90a at the launches the plan gives (rows 3, 4 and 7 of the GPU
    script: BV = 128; K = 64): β loaded by TMA in each, never q; h stored by TMA; shared memory within a CTA; no
    spill and no serialised wgmma, as the builds they extend (the affine walk without β, the unsegmented states
    walk)."""
    from linattn.ops.hopper.cubin import compile_sm90a, launch_shared_bytes, ptxas_summary
    from linattn.ops.hopper.plan import DEFAULT
    kernels = dict(
        maps=walk_launch.walk_kernel(H, HV, K, K, BV, 1.0, DEFAULT.threads, DEFAULT.num_stages, False, torch.float32,
                                     True, True, "sm_90a", beta_in_a_inv=False),
        warm_states=walk_launch.states_kernel(H, HV, K, K, BV, DEFAULT.threads, DEFAULT.num_stages, True,
                                              torch.float32, "sm_90a", warm=True),
        planned_states=walk_launch.states_kernel(H, HV, K, K, BV, DEFAULT.threads, DEFAULT.num_stages, False,
                                                 torch.float32, "sm_90a", warm=True,
                                                 threshold=DEFAULT.negligible_m_log2),
        planned_states_h0=walk_launch.states_kernel(H, HV, K, K, BV, DEFAULT.threads, DEFAULT.num_stages, True,
                                                    torch.float32, "sm_90a", warm=True,
                                                    threshold=DEFAULT.negligible_m_log2))
    for name, kernel in kernels.items():
        src = kernel.get_kernel_source()
        assert "tma_load(beta_desc" in src and "q_desc" not in src, name
        assert launch_shared_bytes(kernel) <= 227 * 1024, (name, launch_shared_bytes(kernel))
        (tmp_path / name).mkdir()
        ptxas = ptxas_summary(compile_sm90a(src, tmp_path / name)[1])
        assert ptxas["spill_stores"] == ptxas["spill_loads"] == 0 and not ptxas["wgmma_serialised"], (name, ptxas)
    assert all("tma_store(o_desc" in kernels[name].get_kernel_source()
               for name in ("warm_states", "planned_states", "planned_states_h0"))
