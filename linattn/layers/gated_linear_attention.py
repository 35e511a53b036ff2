"""GatedLinearAttention: the Gated DeltaNet layer with the delta term dropped (seed formula 002).

    S_t = γ_t S_{t−1} + η_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t,   γ_t = exp(−exp(A_log)·softplus(a_t + dt_bias)),
    η_t = sigmoid(b_t), scalar per value head; q, k L2-normalised (a bounded state, as in GDN).

Everything around the recurrence (projections, short convolution, output gate, gated RMSNorm, decode state,
packed sequences) is GatedDeltaNet's: this class only swaps the op, :func:`linattn.gated_linear_attention`.
"""
from __future__ import annotations

from ..ops.gated_linear import gated_linear_attention
from ..ops.utils import gate_from_raw, l2norm
from .gated_deltanet import GatedDeltaNet


class GatedLinearAttention(GatedDeltaNet):
    """Gated linear attention mixer; arguments as :class:`GatedDeltaNet` (``allow_neg_eigval`` is not
    available: without the delta term η only scales the write). Decode state: :class:`GatedDeltaNetState`."""

    def __init__(self, *args, **kwargs):
        if kwargs.get("allow_neg_eigval"):
            raise ValueError("allow_neg_eigval applies to the delta rule only, not to GatedLinearAttention")
        super().__init__(*args, **kwargs)

    def _rule(self, q, k, v, a, beta, *, mode, initial_state, output_final_state, cu_seqlens):
        # one op for both modes: the chunked torch path is exact on a single token too
        backend = "torch" if self.backend in (None, "triton") else self.backend
        return gated_linear_attention(l2norm(q), l2norm(k), v, gate_from_raw(a, self.A_log, self.dt_bias), beta,
                                      initial_state=initial_state, output_final_state=output_final_state,
                                      cu_seqlens=cu_seqlens, backend=backend)

    def _rule_cp(self, q, k, v, a, beta, cp):
        from ..parallel import context_parallel_gated_linear_attention  # lazy: it imports torch.distributed
        backend = "torch" if self.backend in (None, "triton") else self.backend
        return context_parallel_gated_linear_attention(l2norm(q), l2norm(k), v, gate_from_raw(a, self.A_log,
                                                       self.dt_bias), beta, plan=cp, backend=backend)[0]
