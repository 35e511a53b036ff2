"""Packed sequences on the Hopper forward by padding (linattn/ops/hopper/varlen.py): the copies between packed rows
and the padded batch (common/varlen.py) against their twins, the padding decision, the padded forward around the
kernels' twins against the float64 recurrence (on the CPU), the plan's padding decision, and on an sm_90 GPU the
real kernels through the op."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import linattn
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import forward as hopper_fwd
from linattn.ops.hopper import plan as plan_module
from linattn.ops.hopper import varlen
from linattn.ops.hopper.plan import DEFAULT, HopperPlan

from .hopper_twins import hand_plan, use_twins
from .test_hopper_fwd import ON_HOPPER, inputs, rel

# lengths with a one-row sequence, an empty one, a whole chunk and two partial last chunks
LENGTHS = [70, 1, 0, 128, 100]


def offsets_of(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def test_padded_rows_and_equal_lengths():
    assert varlen.padded_rows(offsets_of(LENGTHS)) == 128
    assert varlen.padded_rows([0, 0]) == 64 and varlen.padded_rows([0, 65, 66]) == 128
    assert varlen.padded_rows([0, 65]) == 65                            # one sequence: its own length
    # sequences of one length are a batch as they stand, whatever the length
    assert varlen.equal_lengths([0, 100, 200, 300]) and varlen.padded_rows([0, 100, 200, 300]) == 100
    assert not varlen.equal_lengths([0, 100, 200, 299]) and not varlen.equal_lengths([0, 0, 0])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row", [(3, 5), (2, 64), ()], ids=["15_per_row", "128_per_row", "scalar_rows"])
def test_pad_rows_and_back_equal_their_twins(dtype, row):
    """common.varlen.pad_rows / unpad_rows (one Triton launch each) against their twins: each sequence's rows first
    in its row of the batch and zeros after (a one-row, an empty and a whole-chunk sequence; rows of 15, 128 and 1
    elements), and back; a batch row past a sequence's end that holds garbage does not leak into the packed rows."""
    from linattn.ops.common.varlen import pad_rows, pad_rows_ref, unpad_rows, unpad_rows_ref
    offsets = offsets_of(LENGTHS)
    x = torch.randn(1, offsets[-1], *row).to(dtype)
    cu = torch.tensor(offsets, dtype=torch.int32)
    padded = pad_rows(x, cu, 128)
    assert padded.shape == (len(LENGTHS), 128, *row) and torch.equal(padded, pad_rows_ref(x, offsets, 128))
    garbage = padded.clone()
    for n, length in enumerate(LENGTHS):
        garbage[n, length:] = float("nan")
    back = unpad_rows(garbage, cu, offsets[-1])
    assert torch.equal(back, unpad_rows_ref(padded, offsets)) and torch.equal(back, x)
    strided = garbage.transpose(0, 1).contiguous().transpose(0, 1)      # the same values, not contiguous
    assert torch.equal(unpad_rows(strided, cu, offsets[-1]), x)


def test_padding_is_taken_only_where_it_wastes_little():
    def worth(offsets, fraction=0.2):
        return varlen.worth_padding(offsets, varlen.padded_rows(offsets), fraction)
    assert worth([0, 4096, 8192])                      # equal lengths: no waste
    assert worth([0, 4000, 8096])                      # 2·4032 rows for 8096: 0.4% padded
    assert not worth([0, 4096, 4160])                  # 2·4096 rows for 4160: half padded
    assert worth([0, 100]) and worth([0, 100, 200])    # one length: nothing padded
    uneven = [0, 100, 200, 300, 400, 490]
    assert not worth(uneven)                           # 5·128 rows for 490 (23% padded)...
    assert worth(uneven, 0.25)                         # ...within a quarter


@pytest.mark.interpreter
@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
@pytest.mark.parametrize("segments,planned_walk", [(1, False), (2, False), (2, True)],
                         ids=["unsegmented", "segmented", "two_launches"])
def test_packed_sequences_by_padding_equal_the_recurrence(monkeypatch, with_h0, segments, planned_walk):
    """forward_hopper with cu_seqlens around the kernels' twins (fp32, nothing rounded), unsegmented, in two
    segments (five launches) and in two segments with the warm-ups planned in the walk (two launches): o and every
    sequence's final state equal the float64 recurrence over the packed sequences; a partial last chunk decays its
    state by its valid rows only, an empty sequence keeps its initial state. The negative control pads with a
    nonzero gate (the padding would decay the state) and must fail."""
    offsets = offsets_of(LENGTHS)
    N, total = len(LENGTHS), offsets[-1]
    x = inputs(1, total, 1, 2, 16, 16, dtype=torch.float32)
    h0 = inputs(N, 1, 1, 2, 16, 16)["initial_state"] if with_h0 else None
    exact = {n: t.double() for n, t in x.items() if n != "initial_state"}
    ro, rht = gated_delta_rule_reference(**exact, scale=0.25, initial_state=h0, cu_seqlens=offsets)
    use_twins(monkeypatch)
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")]
    h0f = h0.float() if with_h0 else None
    plan = hand_plan(segments, planned_walk, padded_rows=varlen.padded_rows(offsets))
    o, ht = hopper_fwd.forward_hopper(plan, *args, 0.25, h0f, torch.tensor(offsets))
    assert o.shape == x["v"].shape and ht.shape == (N, 2, 16, 16)
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    if with_h0:
        assert torch.allclose(ht[2], h0f[2])                            # the empty sequence
    real_pad = varlen.pad_rows
    monkeypatch.setattr(varlen, "pad_rows", lambda t, *a: real_pad(t, *a) - (0.5 if t is args[3] else 0.0))
    o_bad, ht_bad = hopper_fwd.forward_hopper(plan, *args, 0.25, h0f, torch.tensor(offsets))
    assert rel(ht_bad, rht) > 1e-3


