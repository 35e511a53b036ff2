"""Packed sequences (cu_seqlens) on the Hopper backward by padding (linattn/ops/hopper/backward.py's
``backward_packed``, the exactness argument in hopper/varlen.py), on the CPU: the host chain with its kernels swapped
for their twins as in test_hopper_bwd.py (the recompute's twins, the twin walk, fp32, the dtype and device checks
lifted), the padding copies and partial sums under the Triton interpreter.

* ragged packed sequences (a partial last chunk, one shorter than a chunk, one of exactly two chunks, an empty one, a
  single row; GVA, h0 and dht): every gradient equals the equal-length backward run on each sequence alone (fp32
  rounding) and the float64 reference's autograd over the packed sequences (the host chain's bound: the pre-pass
  twin's bf16 T); padding with a nonzero gate must fail (the negative control);
* sequences of one length take the view path: no copy in or out, the batch backward's bits;
* bad packed inputs raise a clear ValueError / TypeError before any kernel; inputs are never modified;
* on an sm_90 GPU, the kernels: packed = each sequence alone, within bf16 rounding.
The kernels' numbers and times on the GPU: benchmarks/gpu_check_hopper_bwd.py --varlen.
"""
from __future__ import annotations

import pytest
import torch

from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import backward, chunk_bwd, varlen

from .test_hopper_bwd import DEVICE, _twin_walk, use_recompute_twins
from .test_hopper_bwd_ref import GRADS, ON_HOPPER, make_inputs, rel_l2
from .test_hopper_varlen import offsets_of

# a partial last chunk (100), shorter than one chunk (37), exactly two chunks (128), empty (0), a single row (1)
LENGTHS = [100, 37, 128, 0, 1]
NAMES = ("q", "k", "v", "g", "beta")


def packed_inputs(lengths: list[int], H: int = 1, HV: int = 2, K: int = 32, seed: int = 0) -> dict:
    """float64 packed inputs ``[1, ΣT, ...]`` (make_inputs'), one initial state and one dht per sequence."""
    x = make_inputs(1, sum(lengths), H, HV, K, seed=seed)
    states = make_inputs(len(lengths), 1, H, HV, K, seed=seed + 1)
    x["h0"], x["dht"] = states["h0"], states["dht"]
    return {n: t.to(DEVICE) for n, t in x.items()}


def use_twin_chain(monkeypatch) -> None:
    """The host chain around the kernels' twins, fp32, its dtype and device checks lifted."""
    use_recompute_twins(monkeypatch)
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_hopper", _twin_walk)
    monkeypatch.setattr(backward, "check_inputs", lambda *args: None)


def hopper(x: dict, scale: float, cu_seqlens=None, **options) -> tuple:
    """The Hopper backward on x's fp32 copies."""
    low = {n: t.float() for n, t in x.items()}
    return backward.chunk_gated_delta_rule_bwd_hopper(*(low[n] for n in NAMES), scale, low["h0"], low["do"],
                                                      low["dht"], BV=16, cu_seqlens=cu_seqlens, **options)


def packed_reference(x: dict, scale: float, offsets: list[int]) -> list[torch.Tensor]:
    """dq, dk, dv, dg, dβ, dh0 of the float64 reference's autograd over the packed sequences, through
    (o·do).sum() + (ht·dht).sum()."""
    leaves = [x[n].clone().requires_grad_() for n in (*NAMES, "h0")]
    o, ht = gated_delta_rule_reference(*leaves[:5], scale, leaves[5], offsets)
    return list(torch.autograd.grad((o * x["do"]).sum() + (ht * x["dht"]).sum(), leaves))


def per_sequence(x: dict, scale: float, offsets: list[int]) -> list[torch.Tensor]:
    """The equal-length backward run on each non-empty sequence alone (B = 1, its own h0 and dht), its gradients
    laid back into the packed rows; an empty sequence's dh0 is its dht."""
    rows = {n: [] for n in GRADS[:5]}
    dh0 = []
    for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        if bos == eos:
            dh0.append(x["dht"][n].float())
            continue
        one = {**{m: x[m][:, bos:eos] for m in (*NAMES, "do")}, "h0": x["h0"][n:n + 1], "dht": x["dht"][n:n + 1]}
        grads = hopper(one, scale)
        for name, t in zip(GRADS[:5], grads):
            rows[name].append(t)
        dh0.append(grads[5][0])
    return [torch.cat(rows[name], 1) for name in GRADS[:5]] + [torch.stack(dh0)]


