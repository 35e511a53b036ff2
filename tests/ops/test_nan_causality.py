"""Causality under NaN and Inf (issue 46, item 4): a non-finite value in one token's q, k, v, g or β reaches exactly
the outputs the float64 reference (a token loop) makes non-finite: o at that token and after it in the same
sequence (only at that token for q), the value heads that read it, and their final states; never an earlier token
of its chunk (NaN · 0 in a masked chunk product), another head, or another sequence.

Every chunked forward, on the GPU where there is one (else the CPU, Triton under the interpreter): the torch
backend, the Triton split forward (W and U from the pre-pass; A_inv formed in the state pass; segments stitched
through affine maps), the Triton walk (plain and segmented), the unfused stages the backward recomputes (fp32) and
gated linear attention. The pattern is compared per (token, value head) row: a row is non-finite when any of its
entries is (a NaN in one entry of v poisons only that column in the reference, whole V tiles in the kernels). Rows
the reference leaves finite must also match its values (the float64 reference runs on the CPU). The backward must
not crash. bf16 and the Hopper forward are checked on the GPU (benchmarks/gpu_check_edges.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.common import split_fwd as split_module
from linattn.ops.common.seq_parallel import fused_fwd_seq_parallel
from linattn.ops.gated_delta import triton_chunk
from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.gated_linear.chunk import gated_linear_attention
from linattn.ops.gated_linear.reference import gated_linear_attention_reference
from linattn.ops.hopper import forward as hopper_forward

from .hopper_twins import hand_plan, use_twins

B, H, HV, K, V = 2, 1, 2, 16, 16
T = 150                      # three chunks: the plant sits in the second, after its first tokens
T0 = 70
# (name, tensor, index into it, value); q and k planted in key head 0 (both value heads read it), the rest in value
# head 1 (head 0 must stay finite); k and v in one entry only
PLANTS = {
    "q-nan": ("q", (1, T0, 0, 3), float("nan")),
    "k-nan": ("k", (1, T0, 0, 5), float("nan")),
    "k-inf": ("k", (1, T0, 0, 5), float("-inf")),
    "v-nan": ("v", (1, T0, 1, 2), float("nan")),
    "v-inf": ("v", (1, T0, 1, 2), float("inf")),
    "g-nan": ("g", (1, T0, 1), float("nan")),
    "g-inf": ("g", (1, T0, 1), float("inf")),
    "beta-nan": ("beta", (1, T0, 1), float("nan")),
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # the Triton paths: the interpreter on the CPU
TOL = 1e-5   # relative RMS against float64 on the rows the reference leaves finite (fp32, as test_edge_gates.py)


def make(plant, seqlens=None, seed=0, t=T):
    gen = torch.Generator().manual_seed(seed)
    b = 1 if seqlens else B
    t = sum(seqlens) if seqlens else t
    x = dict(q=torch.randn(b, t, H, K, generator=gen), k=F.normalize(torch.randn(b, t, H, K, generator=gen), dim=-1),
             v=torch.randn(b, t, HV, V, generator=gen),
             g=F.logsigmoid(torch.randn(b, t, HV, generator=gen) + 2.0) / 8,    # weak decay: the state matters
             beta=torch.rand(b, t, HV, generator=gen))
    name, index, value = plant
    x[name][index] = value
    h0 = torch.randn(len(seqlens) if seqlens else b, HV, K, V, generator=gen)
    return {n: t.to(DEVICE) for n, t in x.items()}, h0.to(DEVICE)


def on_cpu(x, h0):
    """The float64 references run on the CPU (a token loop: no gain from the device)."""
    return {n: t.cpu() for n, t in x.items()}, h0.cpu()


def reference(x, h0, offsets=None):
    x, h0 = on_cpu(x, h0)
    return gated_delta_rule_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, h0, offsets)


def assert_same_pattern(o, ht, ro, rht):
    o, ht = o.cpu(), ht.cpu()
    bad, rbad = ~torch.isfinite(o).all(-1), ~torch.isfinite(ro).all(-1)
    assert rbad.any(), "the plant must reach some output"
    leaked = bad & ~rbad
    assert not leaked.any(), f"non-finite outside the reference's cone at (b, t, head) {leaked.nonzero().tolist()[:8]}"
    missed = rbad & ~bad
    assert not missed.any(), f"finite where the reference is not at {missed.nonzero().tolist()[:8]}"
    hbad, rhbad = ~torch.isfinite(ht).flatten(2).all(-1), ~torch.isfinite(rht).flatten(2).all(-1)
    assert torch.equal(hbad, rhbad), f"final states non-finite at {hbad.nonzero().tolist()}, " \
                                     f"want {rhbad.nonzero().tolist()}"
    keep = ~rbad
    err = ((o[keep].double() - ro[keep]).norm() / ro[keep].norm()).item()
    assert err <= TOL, f"finite rows differ from the reference: {err:.2e}"


def run_op(x, h0, backend, path="auto", cu_seqlens=None):
    return chunk_gated_delta_rule_on_path(path, x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                          output_final_state=True, cu_seqlens=cu_seqlens, backend=backend)


PATHS = ["torch", pytest.param("split", marks=pytest.mark.interpreter),
         pytest.param("walk", marks=pytest.mark.interpreter)]


@pytest.mark.parametrize("plant", list(PLANTS))
@pytest.mark.parametrize("path", PATHS)
def test_forward_confines_the_plant(path, plant):
    x, h0 = make(PLANTS[plant])
    o, ht = run_op(x, h0, "torch" if path == "torch" else "triton", "auto" if path == "torch" else path)
    assert_same_pattern(o, ht, *reference(x, h0))


@pytest.mark.parametrize("path", PATHS)
def test_varlen_plant_stays_in_its_sequence(path):
    seqlens = [T, 90]        # the plant is in the first sequence (token T0); the second shares its last chunk's row
    plant = ("v", (0, T0, 1, 2), float("nan"))
    x, h0 = make(plant, seqlens)
    offsets = [0, seqlens[0], sum(seqlens)]
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    o, ht = run_op(x, h0, "torch" if path == "torch" else "triton", "auto" if path == "torch" else path, cu)
    assert_same_pattern(o, ht, *reference(x, h0, offsets))


def _split_segmented(q, k, v, g, beta, scale, h0, cu_seqlens, offsets):
    gc, *wy = triton_chunk.fused_prepass(g, k, v, beta, cu_seqlens, None)
    return split_module.split_fwd(q, k, wy, gc, scale, h0, v.dtype, None, None, None, None, segment_chunks=1)


def _walk_segmented(q, k, v, g, beta, scale, h0, cu_seqlens, offsets):
    gc, w, u, p = triton_chunk.fwd_prepass(q, k, v, g, beta)
    return fused_fwd_seq_parallel(q, k, w, u, gc, scale, h0, v.dtype, segment_chunks=1, p=p)


def _stages(q, k, v, g, beta, scale, h0, cu_seqlens, offsets):
    st = triton_chunk.chunk_gated_delta_rule_fwd_stages(q, k, v, g, beta, scale, h0, cu_seqlens, offsets)
    return st.o, st.final_state


# the Triton forwards the op's dispatch reaches only at larger shapes, and the stages of the backward's recompute
VARIANTS = {"split-a-inv": triton_chunk.forward_split, "split-segmented": _split_segmented,
            "walk-segmented": _walk_segmented, "stages": _stages}


@pytest.mark.interpreter
@pytest.mark.parametrize("plant", ["q-nan", "k-nan", "v-nan", "g-nan", "beta-nan"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_triton_variants_confine_the_plant(variant, plant, monkeypatch):
    if variant == "split-a-inv":     # A_inv formed in the state pass (split_fwd.wy_in_state_pass) at any pair count
        monkeypatch.setattr(split_module, "WY_IN_STATE_PASS_MIN_PAIRS", 1)
    x, h0 = make(PLANTS[plant])
    o, ht = VARIANTS[variant](x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, h0, None, None)
    assert_same_pattern(o, ht, *reference(x, h0))


@pytest.mark.parametrize("plant", ["v-nan", "g-nan"])
@pytest.mark.parametrize("path", PATHS)
def test_backward_runs(path, plant):
    """The backward of a forward with a NaN in value head 1 of batch row 1 does not crash, and the gradients of the
    other batch row, and of value head 0's v, g and β in row 1, are finite (those of the planted head are NaN, as
    autograd through the reference's NaN state makes them)."""
    x, h0 = make(PLANTS[plant])
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, ht = run_op(leaves, h0, "torch" if path == "torch" else "triton", "auto" if path == "torch" else path)
    ((o * torch.randn_like(o)).sum() + ht.sum()).backward()
    for n, t in leaves.items():
        assert t.grad is not None and torch.isfinite(t.grad[0]).all(), n
        if n in ("v", "g", "beta"):
            assert torch.isfinite(t.grad[1][:, 0]).all(), n


