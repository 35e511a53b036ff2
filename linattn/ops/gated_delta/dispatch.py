"""Which forward runs for one call of ``chunk_gated_delta_rule``, and why: :func:`choose_forward_path` returns the
path and its reason, :func:`run_forward` runs it. Read top to bottom:

    backend "reference"          the float64 token loop (tests only; the op runs it outside its custom op)
    backend "torch"              the chunked PyTorch twin (``torch_chunk.py``; the default off CUDA)
    backend "triton", then:
      hopper                     bf16 on sm_90 with TileLang, where its plan fills the card (``hopper/plan.py``)
      walk                       the fused Triton walk (``triton_chunk.forward_walk``): fp16 from WALK_MIN_PAIRS
                                 (sequence × value head) pairs, where the walk measured ahead of the split
      split                      the split Triton forward (``triton_chunk.forward_split``): everything else

The backward (:func:`choose_backward_path`, :func:`run_backward`): the torch twin's on backend "torch"; on
"triton", the Hopper backward (``hopper/backward.py``) for bf16 on sm_90 from HOPPER_BWD_MIN_WORK (sequence × value
head) pairs × tokens, else the Triton backward (``triton_bwd.py``). Packed sequences take the Hopper backward on a
batch padded to one length (``hopper/varlen.py``) where the forward's padding rule and that threshold on the padded
batch say so.

``forward_path`` ("auto" for the public op) forces one of "split", "walk" or "hopper" for tests and debugging
(``chunk.chunk_gated_delta_rule_on_path``); a forced "hopper" still falls back to the Triton paths where the Hopper
kernels cannot take the inputs. The Hopper package is asked through two calls, ``plan.plan_inputs`` and
``forward.forward_hopper``; it never imports back.
"""
from __future__ import annotations

import functools
import warnings
from types import MappingProxyType
from typing import Literal, NamedTuple, Optional, get_args

import torch

from ..utils import compute_dtype

ForwardPath = Literal["auto", "split", "walk", "hopper"]
FORWARD_PATHS = get_args(ForwardPath)

# The fused walk from this many (sequence × value head) pairs per input dtype; None: the split at every shape. The
# split keeps only the state update on the sequential chain, so it wins where the pairs do not fill the SMs, and for
# bf16 and fp32 everywhere measured; fp16 (output dots at tf32x3) keeps the walk where the pairs fill the card
WALK_MIN_PAIRS = MappingProxyType({torch.bfloat16: None, torch.float16: 128, torch.float32: None})

# The Hopper backward from this many (sequence × value head) pairs × tokens: the smallest work at which it was measured
# ahead of the Triton backward (16 pairs of 4096 tokens, 32 of 2048, 8 of 8192; docs/decisions.md); smaller calls
# are a few launches of either, not measured
HOPPER_BWD_MIN_WORK = 65536


class ForwardChoice(NamedTuple):
    """The forward one call runs: ``path`` ("reference", "torch", "hopper", "walk" or "split"), ``reason`` (why, in
    words) and, for "hopper", its ``plan`` (``hopper.plan.HopperPlan``)."""
    path: str
    reason: str
    plan: Optional[object] = None


@functools.cache
def _triton_chunk():
    """``triton_chunk``, imported on first use: triton is optional on CPU machines."""
    from . import triton_chunk
    return triton_chunk


@functools.cache
def _hopper():
    """(``hopper.plan``, ``hopper.forward``, ``hopper.chunk_fwd``), imported on first use: only bf16 CUDA calls ask."""
    from ..hopper import chunk_fwd, forward, plan
    return plan, forward, chunk_fwd


def triton_path(num_sequences: int, HV: int, dtype: torch.dtype) -> ForwardChoice:
    """The Triton forward for ``num_sequences`` sequences of ``HV`` value heads in ``dtype``: :data:`WALK_MIN_PAIRS`."""
    pairs = WALK_MIN_PAIRS.get(dtype)
    if pairs is not None and num_sequences * HV >= pairs:
        return ForwardChoice("walk", f"{dtype} with {num_sequences * HV} ≥ {pairs} (sequence, head) pairs")
    return ForwardChoice("split", f"{dtype}, {num_sequences * HV} (sequence, head) pairs")


