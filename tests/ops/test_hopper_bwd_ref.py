"""The Hopper backward's PyTorch twin (linattn/ops/hopper/chunk_bwd_ref.py) against the float64 token-by-token
reference's autograd, gradients through (o·do).sum() + (ht·dht).sum():

* the algebra: the twin in float64 without rounding equals the reference to float64 rounding, on odd lengths
  (T = 1, 63, 64, 65, 200), GVA, with and without h0 and dht, at a strong decay (g ≈ −100 per token);
* the sequence-parallel variant ([Mᵀ | D] maps, their scan, the stitched walks) equals the unsegmented walk, and
  its reverse warm-ups stay within their 2⁻³⁰ bound;
* the recompute of h from sparse checkpoints gives the forward's states bit for bit;
* the kernel's bf16 rounding points: every gradient within 2× the error of the chunked computation in PyTorch with
  every stage's output rounded to bf16 (benchmarks/gpu_check_core.py's baseline), on the case of the repeated token
  too, whole-V with tf32 operands of dA and V-halved with the kernel's bf16 ones;
* the V-sliced walk (the kernel's programs) sums to the whole-V walk;
* determinism: the same inputs give the same bits;
* on an sm_90 GPU, the TileLang walk (chunk_bwd.py) from the twin's saved tensors within the same bound.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linattn.ops.gated_delta import torch_chunk as tc
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import chunk_bwd_ref as bwd
from linattn.ops.hopper import chunk_fwd

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# float64 twin against the float64 reference: both exact algebra, so the error is float64 rounding (≈1e-15 relative
# to the largest gradient; 5e-13 for dg at g ≈ −100, whose gradients mix magnitudes e^{±100} apart before masking)
EXACT_TOL = 1e-11


def make_inputs(B, T, H, HV, K, decay="anchor", repeated=False, seed=0) -> dict:
    """float64 inputs: unit-norm q, k, Gaussian v, do, dht, h0; β uniform; g the anchors' gates (logsigmoid / 16),
    ``slow`` (logsigmoid / 1024) or ``strong`` (−100 − U[0, 1) per token). ``repeated``: one q and one k for every
    token (the case that punishes bf16 operands of dA)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k = F.normalize(r(B, T, H, K), dim=-1), F.normalize(r(B, T, H, K), dim=-1)
    if repeated:
        q, k = q[:, :1].expand_as(q).clone(), k[:, :1].expand_as(k).clone()
    if decay == "strong":
        g = -100 - torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    else:
        g = F.logsigmoid(r(B, T, HV)) / {"anchor": 16, "slow": 1024}[decay]
    return dict(q=q, k=k, v=r(B, T, HV, K), g=g, beta=torch.rand(B, T, HV, generator=gen, dtype=torch.float64),
                h0=r(B, HV, K, K) * 0.1, do=r(B, T, HV, K), dht=r(B, HV, K, K))


def reference_grads(x: dict, scale: float, use_dht: bool) -> list[torch.Tensor]:
    """dq, dk, dv, dg, dβ, dh0 of the float64 reference's autograd (h0 always passed: zeros stand for None)."""
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0")]
    o, ht = gated_delta_rule_reference(*leaves[:5], scale, leaves[5])
    loss = (o * x["do"]).sum() + ((ht * x["dht"]).sum() if use_dht else 0)
    return list(torch.autograd.grad(loss, leaves))


