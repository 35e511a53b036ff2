"""The Hopper backward's host chain (linattn/ops/hopper/backward.py) and its fused walk (chunk_bwd.py) on the CPU:

* the recompute (the pre-pass without β on T, then the forward walk's states build; their twins here) gives the
  backward twin's gc, T (without β) and states entering each chunk, in the layouts the walk reads; the states
  twin equals the float64 recurrence's state at every chunk start, and the old route's (the Triton state pass,
  interpreter) within bf16 rounding;
* the host's sums of what the walk leaves (head-major dg, dβ per slice; dq, dk per value head), one launch, equal
  the twin's, bit for bit;
* the slices' exchange of dq, dk (the walk's cluster), modelled: every read finds its tile, no deadlock;
* bad inputs raise clear errors;
* the walk compiles for sm_90a at K = V = 128 (BV = 64) and K = V = 64 (BV = 64, 32): shared memory within the
  227 KB of a CTA, no spill, no serialised wgmma, the slices of a head one cluster exchanging dq, dk through their
  flags; so do the recompute's states walk and its pre-pass (where TileLang and nvcc are installed).
The kernel's numbers on the GPU: tests/ops/test_hopper_bwd_ref.py (ON_HOPPER), benchmarks/gpu_check_hopper_bwd.py.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.hopper import backward, chunk_bwd, chunk_fwd, prepass, reverse_maps, segments, walk_launch
from linattn.ops.hopper import chunk_bwd_ref as bwd
from linattn.ops.hopper import chunk_fwd_ref as fwd_twins

from .test_hopper_bwd_ref import GRADS, ON_HOPPER, make_inputs, max_rel, rel_l2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # the Triton recompute: the interpreter on the CPU


def use_recompute_twins(monkeypatch) -> None:
    """backward.recompute's kernels replaced by their twins: the pre-pass's (T in bf16, as the kernel's) and the
    states walk's."""
    monkeypatch.setattr(prepass, "prepass_hopper", prepass.prepass_hopper_ref)
    monkeypatch.setattr(walk_launch, "chunk_states_hopper", fwd_twins.chunk_states_hopper_ref)


def head_major(x: torch.Tensor) -> torch.Tensor:
    """Token-major ``[..., T, HV]`` (the twins' dg, dβ partials) → the walk's head-major ``[..., HV, NT·64]``,
    zero-padded to whole chunks."""
    return backward.whole_chunks(x.transpose(-1, -2).contiguous(), x.shape[-2])


def recurrence_states(x: dict, chunks: int) -> torch.Tensor:
    """The float64 recurrence's state entering each chunk ``[B, chunks, HV, K, V]``: its final state after the first
    64·c tokens (h0 at c = 0)."""
    states = [x["h0"]] + [gated_delta_rule_reference(*(x[n][:, :64 * c] for n in ("q", "k", "v", "g", "beta")), 1.0,
                                                     x["h0"])[1] for c in range(1, chunks)]
    return torch.stack(states, 1)


@pytest.mark.parametrize("decay", ["anchor", "strong"])
def test_states_twin_is_the_recurrences_state_at_every_chunk(decay):
    """The states walk's twin without rounding (float64, on the pre-pass twin's gc, β and plain T): h is the float64
    recurrence's state entering each chunk and the final state its final state, to float64 rounding (GVA, T = 150:
    the last chunk partial; g ≈ −100 per token: every chunk renormalises, nothing overflows)."""
    x = make_inputs(2, 150, 1, 2, 16, decay=decay)
    gc_hm, beta_hm, t_inv, _ = prepass.prepass_hopper_ref(x["k"], x["g"], x["beta"], a_inv_dtype=torch.float64,
                                                          beta_in_a_inv=False)
    h, ht = fwd_twins.chunk_states_hopper_ref(x["k"], x["v"], gc_hm, beta_hm, t_inv, x["h0"])
    assert h.dtype == torch.float64 and h.shape == (2, 3, 2, 16, 16)
    assert max_rel(h, recurrence_states(x, 3)) < 1e-12
    final = gated_delta_rule_reference(*(x[n] for n in ("q", "k", "v", "g", "beta")), 1.0, x["h0"])[1]
    assert max_rel(ht, final) < 1e-12


def test_states_twin_rounds_where_the_kernel_does():
    """With bf16 keys and values (the kernel's operands) the twin stores bf16 h, within bf16 rounding of the float64
    recurrence's states (X, V_d and the state rounded as dot operands): a chunk or head out of place would be
    O(1)."""
    x = make_inputs(1, 200, 1, 2, 32)
    kb, vb = x["k"].bfloat16(), x["v"].bfloat16()
    exact = {**x, "k": kb.double(), "v": vb.double()}
    gc_hm, beta_hm, t_inv, _ = prepass.prepass_hopper_ref(kb, x["g"].float(), x["beta"].float(), beta_in_a_inv=False)
    h, _ = fwd_twins.chunk_states_hopper_ref(kb, vb, gc_hm, beta_hm, t_inv, x["h0"].float())
    assert h.dtype == torch.bfloat16
    assert rel_l2(h, recurrence_states(exact, 4)) < 2 ** -7


def test_recompute_gives_the_twins_saved_tensors(monkeypatch):
    """gc, β, T and h from backward.recompute on its kernels' twins (fp32 inputs) against the backward twin's saved
    tensors (checkpoints at every chunk: the states entering each chunk), in the walk's layouts: gc and β
    head-major over whole chunks, zero past T; T bf16 without β; h ``[B, NT, HV, K, V]``."""
    use_recompute_twins(monkeypatch)
    x = {n: t.float() for n, t in make_inputs(1, 150, 1, 2, 32).items()}
    gc_hm, beta_hm, t_inv, h = backward.recompute(x["k"], x["v"], x["g"], x["beta"], x["h0"])
    _, _, saved = bwd.forward_for_backward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], 1.0, x["h0"], 1, None)
    assert gc_hm.shape == beta_hm.shape == (1, 2, 192) and gc_hm.dtype == beta_hm.dtype == torch.float32
    assert t_inv.dtype == torch.bfloat16 and h.shape == (1, 3, 2, 32, 32)
    # past T the host pads with zeros, the twin gc with each chunk's last value: the walk masks those rows either way
    assert max_rel(gc_hm[..., :150], saved.gc[..., :150]) < 1e-6 and not gc_hm[..., 150:].any()
    assert torch.equal(beta_hm, saved.beta.float()) and not beta_hm[..., 150:].any()
    # T: one bf16 rounding (≤ 2⁻⁸ relative), which the states carry (the twins round nothing else in fp32); a
    # chunk or head out of place would be O(1)
    assert max_rel(t_inv, saved.a_inv) < 2 ** -8
    assert max_rel(h.transpose(1, 2), saved.checkpoints) < 2 ** -7


@pytest.mark.interpreter
def test_new_recompute_gives_the_old_state_pass_h():
    """The two routes to h on the same inputs (bf16-exact keys and values): the old one — the Triton chunk-local
    cumsum, kkt_solve and state pass from T and β (fp32 under the interpreter, h stored in bf16) — and the new one at
    twin level — the pre-pass twin's bf16 T, then the states walk's twin rounding where the kernel does. Within bf16
    rounding of each other (the old route rounds h alone, the new one its dot operands too); unrounded, the new
    route's h within the old one's bf16 store (the interpreter rounds by truncation: ≤ 2⁻⁷)."""
    from linattn.ops.common.cumsum import chunk_local_cumsum
    from linattn.ops.common.kkt_solve import kkt_solve
    from linattn.ops.common.state_pass import state_pass_fwd
    x = make_inputs(2, 150, 1, 2, 32, seed=3)
    kb, vb = x["k"].bfloat16(), x["v"].bfloat16()
    g, beta, h0 = x["g"].float(), x["beta"].float(), x["h0"].float()
    k32, v32 = kb.float().to(DEVICE), vb.float().to(DEVICE)
    gc = chunk_local_cumsum(g.to(DEVICE), None, None)
    a_inv = kkt_solve(k32, beta.to(DEVICE), gc, 2, None, None)
    h_old = state_pass_fwd(k32, None, v32, gc, h0.to(DEVICE), store_dtype=torch.bfloat16, a_inv=a_inv,
                           beta=beta.to(DEVICE))[0].cpu()
    rounded = prepass.prepass_hopper_ref(kb, g, beta, beta_in_a_inv=False)
    h_new = fwd_twins.chunk_states_hopper_ref(kb, vb, *rounded[:3], h0)[0]
    assert h_new.dtype == h_old.dtype == torch.bfloat16 and h_new.shape == h_old.shape == (2, 3, 2, 32, 32)
    assert rel_l2(h_new, h_old.float()) < 2 ** -7
    exact = prepass.prepass_hopper_ref(kb.float(), g, beta, a_inv_dtype=torch.float32, beta_in_a_inv=False)
    h_exact = fwd_twins.chunk_states_hopper_ref(kb.float(), vb.float(), *exact[:3], h0)[0]
    assert max_rel(h_old.float(), h_exact) < 2 ** -7