def choose_forward_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                        offsets: Optional[list[int]], backend: str, forward_path: ForwardPath = "auto"
                        ) -> ForwardChoice:
    """The forward for these (checked, contiguous) inputs on ``backend`` (``utils.select_backend``'s), and why."""
    if forward_path not in FORWARD_PATHS:
        raise ValueError(f"forward_path must be one of {FORWARD_PATHS}, got {forward_path!r}")
    if backend in ("reference", "torch"):
        return ForwardChoice(backend, f"backend={backend!r}")
    if forward_path in ("split", "walk"):
        return ForwardChoice(forward_path, "forced")
    hopper_reason = "not a bf16 CUDA call"
    if q.device.type == "cuda" and q.dtype == torch.bfloat16:      # the CPU / fp16 / fp32 case asks no Hopper module
        plan, _, _ = _hopper()
        found, hopper_reason = plan.plan_inputs(q, v, (k, g, beta, initial_state), cu_seqlens, offsets,
                                                forced=forward_path == "hopper")
        if found is not None:
            return ForwardChoice("hopper", hopper_reason, found)
    num_sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    choice = triton_path(num_sequences, v.shape[2], v.dtype)
    return choice._replace(reason=f"{choice.reason}; Hopper: {hopper_reason}")


def run_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                scale: float, initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                offsets: Optional[list[int]], backend: str, forward_path: ForwardPath = "auto"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """o ``[B, T, HV, V]`` and the final state ``[N, HV, K, V]`` from the path :func:`choose_forward_path` picks. A
    Hopper forward that does not compile here warns once and leaves the Triton paths to every later call."""
    if cu_seqlens is not None and offsets is None:
        offsets = cu_seqlens.tolist()
    choice = choose_forward_path(q, k, v, g, beta, initial_state, cu_seqlens, offsets, backend, forward_path)
    if choice.path == "hopper":
        _, hopper_forward, chunk_fwd = _hopper()
        try:
            return hopper_forward.forward_hopper(choice.plan, q, k, v, g, beta, scale, initial_state, cu_seqlens)
        except chunk_fwd.HopperCompileError as e:       # unsupported_reason says so to every later call
            chunk_fwd.mark_compile_failed(str(e))
            warnings.warn(f"linattn: the Hopper forward (TileLang) did not compile here, so the Triton forward runs "
                          f"instead: {e}", RuntimeWarning, stacklevel=2)
            num_sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
            choice = triton_path(num_sequences, v.shape[2], v.dtype)
    if choice.path == "torch":
        from .torch_chunk import chunk_gated_delta_rule_fwd_torch
        return chunk_gated_delta_rule_fwd_torch(q, k, v, g, beta, scale, initial_state, offsets)
    if choice.path == "reference":
        from .reference import gated_delta_rule_reference
        o, ht = gated_delta_rule_reference(q, k, v, g, beta, scale, initial_state, offsets)
        return o.to(v.dtype), ht.to(compute_dtype(v))
    triton_chunk = _triton_chunk()
    run = triton_chunk.forward_walk if choice.path == "walk" else triton_chunk.forward_split
    return run(q, k, v, g, beta, scale, initial_state, cu_seqlens, offsets)


def hopper_backward_blocker(B: int, T: int, HV: int, K: int, V: int, do_dtype: torch.dtype,
                            g_dtype: torch.dtype, offsets: Optional[list[int]] = None, *,
                            initial_state: bool = False) -> Optional[str]:
    """Why the Hopper backward does not take a call of these sizes and dtypes (None: it does), beyond what
    ``hopper.plan.input_blocker`` says of the device, q's dtype and alignment: the walk's own size and dtype limits
    (``hopper.backward.size_limit``, ``dtype_limit``), then two measured defects (docs/performance.md, "Accuracy"):
    K = 64 with V = 128 (and V = 64 with K = 128), the slice walk's, whose dβ race is fixed but not re-measured
    (``hopper.backward.defect_limit``; K = V = 64 takes the role-split walk), and an ``initial_state`` with
    sequences of one chunk (the walk reads the state entering a sequence's first chunk in bf16; where that chunk is
    the whole sequence, dg's error is above the bound), then :data:`HOPPER_BWD_MIN_WORK`.

    Packed sequences (``offsets``, cu_seqlens' host values) run the padded backward (``hopper/varlen.py``): the
    forward's rule (padding at most ``plan.HopperPlanConfig.max_padded_fraction`` of the batch), then the threshold
    on the padded batch: N sequences of Tp rows (``varlen.padded_rows``)."""
    from ..common import CHUNK
    from ..hopper.backward import defect_limit, dtype_limit, size_limit
    static = size_limit(K, V) or dtype_limit(g_dtype, dO=do_dtype)
    if static is not None:
        return static
    if offsets is not None:
        from ..hopper.plan import DEFAULT
        from ..hopper.varlen import padded_rows, worth_padding
        B, T = len(offsets) - 1, padded_rows(offsets)
        if not worth_padding(offsets, T, DEFAULT.max_padded_fraction):
            return (f"packed sequences would waste more than {DEFAULT.max_padded_fraction:.0%} of the padded batch "
                    f"to padding")
    defect = defect_limit(K, V)
    if defect is not None:
        return defect
    if initial_state and T <= CHUNK:
        return f"an initial state with sequences of one chunk ({T} ≤ {CHUNK} tokens): dg outside the accuracy bound"
    if B * HV * T < HOPPER_BWD_MIN_WORK:
        return (f"{B * HV} (sequence, head) pairs × {T} tokens = {B * HV * T} < {HOPPER_BWD_MIN_WORK}, where it is "
                f"not measured ahead")
    return None


