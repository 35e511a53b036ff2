"""Test bodies run on every rank (module level, so spawn can pickle them), each checking its shard against the
single-process result computed in the same process from the same seed."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from linattn import chunk_gated_delta_rule, gated_linear_attention
from linattn.parallel import ShardPlan, context_parallel_gated_delta_rule, context_parallel_gated_linear_attention
from linattn.parallel.scan import _gdn_log_decay_bound, entering_reach

# float64: the split changes only the summation order, so the match is near machine precision;
# float32: the tolerance of the op's own float32 tests;
# "fp32-beta": float64 GDN / GLA layers, whose β is float32 by design (sigmoid(b).float()): the split rounds dβ to
# float32 once per local backward pass instead of once, ~1e-7 relative
TOLERANCES = {torch.float64: (1e-9, 1e-9), torch.float32: (2e-4, 2e-4), "fp32-beta": (1e-7, 1e-6)}


def close(what: str, got: torch.Tensor, want: torch.Tensor, dtype, rank: int) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"rank {rank}: {what}: {m}")


def gdn_inputs(B, T, H, HV, K, V, dtype, seed, raw_gate, decay_shift=3.0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    if raw_gate:        # the layer's form: raw gate logits, A_log / dt_bias, L2 norm inside the op
        g, A_log, dt_bias = r(B, T, HV), r(HV) * 0.5, r(HV) * 0.5
    else:
        k = torch.nn.functional.normalize(k, dim=-1)
        g, A_log, dt_bias = torch.nn.functional.logsigmoid(r(B, T, HV) + decay_shift), None, None
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)


def op_cases(rank: int, world: int, cases: dict) -> None:
    """Every case of a table in one set of processes (starting processes costs more than the cases)."""
    for name, case in cases.items():
        op_case(rank, world, case, name)


def op_case(rank: int, world: int, case: dict, name: str = "") -> None:
    """One context-parallel op call against the unsplit op: o, final states, every gradient."""
    dtype, kind = case["dtype"], case.get("op", "gdn")
    B, T, H, HV, K, V = case["shape"]
    cu = case.get("cu_seqlens")
    lengths = case["lengths"]
    assert sum(lengths) == T and len(lengths) == world
    x = gdn_inputs(B, T, H, HV, K, V, dtype, case.get("seed", 0), case.get("raw_gate", False),
                   case.get("decay_shift", 3.0))
    N = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(99)
    h0 = torch.randn(N, HV, K, V, generator=gen, dtype=dtype) if case.get("h0") else None
    do = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    dht = torch.randn(N, HV, K, V, generator=gen, dtype=dtype)
    names = [n for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias") if x[n] is not None]
    token_names = ["q", "k", "v", "g", "beta"]

    def leaves(d):
        return {n: d[n].detach().clone().requires_grad_(True) for n in names}

    # the unsplit result
    ref = leaves(x)
    ref_h0 = None if h0 is None else h0.clone().requires_grad_(True)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    if kind == "gdn":
        o, ht = chunk_gated_delta_rule(**{n: ref[n] for n in names}, initial_state=ref_h0, output_final_state=True,
                                       cu_seqlens=cu_t, use_qk_l2norm_in_kernel=case.get("raw_gate", False),
                                       backend="torch")
    else:
        o, ht = gated_linear_attention(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], initial_state=ref_h0,
                                       output_final_state=True, cu_seqlens=cu_t, backend="torch")
    ((o * do).sum() + (ht * dht).sum()).backward()

    # the split
    plan = ShardPlan.from_lengths(lengths, cu, rank=rank)
    a, b = plan.start, plan.end
    mine = {n: (x[n][:, a:b] if n in token_names else x[n]).detach().clone().requires_grad_(True) for n in names}
    my_h0 = None if h0 is None else h0.clone().requires_grad_(True)
    if kind == "gdn":
        tol = case.get("map_tolerance", 0.0)
        if tol and plan.continues():
            # the case must exercise the cut: the bound falls under the tolerance inside the entering span
            reach = entering_reach(plan, [mine[n] for n in token_names], (None, None),
                                   functools.partial(_gdn_log_decay_bound, use_qk_l2norm_in_kernel=False,
                                                     use_beta_sigmoid_in_kernel=False), tol)
            assert 0 < reach < plan.local_len, (name, reach)
        o_r, ht_r = context_parallel_gated_delta_rule(
            **{n: mine[n] for n in names}, plan=plan, initial_state=my_h0, output_final_state=True,
            use_qk_l2norm_in_kernel=case.get("raw_gate", False), backend="torch", map_tolerance=tol)
    else:
        o_r, ht_r = context_parallel_gated_linear_attention(
            mine["q"], mine["k"], mine["v"], mine["g"], mine["beta"], plan=plan, initial_state=my_h0,
            output_final_state=True, backend="torch")
    # the objective is the sum of the ranks' losses: the final-state term counted once, on rank 0
    loss = (o_r * do[:, a:b]).sum() + ((ht_r * dht).sum() if rank == 0 else 0)
    loss.backward()

    close(f"{name} o", o_r, o[:, a:b].detach(), dtype, rank)
    close(f"{name} final_state", ht_r, ht.detach(), dtype, rank)
    for n in names:
        got = mine[n].grad
        if n not in token_names:          # replicated: each rank holds its share
            dist.all_reduce(got)
            want = ref[n].grad
        else:
            want = ref[n].grad[:, a:b]
        close(f"{name} d{n}", got, want, dtype, rank)
    if h0 is not None:
        dist.all_reduce(my_h0.grad)
        close(f"{name} dh0", my_h0.grad, ref_h0.grad, dtype, rank)


def _layer(kind: str):
    from linattn.layers import GatedDeltaNet, GatedLinearAttention, SlidingWindowAttention
    from linattn.models import HybridConfig, HybridLM
    torch.manual_seed(0)
    if kind.startswith("model"):
        config = HybridConfig(vocab_size=32, hidden_size=32, num_layers=4, layer_pattern="GSLA", gdn_num_heads=2,
                              gdn_head_dim=8, attn_num_heads=2, attn_num_kv_heads=1, window_size=6,
                              gdn_backend="torch")
        # "model-checkpointing": blocks recomputed in the backward, collectives included
        return HybridLM(config).double().set_gradient_checkpointing(kind == "model-checkpointing")
    if kind in ("gdn", "gla"):
        cls = GatedDeltaNet if kind == "gdn" else GatedLinearAttention
        return cls(32, num_heads=2, head_dim=8, num_v_heads=4, backend="torch").double()
    return SlidingWindowAttention(32, num_heads=2, num_kv_heads=1, window_size=None if kind == "full" else 7).double()


def layer_cases(rank: int, world: int, cases: dict) -> None:
    for name, case in cases.items():
        layer_case(rank, world, case, name)


def layer_case(rank: int, world: int, case: dict, name: str) -> None:
    """A layer (or the hybrid model) on a split batch against the unsplit one: outputs (the loss), the input's
    gradient and every parameter's gradient (summed over ranks)."""
    kind, (B, T), lengths, cu = case["kind"], case["shape"], case["lengths"], case.get("cu_seqlens")
    dtype = torch.float64 if kind in ("swa", "full") else "fp32-beta"
    gen = torch.Generator().manual_seed(1)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    plan = ShardPlan.from_lengths(lengths, cu, rank=rank)
    a, b = plan.start, plan.end
    ref, split = _layer(kind), _layer(kind)
    if kind.startswith("model"):
        ids = torch.randint(0, 32, (B, T), generator=gen)
        labels = torch.randint(0, 32, (B, T), generator=gen)
        labels[:, ::5] = -100
        want = ref(ids, cu_seqlens=cu_t, labels=labels).loss
        want.backward()
        got = split(ids[:, a:b], labels=labels[:, a:b], cp=plan).loss
        got.backward()
        total = got.detach().clone()
        dist.all_reduce(total)
        close(f"{name} loss", total, want.detach(), dtype, rank)
    else:
        x = torch.randn(B, T, 32, generator=gen, dtype=torch.float64)
        dy = torch.randn(B, T, 32, generator=gen, dtype=torch.float64)
        x_ref, x_mine = x.clone().requires_grad_(True), x[:, a:b].clone().requires_grad_(True)
        y = ref(x_ref, cu_seqlens=cu_t)[0]
        (y * dy).sum().backward()
        y_mine = split(x_mine, cp=plan)[0]
        (y_mine * dy[:, a:b]).sum().backward()
        close(f"{name} y", y_mine, y[:, a:b].detach(), dtype, rank)
        close(f"{name} dx", x_mine.grad, x_ref.grad[:, a:b], dtype, rank)
    for (pname, p_ref), p_mine in zip(ref.named_parameters(), split.parameters()):
        g = p_mine.grad if p_mine.grad is not None else torch.zeros_like(p_mine)
        dist.all_reduce(g)
        close(f"{name} d{pname}", g, p_ref.grad, dtype, rank)