def twin_grads(x: dict, scale: float, use_h0: bool, use_dht: bool, segments: int = 1, checkpoint_every: int = 2,
               operand_dtype=None, da_operands: str = "exact", BV: int = 0) -> list[torch.Tensor]:
    """The forward twin's saved tensors, then the backward twin, in x's dtypes (float64, or bf16 q, k, v, β, do);
    ``BV`` > 0: the V-sliced walk (unsegmented) and the sum of its partials."""
    _, _, saved = bwd.forward_for_backward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], scale,
                                               x["h0"] if use_h0 else None, checkpoint_every, operand_dtype)
    if BV:
        parts = bwd.chunk_bwd_v_slices_ref(x["q"], x["k"], x["v"], x["do"], x["dht"] if use_dht else None, saved,
                                           scale, BV, operand_dtype, da_operands)
        return list(bwd.sum_partials_ref(parts, x["q"].shape[2]))
    return list(bwd.chunk_bwd_hopper_ref(x["q"], x["k"], x["v"], x["do"], x["dht"] if use_dht else None, saved,
                                         scale, segments, operand_dtype, da_operands))


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# (id, B, T, H, HV, K, h0, dht, decay): odd lengths around the chunk (1, 63, 64, 65, 200 = 3 chunks + 8), GVA
# (HV = 2H), each of h0 and dht on and off, and the strong decay under which exp must never see G_i alone
EXACT_CASES = [
    ("T1", 1, 1, 1, 1, 32, True, True, "anchor"),
    ("T63_no_h0_no_dht", 1, 63, 1, 1, 32, False, False, "anchor"),
    ("T64_gva_K64", 1, 64, 1, 2, 64, True, False, "anchor"),
    ("T65_B2_gva", 2, 65, 1, 2, 32, False, True, "anchor"),
    ("T200_gva", 1, 200, 2, 4, 32, True, True, "anchor"),
    ("T200_gva_K64_strong", 1, 200, 1, 2, 64, True, True, "strong"),
]


@pytest.mark.parametrize("case", EXACT_CASES, ids=[c[0] for c in EXACT_CASES])
def test_float64_twin_equals_reference_autograd(case):
    _, B, T, H, HV, K, use_h0, use_dht, decay = case
    x = make_inputs(B, T, H, HV, K, decay)
    if not use_h0:
        x["h0"] = torch.zeros_like(x["h0"])
    scale = K ** -0.5
    ref = reference_grads(x, scale, use_dht)
    got = twin_grads(x, scale, use_h0, use_dht)
    errors = {n: max_rel(a, b) for n, a, b in zip(GRADS, got, ref)}
    assert max(errors.values()) < EXACT_TOL, errors


@pytest.mark.parametrize("segments", [2, 4])
@pytest.mark.parametrize("T,decay", [(200, "anchor"), (300, "strong"), (65, "anchor")])
def test_segments_equal_the_unsegmented_walk(segments, T, decay):
    """[Mᵀ | D] per segment, the reverse scan and the stitched walks: the unsegmented walk's gradients in float64
    (T = 300: 5 chunks in segments of 3 + 2 and 2 + 2 + 1; T = 65: 2 chunks, at most 2 segments)."""
    x = make_inputs(1, T, 1, 2, 32, decay, seed=1)
    whole = twin_grads(x, 32 ** -0.5, True, True, segments=1)
    cut = twin_grads(x, 32 ** -0.5, True, True, segments=segments)
    errors = {n: max_rel(a, b) for n, a, b in zip(GRADS, cut, whole)}
    assert max(errors.values()) < EXACT_TOL, errors


# (id, T, H, HV, K, BV, decay): halves and quarters of V, GVA, a partial last chunk, the strong decay
SLICE_CASES = [
    ("T200_gva_halves", 200, 1, 2, 32, 16, "anchor"),
    ("T130_K128_halves", 130, 1, 1, 128, 64, "anchor"),
    ("T200_gva_K64_quarters_strong", 200, 1, 2, 64, 16, "strong"),
]


@pytest.mark.parametrize("case", SLICE_CASES, ids=[c[0] for c in SLICE_CASES])
def test_v_slices_sum_to_the_whole_walk(case):
    """The V-sliced walk (one program per V slice, its chain alone; dq, dk added over the slices per chunk) and the
    sum of its partials equal the whole-V walk in float64, every gradient: the reverse step is column-separable in
    V."""
    _, T, H, HV, K, BV, decay = case
    x = make_inputs(1, T, H, HV, K, decay, seed=5)
    scale = K ** -0.5
    _, _, saved = bwd.forward_for_backward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["h0"], 2, None)
    args = (x["q"], x["k"], x["v"], x["do"], x["dht"], saved, scale)
    whole = bwd.chunk_bwd_hopper_ref(*args, 1, None, "exact")
    parts = bwd.chunk_bwd_v_slices_ref(*args, BV, None, "exact")
    assert parts.dg.shape[0] == K // BV and parts.dq.shape == x["v"].shape[:3] + (K,)
    sliced = bwd.sum_partials_ref(parts, H)
    errors = {n: max_rel(a, b) for n, a, b in zip(GRADS, sliced, whole)}
    assert max(errors.values()) < 1e-12, errors