def choose_backward_path(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, do: torch.Tensor,
                         cu_seqlens: Optional[torch.Tensor], backend: str, offsets: Optional[list[int]] = None,
                         others: tuple = (), initial_state: Optional[torch.Tensor] = None) -> tuple[str, str]:
    """The backward for these saved inputs on ``backend``: ("torch" | "hopper" | "triton", why). ``offsets``:
    cu_seqlens' host values (None: read from the device); ``others``: the call's other tensors (k, β, dht; None
    skipped), which must start on a 16-byte boundary as q, v, g, dO and ``initial_state`` (or None) must
    (``hopper.plan.input_blocker``: the walk's TMA loads)."""
    if backend != "triton":
        return "torch", f"backend={backend!r}"
    if q.device.type != "cuda":
        return "triton", "Hopper backward: not a CUDA call"
    if cu_seqlens is not None and offsets is None:
        offsets = cu_seqlens.tolist()
    reason = _hopper()[0].input_blocker(q, v, g, do, *others, initial_state) or \
        hopper_backward_blocker(*q.shape[:2], v.shape[2], q.shape[3], v.shape[3], do.dtype, g.dtype, offsets,
                                initial_state=initial_state is not None)
    if reason is None:
        if offsets is not None:
            return "hopper", f"{len(offsets) - 1} packed sequences × {v.shape[2]} heads, padded"
        return "hopper", f"{q.shape[0] * v.shape[2]} (sequence, head) pairs of {q.shape[1]} tokens"
    return "triton", f"Hopper backward: {reason}"


def zero_state_gradient(q: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """The final state's gradient of zeros ``[N, HV, K, V]`` (N: the sequences) in the states' dtype, for the
    backwards that read a tensor where the loss does not read the final state."""
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return v.new_zeros(N, v.shape[2], q.shape[3], v.shape[3], dtype=compute_dtype(v))


def run_backward(q, k, v, g, beta, scale: float, initial_state: Optional[torch.Tensor],
                 cu_seqlens: Optional[torch.Tensor], offsets: Optional[list[int]], do: torch.Tensor,
                 dht: Optional[torch.Tensor], backend: str) -> tuple:
    """dq, dk, dv, dg, dbeta, dh0 (None without initial_state) from the path :func:`choose_backward_path` picks;
    dht None is the final state's gradient of zeros (the Hopper walk then allocates none: its dh0 buffer starts as
    them). A Hopper backward that does not compile here warns once and leaves the Triton backward to every later call."""
    path, _ = choose_backward_path(q, v, g, do, cu_seqlens, backend, offsets, others=(k, beta, dht),
                                   initial_state=initial_state)
    if path == "torch":
        from .torch_chunk import chunk_gated_delta_rule_bwd_torch
        return chunk_gated_delta_rule_bwd_torch(q, k, v, g, beta, scale, initial_state, offsets, do, dht)
    if path == "hopper":
        from ..hopper.backward import chunk_gated_delta_rule_bwd_hopper
        _, _, chunk_fwd = _hopper()
        try:
            return chunk_gated_delta_rule_bwd_hopper(q, k, v, g, beta, scale, initial_state, do, dht,
                                                     cu_seqlens=cu_seqlens, offsets=offsets)
        except chunk_fwd.HopperCompileError as e:
            chunk_fwd.mark_compile_failed(str(e))
            warnings.warn(f"linattn: the Hopper backward (TileLang) did not compile here, so the Triton backward "
                          f"runs instead: {e}", RuntimeWarning, stacklevel=2)
    from .triton_bwd import chunk_gated_delta_rule_bwd_triton  # lazy: triton is optional on CPU machines
    if dht is None:
        dht = zero_state_gradient(q, v, cu_seqlens)
    return chunk_gated_delta_rule_bwd_triton(q, k, v, g, beta, scale, initial_state, cu_seqlens, offsets, do, dht)