@pytest.mark.interpreter
def test_gradients_from_partials_equal_the_twins_sum():
    """The twin's V-sliced walk's outputs in the walk's layouts (dq, dk per value head; dg, dβ head-major and padded
    to whole chunks), added by the host's one launch: the twin's own sums, to float64 rounding (GVA: 4 value heads
    on 2 qk heads, T = 100 not a multiple of 64)."""
    x = make_inputs(2, 100, 2, 4, 32)
    _, _, saved = bwd.forward_for_backward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.2, x["h0"], 2, None)
    parts = bwd.chunk_bwd_v_slices_ref(x["q"], x["k"], x["v"], x["do"], x["dht"], saved, 0.2, 16, None, "exact")
    dq, dk, dg, dbeta = backward.gradients_from_partials(
        parts.dq.to(DEVICE), parts.dk.to(DEVICE), head_major(parts.dg).to(DEVICE), head_major(parts.dbeta).to(DEVICE),
        x["g"].to(DEVICE), torch.float64, torch.float64, 2)
    twin = bwd.sum_partials_ref(parts, 2)
    errors = {n: max_rel(a.cpu(), b) for n, a, b in zip(GRADS, (dq, dk, twin[2], dg, dbeta, twin[5]), twin)}
    assert max(errors.values()) < 1e-14, errors


def _walk_partials(NV, B, T, H, HV, K, seed=0):
    """Random outputs in the walk's layouts (dq, dk per value head; dg, dβ per slice, head-major, padded to whole
    chunks with values the sums must not read) and gates with every fifth one below the floor."""
    from linattn.ops.utils import MIN_LOG_DECAY
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    Lp = -(-T // 64) * 64
    g = -r(B, T, HV).abs()
    g.view(-1)[::5] = MIN_LOG_DECAY - 1
    return [t.to(DEVICE) for t in (r(B, T, HV, K), r(B, T, HV, K), r(NV, B, HV, Lp), r(NV, B, HV, Lp), g)]


@ON_HOPPER
def test_recompute_kernels_match_their_twins_on_the_gpu():
    """On the GPU: backward.recompute's gc, β and T against the pre-pass twin's, and its h against the states twin's
    on the kernels' own gc, β and T (GVA, T = 300: a partial last chunk), within bf16 rounding (the kernels' fp32
    sums run in another order, so a few bf16 operands round the other way)."""
    x = make_inputs(2, 300, 2, 4, 128, seed=5)
    low = {n: (t.to(torch.bfloat16) if n in ("k", "v", "beta") else t.float()).cuda() for n, t in x.items()}
    gc_hm, beta_hm, t_inv, h = backward.recompute(low["k"], low["v"], low["g"], low["beta"], low["h0"])
    assert gc_hm.shape == beta_hm.shape == (2, 4, 320) and h.shape == (2, 5, 4, 128, 128)
    gc_twin, beta_twin, t_twin, _ = prepass.prepass_hopper_ref(low["k"], low["g"], low["beta"], beta_in_a_inv=False)
    assert max_rel(gc_hm[..., :300], gc_twin[..., :300]) < 1e-5 and not gc_hm[..., 300:].any()
    assert torch.equal(beta_hm[..., :300], beta_twin[..., :300].float()) and not beta_hm[..., 300:].any()
    assert rel_l2(t_inv, t_twin) < 2 ** -8
    h_twin, _ = fwd_twins.chunk_states_hopper_ref(low["k"], low["v"], gc_hm, beta_hm, t_inv, low["h0"])
    assert torch.isfinite(h.float()).all() and rel_l2(h, h_twin) < 2 ** -8


@pytest.mark.interpreter
@pytest.mark.parametrize("NV,H,HV,K", [(2, 2, 4, 32), (1, 1, 1, 48), (4, 1, 4, 16), (2, 1, 3, 48), (2, 2, 2, 32)],
                         ids=["halves_gva", "one_K48", "quarters_gva4", "halves_hv3_K48", "halves_no_gva"])
def test_partial_sums_equal_their_twin(NV, H, HV, K):
    """common/partial_sum.py's one launch against its twin, the same fp32 bits: dq, dk (the group's value heads
    added; without GVA the walk's own) and dg, dβ (head-major → token-major, dg zero below the gate floor); rows
    and tokens past a program's block masked (B·T·H not a multiple of its rows, T = 37 of a 64-wide padded row;
    K = 48, HV = 3 not powers of two)."""
    from linattn.ops.common.partial_sum import partial_sums, partial_sums_ref
    from linattn.ops.utils import MIN_LOG_DECAY
    args = _walk_partials(NV, 2, 37, H, HV, K)
    got = partial_sums(*args, H, torch.float32, torch.float32)
    twin = partial_sums_ref(*args, H, torch.float32, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got, twin))
    g = args[4]
    assert (got[2][g < MIN_LOG_DECAY] == 0).all() and (got[2][g >= MIN_LOG_DECAY] != 0).all()


@pytest.mark.interpreter
def test_partial_sums_add_the_walks_bf16_dq_heads_in_fp32():
    """The walk's per-value-head dtypes with GVA (chunk_bwd.qk_heads_dtypes: dq bf16, dk fp32): the twin's fp32
    bits, dq's heads summed in fp32 (a bf16 sum rounds at every head: four values of 1 + 2⁻⁷ add to 4 + 2⁻⁵ in
    fp32, not in bf16)."""
    from linattn.ops.common.partial_sum import partial_sums, partial_sums_ref
    dq_h, dk_h, dg_p, db_p, g = _walk_partials(2, 2, 37, 1, 4, 32, seed=4)
    dq_h = dq_h.to(chunk_bwd.qk_heads_dtypes(4)[0])
    dq_h[0, 0] = 1 + 2 ** -7
    got = partial_sums(dq_h, dk_h, dg_p, db_p, g, 1, torch.float32, torch.float32)
    twin = partial_sums_ref(dq_h, dk_h, dg_p, db_p, g, 1, torch.float32, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got, twin))
    assert (got[0][0, 0] == 4 * (1 + 2 ** -7)).all()


@pytest.mark.interpreter
def test_partial_sums_cast_to_the_gradients_dtypes():
    """bf16 dq, dk and dβ: the twin's, to one bf16 unit in the last place (the interpreter rounds fp32 → bf16 by
    truncation, the GPU to nearest even); dg stays in g's dtype."""
    from linattn.ops.common.partial_sum import partial_sums, partial_sums_ref
    args = _walk_partials(2, 2, 37, 2, 4, 32)
    got = partial_sums(*args, 2, torch.bfloat16, torch.bfloat16)
    twin = partial_sums_ref(*args, 2, torch.bfloat16, torch.bfloat16)
    assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
    assert torch.equal(got[2], twin[2])
    for a, b in zip(got[:2] + got[3:], twin[:2] + twin[3:]):
        assert ((a.float() - b.float()).abs() <= 2 ** -7 * b.float().abs()).all()


@pytest.mark.interpreter
def test_partial_sums_add_the_heads_in_order():
    """dq, dk per value head (two per qk head): the bits of head 0 + head 1 (no zero added first: its sign of zero
    would differ), dg and dβ the bits of torch's sum over the slices, slice to T, transpose and mask. Without GVA
    the walk's dq, dk are the gradients: returned as they are, no copy, in their dtype."""
    from linattn.ops.common.partial_sum import partial_sums
    from linattn.ops.utils import MIN_LOG_DECAY
    dq_h, dk_h, dg_p, db_p, g = _walk_partials(2, 2, 37, 2, 4, 32, seed=1)
    dq_h[0, 0, 0] = dq_h[0, 0, 1] = -0.0
    dq, dk, dg, dbeta = partial_sums(dq_h, dk_h, dg_p, db_p, g, 2, torch.float32, torch.float32)
    rows = lambda p: p.view(2, 37, 2, 2, 32)[..., 0, :] + p.view(2, 37, 2, 2, 32)[..., 1, :]
    tokens = lambda p: p.sum(0)[..., :37].transpose(1, 2)
    assert torch.equal(dq, rows(dq_h)) and torch.equal(dk, rows(dk_h)) and dq[0, 0, 0].signbit().all()
    assert torch.equal(dg, tokens(dg_p).masked_fill(g < MIN_LOG_DECAY, 0)) and torch.equal(dbeta, tokens(db_p))
    own = _walk_partials(2, 2, 37, 2, 2, 32, seed=2)
    dq, dk, _, _ = partial_sums(*own, 2, torch.float32, torch.float32)
    assert dq is own[0] and dk is own[1]


