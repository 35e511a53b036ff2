"""gated_delta_rule_decode against the float64 reference, on both backends (the Triton kernel under the
interpreter): one step, many steps, several tokens per step with intermediate states (speculative rollback),
slots with gaps, negative slots, rejected slots, a bf16 pool, fused gating, and prefill with the chunked op
followed by decode steps equal to the chunked op over the whole sequence.

Shapes: K = 20 and V = 36 are not powers of two (the kernel's K and V tails); HV = 2·H (grouped heads).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.utils import gate_from_raw, l2norm

# relative RMS error against float64, by pool dtype (bf16: the state is rounded to 8 bits once per step)
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 1e-2}

H, HV, K, V = 1, 2, 20, 36
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]


def make_tokens(B: int, T: int, gate_in_op: bool = False, l2norm_qk: bool = False):
    t = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V))
    if not l2norm_qk:
        t["k"] = F.normalize(t["k"], dim=-1)
    if gate_in_op:
        t["g"], t["beta"] = torch.randn(B, T, HV), torch.randn(B, T, HV)
    else:
        t["g"], t["beta"] = F.logsigmoid(torch.randn(B, T, HV)), torch.rand(B, T, HV)
    return t


def reference(t: dict, h0: torch.Tensor, gate=None, l2norm_qk=False):
    """float64 o and final state; ``gate`` = (A_log, dt_bias): raw g and beta logits as the op's fused path."""
    q, k, v, g, beta = (t[n].double() for n in ("q", "k", "v", "g", "beta"))
    if l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    if gate is not None:
        g, beta = gate_from_raw(g, gate[0].double(), gate[1].double()), beta.sigmoid()
    return gated_delta_rule_reference(q, k, v, g, beta, K ** -0.5, h0.double())


def rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def slice_tokens(t: dict, lo: int, hi: int) -> dict:
    return {n: x[:, lo:hi] for n, x in t.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_step_slots_with_gaps(backend):
    P, slots = 8, [6, 1, 3]
    pool = torch.randn(P, HV, K, V)
    before = pool.clone()
    t = make_tokens(3, 1)
    t_before = {n: x.clone() for n, x in t.items()}
    idx = torch.tensor(slots, dtype=torch.int32)
    o, inter = linattn.gated_delta_rule_decode(**t, state_pool=pool, state_indices=idx, backend=backend)
    ro, rht = reference(t, before[slots])
    assert inter is None and o.shape == (3, 1, HV, V) and o.dtype == torch.float32
    assert rel_rms(o, ro) <= TOLERANCES[torch.float32]
    assert rel_rms(pool[slots], rht) <= TOLERANCES[torch.float32]
    untouched = [s for s in range(P) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched]), "rows without a sequence must not change"
    for n in t:
        assert torch.equal(t[n], t_before[n]), f"{n} was modified"


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_steps_fused_gating(backend):
    """12 one-token steps with the gate, β sigmoid and q/k L2 norm in the op = the reference over 12 tokens."""
    B, steps = 2, 12
    pool = torch.randn(5, HV, K, V) * 0.1
    slots = torch.tensor([4, 0])
    h0 = pool[[4, 0]].clone()
    gate = (torch.randn(HV) * 0.5, torch.randn(HV))
    t = make_tokens(B, steps, gate_in_op=True, l2norm_qk=True)
    outs = []
    for s in range(steps):
        o, _ = linattn.gated_delta_rule_decode(**slice_tokens(t, s, s + 1), state_pool=pool, state_indices=slots,
                                               A_log=gate[0], dt_bias=gate[1], use_qk_l2norm_in_kernel=True,
                                               use_beta_sigmoid_in_kernel=True, backend=backend)
        outs.append(o)
    ro, rht = reference(t, h0, gate=gate, l2norm_qk=True)
    assert rel_rms(torch.cat(outs, 1), ro) <= TOLERANCES[torch.float32]
    assert rel_rms(pool[[4, 0]], rht) <= TOLERANCES[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_token_intermediate_states_and_rollback(backend):
    B, Tq = 2, 4
    pool = torch.randn(3, HV, K, V)
    h0 = pool[[2, 0]].clone()
    t = make_tokens(B, Tq)
    o, inter = linattn.gated_delta_rule_decode(**t, state_pool=pool, state_indices=torch.tensor([2, 0]),
                                               output_intermediate_states=True, backend=backend)
    ro, _ = reference(t, h0)
    assert rel_rms(o, ro) <= TOLERANCES[torch.float32]
    assert inter.shape == (B, Tq, HV, K, V) and inter.dtype == pool.dtype
    for j in range(1, Tq + 1):  # the state after j tokens = the reference over the first j tokens
        _, rj = reference(slice_tokens(t, 0, j), h0)
        assert rel_rms(inter[:, j - 1], rj) <= TOLERANCES[torch.float32], f"state after {j} tokens"
    torch.testing.assert_close(pool[[2, 0]], inter[:, -1], rtol=0, atol=0)
    pool[2] = inter[0, 1]   # rollback: sequence 0 accepted 2 of its 4 tokens; the next step starts from there
    _, r2 = reference(slice_tokens(t, 0, 2), h0)
    assert rel_rms(pool[2], r2[0]) <= TOLERANCES[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_slot_starts_from_zero_and_writes_nothing(backend):
    pool = torch.randn(4, HV, K, V)
    before = pool.clone()
    t = make_tokens(3, 2)
    o, inter = linattn.gated_delta_rule_decode(**t, state_pool=pool, state_indices=torch.tensor([-1, 3, -7]),
                                               output_intermediate_states=True, backend=backend)
    h0 = torch.stack([torch.zeros(HV, K, V), before[3], torch.zeros(HV, K, V)])
    ro, rht = reference(t, h0)
    assert rel_rms(o, ro) <= TOLERANCES[torch.float32]
    assert rel_rms(inter[:, -1], rht) <= TOLERANCES[torch.float32]
    assert torch.equal(pool[:3], before[:3])
    assert rel_rms(pool[3], rht[1]) <= TOLERANCES[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_pool(backend):
    """A bf16 pool is widened to fp32 on load and rounded once on store: the error is one bf16 rounding of the
    state, not an accumulation over tokens."""
    pool32 = torch.randn(3, HV, K, V)
    pool = pool32.to(torch.bfloat16)
    h0 = pool[[1, 2]].float()
    t = make_tokens(2, 3)
    o, inter = linattn.gated_delta_rule_decode(**t, state_pool=pool, state_indices=torch.tensor([1, 2]),
                                               output_intermediate_states=True, backend=backend)
    ro, rht = reference(t, h0)
    assert pool.dtype == inter.dtype == torch.bfloat16
    assert rel_rms(o, ro) <= TOLERANCES[torch.float32]        # o is computed from the fp32 state
    assert rel_rms(pool[[1, 2]], rht) <= TOLERANCES[torch.bfloat16]
    assert rel_rms(pool[[1, 2]], rht) > 0                      # the test would see a missing store


def test_no_state_indices_uses_row_b():
    pool = torch.randn(3, HV, K, V)
    h0 = pool[:2].clone()
    t = make_tokens(2, 1)
    o, _ = linattn.gated_delta_rule_decode(**t, state_pool=pool)
    ro, rht = reference(t, h0)
    assert rel_rms(o, ro) <= TOLERANCES[torch.float32] and rel_rms(pool[:2], rht) <= TOLERANCES[torch.float32]


def in_layout(pool_kv: torch.Tensor, layout: str) -> torch.Tensor:
    """A K-major pool's data in ``layout`` (contiguous, as the op requires)."""
    return pool_kv.transpose(-1, -2).contiguous() if layout == "vk" else pool_kv.clone()


def as_kv(pool: torch.Tensor, layout: str) -> torch.Tensor:
    """A pool (or intermediate states) of ``layout`` seen K-major."""
    return pool.transpose(-1, -2) if layout == "vk" else pool


@pytest.fixture
def large_batch_tiles(monkeypatch):
    """pick_tiles as at large batch: a one-SM plan, so the test's few (sequence, head) pairs are not narrowed to
    8 columns and the kernel runs each layout's own tiles (V-major one token: 32 fp32 / 16 bf16 columns)."""
    from linattn.ops.gated_delta import recurrent_kernels as rk
    rk.pick_tiles.cache_clear()
    monkeypatch.setattr(rk, "_num_sms", lambda device: 1)
    yield rk
    monkeypatch.undo()
    rk.pick_tiles.cache_clear()


# (Tq, intermediate states, large-batch tiles): the token loop with intermediate states (1 and 3 tokens); one token
# without them, the ONE_STEP path; at the tiles of a large batch, where each layout has its own (pick_tiles'
# state_vk, run 20: V-major one token 32 fp32 / 16 bf16 columns, several tokens 8 fp32 / 16 bf16)
V_MAJOR_CASES = [(1, True, False), (3, True, False), (1, False, False), (1, False, True), (3, True, True)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Tq,inter_out,wide", V_MAJOR_CASES,
                         ids=["loop-Tq1", "loop-Tq3", "one-step", "one-step-large-batch-tiles",
                              "loop-Tq3-large-batch-tiles"])
def test_v_major_pool_equals_k_major(backend, pool_dtype, Tq, inter_out, wide, request):
    """state_layout="vk" ([P, HV, V, K]) gives the outputs, pool rows and intermediate states of the K-major call,
    each in its own layout, with slots that have gaps and a negative slot; rows without a sequence untouched. Also
    at the tiles of a large batch (V = 36: a masked tail in the last tile)."""
    if wide:
        if backend == "torch":
            pytest.skip("tiles are the Triton kernel's")
        rk = request.getfixturevalue("large_batch_tiles")
        one_step = rk.one_step_path(Tq, None, True if inter_out else None)   # as the launch decides it
        BV_vk = rk.pick_tiles(3 * HV, K, V, torch.device("cpu"), pool_dtype.itemsize, Tq > 1, one_step, True)[1]
        assert BV_vk == {(1, 4): 32, (1, 2): 16, (3, 4): 8, (3, 2): 16}[Tq, pool_dtype.itemsize], BV_vk
    pool_kv = torch.randn(6, HV, K, V).to(pool_dtype)
    slots = torch.tensor([5, -1, 2])
    t = make_tokens(3, Tq, gate_in_op=True, l2norm_qk=True)
    kw = dict(A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV), use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, output_intermediate_states=inter_out, backend=backend)
    got = {}
    for layout in ("kv", "vk"):
        pool = in_layout(pool_kv, layout)
        o, inter = linattn.gated_delta_rule_decode(**t, state_pool=pool, state_indices=slots, state_layout=layout,
                                                   **kw)
        if inter_out:
            assert inter.shape == (3, Tq) + pool.shape[1:] and inter.dtype == pool_dtype
            inter = as_kv(inter, layout)
        else:
            assert inter is None
        got[layout] = (o, as_kv(pool, layout), inter)
    h0 = torch.stack([pool_kv[5].float(), torch.zeros(HV, K, V), pool_kv[2].float()])
    ro, rht = reference(t, h0, gate=(kw["A_log"], kw["dt_bias"]), l2norm_qk=True)
    (o_kv, pool_kv_after, inter_kv), (o_vk, pool_vk_after, inter_vk) = got["kv"], got["vk"]
    assert rel_rms(o_vk, ro) <= TOLERANCES[torch.float32]
    assert rel_rms(pool_vk_after[[5, 2]], rht[[0, 2]]) <= TOLERANCES[pool_dtype]
    # the same arithmetic in the other layout: equal up to the order of the fp32 reductions
    assert rel_rms(o_vk, o_kv) <= 1e-6
    assert rel_rms(pool_vk_after, pool_kv_after) <= (1e-6 if pool_dtype == torch.float32 else 2.0 ** -8)
    if inter_out:
        assert rel_rms(inter_vk[:, -1], rht) <= TOLERANCES[pool_dtype]
        assert rel_rms(inter_vk, inter_kv) <= (1e-6 if pool_dtype == torch.float32 else 2.0 ** -8)
    assert torch.equal(pool_vk_after[[0, 1, 3, 4]], pool_kv[[0, 1, 3, 4]])


def test_v_major_pool_of_prefill_final_states():
    """A prefill's final state (K-major) enters a V-major pool as final_state.transpose(-1, -2); decoding from it
    continues the sequence exactly as from the K-major pool."""
    t = make_tokens(2, 9)
    _, ht = linattn.chunk_gated_delta_rule(**slice_tokens(t, 0, 8), output_final_state=True, backend="torch")
    pools = {"kv": ht.clone(), "vk": ht.transpose(-1, -2).contiguous()}
    outs = {layout: linattn.gated_delta_rule_decode(**slice_tokens(t, 8, 9), state_pool=pool, state_layout=layout)[0]
            for layout, pool in pools.items()}
    o_whole, _ = linattn.chunk_gated_delta_rule(**t, backend="torch")
    for layout in pools:
        assert rel_rms(outs[layout], o_whole[:, 8:]) <= TOLERANCES[torch.float32], layout
    torch.testing.assert_close(pools["vk"].transpose(-1, -2), pools["kv"])


BAD_CALLS = [
    ("repeated_slot", dict(state_indices=torch.tensor([1, 1])), ValueError, "repeat"),
    ("slot_out_of_range", dict(state_indices=torch.tensor([0, 4])), ValueError, "< P"),
    ("float_slots", dict(state_indices=torch.tensor([0.0, 1.0])), TypeError, "int32 or int64"),
    ("slots_wrong_length", dict(state_indices=torch.tensor([0, 1, 2])), ValueError, r"\[B\]"),
    ("pool_wrong_shape", dict(state_pool=torch.randn(4, HV, V, K)), ValueError, "P, HV, K, V"),
    ("pool_fp64", dict(state_pool=torch.randn(4, HV, K, V, dtype=torch.float64)), TypeError, "dtype"),
    ("pool_not_contiguous", dict(state_pool=torch.randn(4, HV, V, K).transpose(-1, -2)), ValueError, "contiguous"),
    ("pool_too_small", dict(state_pool=torch.randn(1, HV, K, V), state_indices=None), ValueError, "P >= B"),
    ("unknown_layout", dict(state_layout="kv-major"), ValueError, "state_layout must be one of"),
    ("v_major_pool_k_major_shape", dict(state_layout="vk"), ValueError, r"P, HV, V, K"),
]


@pytest.mark.parametrize("kwargs,exc,match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_slots_and_pools_are_rejected(kwargs, exc, match):
    args = dict(**make_tokens(2, 1), state_pool=torch.randn(4, HV, K, V), state_indices=torch.tensor([0, 1]))
    args.update(kwargs)
    pool_before = args["state_pool"].clone()
    with pytest.raises(exc, match=match):
        linattn.gated_delta_rule_decode(**args)
    assert torch.equal(args["state_pool"], pool_before), "a rejected call must not touch the pool"


def test_repeated_negative_slots_are_allowed():
    pool = torch.randn(2, HV, K, V)
    before = pool.clone()
    linattn.gated_delta_rule_decode(**make_tokens(3, 1), state_pool=pool, state_indices=torch.tensor([-1, -1, 0]))
    assert torch.equal(pool[1], before[1]) and not torch.equal(pool[0], before[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_then_decode_equals_whole_sequence(backend):
    """Chunked prefill of 37 tokens (varlen: two sequences) → states into pool slots → 3 one-token steps and one
    3-token step = the chunked op over all the tokens of each sequence. The chunked op (the truth here) runs on its
    torch backend; ``backend`` picks the decode path."""
    lengths, T_dec = (37, 21), 6
    full = [make_tokens(1, L + T_dec, gate_in_op=True, l2norm_qk=True) for L in lengths]
    gate = dict(A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV))
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **gate)
    chunk_backend = "torch"
    # the whole sequences, one call each
    whole = [linattn.chunk_gated_delta_rule(**t, **kw, backend=chunk_backend)[0] for t in full]
    # prefill, packed
    pre = {n: torch.cat([t[n][:, :L] for t, L in zip(full, lengths)], 1) for n in full[0]}
    cu = torch.tensor([0, lengths[0], sum(lengths)])
    o_pre, ht = linattn.chunk_gated_delta_rule(**pre, **kw, cu_seqlens=cu, output_final_state=True,
                                               backend=chunk_backend)
    pool = torch.randn(5, HV, K, V)
    slots = torch.tensor([3, 1])
    pool[slots] = ht
    dec = {n: torch.cat([t[n][:, L:] for t, L in zip(full, lengths)], 0) for n in full[0]}   # [2, T_dec, ...]
    outs = []
    for lo, hi in ((0, 1), (1, 2), (2, 3), (3, 6)):
        o, _ = linattn.gated_delta_rule_decode(**slice_tokens(dec, lo, hi), state_pool=pool, state_indices=slots,
                                               **kw, backend=backend)
        outs.append(o)
    o_dec = torch.cat(outs, 1)
    for b, L in enumerate(lengths):
        o_seq = torch.cat([o_pre[:, sum(lengths[:b]):sum(lengths[:b]) + L], o_dec[b:b + 1]], 1)
        assert rel_rms(o_seq, whole[b]) <= TOLERANCES[torch.float32], f"sequence {b}"
    _, ht_whole = linattn.chunk_gated_delta_rule(**full[0], **kw, output_final_state=True, backend=chunk_backend)
    assert rel_rms(pool[3], ht_whole[0]) <= TOLERANCES[torch.float32]


def test_torch_compile_fullgraph_mutates_pool():
    pool = torch.randn(3, HV, K, V)
    pool_eager = pool.clone()
    t = make_tokens(2, 2)
    slots = torch.tensor([2, 0])

    def step(pool, slots, **t):
        o, inter = linattn.gated_delta_rule_decode(**t, state_pool=pool, state_indices=slots,
                                                   output_intermediate_states=True)
        return o, inter

    o_eager, i_eager = step(pool_eager, slots, **t)
    o_comp, i_comp = torch.compile(step, fullgraph=True, backend="aot_eager")(pool, slots, **t)
    torch.testing.assert_close(o_comp, o_eager)
    torch.testing.assert_close(i_comp, i_eager)
    torch.testing.assert_close(pool, pool_eager)


# pick_tiles at HV = 32, K = V = 128 on the 132-SM plan: (B·HV, state bytes) → the (BK, BV, num_warps) of one
# token on the token loop, one token on the ONE_STEP path and several tokens, K-major and V-major
TILE_PLANS = [
    # B=64 and 256, fp32 pool: K-major multi-token 32 columns (run 20: 121.2 µs against 134.6 at 16), V-major
    # one-step 32 columns on one warp, V-major multi-token 8 columns
    (64 * 32, 4, (128, 32, 4), (128, 64, 2), (128, 32, 1), (128, 32, 1), (128, 8, 1)),
    (256 * 32, 4, (128, 32, 4), (128, 64, 2), (128, 32, 1), (128, 32, 1), (128, 8, 1)),
    # bf16 pool: V-major one-step 16 columns on one warp (run 20: 38.9 µs at B=64, K-major's best 47.0)
    (64 * 32, 2, (128, 64, 4), (128, 32, 1), (128, 16, 1), (128, 16, 1), (128, 16, 1)),
    (256 * 32, 2, (128, 64, 4), (128, 32, 1), (128, 16, 1), (128, 16, 1), (128, 16, 1)),
    # B=1: too few programs to fill the SMs, every tile narrowed to 8 columns
    (32, 4, (128, 8, 1), (128, 8, 1), (128, 8, 1), (128, 8, 1), (128, 8, 1)),
    (32, 2, (128, 8, 1), (128, 8, 1), (128, 8, 1), (128, 8, 1), (128, 8, 1)),
]


@pytest.mark.parametrize("nh,state_bytes,one_token,one_step,multi,one_step_vk,multi_vk", TILE_PLANS)
def test_decode_tiles_by_token_count_and_layout(nh, state_bytes, one_token, one_step, multi, one_step_vk,
                                                multi_vk):
    """pick_tiles: one token on the token loop keeps the byte-sized tiles run 11 measured fastest (either layout);
    on the ONE_STEP path K-major takes one warp per 4096 values, 64 fp32 or 32 bf16 columns (run 17: 5–12% faster at
    B=64 and 256), V-major one warp of 32 fp32 or 16 bf16 columns (run 20); several tokens per sequence take
    one-warp tiles, K-major 32 fp32 or 16 bf16 columns, V-major 8 fp32 or 16 bf16 (run 20); all narrowed where the
    pairs are few (B=1)."""
    from linattn.ops.gated_delta.recurrent_kernels import pick_tiles
    cpu = torch.device("cpu")
    for state_vk in (False, True):
        assert pick_tiles(nh, 128, 128, cpu, state_bytes, state_vk=state_vk) == one_token
    assert pick_tiles(nh, 128, 128, cpu, state_bytes, False, True) == one_step
    assert pick_tiles(nh, 128, 128, cpu, state_bytes, True) == multi
    assert pick_tiles(nh, 128, 128, cpu, state_bytes, one_step=True, state_vk=True) == one_step_vk
    assert pick_tiles(nh, 128, 128, cpu, state_bytes, multi_token=True, state_vk=True) == multi_vk


@pytest.mark.interpreter
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused-gate-norm"])
def test_one_step_path_matches_the_token_loop(pool_dtype, fused):
    """The decode step's ONE_STEP path (one token, no intermediates: the state tile kept in the pool's dtype, o
    from the entering state) against the reference and the token loop (the same token asked with intermediate
    states, which takes the loop); a negative slot included."""
    from linattn.ops.gated_delta import recurrent_kernels as rk
    assert rk.one_step_path(1, None, None) and not rk.one_step_path(1, None, torch.empty(0))
    pool0 = torch.randn(5, HV, K, V).to(pool_dtype)
    slots = torch.tensor([4, -1, 0])
    t = make_tokens(3, 1, gate_in_op=fused, l2norm_qk=fused)
    gate = dict(A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV)) if fused else {}
    flags = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True) if fused else {}
    got = {}
    for one_step in (False, True):
        pool = pool0.clone()
        o, _ = linattn.gated_delta_rule_decode(**t, state_pool=pool, state_indices=slots, backend="triton",
                                               output_intermediate_states=not one_step, **gate, **flags)
        got[one_step] = (o, pool)
    h0 = torch.stack([pool0[4].float(), torch.zeros(HV, K, V), pool0[0].float()])
    ro, rht = reference(t, h0, (gate["A_log"], gate["dt_bias"]) if fused else None, l2norm_qk=fused)
    (o1, pool1), (o0, pool0_loop) = got[True], got[False]
    assert rel_rms(o1, ro) <= TOLERANCES[torch.float32] and rel_rms(o1, o0) <= 1e-6
    assert rel_rms(pool1[[4, 0]], rht[[0, 2]]) <= TOLERANCES[pool_dtype]
    assert rel_rms(pool1, pool0_loop) <= (1e-6 if pool_dtype == torch.float32 else 2.0 ** -8)
    assert torch.equal(pool1[1:4], pool0[1:4])                     # rows of no slot (and the negative one) untouched


def test_one_step_ref_is_one_token_of_the_recurrence():
    """recurrent.one_step_ref (the torch backend's decode step and the ONE_STEP path's twin: o from the entering
    state, the state updated in place) against fused_recurrent_fwd_ref on one token, float64, grouped heads and a
    strong gate included; the inputs other than the state are not modified."""
    from linattn.ops.gated_delta.recurrent import fused_recurrent_fwd_ref, one_step_ref
    N, HV, K, V = 3, 4, 16, 24
    q = torch.randn(N, 1, HV, K, dtype=torch.float64)
    k = F.normalize(torch.randn(N, 1, HV, K, dtype=torch.float64), dim=-1)
    v = torch.randn(N, 1, HV, V, dtype=torch.float64)
    g = torch.tensor([-0.1, -20.0, 0.0], dtype=torch.float64)[:, None, None].expand(N, 1, HV).clone()
    beta = torch.rand(N, 1, HV, dtype=torch.float64)
    S0 = torch.randn(N, HV, K, V, dtype=torch.float64)
    want_o, want_S, _ = fused_recurrent_fwd_ref(q, k, v, g, beta, 0.3, S0)
    inputs = [t.clone() for t in (q, k, v, g, beta)]
    S = S0.clone()
    o = one_step_ref(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], 0.3, S)
    assert torch.allclose(o, want_o[:, 0], rtol=1e-12, atol=1e-12)
    assert torch.allclose(S, want_S, rtol=1e-12, atol=1e-12) and not torch.equal(S, S0)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q, k, v, g, beta)))


def test_one_step_path_compiles_for_h200_with_fewer_registers():
    """sm_90 (ptxas, no GPU): the ONE_STEP path of a bf16-pool decode step compiles, and at BV=32 / 4 warps takes
    fewer registers than the token loop (128 against 146 with triton 3.6: four programs per SM instead of three)."""
    from tests.ops.sm90_compile import compile_for_h200
    (one_regs, one_spill, _, _), (loop_regs, _, _, _) = compile_for_h200(
        "import sm90 as c; from linattn.ops.gated_delta.recurrent_kernels import fused_recurrent_fwd_kernel",
        "[tuple(c.compile_kernel(fused_recurrent_fwd_kernel, c.decode_consts(32, one), "
        "bf16_args=('h0', 'ht')))[:4] for one in (True, False)]")
    assert 0 < one_regs < loop_regs and one_spill == 0, (one_regs, loop_regs)
