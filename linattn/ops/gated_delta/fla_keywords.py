"""fla 0.6's keyword arguments of ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``, mapped onto
linattn's explicit ones: each is honoured with fla's meaning or rejected with a message saying what to do instead.

The table with every keyword, fla's meaning and what linattn does is docs/api.md's "fla compatibility". In short:

* honoured exactly: ``state_v_first`` (and its deprecated alias ``transpose_state_layout``: states ``[N, HV, V, K]``
  in and out), ``use_gate_in_kernel`` (with ``A_log``, ``dt_bias`` optional), ``allow_neg_eigval`` (β = 2·sigmoid(b)),
  the recurrent op's optional ``g`` (no decay) and ``beta`` (ones), ``head_first=False``;
* accepted and not needed: ``chunk_size`` (16, 32 or 64, as fla allows; the result is the same function, linattn
  picks its own chunking), ``chunk_indices`` and ``cu_seqlens_cpu`` (linattn derives both from ``cu_seqlens``);
* rejected: ``head_first=True``, ``cp_context``, ``gk``, ``gv``, ``A_log`` with ``use_gate_in_kernel=False``.

Nothing here imports the rest of linattn: the public ops (chunk.py, recurrent.py) and the fla integration call
:func:`resolve_fla_keywords`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

CHUNK_SIZES = (16, 32, 64)


@dataclass(frozen=True)
class FlaArguments:
    """The op's arguments after fla's keywords are applied (in linattn's conventions)."""

    g: torch.Tensor
    beta: torch.Tensor
    initial_state: Optional[torch.Tensor]
    A_log: Optional[torch.Tensor]
    dt_bias: Optional[torch.Tensor]
    use_beta_sigmoid_in_kernel: bool
    state_v_first: bool

    def final_state(self, ht: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The op's final state ``[N, HV, K, V]`` in the caller's layout (``[N, HV, V, K]`` if state_v_first)."""
        if ht is None or not self.state_v_first:
            return ht
        return ht.transpose(-1, -2).contiguous()


def fla_keywords_given(A_log=None, dt_bias=None, head_first=False, chunk_size=None, chunk_indices=None,
                       cu_seqlens_cpu=None, use_gate_in_kernel=None, allow_neg_eigval=False, state_v_first=False,
                       transpose_state_layout=None, cp_context=None, gk=None, gv=None) -> bool:
    """Whether a call needs :func:`resolve_fla_keywords`: an fla keyword off its default, or ``A_log`` without
    ``dt_bias`` (fla's gate without a bias). The ops skip the resolution otherwise (no cost on the common call)."""
    return not (head_first is False and chunk_size is None and chunk_indices is None and cu_seqlens_cpu is None
                and use_gate_in_kernel is None and allow_neg_eigval is False and state_v_first is False
                and transpose_state_layout is None and cp_context is None and gk is None and gv is None
                and (A_log is None or dt_bias is not None))


def resolve_fla_keywords(op: str, q: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                         beta: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
                         A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                         use_beta_sigmoid_in_kernel: bool, *, head_first: bool = False,
                         chunk_size: Optional[int] = None, chunk_indices: Optional[torch.Tensor] = None,
                         cu_seqlens: Optional[torch.Tensor] = None, cu_seqlens_cpu: Optional[torch.Tensor] = None,
                         use_gate_in_kernel: Optional[bool] = None, allow_neg_eigval: bool = False,
                         state_v_first: bool = False, transpose_state_layout: Optional[bool] = None,
                         cp_context=None, gk: Optional[torch.Tensor] = None,
                         gv: Optional[torch.Tensor] = None) -> FlaArguments:
    """Apply fla's keywords; return the arguments of linattn's op (:class:`FlaArguments`).

    Args:
        op: ``"chunk_gated_delta_rule"`` or ``"fused_recurrent_gated_delta_rule"`` (names the op in messages; only
            the recurrent op takes ``gk``, ``gv`` and an omitted ``g`` / ``beta``).
        q ``[B, T, H, K]``, v ``[B, T, HV, V]``: shapes for the defaults of an omitted g / beta.
        g, beta ``[B, T, HV]``, initial_state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with state_v_first), A_log,
            dt_bias ``[HV]``, use_beta_sigmoid_in_kernel: as the op received them.
        the rest: fla's keywords, with fla's defaults (``use_gate_in_kernel=None``: not given).
    Raises:
        ValueError: a keyword linattn cannot honour, or an fla combination fla itself rejects.
    """
    recurrent = op == "fused_recurrent_gated_delta_rule"
    if head_first:
        raise ValueError(f"{op}: head_first=True is not supported (fla 0.6 removed it too): pass q, k, v, g, beta "
                         "as [B, T, H, ...], e.g. x.transpose(1, 2)")
    if cp_context is not None:
        raise ValueError(f"{op}: fla's cp_context is not supported; linattn's context parallelism is "
                         "linattn.parallel (docs/parallel.md), or call the op per rank with cp_context=None")
    if gk is not None or gv is not None:
        raise ValueError(f"{op}: per-channel decays (gk [B, T, HV, K] / gv [B, T, HV, V]) are not supported; the "
                         "gated delta rule here takes one log decay per token and value head, g [B, T, HV]")
    if chunk_size is not None and (isinstance(chunk_size, bool) or chunk_size not in CHUNK_SIZES):
        raise ValueError(f"{op}: chunk_size must be 16, 32 or 64 (as in fla), got {chunk_size!r}; it does not "
                         "change the result, so it can be left out")
    if chunk_indices is not None and cu_seqlens is None:
        raise ValueError(f"{op}: chunk_indices is only meaningful with cu_seqlens (linattn derives it from them)")
    if cu_seqlens_cpu is not None:
        if cu_seqlens is None:
            raise ValueError(f"{op}: cu_seqlens_cpu without cu_seqlens; pass cu_seqlens (on q's device)")
        if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"{op}: cu_seqlens_cpu must be a tensor of cu_seqlens' shape {tuple(cu_seqlens.shape)}")
    if transpose_state_layout is not None:
        if state_v_first:
            raise ValueError(f"{op}: pass state_v_first or its deprecated alias transpose_state_layout, not both")
        state_v_first = bool(transpose_state_layout)
    if use_gate_in_kernel is not None:
        if use_gate_in_kernel and A_log is None:
            raise ValueError(f"{op}: use_gate_in_kernel=True needs A_log ([HV]); g is then the raw gate input")
        if not use_gate_in_kernel and (A_log is not None or dt_bias is not None):
            raise ValueError(f"{op}: A_log / dt_bias with use_gate_in_kernel=False: fla ignores them, linattn would "
                             "compute the gate from them; drop them (g is a log decay) or pass use_gate_in_kernel="
                             "True (g is the raw input)")
    if A_log is not None and dt_bias is None:
        # fla's gate without a bias: −exp(A_log)·softplus(g)
        dt_bias = torch.zeros_like(A_log)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{op}: allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True (as in fla): beta is "
                         "then the logit b and β = 2·sigmoid(b)")

    B, T, HV = v.shape[0], v.shape[1], v.shape[2]
    if g is None:
        if not recurrent:
            raise TypeError(f"{op}: g is required (only the recurrent op may omit it)")
        if A_log is not None:
            raise ValueError(f"{op}: use_gate_in_kernel / A_log needs g, the raw gate input")
        g = torch.zeros(B, T, HV, dtype=torch.float32, device=q.device)
    if beta is None:
        if not recurrent:
            raise TypeError(f"{op}: beta is required (only the recurrent op may omit it)")
        if use_beta_sigmoid_in_kernel:
            raise ValueError(f"{op}: use_beta_sigmoid_in_kernel=True needs beta (its logits)")
        beta = torch.ones(B, T, HV, dtype=q.dtype, device=q.device)
    if allow_neg_eigval:
        # in fp32 (fp64 for fp64 input), as the ops' own sigmoid
        b = beta if beta.dtype == torch.float64 else beta.float()
        beta, use_beta_sigmoid_in_kernel = 2 * b.sigmoid(), False
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    return FlaArguments(g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias,
                        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, state_v_first=state_v_first)