@pytest.mark.interpreter
@pytest.mark.parametrize("HV", [4, 2], ids=["gva", "no_gva"])
def test_partial_sums_write_into_out(HV):
    """``out``: the same bits written into the given tensors (views of a larger gradient: the walk's batches), and
    returned; without GVA the walk's dq, dk copied in unless they are out's own (then untouched)."""
    from linattn.ops.common.partial_sum import partial_sums
    args = _walk_partials(2, 2, 37, 2, HV, 32, seed=3)
    fresh = partial_sums(*args, 2, torch.float32, torch.float32)
    whole = [torch.full((3, *x.shape[1:]), 7.0, device=DEVICE) for x in fresh]
    out = tuple(x[1:] for x in whole)
    got = partial_sums(*args, 2, torch.float32, torch.float32, out=out)
    assert all(a is b for a, b in zip(got, out)) and all(torch.equal(a, b) for a, b in zip(got, fresh))
    assert all((x[0] == 7).all() for x in whole)
    if HV == 2:
        own = (args[0], args[1], *out[2:])
        kept = args[0].clone()
        got = partial_sums(*args, 2, torch.float32, torch.float32, out=own)
        assert got[0] is args[0] and torch.equal(got[0], kept)


def test_partial_sums_reject_bad_out():
    from linattn.ops.common.partial_sum import partial_sums
    args = _walk_partials(2, 1, 37, 1, 2, 16)
    good = [torch.empty(1, 37, 1, 16), torch.empty(1, 37, 1, 16), torch.empty(1, 37, 2), torch.empty(1, 37, 2)]
    for index, bad, match in [(0, torch.empty(1, 37, 2, 16), "dq must be"), (3, torch.empty(1, 37, 2).double(),
                              "dbeta must be"), (2, torch.empty(1, 2, 37).transpose(1, 2), "not contiguous")]:
        out = list(good)
        out[index] = bad
        with pytest.raises(ValueError, match=match):
            partial_sums(*args, 1, torch.float32, torch.float32, out=tuple(out))
    with pytest.raises(ValueError, match="out must be"):
        partial_sums(*args, 1, torch.float32, torch.float32, out=tuple(good[:3]))


def test_partial_sums_compile_for_h200_like_a_row_sum():
    """The one launch for sm_90 (row 5's sizes: G = 2, HV = 32; the walk's bf16 dq and fp32 dk per value head): no
    spill, and registers of a plain row sum (≤ 64 per thread; the old dq/dk kernel took 48-54), so that the gate
    programs' transpose costs the row sums no occupancy."""
    from tests.ops.sm90_compile import compile_for_h200
    types = {"dq": "*bf16", "dk": "*bf16", "dbeta": "*bf16", "dq_heads": "*bf16", "dk_heads": "*fp32",
             "dg_parts": "*fp32", "dbeta_parts": "*fp32", "g": "*fp32", "dg": "*fp32"}
    consts = ("dict(NV=2, G=2, K=128, HV=32, BT=p.CHUNK, BK=128, BR=p.ROW_ELEMENTS // 128, BH=32, "
              "BTOK=p.GATE_ELEMENTS // 32, FLOOR=-104.0)")     # the launcher's tiles
    registers, spills = compile_for_h200(
        "import sm90; from linattn.ops.common import partial_sum as p",
        f"tuple(sm90.compile_sm90(p.partial_sums_kernel, {consts}, lambda n: {types!r}.get(n, 'i32'), 4)[:2])")
    assert spills == 0 and registers <= 64, (registers, spills)


def test_partial_sums_reject_bad_partials():
    from linattn.ops.common.partial_sum import partial_sums
    dq_p, dk_p, dg_p, db_p, g = _walk_partials(2, 1, 37, 1, 2, 16)
    for bad, match in [(dict(H=3), "multiple"), (dict(dk_p=dk_p[:, :5]), "one shape"),
                       (dict(dq_p=dq_p.half()), "per value head must be of"),
                       (dict(dg_p=dg_p[..., :30]), "Lp"), (dict(db_p=db_p.bfloat16()), "dbeta partials"),
                       (dict(g=g[:, :5]), "g must")]:
        x = {**dict(dq_p=dq_p, dk_p=dk_p, dg_p=dg_p, db_p=db_p, g=g, H=1), **bad}
        with pytest.raises(ValueError, match=match):
            partial_sums(x["dq_p"], x["dk_p"], x["dg_p"], x["db_p"], x["g"], x["H"], torch.float32, torch.float32)


def _inputs(B=1, T=70, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16):
    x = make_inputs(B, T, H, HV, max(K, V))
    q, k = (x[n][..., :K].to(dtype) for n in ("q", "k"))
    v, do = (x[n][..., :V].to(dtype) for n in ("v", "do"))
    return dict(q=q, k=k, v=v, g=x["g"].float(), beta=x["beta"].float(), scale=K ** -0.5,
                initial_state=x["h0"][..., :K, :V].float(), do=do, dht=x["dht"][..., :K, :V].float())


@pytest.mark.parametrize("change,error,match", [
    (dict(K=32), ValueError, "K and V in"),
    (dict(V=96), ValueError, "K and V in"),
    (dict(HV=3, H=2), ValueError, "multiple"),
    (dict(dtype=torch.float32), TypeError, "bf16"),
], ids=["K32", "V96", "HV_not_a_multiple", "fp32"])
def test_bad_inputs_raise(change, error, match):
    with pytest.raises(error, match=match):
        backward.chunk_gated_delta_rule_bwd_hopper(**_inputs(**change))


def test_bad_states_gates_and_device_raise():
    x = _inputs()
    for name, bad, match in [("g", x["g"].double(), r"float32 g .*g torch\.float64"),
                             ("beta", x["beta"][:, :5], "g and beta"), ("do", x["do"][:, :5], "do must"),
                             ("initial_state", x["initial_state"][0], "no varlen"),
                             ("dht", x["dht"][..., :5], "dht must"), ("scale", 0.0, "scale")]:
        with pytest.raises((ValueError, TypeError), match=match):
            backward.chunk_gated_delta_rule_bwd_hopper(**{**x, name: bad})
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sm_90"):
            backward.chunk_gated_delta_rule_bwd_hopper(**x)


ROOT = Path(__file__).resolve().parents[2]
COMPILES = pytest.mark.skipif(not chunk_fwd.tilelang_available() or shutil.which("nvcc") is None,
                              reason="TileLang (optional) and nvcc compile the Hopper kernels")
CTA_SHARED = 227 * 1024
# The walk's timeline build (a benchmark's instrument, never the op's) sits at the 168-register wall: TileLang places
# its shared buffers differently from one compile to the next (the CUDA source differs between two compiles of the
# same prim_func, whatever PYTHONHASHSEED), and ptxas then spills 4 B in about one compile of five (2026-12-06, five
# compiles at H = HV = 16). Its bound is that; every kernel the op launches spills nothing.
TIMELINE_SPILL_BYTES = 8


WALKS = [(2, 128, 64), (4, 128, 64), (2, 64, 64), (2, 64, 32)]
WALK_IDS = ["K128_gva", "K128", "K64_gva_one_slice", "K64_gva_BV32"]


