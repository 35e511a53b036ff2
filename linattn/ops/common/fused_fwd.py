"""Fused forward, part 2: ONE sequential kernel walks the chunks with the state on chip and writes o directly.

Twin: ``torch_chunk.state_pass_fwd_ref`` followed by ``torch_chunk.output_fwd_ref`` (the two stages it fuses;
h and v_new are the values those twins would pass between them, never stored here).

One program owns one (sequence, value head, BV-wide slice of V) and holds the whole K extent of the state S
[BK, BV] in fp32 registers (BK = next power of two ≥ K, up to 256). Per chunk, with S the state entering it:

    read   W [BT, BK] fp32, U [BT, BV] fp32, gc [BT] fp32       (from the pre-pass, ``fused_prepass.py``)
           Q [BT, BK], K [BT, BK] in the input dtype
    V_new = U − W S                                              [BT, BV] fp32, registers only
    O     = scale·[Γ ⊙ (Q S) + (Q Kᵀ ⊙ D ⊙ causal) V_new]       write BT×BV in the output dtype
    S    ← e^{G_C} S + Kᵀ (e^{G_C − G} ⊙ V_new)                 the decay scales V_new's rows, so K stays in
                                                                 the input dtype (fewer registers, no fp32 copy)

so per chunk and head it moves BT·(K + V)·4 + BT·2K·(2 bytes) + BT·V·2 bytes and writes neither h (BK·BV fp32
per chunk) nor V_new, against the unfused state pass + output stages that write h and V_new and read them back.
The order inside a chunk — V_new, then O from the entering S, then the update — is the math's; O and V_new both
read the S that entered the chunk.

P = Q Kᵀ ⊙ D ⊙ causal does not depend on S. Without LOAD_P it is recomputed here for each V slice (2·BT²·K FLOPs per
slice, about a quarter of the walk's tensor-core work). With LOAD_P (``p`` given, from ``fused_prepass`` with
queries; the op's default) the walk instead reads the chunk's P [BT, BT] fp32 (16 KB per chunk and head; the V
slices of one head read the same tile, mostly from L2) and skips that dot and its mask; Q is still read for Q S and
K for the state update.

Modes (constexpr flags of the same kernel, driven by ``seq_parallel.py`` for intra-card sequence parallelism):
SEGMENTED walks a chunk range [i_c0, i_c1) of a sequence from a per-segment initial state; AFFINE skips Q and the
output and walks the augmented K×(K+V) state [M | N] from [I | 0] (U = 0 in M's columns), giving the segment's
affine map S_out = M S_in + N. Without either flag the kernel is the plain walk above.

Dot precision (``common/__init__.py``): Q Kᵀ runs on the input dtype (exact products; INPUT_PREC only matters
for fp32 inputs); W S, Q S, P V_new and Kᵀ V_new touch fp32 intermediates: the output dots (Q S, P V_new) run
at DOT_PREC, the state dots (W S, Kᵀ V_new) at STATE_PREC, both from :func:`fused_dot_precisions` (bf16: tf32x3 / tf32, chosen by measurement).
Every dot goes through ``common/dot.py``'s ``dot``, which also offers split-bf16 "bf16x3" (three bf16 MMAs; two for
Q S of bf16 inputs, whose Q is not split) and keeps bf16 products right under the interpreter (INTERPRET).
"bf16x3" in this kernel faults on sm_90 with Triton 3.6 (illegal memory access) while the helper alone passes its
GPU test at M=32 (mma.sync, not wgmma): ``launch_walk`` refuses it on CUDA.

Load pipelining (NUM_STAGES): a ``while`` loop is never software-pipelined, so each chunk waits for its own loads
before its dots (the walk is latency-bound where few programs run). NUM_STAGES ≥ 1 compiles the same steps as a
``tl.range`` loop; at 2 (the launcher's choice for a one-wave grid) Triton prefetches the next chunk's tiles with
cp.async while this chunk computes; grids of several waves keep the while loop, whose smaller shared memory keeps
more programs resident.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..utils import cdiv
from . import (
    CHUNK,
    block_size,
    dot_precision,
    fill_tile_v,
    launch_options,
    loop_stages,
    num_sms,
    triton_interpret,
)
from .dot import DOT_PRECISIONS, dot
from .finite import nonfinite


@triton.jit
def _fused_chunk(q, k, w, u, gc, p, o, b_h, scale, i_c, bos, T_seq, i_h, i_hv, i_v, H: tl.constexpr,
                 HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, DOT_PREC: tl.constexpr, STATE_PREC: tl.constexpr, INPUT_PREC: tl.constexpr,
                 AFFINE: tl.constexpr, LOAD_P: tl.constexpr, INTERPRET: tl.constexpr):
    """One chunk: write its BT×BV slice of O (not in AFFINE mode) and return the state leaving it."""
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < T_seq
    i_last = tl.minimum((i_c + 1) * BT, T_seq) - 1
    b_gc = tl.load(gc + (bos + o_t) * HV + i_hv, mask=m_t, other=0)
    b_g_last = tl.load(gc + (bos + i_last) * HV + i_hv)

    # V_new = U − W S (padded rows of W and U load as 0, so their V_new is 0 and they leave S unchanged)
    p_w = tl.make_block_ptr(w + (bos * HV + i_hv) * K, (T_seq, K), (HV * K, 1), (i_c * BT, 0), (BT, BK), (1, 0))
    b_w = tl.load(p_w, boundary_check=(0, 1))
    if AFFINE:
        # column c of the augmented state [M | N]: c < K is a column of M (its U column is 0), c ≥ K is column
        # c − K of N (U column c − K); a BV slice may straddle the two, so the mask is per element
        o_u = i_v * BV + tl.arange(0, BV) - K
        m_u = (o_u >= 0) & (o_u < V)
        b_u = tl.load(u + ((bos + o_t) * HV + i_hv)[:, None] * V + o_u[None, :], mask=m_t[:, None] & m_u[None, :],
                      other=0)
    else:
        p_u = tl.make_block_ptr(u + (bos * HV + i_hv) * V, (T_seq, V), (HV * V, 1), (i_c * BT, i_v * BV), (BT, BV),
                                (1, 0))
        b_u = tl.load(p_u, boundary_check=(0, 1))
    b_v = b_u - dot(b_w, b_h, STATE_PREC, INTERPRET)

    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (K, T_seq), (1, H * K), (0, i_c * BT), (BK, BT), (0, 1))
    b_kt = tl.load(p_k, boundary_check=(0, 1))
    if not AFFINE:
        # O = scale·[Γ ⊙ (Q S) + (Q Kᵀ ⊙ D ⊙ causal) V_new]; D is formed from the masked difference (→ −inf → 0)
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T_seq, K), (H * K, 1), (i_c * BT, 0), (BT, BK), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        if LOAD_P:
            # P from the pre-pass: read BT×BT fp32 (rows past the sequence end load as 0, like Q's)
            p_P = tl.make_block_ptr(p + (bos * HV + i_hv) * BT, (T_seq, BT), (HV * BT, 1), (i_c * BT, 0), (BT, BT),
                                    (1, 0))
            b_P = tl.load(p_P, boundary_check=(0,))
        else:
            # (the mask is a select: a non-finite key never reaches an earlier row, finite.py)
            m_P = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
            b_P = dot(b_q, b_kt, INPUT_PREC, INTERPRET)
            b_P = tl.where(m_P, b_P * tl.exp(tl.where(m_P, b_gc[:, None] - b_gc[None, :], float("-inf"))), 0.)
        # Q stays in the input dtype: dot widens it to fp32 only where Triton's precisions need matching dtypes
        # (bf16x3 multiplies a bf16 Q as it is, which saves the fp32 copy's registers)
        b_o = dot(b_q, b_h, DOT_PREC, INTERPRET) * tl.exp(b_gc)[:, None]
        # P V_new with V_new's non-finite entries zeroed and o NaN there: V_new's non-finite rows are closed
        # downward (finite.py); the state update below reads V_new as it is, so the state leaving the chunk is NaN
        m_bad = nonfinite(b_v)
        b_pv = dot(b_P, tl.where(m_bad, 0., b_v).to(b_v.dtype), DOT_PREC, INTERPRET)
        b_o = tl.where(m_bad, float("nan"), (b_o + b_pv) * scale)
        p_o = tl.make_block_ptr(o + (bos * HV + i_hv) * V, (T_seq, V), (HV * V, 1), (i_c * BT, i_v * BV), (BT, BV),
                                (1, 0))
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))

    # S ← e^{G_C} S + Kᵀ (e^{G_C − G} ⊙ V_new): the decay scales the rows of V_new [BT, BV] instead of the
    # columns of Kᵀ [BK, BT], so K stays in the input dtype (bf16x3 does not split it: 2 MMAs, not 3; tf32 rounds
    # only V_new) and no fp32 [BK, BT] copy of K is held: fewer spills at every precision (ptxas, sm_90)
    b_vd = b_v * tl.exp(tl.where(m_t, b_g_last - b_gc, float("-inf")))[:, None]
    return b_h * tl.exp(b_g_last) + dot(b_kt, b_vd, STATE_PREC, INTERPRET)


@triton.jit(do_not_specialize=["T", "NSEG", "L"])
def fused_fwd_kernel(q, k, w, u, gc, p, o, h0, ht, scale, cu_seqlens, segments, T, NSEG, L, H: tl.constexpr,
                     HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, DOT_PREC: tl.constexpr, STATE_PREC: tl.constexpr, INPUT_PREC: tl.constexpr,
                     USE_INITIAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr, SEGMENTED: tl.constexpr,
                     AFFINE: tl.constexpr, LOAD_P: tl.constexpr, INTERPRET: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    # grid (cdiv(VS, BV), NS·HV): program (i_v, segment i_s, value head i_hv). Without SEGMENTED a segment is a
    # whole sequence (NS = N, i_s = i_n): the default walk. With SEGMENTED (seq_parallel.py) segment i_s covers
    # chunks [i_c0, i_c1) of sequence i_n: varlen reads (i_n, i_c0, i_c1) from segments [NS, 3]; otherwise every
    # sequence has NSEG segments of L chunks (the last one shorter).
    # AFFINE (phase A of seq_parallel.py): no output; the walked state is the augmented [M | N] of K + V columns,
    # starting from [I | 0] with U's columns shifted by K, and the state leaving the segment is stored to
    # ht [NS, HV, K, K + V]. Otherwise the state starts from h0 (per segment i_s) and the state leaving the last
    # chunk of sequence i_n is stored to ht [N, HV, K, V].
    # LOAD_P (never with AFFINE, which has no output): P of each chunk is read from p [B, T, HV, BT] instead of
    # being computed from Q Kᵀ.
    i_v, i_sh = tl.program_id(0), tl.program_id(1)
    i_s, i_hv = i_sh // HV, i_sh % HV
    i_h = i_hv // (HV // H)
    if SEGMENTED and IS_VARLEN:
        i_n = tl.load(segments + i_s * 3)
        i_c0 = tl.load(segments + i_s * 3 + 1)
    elif SEGMENTED:
        i_n = i_s // NSEG
        i_c0 = (i_s % NSEG) * L
    else:
        i_n = i_s
        i_c0 = 0
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    T_seq = eos - bos
    NT_seq = tl.cdiv(T_seq, BT)
    if SEGMENTED and IS_VARLEN:
        i_c1 = tl.load(segments + i_s * 3 + 2)
    elif SEGMENTED:
        i_c1 = tl.minimum(i_c0 + L, NT_seq)
    else:
        i_c1 = NT_seq

    if AFFINE:
        VS: tl.constexpr = K + V
    else:
        VS: tl.constexpr = V
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < VS)
    o_kv = o_k[:, None] * VS + o_v[None, :]
    if AFFINE:
        b_h = ((o_k[:, None] == o_v[None, :]) & (o_k[:, None] < K)).to(tl.float32)
    elif USE_INITIAL_STATE:
        b_h = tl.load(h0 + i_sh.to(tl.int64) * K * V + o_kv, mask=m_kv, other=0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)

    if INTERPRET or NUM_STAGES == 0:
        # a while loop: the interpreter cannot take range() of a runtime bound (numpy >= 2 refuses int() of its
        # 1-element arrays), and NUM_STAGES = 0 (a grid of more than one wave) is never software-pipelined
        i_c = i_c0
        while i_c < i_c1:
            b_h = _fused_chunk(q, k, w, u, gc, p, o, b_h, scale, i_c, bos, T_seq, i_h, i_hv, i_v, H, HV, K, V, BT,
                               BK, BV, DOT_PREC, STATE_PREC, INPUT_PREC, AFFINE, LOAD_P, INTERPRET)
            i_c += 1
    else:
        # the same steps in a for loop (scf.for), which Triton's software pipeliner can stage: the loads of the
        # next NUM_STAGES - 1 chunks (W, U, K, Q or P, gates: none depends on the state) are issued as cp.async
        # into shared memory while this chunk's dots run. A while loop is never pipelined: every chunk waits for
        # its own loads. int32 bounds: block-pointer offsets must be 32-bit.
        for i_c in tl.range(i_c0, i_c1.to(tl.int32), num_stages=NUM_STAGES):
            b_h = _fused_chunk(q, k, w, u, gc, p, o, b_h, scale, i_c, bos, T_seq, i_h, i_hv, i_v, H, HV, K, V, BT,
                               BK, BV, DOT_PREC, STATE_PREC, INPUT_PREC, AFFINE, LOAD_P, INTERPRET)

    if AFFINE:
        tl.store(ht + i_sh.to(tl.int64) * K * VS + o_kv, b_h, mask=m_kv)
    else:
        # only the segment that ends the sequence writes its final state (always true without SEGMENTED)
        tl.store(ht + (i_n * HV + i_hv).to(tl.int64) * K * V + o_kv, b_h, mask=m_kv & (i_c1 == NT_seq))


def fused_dot_precisions(dtype: torch.dtype) -> tuple[str, str]:
    """(DOT_PREC, STATE_PREC) of the sequential kernel for inputs of ``dtype``.

    bf16 runs the two output dots (Q S, P V_new) at ``"tf32x3"`` and the two state dots (W S, Kᵀ V_new) at tf32:
    the cheapest split that meets the bf16 rule (anchor o ≤ 2e-3 with margin; all tf32 sits at the edge).
    Other dtypes follow ``dot_precision``."""
    if dtype == torch.bfloat16:
        return "tf32x3", "tf32"
    return dot_precision(dtype), dot_precision(dtype)


def fused_fwd_config(K: int, V: int, NHV: int, num_sms: int) -> tuple[int, int, int]:
    """(BK, BV, num_warps) of :func:`fused_fwd` for N·HV = NHV (sequence, value head) pairs on num_sms SMs.

    The whole K extent stays in registers (BK = next power of two ≥ K). BV is the one lever on parallelism: the
    walk is sequential, so BV is the widest of 64, 32, 16 whose NHV·cdiv(V, BV) programs fill the SMs (16 if none
    does). Beyond K = 128, BV ≤ 32 keeps the fp32 state tile at ≤ 8192 values. 4 warps are faster than 8 and 2."""
    BK = block_size(K, 256)
    return BK, fill_tile_v(NHV, V, 64 if BK <= 128 else 32, num_sms), 4


def launch_walk(q, k, w, u, gc, o, h0, ht, scale: float, cu_seqlens, BV: int, num_warps: int,
                dot_prec: Optional[str], state_prec: Optional[str], chunk_size: int, num_segments: int,
                segments: Optional[torch.Tensor] = None, nseg: int = 1, seg_len: int = 0,
                segmented: bool = False, affine: bool = False, p: Optional[torch.Tensor] = None,
                num_stages: Optional[int] = None) -> None:
    """Launch :func:`fused_fwd_kernel` over ``num_segments`` segments (sequences without ``segmented``) × value
    heads × BV slices of the walked state's columns (V, or K + V with ``affine``). The tensors are as the kernel
    describes; seq_parallel.py drives the segmented and affine modes. ``p`` (``[B, T, HV, chunk_size]`` fp32 from
    ``fused_prepass`` with queries, or None) sets LOAD_P; the affine mode has no output and ignores it.
    ``num_stages``: the chunk loop's pipelining (None: 2 when the grid is one wave, else 0)."""
    B, T, H, K = q.shape
    HV, V = u.shape[2], u.shape[3]
    for name, prec in (("dot_prec", dot_prec), ("state_prec", state_prec)):
        if prec is not None and prec not in DOT_PRECISIONS:
            raise ValueError(f"{name} must be one of {DOT_PRECISIONS} or None, got {prec!r}")
        if prec == "bf16x3" and q.device.type == "cuda":
            # every walk variant with a bf16x3 dot faults on sm_90 (Triton 3.6, illegal memory access), while the
            # same `dot` helper passes tests/ops/test_dot.py there at M=32 (mma.sync, not wgmma)
            raise ValueError(f"{name}='bf16x3' is not available on CUDA yet: the sequential kernel faults with it "
                             "on sm_90 (Triton 3.6); use 'tf32x3', 'tf32' or 'ieee'")
    grid = (cdiv(K + V if affine else V, BV), num_segments * HV)
    stages = loop_stages(num_stages, 2, grid[0] * grid[1], num_sms(q.device))
    load_p = p is not None and not affine
    if load_p and (p.shape != (B, T, HV, chunk_size) or p.dtype != torch.float32):
        raise ValueError(f"p must be [B, T, HV, chunk_size] = {[B, T, HV, chunk_size]} fp32 (fused_prepass with q), "
                         f"got {list(p.shape)} {p.dtype}")
    o_prec, s_prec = fused_dot_precisions(q.dtype)
    fused_fwd_kernel[grid](
        q, k, w, u, gc, p if load_p else None, o, h0, ht, scale, cu_seqlens, segments, T, nseg, seg_len, H=H,
        HV=HV, K=K, V=V, BT=chunk_size, BK=block_size(K, 256), BV=BV, DOT_PREC=dot_prec or o_prec,
        STATE_PREC=state_prec or dot_prec or s_prec, INPUT_PREC=dot_precision(q.dtype),
        USE_INITIAL_STATE=h0 is not None, IS_VARLEN=cu_seqlens is not None, SEGMENTED=segmented, AFFINE=affine,
        LOAD_P=load_p, INTERPRET=triton_interpret(), NUM_STAGES=stages,
        num_warps=num_warps, **launch_options("fused_fwd"))