@pytest.mark.parametrize("plant", list(PLANTS))
def test_gated_linear_attention_confines_the_plant(plant):
    x, h0 = make(PLANTS[plant])
    names = ("q", "k", "v", "g", "beta")
    o, ht = gated_linear_attention(*(x[n] for n in names), initial_state=h0, output_final_state=True)
    cx, ch0 = on_cpu(x, h0)
    assert_same_pattern(o, ht, *gated_linear_attention_reference(*(cx[n] for n in names), K ** -0.5, ch0))


# the Hopper forward around its kernels' twins (the kernels' selects, chunk_fwd.py's module docstring): unsegmented,
# the five-launch segmented forward (maps, scan, warm walk) and the planned warm walk, 4 segments of one chunk
HOPPER_PLANS = {"one": (hand_plan(1), T), "segmented": (hand_plan(4), 256),
                "planned": (hand_plan(4, planned_walk=True), 256)}


@pytest.mark.parametrize("plant", list(PLANTS))
@pytest.mark.parametrize("plan", [pytest.param(p, marks=pytest.mark.interpreter) if p != "one" else p
                                  for p in HOPPER_PLANS])
def test_hopper_twin_confines_the_plant(plan, plant, monkeypatch):
    """The twins take non-finite inputs as the kernels do (a non-finite v: X 0 there, o NaN from its row on, the
    state dead through ln a), so the pattern is the reference's: in one walk, through phase A's maps and the scan
    (a NaN map makes every later entering state NaN), and through the warm walks (the gates are weak: no map is
    negligible, so every warm-up reaches back to the sequence's start)."""
    hand, t = HOPPER_PLANS[plan]
    use_twins(monkeypatch)
    x, h0 = make(PLANTS[plant], t=t)
    o, ht = hopper_forward.forward_hopper(hand, x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, h0)
    assert_same_pattern(o, ht, *reference(x, h0))