@pytest.mark.interpreter
def test_packed_gradients_equal_each_sequence_alone_and_the_reference(monkeypatch):
    """Five ragged sequences padded to 128 rows (GVA, h0 and dht): dq, dk, dv, dg, dβ in the packed rows and dh0 per
    sequence equal the equal-length backward on each sequence alone to fp32 rounding (the padding adds exact zeros,
    so only the sums' order differs), and the float64 reference within the host chain's bound (test_hopper_bwd's:
    the pre-pass twin's bf16 T). The empty sequence's dh0 is its dht: the zero rows pass dS back unchanged. Inputs
    are not modified."""
    use_twin_chain(monkeypatch)
    offsets = offsets_of(LENGTHS)
    x = packed_inputs(LENGTHS)
    before = {n: t.clone() for n, t in x.items()}
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    got = hopper(x, 0.3, cu)
    assert all(torch.equal(x[n], before[n]) for n in x)
    shapes = [x[n].shape for n in NAMES] + [x["h0"].shape]
    assert [t.shape for t in got] == shapes and all(t.dtype == torch.float32 for t in got)
    alone = per_sequence(x, 0.3, offsets)
    errors = {n: rel_l2(a, b) for n, a, b in zip(GRADS, got, alone)}
    assert max(errors.values()) < 2e-6, errors
    assert torch.equal(got[5][3], x["dht"][3].float())
    ref = packed_reference(x, 0.3, offsets)
    errors = {n: rel_l2(a, b) for n, a, b in zip(GRADS, got, ref)}
    assert max(errors.values()) < 2e-2, errors


@pytest.mark.interpreter
def test_padding_with_a_nonzero_gate_fails(monkeypatch):
    """The negative control: the same chain with the padded rows' gates at −0.5 (a padding that decays the state)
    moves dh0 by O(1): dht no longer reaches each sequence's last row as it is."""
    use_twin_chain(monkeypatch)
    x = packed_inputs(LENGTHS)
    low = {n: t.float() for n, t in x.items()}
    args = [*(low[n] for n in NAMES), 0.3, low["h0"], low["do"], low["dht"]]
    cu = torch.tensor(offsets_of(LENGTHS), dtype=torch.int32, device=DEVICE)
    good = backward.chunk_gated_delta_rule_bwd_hopper(*args, BV=16, cu_seqlens=cu)
    real_pad = varlen.pad_rows
    padding = (torch.arange(128)[None, :] >= torch.tensor(LENGTHS)[:, None]).to(DEVICE)      # [N, Tp]

    def decaying_pad(t, cu_seqlens, Tp):
        out = real_pad(t, cu_seqlens, Tp)
        return out.masked_fill(padding[..., None], -0.5) if t is low["g"] else out
    monkeypatch.setattr(varlen, "pad_rows", decaying_pad)
    bad = backward.chunk_gated_delta_rule_bwd_hopper(*args, BV=16, cu_seqlens=cu)
    assert rel_l2(bad[5], good[5]) > 1e-2


@pytest.mark.interpreter
def test_packed_sequences_of_one_length_run_as_views(monkeypatch):
    """Three sequences of 100 rows: no copy in or out (pad_rows, unpad_rows never called; the batch the equal-length
    backward gets is the packed rows' memory, left unmodified), the bits of the backward on the ``[3, 100]`` batch
    itself, and the float64 reference's gradients within the host chain's bound."""
    use_twin_chain(monkeypatch)
    offsets = [0, 100, 200, 300]
    x = packed_inputs([100] * 3, seed=4)
    low = {n: t.float() for n, t in x.items()}
    before = {n: t.clone() for n, t in low.items()}
    monkeypatch.setattr(varlen, "pad_rows", None)
    monkeypatch.setattr(varlen, "unpad_rows", None)
    seen = []
    real = backward.backward_equal_lengths
    monkeypatch.setattr(backward, "backward_equal_lengths", lambda *a, **kw: seen.append(a[:5]) or real(*a, **kw))
    got = backward.chunk_gated_delta_rule_bwd_hopper(*(low[n] for n in NAMES), 0.3, low["h0"], low["do"], low["dht"],
                                                     BV=16, cu_seqlens=torch.tensor(offsets, device=DEVICE))
    assert [t.shape[:2] for t in seen[0]] == [(3, 100)] * 5
    assert all(t.data_ptr() == low[n].data_ptr() for t, n in zip(seen[0], NAMES))
    assert all(torch.equal(low[n], before[n]) for n in low)
    batch = {n: (t.view(3, 100, *t.shape[2:]) if n in (*NAMES, "do") else t) for n, t in x.items()}
    whole = hopper(batch, 0.3)
    assert all(torch.equal(a.reshape(b.shape), b) for a, b in zip(got, whole))
    ref = packed_reference(x, 0.3, offsets)
    assert max(rel_l2(a, b) for a, b in zip(got, ref)) < 2e-2


def _bf16_packed(lengths=(70, 30), HV=2, K=64) -> dict:
    """bf16 packed inputs the Hopper backward takes but for the device (K = V = 64)."""
    x = packed_inputs(list(lengths), HV=HV, K=K)
    low = {n: (t.bfloat16() if n in ("q", "k", "v", "do") else t.float()) for n, t in x.items()}
    return dict(q=low["q"], k=low["k"], v=low["v"], g=low["g"], beta=low["beta"], scale=K ** -0.5,
                initial_state=low["h0"], do=low["do"], dht=low["dht"],
                cu_seqlens=torch.tensor(offsets_of(list(lengths)), dtype=torch.int32))