def test_slice_sum_follows_the_walks_owners():
    """slice_sum_ref adds a chunk's slices as the walk's cluster does: at step s (chunks from the last) slice
    s mod NV first, then the others cyclically — fp32 bits per chunk (NV = 3, T = 200: 4 chunks, the last partial;
    a fixed slice order gives other bits on some chunk)."""
    gen = torch.Generator().manual_seed(3)
    parts = torch.randn(3, 2, 200, 2, 16, generator=gen) * torch.logspace(-4, 4, 16)
    got = bwd.slice_sum_ref(parts)
    for c, owner in enumerate((0, 2, 1, 0)):      # steps 3, 2, 1, 0
        rows = slice(64 * c, 64 * c + 64)
        order = [(owner + i) % 3 for i in range(3)]
        assert torch.equal(got[:, rows], parts[order[0], :, rows] + parts[order[1], :, rows] + parts[order[2], :, rows])
    fixed = parts[0] + parts[1] + parts[2]
    assert not torch.equal(got, fixed) and torch.allclose(got, fixed, rtol=1e-5, atol=1e-3)


def test_reverse_warm_ups_within_their_bound():
    """Segments whose dS comes from reverse warm-ups (the chain from zero w chunks after the segment, w from the
    forward's chunk norm bounds, threshold 2⁻³⁰) instead of maps and scan: at g ≈ −0.35 per token (a chunk's bound
    ≈ −32) one chunk suffices, so three of the four segments truncate, and the gradients stay within 2⁻³⁰ of the
    exact ones (relative to the largest) — while differing from them (the truncation happened)."""
    from linattn.ops.hopper.map_bound import chunk_bounds_ref
    x = make_inputs(1, 448, 1, 2, 32, seed=3)
    x["g"] = -0.35 * (1 + 0.1 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(4),
                                            dtype=torch.float64))
    bound = chunk_bounds_ref(x["k"], x["g"], x["beta"])                    # [B, HV, 7]
    cuts = bwd.segment_cuts(7, 4)
    warm = bwd.reverse_warm_ups_ref(bound, cuts)
    assert warm[:3].max() == 1 and warm[3].max() == 0
    _, _, saved = bwd.forward_for_backward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["h0"], 2,
                                               None)
    args = (x["q"], x["k"], x["v"], x["do"], x["dht"], saved, 32 ** -0.5)
    exact = bwd.chunk_bwd_hopper_ref(*args, 1, None, "exact")
    warmed = bwd.chunk_bwd_hopper_ref(*args, 4, None, "exact", warm_bound=bound)
    errors = {n: max_rel(a, b) for n, a, b in zip(GRADS, warmed, exact)}
    assert max(errors.values()) < 2.0 ** -30 and errors["dk"] > 0, errors


def exact_segment_state_grads(x: dict, scale: float, segments: int) -> torch.Tensor:
    """``[B·S, HV, K, V]``: the float64 reference's gradient of the loss (o·dO + ht·dht) with respect to the state
    leaving each of ``segments`` equal segments (autograd through the token recurrence from that state on; the last
    segment's is dht)."""
    B, T = x["q"].shape[:2]
    L = T // segments
    out = []
    for b in range(B):
        for s in range(1, segments):
            head = [x[n][b:b + 1, :s * L] for n in ("q", "k", "v", "g", "beta")]
            tail = [x[n][b:b + 1, s * L:] for n in ("q", "k", "v", "g", "beta", "do")]
            state = gated_delta_rule_reference(*head, scale, x["h0"][b:b + 1])[1].detach().requires_grad_()
            o, ht = gated_delta_rule_reference(*tail[:5], scale, state)
            loss = (o * tail[5]).sum() + (ht * x["dht"][b:b + 1]).sum()
            out.append(torch.autograd.grad(loss, state)[0][0])
        out.append(x["dht"][b])
    return torch.stack(out)