@pytest.mark.interpreter
@pytest.mark.parametrize("plan", ["segmented", "planned"])
def test_hopper_twin_warm_ups_carry_a_nonfinite_v_and_never_leak_it(plan, monkeypatch):
    """Heads that forget fast: the segmented forwards start segments from warm-ups instead of maps. Nothing before
    the plant (v, token 70, segment 1) turns NaN; the next segment's warm-up covers the plant and carries the dead
    state into it (NaN throughout). The pre-pass does not read v, so a warm-up that starts past the plant (segment
    3's) starts clean: its rows and the final state stay finite where the reference's are NaN (the known limit,
    docs in chunk_fwd.py)."""
    hand, t = HOPPER_PLANS[plan]
    use_twins(monkeypatch)
    x, h0 = make(PLANTS["v-nan"], t=t)
    x["g"] = x["g"] * 200
    o, ht = hopper_forward.forward_hopper(hand, x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, h0)
    ro, _ = reference(x, h0)
    bad, rbad = ~torch.isfinite(o.cpu()).all(-1), ~torch.isfinite(ro).all(-1)
    assert not (bad & ~rbad).any()
    assert bad[1, T0:192, 1].all() and rbad[1, 192:, 1].all()


@pytest.mark.parametrize("plant", list(PLANTS))
def test_hopper_states_twin_confines_the_plant(plant):
    """The Hopper backward's recompute (its pre-pass without β on T, the states walk; twins, fp32): the state
    entering each chunk and the final state are non-finite exactly where the reference's (the token loop over the
    sequence up to that chunk) are, per (sequence, value head), and equal to it elsewhere. A non-finite v needs no
    search there: it makes the state's columns it lies in non-finite, as the reference's."""
    from linattn.ops.hopper.chunk_fwd_ref import chunk_states_hopper_ref
    from linattn.ops.hopper.prepass import prepass_hopper_ref
    x, h0 = on_cpu(*make(PLANTS[plant]))
    gc_hm, beta_hm, t_inv, _ = prepass_hopper_ref(x["k"], x["g"], x["beta"], a_inv_dtype=torch.float32,
                                                  beta_in_a_inv=False)
    h, ht = chunk_states_hopper_ref(x["k"], x["v"], gc_hm, beta_hm, t_inv, h0)
    entering = [h0.double()] + [gated_delta_rule_reference(*(x[n][:, :c * 64] for n in ("q", "k", "v", "g", "beta")),
                                                           K ** -0.5, h0)[1] for c in range(1, h.shape[1])]
    states = torch.cat([h.transpose(0, 1), ht[None]]).flatten(3)      # [NT + 1, B, HV, K·V]
    ref = torch.stack(entering + [reference(x, h0)[1]]).flatten(3)
    bad, rbad = ~torch.isfinite(states).all(-1), ~torch.isfinite(ref).all(-1)
    assert torch.equal(bad, rbad), f"non-finite at {bad.nonzero().tolist()}, want {rbad.nonzero().tolist()}"
    assert rbad.any() or plant.startswith("q"), "the plant must reach some state"
    err = ((states[~rbad].double() - ref[~rbad]).norm() / ref[~rbad].norm()).item()
    assert err <= TOL, f"finite states differ from the reference: {err:.2e}"