@COMPILES
@pytest.mark.parametrize("H,K,BV", WALKS, ids=WALK_IDS)
def test_reverse_walk_compiles_for_sm90a(tmp_path, H, K, BV):
    """The walk (V = K, four value heads on H qk heads) for sm_90a: its 20 dots on bf16 wgmma (none on mma.sync),
    its dynamic shared memory within a CTA's 227 KB (213 KB at K = 128), and ptxas spilling nothing and serialising
    no wgmma (C7512). No shared-memory scan template: TileLang's CumSum1D runs on threads 0–31, the producer
    warpgroup's in this warp-specialised kernel, so its scan would never run (the dg bug the GPU found).
    The slices' exchange: NV = V / BV slices launched as one cluster; at the exchange points each of dq, dk awaited
    by the chunk's owner (one call in a loop over the others) and published by every other slice; dq, dk stored
    per value head with GVA (dq bf16, dk fp32), in bf16 (the gradients themselves) without; one slice: no cluster, no
    exchange."""
    from linattn.ops.hopper.cubin import compile_sm90a, launch_shared_bytes, ptxas_summary
    kernel = chunk_bwd.compiled_kernel(H, 4, K, K, K ** -0.5, BV, "sm_90a")  # gpu_check_hopper_bwd's
    source = kernel.get_kernel_source()
    assert source.count("tl::wgmma_ss<tl::DataType::kBFloat16") == 20 and "mma_sync" not in source
    assert "tl::CumSum" not in source
    NV = K // BV
    clusters = re.findall(r'"cluster_dims": \[(\d+), 1, 1\]', kernel.prim_func.script())
    assert clusters == ([] if NV == 1 else [str(NV)]), clusters
    awaits, publishes = (0, 0) if NV == 1 else (2, 2)
    assert source.count("linattn_warp_await((") == awaits and source.count("linattn_warp_publish((") == publishes
    dk_stored = "bfloat16_t* __restrict__ dk" if H == 4 else "float* __restrict__ dk"    # chunk_bwd.qk_heads_dtypes
    assert "bfloat16_t* __restrict__ dq" in source and dk_stored in source, dk_stored
    assert launch_shared_bytes(kernel) <= CTA_SHARED, launch_shared_bytes(kernel)
    report = compile_sm90a(source, tmp_path)[1]
    ptxas = ptxas_summary(report)
    assert ptxas["spill_stores"] == ptxas["spill_loads"] == 0 and not ptxas["wgmma_serialised"], report


def assert_launch_matches_params(launched: list, params) -> None:
    """The tensors a launch passed against a compiled kernel's parameters (the checks its launch makes on the
    GPU): every dtype, and every shape, one value per symbolic size."""
    sizes = {}
    for i, (x, param) in enumerate(zip(launched, params)):
        assert x.dtype == getattr(torch, str(param.dtype)), (i, x.dtype, param.dtype)
        assert len(x.shape) == len(param.shape), (i, tuple(x.shape), param.shape)
        for n, dim in zip(x.shape, param.shape):
            assert n == sizes.setdefault(str(dim), n) if not str(dim).isdigit() else n == int(str(dim)), (i, param)


@COMPILES
@pytest.mark.parametrize("H,K,BV", WALKS, ids=WALK_IDS)
def test_reverse_walk_launch_matches_the_kernels_parameters(monkeypatch, H, K, BV):
    """chunk_bwd_hopper's tensors (CPU stand-ins; the launch recorded, not run) against the compiled walk's
    parameters, which the launch checks on the GPU: every dtype, and every shape with one value per symbolic size —
    dq, dk bf16 without GVA, dq bf16 and dk fp32 with; the exchange ring and its zeroed flags per (sequence, value
    head), or one element each for one slice."""
    compiled = chunk_bwd.compiled_kernel(H, 4, K, K, K ** -0.5, BV, "sm_90a")
    launched = []
    monkeypatch.setattr(chunk_bwd, "compiled_kernel", lambda *args, **kw: compiled)
    monkeypatch.setattr(chunk_bwd, "launcher", lambda kernel: lambda *args: launched.extend(args))
    B, T, NT = 2, 100, 2
    bf = torch.bfloat16
    q, k = (torch.zeros(B, T, H, K, dtype=bf) for _ in range(2))
    v, do = (torch.zeros(B, T, 4, K, dtype=bf) for _ in range(2))
    gc, beta = (torch.zeros(B, 4, NT * 64) for _ in range(2))
    out = chunk_bwd.chunk_bwd_hopper(q, k, v, do, gc, beta, torch.zeros(B, T, 4, 64, dtype=bf),
                                     torch.zeros(B, NT, 4, K, K, dtype=bf), None, K ** -0.5, BV)
    assert len(launched) == len(compiled.params) and out[0] is launched[9] and out[1] is launched[10]
    assert_launch_matches_params(launched, compiled.params)
    assert out[0].dtype == bf and out[1].dtype == (bf if H == 4 else torch.float32) and not launched[-1].any()
    flags = B * 4 * 2 * 2 * 1 * chunk_bwd.FLAG_WARPS    # 2 · NV (NV − 1) per (sequence, value head)
    assert launched[-1].numel() == (1 if BV == K else flags)
    given = dict(dv=torch.empty(B, T, 4, K, dtype=bf), dh0=torch.empty(B, 4, K, K))
    launched.clear()
    out = chunk_bwd.chunk_bwd_hopper(q, k, v, do, gc, beta, torch.zeros(B, T, 4, 64, dtype=bf),
                                     torch.zeros(B, NT, 4, K, K, dtype=bf), None, K ** -0.5, BV, **given)
    assert out[2] is given["dv"] is launched[11] and out[5] is given["dh0"] is launched[14]
    for bad, match in [(dict(dv=given["dv"].float()), "dv must be"), (dict(dh0=torch.empty(B, 4, K, 2 * K)
                       .narrow(3, 0, K)), "not contiguous"), (dict(dg=given["dh0"]), "writes only"),
                       (dict(dh0=given["dh0"], want_dh0=False), "without state gradients")]:
        with pytest.raises((ValueError, TypeError), match=match):
            chunk_bwd.chunk_bwd_hopper(q, k, v, do, gc, beta, torch.zeros(B, T, 4, 64, dtype=bf),
                                       torch.zeros(B, NT, 4, K, K, dtype=bf), None, K ** -0.5, BV, **bad)


@COMPILES
def test_reverse_walk_without_state_gradients(monkeypatch):
    """Neither an initial state nor dht (``want_dh0=False``): the build without state gradients reads no dht and
    writes no dh0 (its dS starts at zero), its dht and dh0 are one-element placeholders, and the launch matches its
    parameters; with dht given, or dh0 wanted, the launch is the default build's. (On an H100 the two builds give
    the same dq, dk, dv, dg, dβ bit for bit, at row 2 and at B = 1, T = 8192, H = 2, HV = 8.)"""
    H, K, BV = 2, 128, 64
    default = chunk_bwd.compiled_kernel(H, 4, K, K, K ** -0.5, BV, "sm_90a")
    lean = chunk_bwd.compiled_kernel(H, 4, K, K, K ** -0.5, BV, "sm_90a", state_grads=False)
    params = {name: param for name, param in zip(("dht", "dh0"), (lean.params[8], lean.params[14]))}
    assert all([str(n) for n in p.shape] == ["1"] for p in params.values()), params
    source, default_source = lean.get_kernel_source(), default.get_kernel_source()
    for name in ("dht", "dh0"):     # the lean kernel's source does not name them at all
        assert re.search(rf"\b{name}\b", default_source) and not re.search(rf"\b{name}\b", source), name
    built = []
    monkeypatch.setattr(chunk_bwd, "compiled_kernel", lambda *args, **kw: built.append(kw) or
                        (lean if kw.get("state_grads") is False else default))
    launched = []
    monkeypatch.setattr(chunk_bwd, "launcher", lambda kernel: lambda *args: launched.append((kernel, args)))
    B, T, NT = 2, 100, 2
    bf = torch.bfloat16
    q, k = (torch.zeros(B, T, H, K, dtype=bf) for _ in range(2))
    v, do = (torch.zeros(B, T, 4, K, dtype=bf) for _ in range(2))
    gc, beta = (torch.zeros(B, 4, NT * 64) for _ in range(2))
    inputs = (q, k, v, do, gc, beta, torch.zeros(B, T, 4, 64, dtype=bf), torch.zeros(B, NT, 4, K, K, dtype=bf))
    out = chunk_bwd.chunk_bwd_hopper(*inputs, None, K ** -0.5, BV, want_dh0=False)
    kernel, args = launched[-1]
    assert kernel is lean and out[5] is None and args[8].numel() == args[14].numel() == 1
    assert_launch_matches_params(list(args), lean.params)
    for dht, want in ((torch.zeros(B, 4, K, K), False), (None, True)):
        out = chunk_bwd.chunk_bwd_hopper(*inputs, dht, K ** -0.5, BV, want_dh0=want)
        assert launched[-1][0] is default and out[5].shape == (B, 4, K, K)