def fused_fwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gc: torch.Tensor, scale: float,
              initial_state: Optional[torch.Tensor], out_dtype: torch.dtype,
              cu_seqlens: Optional[torch.Tensor] = None, BV: Optional[int] = None,
              num_warps: Optional[int] = None, dot_prec: Optional[str] = None,
              state_prec: Optional[str] = None, chunk_size: int = CHUNK, p: Optional[torch.Tensor] = None,
              num_stages: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the chunks of every sequence in order and write the output and the final state.

    Args:
        q, k: ``[B, T, H, K]`` (value head i reads query/key head ``i // (HV // H)``).
        w: ``[B, T, HV, K]`` fp32, u: ``[B, T, HV, V]`` fp32, gc: ``[B, T, HV]`` fp32, from :func:`fused_prepass`.
        scale: query scale. initial_state: ``[N, HV, K, V]`` (any float dtype; read as fp32) or None (zeros).
        out_dtype: dtype of o. cu_seqlens: varlen offsets ``[N + 1]`` (B == 1) or None.
        BV, num_warps: override :func:`fused_fwd_config`; dot_prec, state_prec: override
            :func:`fused_dot_precisions` for the output dots (Q S, P V_new) and the state dots (W S, Kᵀ V_new):
            one of ``dot.DOT_PRECISIONS`` ("ieee", "tf32", "tf32x3", "bf16x3"); a dot_prec alone sets both
            (benchmarks).
        p: ``[B, T, HV, chunk_size]`` fp32 P = Q Kᵀ ⊙ D ⊙ causal of every chunk (``fused_prepass`` with q), or
            None: the walk computes P itself. Given, it is read instead (LOAD_P); the result is the same up to fp32
            rounding.
        num_stages: the chunk loop's pipelining (None: 2 when the grid is one wave, else 0; benchmarks).
    Returns:
        o ``[B, T, HV, V]`` in ``out_dtype``, final state ``[N, HV, K, V]`` fp32.
    """
    B, T, H, K = q.shape
    HV, V = u.shape[2], u.shape[3]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    _, BV_default, warps_default = fused_fwd_config(K, V, N * HV, num_sms(q.device))
    o = torch.empty(B, T, HV, V, dtype=out_dtype, device=q.device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    launch_walk(q, k, w, u, gc, o, initial_state, ht, scale, cu_seqlens, BV or BV_default,
                num_warps or warps_default, dot_prec, state_prec, chunk_size, N, p=p, num_stages=num_stages)
    return o, ht
