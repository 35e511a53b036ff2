"""The forward's dispatch (``gated_delta/dispatch.py``): which path one call runs and why, and the forced paths of
``chunk_gated_delta_rule_on_path`` reaching the Triton forwards (under the interpreter, tiny shapes)."""
from __future__ import annotations

import pytest
import torch

import linattn
from linattn.ops.gated_delta import dispatch
from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path
from linattn.ops.gated_delta.reference import gated_delta_rule_reference

from .test_hopper_fwd import inputs


def choose(x, dtype, backend="triton", forward_path="auto", B=None):
    q, k, v, g, beta = (x[n].to(dtype if n in ("q", "k", "v") else torch.float32) for n in ("q", "k", "v", "g", "beta"))
    return dispatch.choose_forward_path(q, k, v, g, beta, None, None, None, backend, forward_path)


def test_the_choice_and_its_reason():
    """torch and reference by backend; on the triton backend fp16 walks from WALK_MIN_PAIRS (sequence, head) pairs,
    everything else splits; a forced split or walk is taken as asked; CPU inputs never reach the Hopper plan, and the
    reason says so."""
    few, many = inputs(1, 64, 1, 2, 16, 16), inputs(2, 64, 1, 64, 16, 16)
    assert choose(few, torch.float32, "torch").path == "torch"
    assert choose(few, torch.float32, "reference").path == "reference"
    assert choose(few, torch.float16).path == "split"
    assert choose(many, torch.float16).path == "walk"                    # 128 pairs
    assert choose(many, torch.bfloat16).path == "split" and choose(many, torch.float32).path == "split"
    assert choose(few, torch.float32, forward_path="walk") == ("walk", "forced", None)
    assert choose(many, torch.float16, forward_path="split").path == "split"
    forced = choose(few, torch.bfloat16, forward_path="hopper")
    assert forced.path == "split" and "Hopper" in forced.reason and "bf16 CUDA" in forced.reason
    with pytest.raises(ValueError, match="forward_path"):
        choose(few, torch.float32, forward_path="fused")


@pytest.mark.interpreter
def test_forced_paths_reach_their_triton_forward(monkeypatch):
    """chunk_gated_delta_rule_on_path runs the forward it names (a spy on each), with the public op's results; a
    forced "hopper" where the kernels cannot run (CPU tensors) runs the "auto" path: the same output and state."""
    from linattn.ops.gated_delta import triton_chunk
    x = inputs(2, 70, 1, 2, 16, 16, dtype=torch.float32)
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=x["initial_state"].float(), output_final_state=True, backend="triton")
    o_auto, ht_auto = linattn.chunk_gated_delta_rule(*args, **kw)
    ran = []
    for name in ("forward_split", "forward_walk"):
        real = getattr(triton_chunk, name)
        monkeypatch.setattr(triton_chunk, name, lambda *a, _real=real, _name=name: ran.append(_name) or _real(*a))
    for path in ("split", "walk", "hopper"):
        o, ht = chunk_gated_delta_rule_on_path(path, *args, **kw)
        torch.testing.assert_close(o, o_auto, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ht, ht_auto, rtol=1e-4, atol=1e-5)
    assert ran == ["forward_split", "forward_walk", "forward_split"]


@pytest.mark.interpreter
def test_a_hopper_forward_that_does_not_compile_falls_back_to_triton(monkeypatch):
    """A Hopper plan whose kernels fail to compile: the call warns, records the failure (so every later call's plan
    says why not) and returns the Triton split's result."""
    from linattn.ops.hopper import chunk_fwd, compile
    from linattn.ops.hopper import forward as hopper_fwd

    from .hopper_twins import hand_plan

    def does_not_compile(*args, **kwargs):
        raise chunk_fwd.HopperCompileError("no sm_90a here")
    monkeypatch.setattr(compile, "_compile_failure", None)
    monkeypatch.setattr(hopper_fwd, "forward_hopper", does_not_compile)
    monkeypatch.setattr(dispatch, "choose_forward_path",
                        lambda *a, **kw: dispatch.ForwardChoice("hopper", "test", hand_plan()))
    x = inputs(1, 70, 1, 2, 16, 16, dtype=torch.float32)
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")]
    with pytest.warns(RuntimeWarning, match="did not compile"):
        o, ht = dispatch.run_forward(*args, 0.25, None, None, None, "triton")
    assert chunk_fwd.compile_failed() == "no sm_90a here"
    from linattn.ops.gated_delta.triton_chunk import forward_split
    o_split, ht_split = forward_split(*args, 0.25, None, None, None)
    assert torch.equal(o, o_split) and torch.equal(ht, ht_split)