@COMPILES
@pytest.mark.parametrize("K,BV", [(128, 64), (64, 64)])
def test_reverse_warm_ups_compile_for_sm90a(tmp_path, K, BV):
    """The reverse warm-ups (``chunk_bwd.build_warm_kernel``) for sm_90a: the chain's 8 dots alone (P, C1 hi + lo,
    Pᵀ dO, C2, C3's three) on bf16 wgmma, no h or v loaded, no gradient but dS_out stored; its shared memory within
    the walk's 218 368 B at K = 128, BV = 64 (the walk's tiles, those the chain reads), no spill, no serialised
    wgmma."""
    from linattn.ops.hopper.cubin import compile_sm90a, launch_shared_bytes, ptxas_summary
    kernel = chunk_bwd.compiled_warm_kernel(2, 4, K, K, K ** -0.5, BV, "sm_90a")
    source = kernel.get_kernel_source()
    assert source.count("tl::wgmma_ss<tl::DataType::kBFloat16") == 8 and "mma_sync" not in source
    loads = set(re.findall(r"tma_load\((\w+)_desc", source))
    assert loads == {"a_inv", "do", "q", "k", "gc", "beta"} and "tl::CumSum" not in source, loads
    assert launch_shared_bytes(kernel) <= 218368, launch_shared_bytes(kernel)
    report = compile_sm90a(source, tmp_path)[1]
    ptxas = ptxas_summary(report)
    assert ptxas["spill_stores"] == ptxas["spill_loads"] == 0 and not ptxas["wgmma_serialised"], report


@COMPILES
@pytest.mark.parametrize("K,BV", [(128, 128), (128, 64), (64, 64)])
def test_recompute_states_walk_compiles_for_sm90a(tmp_path, K, BV):
    """The recompute's states walk (the forward walk's ``store_states`` build, ``walk_launch.states_kernel``) for
    sm_90a: the state's three dots alone (K S, T X, Kᵀ V_d) on bf16 wgmma and q never loaded; β loaded by TMA; h
    stored by TMA from the state's bf16 tile, that store waited for before the tile is written again and before the
    program ends; shared memory within a CTA, no spill, no serialised wgmma."""
    from linattn.ops.hopper.cubin import compile_sm90a, launch_shared_bytes, ptxas_summary
    kernel = walk_launch.states_kernel(2, 4, K, K, BV, 256, 2, True, torch.float32, "sm_90a")
    src = kernel.get_kernel_source()
    assert src.count("tl::wgmma_ss<tl::DataType::kBFloat16") == 3 and "mma_sync" not in src
    assert "q_desc" not in src and "tma_load(beta_desc" in src and "tma_store(o_desc, (&(((bfloat16_t*)Ss)" in src
    loop = src[re.search(r"for \(int cr?_1 = 0;", src).start():]    # the consumers' loop (its name TVM's choice)
    assert loop.index("tma_store_wait") < loop.index("ptx_stmatrix_m8n8_x4((&(((bfloat16_t*)Ss)")
    assert src.count("tl::tma_store_wait") == 2
    assert launch_shared_bytes(kernel) <= CTA_SHARED, launch_shared_bytes(kernel)
    report = compile_sm90a(src, tmp_path)[1]
    ptxas = ptxas_summary(report)
    assert ptxas["spill_stores"] == ptxas["spill_loads"] == 0 and not ptxas["wgmma_serialised"], report


@COMPILES
def test_recompute_prepass_compiles_for_sm90a(tmp_path):
    """The recompute's pre-pass (``beta_in_a_inv=False``: T without diag(β)) for sm_90a: no β read for T's columns,
    the forward pre-pass's launch bounds, no spill."""
    from linattn.ops.hopper.cubin import compile_sm90a, ptxas_summary
    src = prepass.compiled_kernel(2, 4, 128, "bfloat16", "sm_90a", beta_in_a_inv=False).get_kernel_source()
    assert "Bl[" not in src and "Bh[" not in src and "__launch_bounds__(128, 7)" in src
    with_beta = prepass.compiled_kernel(2, 4, 128, "bfloat16", "sm_90a").get_kernel_source()
    assert "Bl[" in with_beta
    ptxas = ptxas_summary(compile_sm90a(src, tmp_path)[1])
    assert ptxas["spill_stores"] == ptxas["spill_loads"] == 0, ptxas