@pytest.mark.parametrize("change,error,match", [
    (lambda x: {n: (t.expand(2, *t.shape[1:]) if n in ("q", "k", "v", "g", "beta", "do") else t)
                for n, t in x.items()}, ValueError, "B = 1"),
    (lambda x: dict(x, cu_seqlens=torch.tensor([0, 70, 60, 100])), ValueError, "non-decreasing"),
    (lambda x: dict(x, cu_seqlens=torch.tensor([0, 70, 99])), ValueError, "end at T=100"),
    (lambda x: dict(x, cu_seqlens=torch.tensor([3, 70, 100])), ValueError, "start at 0"),
    (lambda x: dict(x, cu_seqlens=torch.tensor([100])), ValueError, "N \\+ 1 >= 2"),
    (lambda x: dict(x, cu_seqlens=torch.tensor([[0, 70, 100]])), ValueError, "1-D"),
    (lambda x: dict(x, cu_seqlens=torch.tensor([0.0, 70.0, 100.0])), TypeError, "int32 or int64"),
    (lambda x: dict(x, initial_state=x["initial_state"][:1]), ValueError, "initial_state .*packed sequences"),
    (lambda x: dict(x, dht=torch.cat([x["dht"]] * 2)), ValueError, "dht .*packed sequences"),
], ids=["B2", "non_monotone", "short_end", "nonzero_start", "one_offset", "2d", "float_offsets", "h0_of_wrong_N",
        "dht_of_wrong_N"])
def test_bad_packed_inputs_raise(change, error, match):
    """Each bad packed input names itself before any kernel (and before the device check: these run on the CPU)."""
    x = change(_bf16_packed())
    with pytest.raises(error, match=match):
        backward.chunk_gated_delta_rule_bwd_hopper(**x)


def test_good_packed_inputs_reach_the_device_check():
    """The same inputs unchanged pass every packed check: on the CPU, only the device is refused."""
    if torch.cuda.is_available():
        pytest.skip("the device check passes on a GPU")
    x = _bf16_packed()
    before = {n: t.clone() for n, t in x.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ValueError, match="sm_90"):
        backward.chunk_gated_delta_rule_bwd_hopper(**x)
    assert all(torch.equal(x[n], t) for n, t in before.items())


@ON_HOPPER
def test_packed_kernels_equal_each_sequence_alone_on_the_gpu():
    """On the GPU, bf16 (GVA, K = V = 64, h0 and dht): the padded backward's gradients within bf16 rounding of the
    Hopper backward run on each sequence alone (the same kernels on the same rows: a row out of place, a chunk
    decayed by the padding or a dh0 from the wrong sequence is O(1)), every one finite, and the float64 reference's
    within the bound the per-sequence runs meet themselves (twice their error)."""
    offsets = offsets_of(LENGTHS)
    x = packed_inputs(LENGTHS, H=2, HV=4, K=64, seed=5)
    low = {n: (t.bfloat16() if n in ("q", "k", "v", "beta", "do") else t.float()).cuda() for n, t in x.items()}
    scale = 64 ** -0.5
    got = backward.chunk_gated_delta_rule_bwd_hopper(*(low[n] for n in NAMES), scale, low["h0"], low["do"],
                                                     low["dht"], cu_seqlens=torch.tensor(offsets, device="cuda"))
    assert all(torch.isfinite(t.float()).all() for t in got)
    rows, dh0 = [[] for _ in GRADS[:5]], []
    for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
        if bos == eos:
            dh0.append(low["dht"][n])
            continue
        # copies: a view from an odd row would start β (bf16, 4 heads) off the kernels' 16-byte boundary
        one = [low[m][:, bos:eos].clone() for m in (*NAMES, "do")]
        grads = backward.chunk_gated_delta_rule_bwd_hopper(*one[:5], scale, low["h0"][n:n + 1], one[5],
                                                           low["dht"][n:n + 1])
        for i in range(5):
            rows[i].append(grads[i])
        dh0.append(grads[5][0])
    alone = [torch.cat(r, 1) for r in rows] + [torch.stack(dh0)]
    distance = {n: rel_l2(a.float(), b.float()) for n, a, b in zip(GRADS, got, alone)}
    assert max(distance.values()) < 1e-2, distance
    ref = packed_reference({n: t.double().cpu() for n, t in low.items()}, scale, offsets)
    ratios = {n: rel_l2(a.cpu(), c) / max(rel_l2(b.cpu(), c), 1e-30) for n, a, b, c in zip(GRADS, got, alone, ref)}
    assert max(ratios.values()) <= 2.0, ratios