@pytest.mark.parametrize("decay", ["fast", "slow"])
def test_warm_ups_twin_gives_the_segments_state_gradients(decay):
    """``reverse_warm_ups_hopper_ref`` (the warm-ups kernel's contract: whole sequences, head-major gc and β, bounds
    [B, HV, NT], dS_out [B·S, HV, K, V]) in float64 against the reference's gradient of the state leaving each
    segment (autograd, an independent path). Fast decay (g ≈ −0.35 per token, a chunk's bound ≈ −32): w = 1, every
    segment but the last truncated, within 2⁻³⁰ of ‖dS‖ and not equal; slow decay (the anchors' gates / 1024):
    no w below −30, every warm-up reaches the sequence's end and starts from dht: exact."""
    from linattn.ops.hopper.map_bound import chunk_bounds_ref
    x = make_inputs(2, 512, 1, 2, 32, "slow" if decay == "slow" else "anchor", seed=6)
    if decay == "fast":
        x["g"] = -0.35 * (1 + 0.1 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(7),
                                                dtype=torch.float64))
    scale = 32 ** -0.5
    _, _, saved = bwd.forward_for_backward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["h0"], 2, None)
    bound = chunk_bounds_ref(x["k"], x["g"], x["beta"])                     # [B, HV, 8]
    warm = bwd.reverse_warm_ups_ref(bound, bwd.segment_cuts(8, 4))
    assert (warm[:3].max() == 1) if decay == "fast" else all(int(w.min()) == 8 - 2 * (s + 1)
                                                              for s, w in enumerate(warm))
    got = bwd.reverse_warm_ups_hopper_ref(x["q"], x["k"], x["do"], saved.gc, saved.beta, saved.a_inv, bound,
                                          x["dht"], scale, 4, None)
    exact = exact_segment_state_grads(x, scale, 4)
    assert got.shape == exact.shape == (8, 2, 32, 32)
    error = max_rel(got, exact)
    if decay == "fast":
        assert 0 < error < 2.0 ** -30, error
    else:
        assert error < EXACT_TOL, error


def test_recompute_gives_the_forward_states_bitwise():
    """h from checkpoints every 3 chunks (5 chunks: the last interval part padding) equals, bit for bit, the
    bf16-rounded state the forward walk entered every chunk with (its checkpoints at every chunk)."""
    x = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v") else t.float())
         for n, t in make_inputs(1, 300, 1, 2, 32).items()}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["h0"])
    every_chunk = bwd.forward_for_backward_ref(*args, checkpoint_every=1)[2].checkpoints
    saved = bwd.forward_for_backward_ref(*args, checkpoint_every=3)[2]
    rnd = bwd.rounder(torch.float32, torch.bfloat16)
    assert saved.checkpoints.shape[2] == 2
    assert torch.equal(bwd.recompute_states_ref(x["k"], x["v"], saved, rnd), rnd(every_chunk))


def rounded_baseline(x: dict, scale: float) -> list[torch.Tensor]:
    """The gradients PyTorch computes from the same bf16 inputs with every stage's output rounded to bf16 (A_inv, W,
    U, V_new, dV_new), fp32 arithmetic: ``gpu_check_core.rounded_twin``'s error floor, on the CPU."""
    r = lambda t: t.to(torch.bfloat16).float()
    B, T, H, K = x["q"].shape
    G = x["v"].shape[2] // H
    q, k = (r(x[n]).repeat_interleave(G, 2) for n in ("q", "k"))
    qc, kc, vc, bc, doc = (tc.to_chunks(t) for t in (q, k, r(x["v"]), r(x["beta"]), r(x["do"])))
    gc = tc.chunk_local_cumsum_ref(tc.to_chunks(x["g"].float()))
    A_inv = r(tc.kkt_solve_ref(kc, bc, gc))
    w, u = (r(t) for t in tc.wy_ref(A_inv, kc, vc, bc, gc))
    h, vn, _ = tc.state_pass_fwd_ref(w, u, kc, gc, x["h0"].float())
    dh, dvn, dh0 = tc.state_pass_bwd_ref(qc, kc, w, gc, doc, x["dht"].float(), scale)
    dq, dk, dv, dbeta, dgc = tc.local_bwd_ref(qc, kc, vc, bc, gc, A_inv, w, h, r(vn), doc, dh, r(dvn), scale)
    chunks = lambda t: tc.from_chunks(t, T)
    return [bwd.group_sum(chunks(dq), H), bwd.group_sum(chunks(dk), H), chunks(dv),
            chunks(tc.chunk_local_cumsum_bwd_ref(dgc)), chunks(dbeta), dh0]