@COMPILES
def test_gpu_script_smoke_builds_every_kernel():
    """benchmarks/gpu_check_hopper_bwd.py --smoke (as CI runs it): every kernel the GPU script launches — the reverse
    walks of the accuracy cases and timing rows (the segmented cases and rows reuse them), the reverse warm-ups of
    the segmented cases and rows, the states walks (unsegmented, and the segments' phases A and C where the plan cuts a
    row), the pre-passes without β on T, the walks' timeline builds of part (g) — compiles for sm_90a without a spill
    (the timeline builds within TIMELINE_SPILL_BYTES; kernels the compile tests built are cached by TileLang)."""
    done = subprocess.run([sys.executable, "benchmarks/gpu_check_hopper_bwd.py", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [ast.literal_eval(line) for line in done.stdout.splitlines() if line.startswith("{'config'")]
    assert len(rows) == 34 and sum(r["config"][0] == "warm" for r in rows) == 5, rows
    assert sum(r["config"][0] == "timeline" for r in rows) == 3, rows
    assert sum(r["config"][0] in ("states_warm", "states_maps") for r in rows) == 6, rows
    spill_bound = lambda r: TIMELINE_SPILL_BYTES if r["config"][0] == "timeline" else 0
    assert all(r["spill_stores"] <= spill_bound(r) and r["shared_bytes"] <= CTA_SHARED for r in rows), rows


def _twin_walk(q, k, v, do, gc, beta, a_inv, h, dht, scale, BV, want_dh0=True, **out):
    """chunk_bwd.chunk_bwd_hopper's contract computed by the twin (no rounding): the host chain's stand-in walk,
    writing ``out``'s tensors where given; dh0 None without state gradients (``want_dh0`` False, dht None)."""
    T = q.shape[1]
    pad = (0, gc.shape[-1] - T)
    saved = bwd.SavedForward(torch.nn.functional.pad(gc[..., :T], pad, mode="replicate"), beta, a_inv.float(),
                             h.transpose(1, 2).float(), 1)
    p = bwd.chunk_bwd_v_slices_ref(q, k, v, do, dht, saved, scale, BV, None, "exact")
    dq_dtype, dk_dtype = chunk_bwd.qk_heads_dtypes(v.shape[2] // q.shape[2])     # the walk's (G = 1: the gradients)
    made = dict(dq=p.dq.to(dq_dtype), dk=p.dk.to(dk_dtype), dv=p.dv, dh0=p.dh0)
    for name, x in out.items():
        x.copy_(made[name])
        made[name] = x
    dh0 = made["dh0"] if want_dh0 or dht is not None else None
    return made["dq"], made["dk"], made["dv"], head_major(p.dg), head_major(p.dbeta), dh0


def _twin_warm_ups(q, k, do, gc, beta, a_inv, bound, dht, scale, segments, BV, map_flags=None):
    """chunk_bwd.reverse_warm_ups_hopper's contract computed by its twin (no rounding): the host chain's stand-in,
    capped at one segment with ``map_flags`` (written there)."""
    capped = map_flags is not None
    if capped:
        map_flags.copy_(bwd.reverse_warm_map_flags_ref(bound, segments))
    return bwd.reverse_warm_ups_hopper_ref(q, k, do, gc, beta, a_inv.float(), bound, dht, scale, segments, None,
                                           capped)


def use_host_chain_twins(monkeypatch) -> list:
    """The recompute's kernels, the walk, the reverse warm-ups and the reverse maps' affine walk replaced by their
    twins, the dtype and device checks lifted: the host chain alone runs (the reverse maps' scan in the
    interpreter). Returns the list each warm-ups launch appends its segment count to."""
    use_recompute_twins(monkeypatch)
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_hopper", _twin_walk)
    monkeypatch.setattr(walk_launch, "chunk_fwd_hopper_hm", fwd_twins.chunk_fwd_hopper_hm_ref)
    launches = []
    monkeypatch.setattr(chunk_bwd, "reverse_warm_ups_hopper",
                        lambda *a, **kw: launches.append(a[-2]) or _twin_warm_ups(*a, **kw))
    monkeypatch.setattr(backward, "check_inputs", lambda *args: None)
    return launches


@pytest.mark.interpreter
def test_host_chain_around_the_twin_walk_gives_the_reference_gradients(monkeypatch):
    """The host chain (the recompute, layouts, partial sums, the gate floor's mask, output dtypes) with the walk and
    the recompute's kernels replaced by their twins, fp32 (the partial sums' Triton pass under the interpreter; the
    dtype and device checks lifted): the float64 reference's gradients up to the bf16 T the pre-pass stores (GVA,
    T = 100, V halves). An O(1) layout error fails."""
    from .test_hopper_bwd_ref import reference_grads
    use_host_chain_twins(monkeypatch)
    x = {n: t.to(DEVICE) for n, t in make_inputs(1, 100, 1, 2, 32, seed=2).items()}
    ref = reference_grads(x, 0.3, use_dht=True)
    low = {n: t.float() for n, t in x.items()}
    got = backward.chunk_gated_delta_rule_bwd_hopper(low["q"], low["k"], low["v"], low["g"], low["beta"], 0.3,
                                                     low["h0"], low["do"], low["dht"], BV=16)
    assert all(t.dtype == torch.float32 for t in got)
    errors = {n: rel_l2(a, b) for n, a, b in zip(GRADS, got, ref)}
    assert max(errors.values()) < 2e-2, errors


# K = V, then (BV given or None, the walks it runs: "roles" or the slice walk's BV)
ROLE_SPLIT_CHOICES = {128: ((128, ["roles"]), (64, [64]), (None, ["roles"])),
                      64: ((64, ["roles"]), (32, [32]), (None, ["roles"]))}


@pytest.mark.interpreter
@pytest.mark.parametrize("K", [128, 64], ids=["K128", "K64"])
def test_host_chain_takes_the_role_split_walk_where_it_is_built(monkeypatch, K):
    """At K = V in ``chunk_bwd_roles.SIZES`` with BV = V the host chain runs the role-split walk (its twin: the
    slice walk's contract with one slice of the whole V) and never the slice walk, and gives the float64 reference's
    gradients (GVA, T = 100, with h0 and dht); a narrower BV given asks for the slice walk instead. BV None: the
    role-split walk (at K = 128 the model prices its step lower, at K = 64 the slice walk's width is V), with the
    same gradients."""
    from linattn.ops.hopper import chunk_bwd, chunk_bwd_roles

    from .test_hopper_bwd_ref import reference_grads
    use_host_chain_twins(monkeypatch)
    walked = []
    slices = chunk_bwd.chunk_bwd_hopper
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_hopper", lambda *a, **o: walked.append(a[10]) or slices(*a, **o))
    monkeypatch.setattr(chunk_bwd_roles, "chunk_bwd_roles_hopper",
                        lambda *a, **o: walked.append("roles") or _twin_walk(*a, a[2].shape[3], **o))
    x = {n: t.to(DEVICE) for n, t in make_inputs(1, 100, 1, 2, K, seed=3).items()}
    ref = reference_grads(x, 0.3, use_dht=True)
    low = {n: t.float() for n, t in x.items()}
    for BV, expected in ROLE_SPLIT_CHOICES[K]:
        walked.clear()
        got = backward.chunk_gated_delta_rule_bwd_hopper(low["q"], low["k"], low["v"], low["g"], low["beta"], 0.3,
                                                         low["h0"], low["do"], low["dht"], BV=BV)
        assert walked == expected
        errors = {n: rel_l2(a, b) for n, a, b in zip(GRADS, got, ref)}
        assert max(errors.values()) < 2e-2, errors


def test_the_walk_is_the_one_the_segment_model_prices_lower():
    """``backward.choose_walk``: BV None at K = V = 128 takes the role-split walk (BV = V) where the slice walk needs
    a second wave (B = 8, T = 4096, HV = 16: 256 slice programs on 132 SMs), where shorter segments fill the SMs with
    it (B = 1, T = 32768, HV = 8), and where the slice walk's programs fit one wave unsegmented (B = 1, T = 256,
    HV = 2: its step is the shorter); each pick costs no more than the other by ``segments.walk_cost_us``. A BV
    given is the walk asked for. At K = V = 64 the slice walk's width is V: BV None is the role-split walk; K ≠ V
    never is."""
    def cost(B, T, HV, G, BV, step_us):
        plan = segments.plan_walk(None, B, T, HV, 128, BV, G, 132, step_us)
        return segments.walk_cost_us(B, T // 64, HV, 128, BV, plan.L or T // 64, 132, plan.parts, step_us)

    for (B, T, H, HV), width in (((8, 4096, 16, 16), 128), ((1, 32768, 2, 8), 128), ((1, 256, 2, 2), 128)):
        chosen, _ = backward.choose_walk(B, T, H, HV, 128, 128, None, None, 132)
        assert chosen == width, (B, T, HV)
        costs = {BV: cost(B, T, HV, HV // H, BV, step_us)
                 for BV, step_us in ((128, segments.ROLES_CHUNK_US), (64, segments.WALK_CHUNK_US))}
        assert costs[chosen] == min(costs.values()), costs
    assert backward.choose_walk(8, 4096, 16, 16, 128, 128, 64, None, 132)[0] == 64
    assert backward.choose_walk(1, 256, 2, 2, 128, 128, 128, None, 132)[0] == 128
    assert backward.choose_walk(8, 4096, 16, 16, 64, 64, None, None, 132)[0] == 64
    assert backward.takes_roles(64, 64, 64) and backward.takes_roles(128, 128, 128)
    assert not any(backward.takes_roles(K, V, BV) for K, V, BV in ((64, 128, 128), (128, 64, 64), (64, 64, 32),
                                                                 (128, 128, 64)))


@ON_HOPPER
@pytest.mark.parametrize("B,T,H,HV,K,BV,segment_chunks", [
    (2, 300, 2, 2, 128, 128, None), (2, 300, 2, 2, 128, 64, None), (1, 4096, 2, 8, 128, 128, 16),
    (1, 4096, 2, 2, 128, 64, 16), (2, 300, 2, 4, 64, 64, None), (1, 4096, 2, 8, 64, 64, 16)],
    ids=["roles", "slices", "roles_segments_gva", "slices_segments", "roles_k64_gva", "roles_k64_segments_gva"])
def test_backward_repeats_bit_for_bit_on_the_gpu(B, T, H, HV, K, BV, segment_chunks):
    """Determinism on the GPU: the Hopper backward twice on the same inputs (initial state and dht given) gives every
    gradient bit for bit, on both walks (BV = V: the role-split walk, at K = V = 128 and 64; 64 at K = 128: the
    slice walk), unsegmented with a partial last chunk and in segments (their warm-ups; grouped value heads summed on
    the host)."""
    x = make_inputs(B, T, H, HV, K, seed=3)
    low = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v", "do") else t.float()).cuda() for n, t in x.items()}
    run = lambda: backward.chunk_gated_delta_rule_bwd_hopper(
        low["q"], low["k"], low["v"], low["g"], low["beta"], K ** -0.5, low["h0"], low["do"], low["dht"], BV=BV,
        segment_chunks=segment_chunks)
    first, second = run(), run()
    for name, a, b in zip(GRADS, first, second):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


@pytest.mark.interpreter
@pytest.mark.parametrize("edge", [((37, 1, float("-inf")),), ((20, 0, -3e38), (21, 0, -3e38))],
                         ids=["minus_inf", "overflowing_pair"])
def test_host_chain_takes_gates_at_the_end_of_their_range(monkeypatch, edge):
    """Issue 46 item 1 on the Hopper backward's host chain (the twins for its kernels, fp32): a −inf gate, or two
    at −3e38 whose chunk sum overflows, give finite gradients at the float64 reference's (its autograd through
    e^−inf = 0), dg = 0 at those gates (below the floor)."""
    from .test_hopper_bwd_ref import reference_grads
    use_host_chain_twins(monkeypatch)
    x = {n: t.to(DEVICE) for n, t in make_inputs(1, 100, 1, 2, 32, seed=2).items()}
    for t, hv, value in edge:
        x["g"][0, t, hv] = value
    ref = reference_grads(x, 0.3, use_dht=True)
    low = {n: t.float() for n, t in x.items()}
    got = backward.chunk_gated_delta_rule_bwd_hopper(low["q"], low["k"], low["v"], low["g"], low["beta"], 0.3,
                                                     low["h0"], low["do"], low["dht"], BV=16)
    assert all(torch.isfinite(t).all() for t in got)
    for t, hv, _ in edge:
        assert got[3][0, t, hv] == 0
    finite = [torch.isfinite(r) for r in ref]
    for t, hv, _ in edge:
        finite[3][0, t, hv] = False
    errors = {n: rel_l2(a[m], b[m]) for n, a, b, m in zip(GRADS, got, ref, finite)}
    assert max(errors.values()) < 2e-2, errors


@pytest.mark.interpreter
@pytest.mark.parametrize("decay,num_segments,maps", [("anchor", 2, False), ("anchor", 4, False), ("fast", 4, False),
                                                     ("slow", 4, False), ("anchor", 4, True), ("slow", 4, True)])
def test_segmented_host_chain_equals_the_unsegmented_one(monkeypatch, decay, num_segments, maps):
    """hopper/segments.py: the walk (its twin) on segment views from the dS_out of the reverse warm-ups (their
    twin, the pre-pass twin's chunk bounds) — uncapped, or (``maps``: ``segments.MAPS_MIN_CHAIN`` 0) capped with the
    reverse maps and their scan —, fp32 under the interpreter (two sequences of 4 chunks, GVA, initial
    state and dht; the recompute's twins), against the unsegmented chain: the same gradients up to fp32 rounding,
    and the float64 reference's up to the bf16 T. Slow decay (the anchors' gates / 1024): every warm-up reaches
    the end (exact); fast decay (g ≈ −0.4 per token): the warm-ups stop after one chunk (truncated, error ≤ 2⁻³⁰
    of ‖dS‖). A wrong w, a warm-up from the wrong chunk, a segment out of place, a wrong dS_out or a dh0 from the
    wrong segment is O(1)."""
    from linattn.ops.hopper.map_bound import chunk_bounds_ref

    from .test_hopper_bwd_ref import reference_grads
    launches = use_host_chain_twins(monkeypatch)
    scans, scan = [], reverse_maps.reverse_map_scan
    monkeypatch.setattr(segments, "MAPS_MIN_CHAIN", 0 if maps else segments.MAPS_MIN_CHAIN)
    monkeypatch.setattr(reverse_maps, "reverse_map_scan", lambda *a: scans.append(a[-1]) or scan(*a))
    x = {n: t.to(DEVICE) for n, t in make_inputs(2, 256, 1, 2, 32, "slow" if decay == "slow" else "anchor",
                                                   seed=3).items()}
    if decay == "fast":
        x["g"] = -0.4 - 0.05 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(8),
                                          dtype=torch.float64).to(DEVICE)
    warm = bwd.reverse_warm_ups_ref(chunk_bounds_ref(x["k"], x["g"], x["beta"]), bwd.segment_cuts(4, num_segments))
    L = 4 // num_segments
    if decay == "fast":
        assert warm[:-1].max() == 1
    elif decay == "slow":
        assert all(int(w.min()) == 4 - L * (s + 1) for s, w in enumerate(warm))
    low = {n: t.float() for n, t in x.items()}
    args = [low[n] for n in ("q", "k", "v", "g", "beta")] + [0.3, low["h0"], low["do"], low["dht"]]
    whole = backward.chunk_gated_delta_rule_bwd_hopper(*args, BV=16)
    split = backward.chunk_gated_delta_rule_bwd_hopper(*args, BV=16, segment_chunks=L)
    assert launches == [num_segments] and scans == ([num_segments] if maps else [])
    assert all(t.dtype == torch.float32 for t in split) and split[5].is_contiguous()
    assert split[5].shape == x["h0"].shape
    errors = {n: rel_l2(a, b) for n, a, b in zip(GRADS, split, whole)}
    assert max(errors.values()) < 2e-6, errors
    ref = reference_grads(x, 0.3, use_dht=True)
    assert max(rel_l2(a, b) for a, b in zip(split, ref)) < 2e-2


@pytest.mark.interpreter
def test_segments_without_dht_start_from_zero(monkeypatch):
    """No dht: the last segment walks from zeros, as the unsegmented walk does (one sequence, 2 segments)."""
    use_host_chain_twins(monkeypatch)
    x = {n: t.to(DEVICE) for n, t in make_inputs(1, 128, 1, 1, 32, seed=4).items()}
    x["dht"] = None
    low = {n: t.float() for n, t in x.items() if t is not None}
    args = [low[n] for n in ("q", "k", "v", "g", "beta")] + [0.3, low["h0"], low["do"], None]
    whole = backward.chunk_gated_delta_rule_bwd_hopper(*args, BV=16)
    split = backward.chunk_gated_delta_rule_bwd_hopper(*args, BV=16, segment_chunks=1)
    errors = {n: rel_l2(a, b) for n, a, b in zip(GRADS, split, whole)}
    assert max(errors.values()) < 1e-5, errors


def test_reverse_maps_where_the_uncapped_chain_is_long():
    """segments.takes_maps: the reverse maps from 3 segments where the first segment's uncapped warm-up would walk
    more than MAPS_MIN_CHAIN chunks; uncapped warm-ups at 2 segments (the cap is the end) and at T = 4096 in 8
    segments (56 chunks: hidden under the host time of the maps' launches)."""
    assert segments.MAPS_MIN_CHAIN == 64
    assert not segments.takes_maps(2, 512) and not segments.takes_maps(8, 8) and not segments.takes_maps(3, 32)
    assert segments.takes_maps(3, 33) and segments.takes_maps(32, 8) and segments.takes_maps(8, 64)
    assert segments.takes_maps(4, 32) and segments.takes_maps(32, 16)      # rows 5 and 7


def test_segment_length_forced():
    """segment_chunks: bad values raise, ≥ T/64 walks unsegmented, else the forced L."""
    length = lambda chunks, T=256: segments.segment_length(chunks, T)
    for bad, match in [(0, ">= 1"), (1.5, ">= 1"), (True, ">= 1"), (3, "multiple")]:
        with pytest.raises(ValueError, match=match):
            length(bad)
    with pytest.raises(ValueError, match="multiple"):
        length(2, T=250)
    assert length(2) == 2 and length(4) is None and length(9, T=250) is None


def test_walk_planner_picks_the_measured_segments():
    """The planner (walk and warm-up waves, 132 SMs, K = V = 128, BV = 64) at the configurations the GPU measured:
    row 3 (B=1 T=32768 HV=16) L = 128 (4 × 32 programs), row 4 (T=131072) L = 512, row 7's HV=8 in one launch L = 64
    (8 × 16 programs), row 2 (B=8 T=4096 HV=16, 256 programs already) unsegmented; in four launches (GVA's
    batches) the segments that keep each batch a full wave: row 7 L = 16 (32 segments, 4 × 8 × 16 programs), row 5
    (B=4 T=8192 HV=32) L = 64 (2 segments, 4 × 2 × 64); none where T is not a multiple of 64, and L always a
    divisor of T/64 of at least MIN_SEGMENT_CHUNKS chunks."""
    plan = lambda B, T, HV, parts=1: segments.plan_walk_segments(B, T, HV, 128, 64, 132, parts)
    assert plan(1, 32768, 16) == 128 and plan(1, 131072, 16) == 512 and plan(1, 32768, 8) == 64
    assert plan(1, 32768, 8, 4) == 16 and plan(4, 8192, 32, 4) == 64
    assert plan(8, 4096, 16) is None and plan(1, 32768 - 64 + 1, 16) is None and plan(1, 0, 16) is None
    for T in (4096, 32768, 131072, 64 * 509, 64 * 600):
        L = plan(1, T, 16)
        assert L is None or (T // 64) % L == 0 and L >= segments.MIN_SEGMENT_CHUNKS


def test_walk_plan_batches_gva_where_the_model_allows():
    """segments.plan_walk: one launch without GVA; with GVA four (a quarter of the fp32 per-value-head dq, dk at a
    time) where the model puts them within GVA_TIME_MARGIN of one launch — rows 5 and 7 (B=4 T=8192 HV=32 G=2:
    4960 µs against 4736; B=1 T=32768 HV=8 G=4: 1408 against 1240) — else two where those are within it (the
    role-split walk at row 7: 714 against 602, four 938), four at the role-split walk's row 5 (2406 against 1958:
    1.23×, within the margin of 1.25), and one where
    neither is (B=1 T=4096 H=2 HV=8: batches of a quarter or half wave); a forced segment length kept, its batches
    judged at that length."""
    plan = lambda B, T, H, HV, chunks=None: segments.plan_walk(chunks, B, T, HV, 128, 64, HV // H, 132)
    P = segments.WalkPlan
    assert plan(8, 4096, 16, 16) == P(None, 1) and plan(1, 32768, 16, 16) == P(128, 1)
    assert plan(4, 8192, 16, 32) == P(64, 4) and plan(1, 32768, 2, 8) == P(16, 4)
    assert plan(1, 4096, 2, 8) == P(8, 1)
    assert plan(1, 32768, 2, 8, chunks=16) == P(16, 4) and plan(1, 32768, 2, 8, chunks=64) == P(64, 1)
    assert plan(1, 32768, 2, 8, chunks=512).L is None
    roles = lambda B, T, H, HV: segments.plan_walk(None, B, T, HV, 128, 128, HV // H, 132, segments.ROLES_CHUNK_US)
    assert roles(1, 32768, 2, 8) == P(16, 2) and roles(4, 8192, 16, 32) == P(32, 4)


def test_head_major_segments_are_one_contiguous_copy():
    """segments.head_major_as_segments: row b·S + s holds sequence b's segment s of every head, contiguous at B = 1
    as at B > 1 (a strided view there would be copied again by every launch that reads it), x itself at S = 1."""
    for B in (1, 2):
        x = torch.arange(B * 3 * 8, dtype=torch.float32).view(B, 3, 8)
        y = segments.head_major_as_segments(x, 4)
        assert y.shape == (B * 4, 3, 2) and y.is_contiguous()
        for b in range(B):
            for s in range(4):
                assert torch.equal(y[b * 4 + s], x[b, :, 2 * s:2 * s + 2])
        assert segments.head_major_as_segments(x, 1) is x


def test_walk_batches_hold_a_quarter_of_the_rows_and_a_wave_at_most():
    """segments.walk_batch_rows: every row in one launch at one part (or one row); in four parts at most a quarter
    of the rows and one wave of programs, at least one row (132 SMs, V = 128, BV = 64): row 5 unsegmented (B=4,
    HV=32) one sequence per batch, its 2 segments each (8 rows) two, 32 segments of row 7 (HV=8) eight (a wave),
    HV=128 one row (256 programs a row); and the cost model counts the batches' waves: row 5 unsegmented in four
    half-card batches takes twice one launch's."""
    rows = lambda n, HV, parts: segments.walk_batch_rows(n, HV, 128, 64, 132, parts)
    assert rows(8, 16, 1) == 8 and rows(1, 32, 4) == 1
    assert rows(4, 32, 4) == 1 and rows(8, 32, 4) == 2 and rows(32, 8, 4) == 8 and rows(3, 128, 4) == 1
    assert rows(9, 32, 4) == 2      # batches of 2, 2, 2, 2, 1
    cost = lambda B, NT, HV, L, parts: segments.walk_cost_us(B, NT, HV, 128, 64, L, 132, parts)
    assert cost(4, 128, 32, 128, 4) == 2 * cost(4, 128, 32, 128, 1) == 4 * 128 * segments.WALK_CHUNK_US
    assert cost(4, 128, 32, 64, 4) == cost(4, 128, 32, 64, 1)      # 4 full-wave batches: 512 programs as one


@pytest.mark.interpreter
@pytest.mark.parametrize("segment_chunks", [None, 1])
def test_walk_in_batches_equals_one_launch(monkeypatch, segment_chunks):
    """backward.walk_rows over batches of rows (forced to one row per batch; GVA, three sequences of two chunks,
    unsegmented and in segments of one chunk: the batches then split sequences) gives one launch's gradients
    bitwise (the twins, fp32, under the interpreter), each batch a walk over its rows alone: a row out of place,
    a gradient left unwritten or written twice, or one batch's view of another (its gates' mask included) fails."""
    from linattn.ops.hopper import chunk_bwd, segments
    use_host_chain_twins(monkeypatch)
    walked = []
    twin = chunk_bwd.chunk_bwd_hopper
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_hopper", lambda *a, **o: walked.append(a[0].shape[0]) or twin(*a, **o))
    x = {n: t.to(DEVICE) for n, t in make_inputs(3, 128, 1, 2, 32, seed=5).items()}
    x["g"][2, 70, 1] = float("-inf")        # below the floor: dg there is 0 (the batch's own gates masked)
    low = {n: t.float() for n, t in x.items()}
    args = [low[n] for n in ("q", "k", "v", "g", "beta")] + [0.3, low["h0"], low["do"], low["dht"]]
    rows = 3 if segment_chunks is None else 6

    def run(per_batch):
        monkeypatch.setattr(segments, "walk_batch_rows", lambda *a: per_batch)
        walked.clear()
        return backward.chunk_gated_delta_rule_bwd_hopper(*args, BV=16, segment_chunks=segment_chunks)
    whole = run(rows)
    assert walked == [rows]
    batched = run(1)
    assert walked == [1] * rows
    for name, a, b in zip(GRADS, batched, whole):
        assert torch.equal(a, b), name


@pytest.mark.interpreter
@pytest.mark.parametrize("segment_chunks", [None, 1])
def test_no_final_state_gradient_is_zeros_and_a_given_one_is_kept(monkeypatch, segment_chunks):
    """dht None gives dht = zeros' gradients bitwise, with and without an initial state (the walk's dh0 buffer then
    starts as the zeros it reads; unsegmented without an initial state, the walk without state gradients, from a
    zero dS), unsegmented and in segments; a caller's dht is read, never written (the walk's
    dh0 is a buffer of its own, or the warm-ups' dS_out in segments). The twins, fp32, under the interpreter."""
    use_host_chain_twins(monkeypatch)
    walks = []      # per walk launch: whether it was asked for the state gradients (dht read, dh0 written)
    monkeypatch.setattr(chunk_bwd, "chunk_bwd_hopper",
                        lambda *a, **kw: walks.append(kw.get("want_dh0", True) or a[8] is not None) or
                        _twin_walk(*a, **kw))
    x = {n: t.to(DEVICE).float() for n, t in make_inputs(2, 128, 1, 2, 32, seed=7).items()}
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    run = lambda h0, dht: backward.chunk_gated_delta_rule_bwd_hopper(*args, 0.3, h0, x["do"], dht, BV=16,
                                                                     segment_chunks=segment_chunks)
    for h0 in (x["h0"], None):
        zeros = torch.zeros_like(x["dht"])
        walks.clear()
        without = run(h0, None)
        # unsegmented, neither an initial state nor dht: the walk without state gradients (no dh0 buffer)
        assert set(walks) == {h0 is not None or segment_chunks is not None}, walks
        with_zeros = run(h0, zeros)
        assert not zeros.any()
        assert (without[5] is None) == (h0 is None)
        for name, a, b in zip(GRADS, without, with_zeros):
            assert (a is None and b is None) or torch.equal(a, b), name
    dht = x["dht"].clone()
    grads = run(x["h0"], dht)
    assert torch.equal(dht, x["dht"])
    assert not torch.equal(grads[5], run(x["h0"], None)[5])     # dht is read


def _exchange_events(NV: int, steps: int, iv: int):
    """Slice ``iv``'s exchange operations in program order, as ``chunk_bwd._exchange_macros`` places them (slot =
    step mod NV = the step's owner): ("write", ring index, step), ("publish", flag index, value), ("await", flag
    index, value), ("read", ring index, (step, writer)) — the ring index and flag index as the kernel forms them."""
    for step in range(steps):
        owner = step % NV
        for which in (0, 1):                                              # sum_out at the q and k sides
            if iv == owner:
                for place in range(NV - 1):
                    yield "await", (which, owner, place), step + 1
                    yield "read", (which, owner, place), (step, (owner + place + 1) % NV)
            else:
                place = (iv - owner + NV) % NV - 1
                yield "write", (which, owner, place), step
                yield "publish", (which, owner, place), step + 1


@pytest.mark.parametrize("NV", [2, 3, 4])
def test_exchange_protocol_reads_each_tile_once_written_and_never_deadlocks(NV):
    """The slices' exchange of dq, dk tiles (chunk_bwd._exchange_macros) as a model: NV slices run their operations
    in program order, interleaved at random (1000 schedules of 7 steps), an await blocking until its flag holds the
    value. Every read finds the tile of the step and slice the sum expects (never one overwritten by a later step or
    not yet written: the ring's reuse argument), every slice finishes (no deadlock), and each step's tiles are read
    by its owner alone. A slot reused one step early, or a publish before its write, fails here."""
    import random
    rng = random.Random(NV)
    for _ in range(1000):
        programs = [list(_exchange_events(NV, 7, iv)) for iv in range(NV)]
        at, ring, flags, reads = [0] * NV, {}, {}, []
        while any(a < len(p) for a, p in zip(at, programs)):
            ready = [iv for iv in range(NV) if at[iv] < len(programs[iv]) and (
                programs[iv][at[iv]][0] != "await" or flags.get(programs[iv][at[iv]][1], 0) >= programs[iv][at[iv]][2])]
            assert ready, "deadlock"
            iv = rng.choice(ready)
            kind, index, value = programs[iv][at[iv]]
            at[iv] += 1
            if kind == "write":
                ring[index] = (value, iv)
            elif kind == "publish":
                flags[index] = value
            elif kind == "read":
                assert ring.get(index) == value, (kind, index, value, ring.get(index))
                reads.append((value[0], iv))
        assert sorted(reads) == sorted((s, s % NV) for s in range(7) for _ in range(2 * (NV - 1)))
