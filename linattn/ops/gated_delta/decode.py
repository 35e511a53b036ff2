"""``gated_delta_rule_decode``: one serving step of Gated DeltaNet over a pool of recurrent states.

A serving engine keeps one ``[HV, K, V]`` state per live sequence in a pool ``[P, HV, K, V]`` and addresses it
by slot (continuous batching: sequences come and go, slots are reused). Each step feeds 1 token per sequence
(or a few: speculative verification) and must read and write each state exactly once; that traffic is the whole
cost, so the step is one kernel launch that reads the state, walks the tokens in registers and writes the state
back **in place**. This is the one linattn op that mutates an input: the pool.

State layout (``state_layout``): ``"kv"`` (the default), K-major ``[P, HV, K, V]`` (row k of a head's state holds
V contiguous values), the layout of ``chunk_gated_delta_rule``'s ``initial_state`` / ``final_state`` and of fla's
``fused_recurrent_gated_delta_rule``: a prefill's final state goes into the pool with a plain copy, and a pool row
is a valid ``initial_state``. Or ``"vk"``, V-major ``[P, HV, V, K]`` (row j holds the K values of column j: the
"K-last" layout of FlashInfer's bf16-state decode): a prefill's final state goes in as
``final_state.transpose(-1, -2)``, and intermediate states come back in the pool's layout. Why both: the kernel
tiles V, so a K-major tile reads rows of BV values (64 bytes for the bf16 pool's 32-column tile, half a 128-byte
line), while a V-major tile reads whole rows of K values (256 bytes at K = 128 in bf16) whatever the tile: a bf16
pool is fastest V-major (use ``"vk"`` for bf16 pools), an fp32 pool K-major; docs/decode.md has the table.

Slots: ``state_indices[b]`` is the pool row of sequence b. A negative slot means "no state": the sequence starts
from a zero state and nothing is written back (its outputs, and intermediate states if asked, are still
produced): padding rows of a CUDA graph batch use it. Two sequences sharing a slot would race on one state, so
duplicate non-negative slots are a ValueError (checked on the host; see ``check_indices``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.graph import increment_version

from ..utils import check_gated_delta_inputs, eager_call, select_backend
from .recurrent import fused_recurrent_fwd_ref, load_recurrent_kernels, one_step_ref, prepare_ref

POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_LAYOUTS = ("kv", "vk")  # K-major [P, HV, K, V], V-major [P, HV, V, K]


def _check_pool(state_pool, state_indices, B: int, HV: int, K: int, V: int, device, check_values: bool,
                state_vk: bool = False) -> None:
    if not isinstance(state_pool, torch.Tensor):
        raise TypeError(f"state_pool must be a torch.Tensor, got {type(state_pool).__name__}")
    if state_pool.dtype not in POOL_DTYPES:
        raise TypeError(f"state_pool must have dtype in {[str(d) for d in POOL_DTYPES]}, got {state_pool.dtype}")
    dims = (HV, V, K) if state_vk else (HV, K, V)
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != dims:
        names = "HV, V, K" if state_vk else "HV, K, V"
        raise ValueError(f"state_pool must be [P, {names}] (state_layout={'vk' if state_vk else 'kv'!r}) with "
                         f"({names}) = {dims}, got {tuple(state_pool.shape)}")
    if state_pool.device != device:
        raise ValueError(f"state_pool is on {state_pool.device} but q is on {device}")
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous: it is updated in place, and a strided pool would be "
                         "updated through a copy that the caller never sees")
    P = state_pool.shape[0]
    if state_indices is None:
        if P < B:
            raise ValueError(f"without state_indices sequence b uses pool row b, so the pool needs P >= B = {B} "
                             f"rows, got P = {P}")
        return
    if not isinstance(state_indices, torch.Tensor):
        raise TypeError(f"state_indices must be a torch.Tensor, got {type(state_indices).__name__}")
    if state_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"state_indices must be int32 or int64, got {state_indices.dtype}")
    if tuple(state_indices.shape) != (B,):
        raise ValueError(f"state_indices must be [B] = [{B}], got {tuple(state_indices.shape)}")
    if state_indices.device != device:
        raise ValueError(f"state_indices is on {state_indices.device} but q is on {device}")
    if not check_values:
        return
    slots = state_indices.tolist()
    bad = [s for s in slots if s >= P]
    if bad:
        raise ValueError(f"state_indices must be < P = {P} (the pool's rows), got {bad}")
    live = [s for s in slots if s >= 0]
    if len(set(live)) != len(live):
        dups = sorted({s for s in live if live.count(s) > 1})
        raise ValueError(f"state_indices must not repeat a slot (two sequences would update one state): {dups}")


def _skip_value_checks() -> bool:
    """Reading the slots syncs with the device: impossible while a CUDA graph is captured, a graph break under
    torch.compile. There the caller vouches for them."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _decode_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
               state_pool: torch.Tensor, state_indices: Optional[torch.Tensor], A_log: Optional[torch.Tensor],
               dt_bias: Optional[torch.Tensor], use_qk_l2norm: bool, use_beta_sigmoid: bool,
               output_intermediate_states: bool, backend: str, state_vk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns o and the intermediate states (an empty tensor when not asked: custom ops cannot return None)."""
    B, T = q.shape[:2]
    if backend == "triton":
        hs = state_pool.new_empty(B, T, *state_pool.shape[1:]) if output_intermediate_states else None
        o = load_recurrent_kernels().fused_recurrent_fwd(
            q, k, v, g, beta, scale, state_pool, state_pool, hs, None, state_indices, A_log, dt_bias,
            use_qk_l2norm, use_beta_sigmoid, state_vk=state_vk)
        return o, (hs if hs is not None else state_pool.new_empty(0))
    return decode_ref(q, k, v, g, beta, scale, state_pool, state_indices, A_log, dt_bias, use_qk_l2norm,
                      use_beta_sigmoid, output_intermediate_states, state_vk)


_decode_op = torch.library.custom_op("linattn::gated_delta_rule_decode", _decode_impl, mutates_args=("state_pool",))


@_decode_op.register_fake
def _(q, k, v, g, beta, scale, state_pool, state_indices, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid,
      output_intermediate_states, backend, state_vk):
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    hs = state_pool.new_empty(B, T, *state_pool.shape[1:]) if output_intermediate_states else state_pool.new_empty(0)
    return v.new_empty(B, T, HV, V), hs


def decode_ref(q, k, v, g, beta, scale, state_pool, state_indices, A_log, dt_bias, use_qk_l2norm,
               use_beta_sigmoid, output_intermediate_states, state_vk=False):
    """The torch backend and the twin of the decode launch: gather the slots' states (zero for negative slots),
    run :func:`one_step_ref` (one token, no intermediate states: the state updated in place) or
    :func:`fused_recurrent_fwd_ref` in fp32, scatter the final states back in the pool's dtype. A V-major pool
    (``state_vk``) is worked on through its K-major view (writes land in the pool)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    if state_vk:
        state_pool = state_pool.transpose(-1, -2)
    qp, kp, gp, bp = prepare_ref(q, k, g, beta, A_log, dt_bias, use_qk_l2norm, use_beta_sigmoid)
    qp, kp = qp.repeat_interleave(HV // H, 2), kp.repeat_interleave(HV // H, 2)
    slots = (state_indices.long() if state_indices is not None
             else torch.arange(B, device=q.device))
    live = slots >= 0
    # the gather copies (the pool is written back only where live); a negative slot starts from zero. index_select
    # and index_copy_ rather than pool[idx]: on a CPU advanced indexing moves the state slowly (half of a step's
    # time)
    h0 = state_pool.index_select(0, slots.clamp(min=0)).to(qp.dtype)
    rows = live.nonzero().squeeze(1)
    if rows.numel() < B:
        h0.masked_fill_(~live[:, None, None, None], 0.)
    if T == 1 and not output_intermediate_states:
        ht, hs = h0, None
        o = one_step_ref(qp[:, 0], kp[:, 0], v[:, 0].to(qp.dtype), gp[:, 0], bp[:, 0], scale, ht)[:, None]
    else:
        o, ht, hs = fused_recurrent_fwd_ref(qp, kp, v.to(qp.dtype), gp, bp, scale, h0, output_intermediate_states)
    src = ht if rows.numel() == B else ht.index_select(0, rows)
    state_pool.index_copy_(0, slots[rows], src.to(state_pool.dtype))
    if not output_intermediate_states:
        return o.to(v.dtype), state_pool.new_empty(0)
    hs = hs.to(state_pool.dtype)
    return o.to(v.dtype), (hs.transpose(-1, -2).contiguous() if state_vk else hs)


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    output_intermediate_states: bool = False,
    check_indices: bool = True,
    backend: Optional[str] = None,
    state_layout: str = "kv",
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""One decode step (1 or a few tokens per sequence) of the gated delta rule; updates ``state_pool`` in place.

    Per sequence b and value head, starting from ``S = state_pool[state_indices[b]]`` (zeros if the slot is
    negative), for each of its Tq tokens::

        S ← exp(g_t) (I − β_t k_t k_tᵀ) S + β_t k_t v_tᵀ        o_t = scale · Sᵀ q_t

    then ``state_pool[state_indices[b]] = S`` (skipped for negative slots). Inference only (no autograd).
    The arithmetic is fp32 whatever the pool dtype: a bf16 pool is read, widened, and rounded once per step.

    Args:
        q (torch.Tensor): queries of shape ``[B, Tq, H, K]``.
        k (torch.Tensor): keys of shape ``[B, Tq, H, K]``.
        v (torch.Tensor): values of shape ``[B, Tq, HV, V]``; grouped value heads if ``HV > H``.
        g (torch.Tensor): log decays ``[B, Tq, HV]``; raw gate logits when ``A_log``/``dt_bias`` are given.
        beta (torch.Tensor): write strengths ``[B, Tq, HV]``; logits if ``use_beta_sigmoid_in_kernel``.
        state_pool (torch.Tensor): ``[P, HV, K, V]`` (``state_layout="kv"``) or ``[P, HV, V, K]`` (``"vk"``), fp32,
            bf16 or fp16, contiguous; **updated in place**.
        state_indices (torch.Tensor): ``[B]`` int32/int64 pool rows; negative = start from zero, write nothing.
            None: sequence b uses row b.
        scale (float): query scale; default ``K ** -0.5``.
        use_qk_l2norm_in_kernel (bool): L2-normalise q and k as ``x · rsqrt(Σx² + 1e-6)`` (fused).
        A_log, dt_bias (torch.Tensor): ``[HV]``; if given, ``g ← −exp(A_log) · softplus(g + dt_bias)`` (fused).
        use_beta_sigmoid_in_kernel (bool): ``beta ← sigmoid(beta)`` (fused).
        output_intermediate_states (bool): also return the state after every token, ``[B, Tq, HV, K, V]`` (or
            ``[B, Tq, HV, V, K]`` with ``"vk"``) in the pool's dtype, for speculative decoding: after verifying
            that j tokens are accepted, roll back with ``state_pool[slot] = intermediate[b, j - 1]``.
        check_indices (bool): check on the host that slots are < P and never repeated (syncs with the device).
            Skipped automatically while a CUDA graph is being captured or under torch.compile.
        backend (str): ``"triton"`` (default on CUDA) or ``"torch"`` (default elsewhere).
        state_layout (str): ``"kv"`` (K-major, the chunked op's state layout) or ``"vk"`` (V-major); module
            docstring.

    Returns:
        ``(o, intermediate_states)``: o ``[B, Tq, HV, V]`` in v's dtype; intermediate_states or None.
    """
    scale, _ = check_gated_delta_inputs(q, k, v, g, beta, scale, None, None, A_log, dt_bias)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS} (K-major [P, HV, K, V] or V-major "
                         f"[P, HV, V, K]), got {state_layout!r}")
    state_vk = state_layout == "vk"
    _check_pool(state_pool, state_indices, B, HV, K, V, q.device,
                check_values=bool(check_indices) and not _skip_value_checks(), state_vk=state_vk)
    backend = select_backend(backend, q.device)
    if backend == "reference":
        raise ValueError("gated_delta_rule_decode has backends 'triton' and 'torch'; the float64 reference is "
                         "linattn.ops.gated_delta.reference.gated_delta_rule_reference")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if state_indices is not None:
        state_indices = state_indices.contiguous()
    args = (q, k, v, g, beta, scale, state_pool, state_indices, A_log, dt_bias, bool(use_qk_l2norm_in_kernel),
            bool(use_beta_sigmoid_in_kernel), bool(output_intermediate_states), backend, state_vk)
    if eager_call(q, k, v, g, beta, state_pool, state_indices, A_log, dt_bias):
        # the custom op's eager dispatch costs ~80 µs of Python (utils.eager_call); its one visible effect beyond
        # the kernel, bumping the pool's version counter, is repeated here
        o, hs = _decode_impl(*args)
        increment_version(state_pool)
    else:
        o, hs = _decode_op(*args)
    return o, (hs if output_intermediate_states else None)