# (id, T, H, HV, K, decay, repeated)
BF16_CASES = [
    ("T200_gva_K64", 200, 2, 4, 64, "anchor", False),
    ("T256_K128", 256, 1, 1, 128, "anchor", False),
    ("T200_K64_slow_decay", 200, 2, 2, 64, "slow", False),
    ("T128_K64_repeated_token", 128, 1, 1, 64, "anchor", True),
    # four value heads per qk head: dq per value head rounds to bf16 before the group's sum (qk_heads_dtypes)
    ("T200_gva4_K64_slow_decay", 200, 1, 4, 64, "slow", False),
    ("T128_gva4_K64_repeated_token", 128, 1, 4, 64, "anchor", True),
]


@pytest.mark.parametrize("sliced", [False, True], ids=["whole_V", "V_halves"])
@pytest.mark.parametrize("case", BF16_CASES, ids=[c[0] for c in BF16_CASES])
def test_bf16_rounding_within_twice_the_rounded_baseline(case, sliced):
    """The twin at the kernel's rounding points, whole-V (dA on tf32 operands) and V-halved as the kernel runs it
    (each half rounds its own partial dP and dKD to bf16; dA on bf16 operands), within 2× the rounded baseline's
    error."""
    _, T, H, HV, K, decay, repeated = case
    x = make_inputs(1, T, H, HV, K, decay, repeated)
    low = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v", "beta", "do") else t.float()) for n, t in x.items()}
    exact = {n: t.double() for n, t in low.items()}         # the ground truth of the inputs the kernel sees
    scale = K ** -0.5
    ref = reference_grads(exact, scale, use_dht=True)
    got = twin_grads(low, scale, True, True, operand_dtype=torch.bfloat16, da_operands="bf16" if sliced else "tf32",
                     BV=K // 2 if sliced else 0)
    base = rounded_baseline(low, scale)
    ratios = {n: rel_l2(a, c) / rel_l2(b, c) for n, a, b, c in zip(GRADS, got, base, ref)}
    assert max(ratios.values()) <= 2.0, ratios


def test_bitwise_deterministic():
    x = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v", "beta", "do") else t.float())
         for n, t in make_inputs(1, 200, 1, 2, 32).items()}
    runs = [twin_grads(x, 32 ** -0.5, True, True, segments=2, operand_dtype=torch.bfloat16, da_operands="tf32")
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_round_tf32_keeps_ten_mantissa_bits_ties_away():
    x = torch.tensor([1 + 2 ** -11, 1 + 2 ** -12, -(1 + 3 * 2 ** -11), 1 + 2 ** -10], dtype=torch.float32)
    expect = torch.tensor([1 + 2 ** -10, 1, -(1 + 2 * 2 ** -10), 1 + 2 ** -10], dtype=torch.float32)
    assert torch.equal(bwd.round_tf32(x), expect)


def test_bad_arguments_raise():
    x = make_inputs(1, 64, 1, 1, 32)
    _, _, saved = bwd.forward_for_backward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], 1.0, None, 2, None)
    with pytest.raises(ValueError, match="da_operands"):
        bwd.chunk_bwd_hopper_ref(x["q"], x["k"], x["v"], x["do"], None, saved, 1.0, da_operands="fp8")
    with pytest.raises(ValueError, match="segments"):
        bwd.chunk_bwd_hopper_ref(x["q"], x["k"], x["v"], x["do"], None, saved, 1.0, segments=0)
    with pytest.raises(ValueError, match="do must"):
        bwd.chunk_bwd_hopper_ref(x["q"], x["k"], x["v"], x["do"][:, :32], None, saved, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        bwd.forward_for_backward_ref(x["q"].repeat(1, 1, 2, 1), x["k"].repeat(1, 1, 2, 1), x["v"].repeat(1, 1, 3, 1),
                                     x["g"].repeat(1, 1, 3), x["beta"].repeat(1, 1, 3), 1.0, None)


ON_HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or not chunk_fwd.tilelang_available()
                               or torch.cuda.get_device_capability()[0] != 9, reason="the kernel runs on sm_90 only")


