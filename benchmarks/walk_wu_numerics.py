"""CPU numerics of a walk reformulation before building it (docs/architecture.md, "The chain itself"): the Hopper
walk forms X = V − Γ ⊙ (K S) and V_new = A′ X per chunk (A′ = A_inv diag(β), bf16; X rounded to bf16: two
dependent dots on the chain); the reformulation precomputes W = A′ (Γ ⊙ K) and U = A′ V one chunk ahead and forms
V_new = U − W S (one dot on the chain). Both are modelled in fp32 with the bf16 roundings of their dot operands
(W rounded to bf16; U in fp32 or rounded, as fla's u is), against the float64 recurrence, relative L2 of o and the
final state. Two gate regimes: the anchors' (logsigmoid(N(0,1))/4, ≈ −0.2 per token: states forget within a
chunk or two) and a slow decay (the same / 64).

    python benchmarks/walk_wu_numerics.py [--T 4096] [--H 2]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from linattn.ops.gated_delta import torch_chunk as tc
from linattn.ops.gated_delta.reference import gated_delta_rule_reference

BT = 64


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


def walk(q, k, v, g, beta, scale, h0, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk loop in fp32 with the kernel's roundings; ``form``: "x" (today's: A′ X), "wu" (U fp32), "wu16" (U
    rounded to bf16)."""
    B, T, H, K = q.shape
    qc, kc, vc = (tc.to_chunks(x.float(), BT) for x in (q, k, v))
    bc = tc.to_chunks(beta.float(), BT)
    gc = tc.chunk_local_cumsum_ref(tc.to_chunks(g.float(), BT))
    a_inv = tc.kkt_solve_ref(kc, bc, gc)                                      # [B, H, NT, BT, BT] fp32
    A = bf16(a_inv * bc[..., None, :])                                        # A′ = A_inv diag(β), bf16
    S = h0.float().clone()
    outs = []
    for c in range(qc.shape[2]):
        Q, Kc, Vc, G = qc[:, :, c], kc[:, :, c], vc[:, :, c], gc[:, :, c]
        Sb = bf16(S)
        gam = G.exp()[..., None]
        if form == "x":
            Vn = A[:, :, c] @ bf16(Vc - gam * (Kc @ Sb))
        else:
            W = bf16(A[:, :, c] @ bf16(gam * Kc))
            U = A[:, :, c] @ Vc
            Vn = (bf16(U) if form == "wu16" else U) - W @ Sb
        P = bf16(scale * tc.qk_decay_ref(Q, Kc, G))
        outs.append(scale * gam * (Q @ Sb) + P @ bf16(Vn))
        g_last = G[..., -1]
        S = g_last.exp()[..., None, None] * S + Kc.transpose(-1, -2) @ bf16((g_last[..., None] - G).exp()[..., None]
                                                                             * Vn)
    return tc.from_chunks(torch.stack(outs, 2), T), S


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=2)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)       # noqa: E731
    B, T, H, K = 1, args.T, args.H, 128
    q, k = (bf16(F.normalize(r(B, T, H, K), dim=-1)) for _ in range(2))
    v = bf16(r(B, T, H, K))
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = r(B, H, K, K) * 0.1
    print("| gates | form | o rel. error | state rel. error |\n|---|---|---|---|")
    for name, g in (("anchors", F.logsigmoid(r(B, T, H)) / 4), ("slow (/64)", F.logsigmoid(r(B, T, H)) / 256)):
        ro, rs = gated_delta_rule_reference(q, k, v, g, beta, K ** -0.5, h0)
        for form in ("x", "wu", "wu16"):
            o, s = walk(q.float(), k.float(), v.float(), g.float(), beta.float(), K ** -0.5, h0, form)
            err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()     # noqa: E731
            print(f"| {name} | {form} | {err(o, ro):.3e} | {err(s, rs):.3e} |")


if __name__ == "__main__":
    main()