@pytest.mark.interpreter
def test_packed_sequences_of_one_length_run_as_views(monkeypatch):
    """Three sequences of 100 rows: no padding and no copies (pad_rows never called), the batch [3, 100] as views of
    the packed rows, o and the final states the float64 recurrence's."""
    offsets = [0, 100, 200, 300]
    x = inputs(1, 300, 1, 2, 16, 16, dtype=torch.float32, seed=3)
    exact = {n: t.double() for n, t in x.items() if n != "initial_state"}
    ro, rht = gated_delta_rule_reference(**exact, scale=0.25, cu_seqlens=offsets)
    use_twins(monkeypatch)
    monkeypatch.setattr(varlen, "pad_rows", None)
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")]
    o, ht = hopper_fwd.forward_hopper(hand_plan(padded_rows=100), *args, 0.25, None, torch.tensor(offsets))
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5


def test_packed_inputs_the_padded_forward_cannot_take_say_why():
    x = inputs(2, 64, 1, 1, 16, 16, dtype=torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="B = 1"):
        hopper_fwd.forward_hopper(hand_plan(padded_rows=64), *args, 0.25, None, torch.tensor([0, 64]))


def test_the_op_plans_packed_bf16_for_the_padded_forward_where_it_wastes_little(monkeypatch):
    """plan.plan_inputs with cu_seqlens: the plan is asked for N sequences of the padded length, and the plan
    records that length, only where padding wastes at most max_padded_fraction ("auto"), or regardless when
    forced. The device and dtype gates are passed as on an sm_90 GPU with TileLang; the kernels themselves run in
    the GPU test below."""
    asked = []
    monkeypatch.setattr(plan_module, "plan", lambda N, HV, V, T, sms, forced, config: asked.append((N, T)) or
                        HopperPlan((("BV", 64),), config=config, reason="test"))
    monkeypatch.setattr(plan_module, "unsupported_reason", lambda q, v: None)
    monkeypatch.setattr(plan_module, "num_sms", lambda device: 132)
    offsets = offsets_of([100, 30])
    q = torch.zeros(1, 130, 1, 64, dtype=torch.bfloat16)
    v = torch.zeros(1, 130, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor(offsets)
    half = dataclasses.replace(DEFAULT, max_padded_fraction=0.5)
    found, _ = plan_module.plan_inputs(q, v, (), cu, offsets, config=half)
    assert found.padded_rows == 128 and asked == [(2, 128)]
    found, why = plan_module.plan_inputs(q, v, (), cu, offsets)           # 256 rows for 130: not worth it
    assert found is None and "padding" in why and len(asked) == 1
    found, _ = plan_module.plan_inputs(q, v, (), cu, offsets, forced=True)
    assert found.padded_rows == 128 and asked[-1] == (2, 128)


@ON_HOPPER
@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
def test_packed_sequences_through_the_op_on_the_gpu(with_h0):
    """Packed bf16 sequences of uneven lengths through chunk_gated_delta_rule take the padded Hopper forward (the
    dispatch's choice), within the core issue's bf16 bound of the float64 recurrence and close to the Triton
    split's answer for the same inputs."""
    from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path
    from linattn.ops.gated_delta.dispatch import choose_forward_path
    lengths = [4096, 4000, 3000, 4096, 1, 4033, 4096, 3500]
    offsets = offsets_of(lengths)
    x = inputs(1, offsets[-1], 16, 16, 128, 128, dtype=torch.bfloat16, seed=6)
    h0 = inputs(len(lengths), 1, 16, 16, 128, 128, seed=7)["initial_state"].float().cuda() if with_h0 else None
    args = {n: (t if n in ("q", "k", "v") else t.float()).cuda() for n, t in x.items() if n != "initial_state"}
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    choice = choose_forward_path(*(args[n] for n in ("q", "k", "v", "g", "beta")), h0, cu, offsets, "triton")
    assert choice.path == "hopper" and choice.plan.padded_rows == 4096, choice
    with torch.no_grad():
        o, ht = linattn.chunk_gated_delta_rule(**args, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        o_split, ht_split = chunk_gated_delta_rule_on_path("split", **args, initial_state=h0, output_final_state=True,
                                                           cu_seqlens=cu)
    exact = {n: t.double() for n, t in args.items()}
    ro, rht = gated_delta_rule_reference(**exact, scale=128 ** -0.5, initial_state=h0.double() if with_h0 else None,
                                         cu_seqlens=offsets)
    assert rel(o, ro) < 5e-3 and rel(ht, rht) < 5e-3
    assert rel(o, o_split) < 5e-3 and rel(ht, ht_split) < 5e-3