@ON_HOPPER
@pytest.mark.parametrize("case", BF16_CASES, ids=[c[0] for c in BF16_CASES])
def test_reverse_walk_kernel_within_twice_the_rounded_baseline(case):
    """On the GPU: the kernel's gradients (V halves added in the walk, the host's sums of the rest) from the twin's
    saved tensors and recomputed h, each within 2× the rounded baseline's error against float64, as the twin's
    are."""
    from linattn.ops.hopper import backward, chunk_bwd
    _, T, H, HV, K, decay, repeated = case
    x = make_inputs(1, T, H, HV, K, decay, repeated)
    low = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v", "beta", "do") else t.float()) for n, t in x.items()}
    exact = {n: t.double() for n, t in low.items()}
    scale = K ** -0.5
    ref = reference_grads(exact, scale, use_dht=True)
    _, _, saved = bwd.forward_for_backward_ref(low["q"], low["k"], low["v"], low["g"], low["beta"], scale, low["h0"])
    h = bwd.recompute_states_ref(low["k"], low["v"], saved, bwd.rounder(torch.float32, torch.bfloat16))
    cuda = lambda t: t.cuda()
    dq, dk, dv, dg, dbeta, dh0 = chunk_bwd.chunk_bwd_hopper(
        *map(cuda, (low["q"], low["k"], low["v"], low["do"], saved.gc, saved.beta, saved.a_inv.to(torch.bfloat16),
                    h.transpose(1, 2).to(torch.bfloat16), low["dht"])), scale, K // 2)
    dq, dk, dg, dbeta = backward.gradients_from_partials(dq, dk, dg, dbeta, low["g"].cuda(), torch.float32,
                                                         torch.float32, H)
    got = [t.cpu().float() for t in (dq, dk, dv, dg, dbeta, dh0)]
    base = rounded_baseline(low, scale)
    ratios = {n: rel_l2(a, c) / rel_l2(b, c) for n, a, b, c in zip(GRADS, got, base, ref)}
    assert max(ratios.values()) <= 2.0, ratios


@ON_HOPPER
@pytest.mark.parametrize("chunks", [1, 2], ids=["S4", "S2"])
def test_segmented_hopper_backward_within_twice_the_rounded_baseline(chunks):
    """On the GPU: the Hopper backward walked in segments (hopper/segments.py; two sequences of 4 chunks, GVA,
    h0 and dht; dS_out from the reverse warm-ups), each gradient within 2× the rounded baseline's error against
    float64, and within bf16 rounding of the unsegmented backward's."""
    from linattn.ops.hopper import backward
    x = make_inputs(2, 256, 2, 4, 64)
    low = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v", "beta", "do") else t.float()) for n, t in x.items()}
    exact = {n: t.double() for n, t in low.items()}
    scale = 64 ** -0.5
    ref = reference_grads(exact, scale, use_dht=True)
    args = [low[n].cuda() for n in ("q", "k", "v", "g", "beta")] + [scale, low["h0"].cuda(), low["do"].cuda(),
                                                                    low["dht"].cuda()]
    split = [t.cpu().float() for t in backward.chunk_gated_delta_rule_bwd_hopper(*args, segment_chunks=chunks)]
    whole = [t.cpu().float() for t in backward.chunk_gated_delta_rule_bwd_hopper(*args, segment_chunks=4)]
    base = rounded_baseline(low, scale)
    ratios = {n: rel_l2(a, c) / rel_l2(b, c) for n, a, b, c in zip(GRADS, split, base, ref)}
    assert max(ratios.values()) <= 2.0, ratios
    distance = {n: rel_l2(a, b) for n, a, b in zip(GRADS, split, whole)}
    assert max(distance.values()) < 1e-2, distance


@ON_HOPPER
@pytest.mark.parametrize("H,HV,K,BV", [(1, 2, 128, 64), (2, 2, 128, 64), (2, 4, 64, 32)],
                         ids=["gva_K128", "K128", "gva_K64_BV32"])
def test_walk_slice_sums_equal_the_twins_order_on_the_gpu(H, HV, K, BV):
    """On the GPU: the walk's dq, dk with the slices added in its cluster (both placements of the sums: at the
    exchange points and one step late) — the same bits from both and from a second run (a tile read stale or
    before it landed would differ) — and within the bf16 walk's rounding of the twin's (rel L2 < 1e-2; a tile
    missed or added twice is O(1)). T = 300: five chunks, the last partial, each slice owning some."""
    from linattn.ops.hopper import chunk_bwd
    x = make_inputs(2, 300, H, HV, K, seed=7)
    low = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v", "beta", "do") else t.float()) for n, t in x.items()}
    scale = K ** -0.5
    _, _, saved = bwd.forward_for_backward_ref(low["q"], low["k"], low["v"], low["g"], low["beta"], scale, low["h0"])
    h = bwd.recompute_states_ref(low["k"], low["v"], saved, bwd.rounder(torch.float32, torch.bfloat16))
    inputs = [t.cuda() for t in (low["q"], low["k"], low["v"], low["do"], saved.gc, saved.beta,
                                 saved.a_inv.to(torch.bfloat16), h.transpose(1, 2).to(torch.bfloat16), low["dht"])]
    runs = [chunk_bwd.chunk_bwd_hopper(*inputs, scale, BV, deferred) for deferred in (True, False, True)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    twin = bwd.chunk_bwd_v_slices_ref(low["q"], low["k"], low["v"], low["do"], low["dht"], saved, scale, BV)
    errors = {n: rel_l2(a.cpu().float(), b) for n, a, b in zip(("dq", "dk"), runs[0][:2], (twin.dq, twin.dk))}
    assert max(errors.values()) < 1e-2, errors


@ON_HOPPER
@pytest.mark.parametrize("B,T,H,HV", [(1, 4096, 4, 16), (1, 16384, 2, 8)], ids=["whole", "segments"])
def test_op_forward_and_backward_replay_from_a_cuda_graph_with_the_eager_bits(B, T, H, HV):
    """On the GPU: the public op's forward and torch.autograd.grad (the Hopper backward: no host sync on equal
    lengths, unsegmented at 16 pairs of 4096 tokens, in the planner's segments at 8 pairs of 16384) captured in one
    CUDA graph; its replay on new inputs copied into the static ones gives the eager call's gradients bit for bit."""
    import linattn
    from linattn.ops.gated_delta.dispatch import choose_backward_path
    torch.manual_seed(0)
    K = 128
    unit = lambda: torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
    fresh = lambda: [unit(), unit(), torch.randn(B, T, HV, K, device="cuda").bfloat16(),
                     torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda")) / 16,
                     torch.rand(B, T, HV, device="cuda").bfloat16(), torch.randn(B, T, HV, K, device="cuda").bfloat16()]
    static = [x.requires_grad_() if i < 5 else x for i, x in enumerate(fresh())]
    q, k, v, g, beta, do = static
    assert choose_backward_path(q, v, g, do, None, "triton")[0] == "hopper"
    step = lambda: torch.autograd.grad(linattn.chunk_gated_delta_rule(q, k, v, g, beta)[0], [q, k, v, g, beta], do)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                  # the warm-up a capture needs (compiles, allocator pools)
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    new = fresh()
    with torch.no_grad():
        for x, value in zip(static, new):
            x.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), captured, eager):
        assert torch.equal(a, b), name