def test_the_backward_choice_and_its_reason():
    """The torch backend's backward is the twin's; CPU calls on the triton backend take the Triton backward and say
    why; the Hopper backward's own limits (K, V sizes, dtypes of dO and g, and too few (sequence, head) pairs or too
    short sequences for the walk) each name themselves, and a call within all of them is taken."""
    x = inputs(1, 64, 1, 2, 16, 16)
    q, v, g = x["q"], x["v"], x["g"]
    assert dispatch.choose_backward_path(q, v, g, v, None, "torch") == ("torch", "backend='torch'")
    path, reason = dispatch.choose_backward_path(q, v, g, v, None, "triton")
    assert path == "triton" and "not a CUDA call" in reason
    bf16, f32 = torch.bfloat16, torch.float32
    blocker = dispatch.hopper_backward_blocker
    T = 4096
    assert "K and V" in blocker(8, T, 16, 96, 128, bf16, f32)
    assert "float32 g" in blocker(8, T, 16, 128, 128, bf16, bf16)
    assert "bf16 dO" in blocker(8, T, 16, 128, 128, f32, f32)
    work = dispatch.HOPPER_BWD_MIN_WORK
    assert blocker(1, work // 16, 16, 128, 128, bf16, f32) is None
    assert "pairs" in blocker(1, work // 16 - 1, 16, 128, 128, bf16, f32)
    # the work, not the pairs alone: one pair of a long sequence, many pairs of short ones
    assert blocker(1, work, 1, 128, 128, bf16, f32) is None and blocker(work // 64, 64, 1, 128, 128, bf16, f32) is None
    assert "pairs" in blocker(1, work // 2 - 1, 2, 128, 128, bf16, f32)
    # K = 64 with V = 128 (the slice walk: dβ's race fixed, not yet re-measured on a GPU) goes to the Triton backward
    # at every length and batch, and V = 64 at K = 128 (one slice per head, as there) with it; K = V = 64 (the
    # role-split walk) and K = V = 128 at the same sizes keep the Hopper backward
    assert "K = 64" in blocker(1, 32768, 4, 64, 128, bf16, f32) and "K = 64" in blocker(8, 4096, 16, 64, 128, bf16, f32)
    assert "V = 64" in blocker(1, 32768, 4, 128, 64, bf16, f32) and "V = 64" in blocker(8, 4096, 16, 128, 64, bf16, f32)
    assert blocker(1, 32768, 4, 64, 64, bf16, f32) is None and blocker(8, 4096, 16, 64, 64, bf16, f32) is None
    assert blocker(1, 32768, 4, 128, 128, bf16, f32) is None and blocker(8, 4096, 16, 128, 128, bf16, f32) is None
    # an initial state with one-chunk sequences: dg's open accuracy defect, routed to the Triton backward
    assert "one chunk" in blocker(2048, 64, 32, 128, 128, bf16, f32, initial_state=True)
    assert blocker(2048, 64, 32, 128, 128, bf16, f32) is None
    assert blocker(1024, 65, 32, 128, 128, bf16, f32, initial_state=True) is None


@pytest.mark.parametrize("K,V,path", [(64, 64, "roles"), (128, 128, "roles"), (64, 128, "triton"),
                                      (128, 64, "triton")])
def test_a_bf16_call_of_these_sizes_takes_this_backward(K, V, path):
    """Where the dispatch decides (bf16, B = 8, T = 4096, HV = 16: work above the threshold), K = V = 64 and 128 take
    the Hopper backward and its walk is the role-split one (``hopper.backward.choose_walk``: BV = V); K = 64 with
    V = 128 and V = 64 with K = 128 take the Triton backward (``hopper.backward.defect_limit``)."""
    from linattn.ops.hopper import backward
    reason = dispatch.hopper_backward_blocker(8, 4096, 16, K, V, torch.bfloat16, torch.float32)
    if path == "triton":
        assert reason is not None and reason == backward.defect_limit(K, V), reason
        return
    BV, _ = backward.choose_walk(8, 4096, 16, 16, K, V, None, None, 132)
    assert reason is None and backward.takes_roles(K, V, BV), (reason, BV)


def test_packed_sequences_take_the_padded_hopper_backward_by_the_forwards_rule():
    """Packed sequences (offsets): the forward's padding rule (at most max_padded_fraction of the padded batch),
    then the thresholds on the padded batch of N sequences × HV pairs of Tp rows. The walk's own limits come
    first."""
    from linattn.ops.hopper.varlen import padded_rows
    bf16, f32 = torch.bfloat16, torch.float32
    blocker = dispatch.hopper_backward_blocker
    ragged = [0, 4096, 8096, 12000, 16096, 20000, 24096, 28000, 32768]      # 8 sequences, Tp = 4800: 15% padding
    assert padded_rows(ragged) == 4800
    assert "K and V" in blocker(1, 32768, 16, 96, 128, bf16, f32, ragged)
    packed = lambda offsets, HV=16: blocker(1, offsets[-1], HV, 128, 128, bf16, f32, offsets)
    assert packed(ragged) is None
    assert "padding" in packed([0, 4096, 4160])                           # 2 × 4096 rows for 4160 tokens
    assert dispatch.HOPPER_BWD_MIN_WORK == 65536
    few = [0, 2000, 4096]                                        # 2 sequences of Tp = 2112: 2 × 2112 × 15 < 65536
    assert padded_rows(few) == 2112 and "pairs" in packed(few, HV=15) and packed(few, HV=16) is None
    # the decision's inputs are the padded batch's (N sequences of Tp rows), not the packed row's (B = 1, ΣT):
    # 2 × 4160 rows for 4160 tokens would pass the threshold, but waste half the batch to padding
    two = [0, 64, 4160]
    assert blocker(1, 4160, 16, 128, 128, bf16, f32) is None and "padding" in packed(two)
    # its work: N sequences × Tp rows × HV heads (3 × 1024 × 21 = 64512 below, × 22 = 67584 above)
    three = [0, 1024, 2048, 3072]
    assert padded_rows(three) == 1024 and "pairs" in packed(three, HV=21) and packed(three, HV=22) is None


def test_run_backward_hands_packed_sequences_to_the_hopper_backward(monkeypatch):
    """Where the choice is the Hopper backward, run_backward passes cu_seqlens and its host offsets on (the padded
    backward's inputs)."""
    from linattn.ops.hopper import backward
    monkeypatch.setattr(dispatch, "choose_backward_path", lambda *args, **kw: ("hopper", "test"))
    seen = {}
    monkeypatch.setattr(backward, "chunk_gated_delta_rule_bwd_hopper", lambda *args, **kw: seen.update(kw) or "grads")
    x = inputs(1, 70, 1, 2, 16, 16)
    cu, offsets = torch.tensor([0, 30, 70]), [0, 30, 70]
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    assert dispatch.run_backward(*args, 0.25, None, cu, offsets, x["v"], None, "triton") == "grads"
    assert seen["cu_seqlens"] is cu and seen["offsets"] == offsets


def test_backward_route_checks_every_tensor_the_walk_reads(monkeypatch):
    """run_backward asks choose_backward_path with k, β, dht and the initial state beside q, v, g and dO: a tensor
    off a 16-byte boundary keeps the Triton backward (``hopper.plan.input_blocker``, tested with the forward's)."""
    asked = {}
    monkeypatch.setattr(dispatch, "choose_backward_path", lambda *args, **kw: asked.update(kw) or ("torch", "test"))
    from linattn.ops.gated_delta import torch_chunk
    monkeypatch.setattr(torch_chunk, "chunk_gated_delta_rule_bwd_torch", lambda *args: "grads")
    x = inputs(1, 70, 1, 2, 16, 16)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    h0, dht = torch.zeros(1, 2, 16, 16), torch.ones(1, 2, 16, 16)
    assert dispatch.run_backward(*args, 0.25, h0, None, None, x["v"], dht, "triton") == "grads"
    assert all(a is b for a, b in zip(asked["others"], (x["k"], x["beta"], dht), strict=True))
    assert asked["initial_state"] is h0


@pytest.mark.parametrize("read_state", [False, True], ids=["o_only", "o_and_state"])
def test_eager_backward_passes_no_zeros_for_an_unread_final_state(monkeypatch, read_state):
    """A loss that does not read the final state gives the backward dht None (no [N, HV, K, V] zeros allocated:
    the Hopper walk's dh0 buffer stands in for them), one that reads it gives its gradient; the gradients match the
    float64 reference's either way."""
    from linattn.ops.gated_delta import chunk
    seen = []
    real = chunk.run_backward
    monkeypatch.setattr(chunk, "run_backward", lambda *a: seen.append(a[10]) or real(*a))
    x = inputs(1, 70, 1, 2, 16, 16)
    xs = [x[n].float().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    o, ht = linattn.chunk_gated_delta_rule(*xs, 0.25, output_final_state=True, backend="torch")
    loss = o.square().sum() + (ht.sum() if read_state else 0)
    grads = torch.autograd.grad(loss, xs)
    assert len(seen) == 1 and (seen[0] is None) != read_state
    ys = [t.detach().double().requires_grad_() for t in xs]
    o_ref, ht_ref = gated_delta_rule_reference(*ys, 0.25)
    ref = torch.autograd.grad(o_ref.square().sum() + (ht_ref.sum() if read_state else 0), ys)
    for a, b in zip(grads, ref):
        assert torch.allclose(a.double(), b, rtol=1e-3, atol=1e-4)
