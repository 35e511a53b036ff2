"""GPU check of the Triton forward of chunk_gated_delta_rule (issue 2, forward half): accuracy and stage timings.

    python benchmarks/gpu_check_fwd.py [--quick] [--dot-prec tf32|tf32x3|bf16x3|ieee] [--out DIR]

Part 1, accuracy (bf16 and fp16; bf16 cannot be tested under the CPU interpreter): every intermediate of
``chunk_gated_delta_rule_fwd_stages`` against the float64 chunked twin, and o / final state against the float64
token-by-token reference. Goal: bf16 o ≤ 2e-3 relative L2 at B=2 T=300 H=4 K=V=128 (fla 3.7e-3; rounding o
itself to bf16 already costs ≈1.7e-3 there).
Part 2, speed (bf16, K=V=128, the anchor shapes of ../shared/anchors/RESULTS.md): ``triton.testing.do_bench``
medians of each stage and of the whole forward, fla's forward beside it when fla is importable.
``--dot-prec`` overrides the precision of the dots on fp32 intermediates for 16-bit inputs (default tf32) to
measure the speed/accuracy trade. Prints one table per part, last; writes fwd_check.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

from linattn.ops import common
from linattn.ops.common import CHUNK, cumsum, kkt_solve, output, state_pass, varlen, wy
from linattn.ops.gated_delta import torch_chunk as tc
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.gated_delta.triton_chunk import chunk_gated_delta_rule_fwd_stages

torch.backends.cuda.matmul.allow_tf32 = False
DEVICE = "cuda"
STAGES = ["gc", "A_inv", "w", "u", "v_new", "h"]


def set_dot_precision(prec: str):
    """Point every stage module at one precision for 16-bit inputs (fp32 inputs keep "ieee")."""
    fn = lambda dtype: "ieee" if dtype == torch.float32 else prec
    for mod in (common, kkt_solve, wy, state_pass, output):
        mod.dot_precision = fn


def make(B, T, H, HV, K, V, lengths, dt, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)
    N = len(lengths) if lengths else B
    x = dict(q=r(B, T, H, K).to(dt), k=F.normalize(r(B, T, H, K), dim=-1).to(dt), v=r(B, T, HV, V).to(dt),
             g=F.logsigmoid(r(B, T, HV)) / 16, beta=torch.rand(B, T, HV, device=DEVICE, generator=gen).to(dt),
             initial_state=r(N, HV, K, V) * 0.1)
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()] if lengths else None
    cu = torch.tensor(offsets, device=DEVICE, dtype=torch.int32) if offsets else None
    return x, cu, offsets


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def twin64(x, offsets, scale):
    """Float64 chunked twin, sequence by sequence, in the Triton layout (as tests/ops/test_triton_fwd.py)."""
    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    HV = v.shape[2]
    seqs = [(b, 0, T) for b in range(B)] if offsets is None else [(0, a, e) for a, e in zip(offsets, offsets[1:])]
    out = {n: [] for n in STAGES}
    for n, (b, bos, eos) in enumerate(seqs):
        if eos == bos:
            continue
        qs, ks = (t[b:b + 1, bos:eos].repeat_interleave(HV // H, 2) for t in (q, k))
        _, kc, vc, gch, bc = (tc.to_chunks(t) for t in (qs, ks, v[b:b + 1, bos:eos], g[b:b + 1, bos:eos],
                                                         beta[b:b + 1, bos:eos]))
        gc = tc.chunk_local_cumsum_ref(gch)
        A_inv = tc.kkt_solve_ref(kc, bc, gc)
        w, u = tc.wy_ref(A_inv, kc, vc, bc, gc)
        h, vn, _ = tc.state_pass_fwd_ref(w, u, kc, gc, x["initial_state"][n:n + 1].double())
        for name, t in (("gc", gc), ("A_inv", A_inv), ("w", w), ("u", u), ("v_new", vn)):
            out[name].append(tc.from_chunks(t, eos - bos))
        out["h"].append(h.permute(0, 2, 1, 3, 4))
    ax = 0 if offsets is None else 1
    return {n: torch.cat(out[n], ax) for n in STAGES}


ACC_CASES = [  # name, B, T, H, HV, K, V, varlen lengths
    ("anchor_B2_T300_K128", 2, 300, 4, 4, 128, 128, None),
    ("T1", 1, 1, 2, 2, 128, 128, None),
    ("T65_K60_V100", 2, 65, 2, 2, 60, 100, None),
    ("GVA_4x_K256_V64", 1, 700, 1, 4, 256, 64, None),
    ("K100_V256", 1, 333, 2, 2, 100, 256, None),
    ("varlen_1_64_0_500", 1, 565, 2, 4, 128, 128, (1, 64, 0, 500)),
]


def accuracy(case, dt):
    name, B, T, H, HV, K, V, lengths = case
    x, cu, offsets = make(B, T, H, HV, K, V, lengths, dt)
    scale = K ** -0.5
    st = chunk_gated_delta_rule_fwd_stages(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"],
                                           cu, offsets)
    ref = twin64(x, offsets, scale)
    ro, rht = gated_delta_rule_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x["initial_state"],
                                         offsets)
    row = dict(case=name, dtype=str(dt)[6:], o=rel(st.o, ro), ht=rel(st.final_state, rht),
               o_rounding_floor=rel(ro.to(dt), ro),
               nonfinite=int(sum((~torch.isfinite(t)).sum() for t in (st.o, st.final_state, st.h))))
    row.update({n: rel(getattr(st, n), ref[n]) for n in STAGES})
    return row


SPEED_SHAPES = [(1, 4096, 16, 16), (8, 4096, 16, 16), (1, 32768, 16, 16), (4, 8192, 16, 32), (2, 16384, 32, 32),
                (1, 32768, 2, 8)]


def speed(B, T, H, HV, fla_fn):
    K = V = 128
    x, _, _ = make(B, T, H, HV, K, V, None, torch.bfloat16)
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    scale = K ** -0.5
    st = chunk_gated_delta_rule_fwd_stages(q, k, v, g, beta, scale, h0, None, None)
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=100)
    row = dict(B=B, T=T, H=H, HV=HV)
    row["cumsum"] = bench(lambda: cumsum.chunk_local_cumsum(g))
    row["kkt_solve"] = bench(lambda: kkt_solve.kkt_solve(k, beta, st.gc, HV))
    row["wy"] = bench(lambda: wy.wy_fwd(k, v, beta, st.gc, st.A_inv))
    row["state_pass"] = bench(lambda: state_pass.state_pass_fwd(k, st.w, st.u, st.gc, h0))
    row["output"] = bench(lambda: output.output_fwd(q, k, st.v_new, st.h, st.gc, scale, v.dtype))
    row["fwd"] = bench(lambda: chunk_gated_delta_rule_fwd_stages(q, k, v, g, beta, scale, h0, None, None))
    # FLOPs per token per value head: K Kᵀ 2CK, WY 2C(K+V), W S + state update 4KV, Q S 2KV, Q Kᵀ 2CK, P V 2CV
    flops = B * T * HV * (4 * CHUNK * K + 2 * CHUNK * (K + V) + 6 * K * V + 2 * CHUNK * V)
    row["fwd_tflops"] = flops / row["fwd"] * 1e-9
    if fla_fn is not None:
        row["fla_fwd"] = bench(lambda: fla_fn(q, k, v, g, beta, scale=scale, initial_state=h0,
                                              output_final_state=True))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dot-prec", default=None, choices=["tf32", "tf32x3", "bf16x3", "ieee"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.dot_prec:
        set_dot_precision(a.dot_prec)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, "dot_prec", a.dot_prec or "default",
          flush=True)
    assert varlen.chunk_tables([0, 1, 65], CHUNK, DEVICE)[1].tolist() == [0, 1, 2]
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
    except Exception:
        fla_fn = None

    acc = []
    for case in ACC_CASES[:3] if a.quick else ACC_CASES:
        for dt in (torch.bfloat16, torch.float16):
            try:
                row = accuracy(case, dt)
            except Exception as e:      # one failing case must not hide the others
                row = dict(case=case[0], dtype=str(dt)[6:], error=f"{type(e).__name__}: {str(e)[:300]}")
            acc.append(row)
            print(json.dumps(row), flush=True)
    spd = []
    for shape in SPEED_SHAPES[:2] if a.quick else SPEED_SHAPES:
        try:
            row = speed(*shape, fla_fn)
        except Exception as e:
            row = dict(B=shape[0], T=shape[1], H=shape[2], HV=shape[3], error=f"{type(e).__name__}: {str(e)[:300]}")
        spd.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "fwd_check.json"), "w") as fh:
        json.dump(dict(accuracy=acc, speed=spd, dot_prec=a.dot_prec), fh, indent=1)

    print("\naccuracy: relative L2 vs float64 (o, ht: token reference; stages: chunked twin); "
          "goal: bf16 anchor o <= 2e-3")
    cols = ["o", "o_rounding_floor", "ht", *STAGES]
    print(f"{'case':<22} {'dtype':<9} " + " ".join(f"{c[:10]:<10}" for c in cols))
    for r in acc:
        head = f"{r['case'][:22]:<22} {r['dtype']:<9} "
        if "error" in r:
            print(head + r["error"])
            continue
        print(head + " ".join(f"{r[c]:<10.2e}" for c in cols)
              + (f"  NONFINITE={r['nonfinite']}" if r["nonfinite"] else ""))
    print("\nspeed: bf16, K=V=128, do_bench median ms (fwd_tflops: TFLOP/s of the whole forward)")
    cols = ["cumsum", "kkt_solve", "wy", "state_pass", "output", "fwd", "fwd_tflops", "fla_fwd"]
    print(f"{'B, T, H, HV':<22} " + " ".join(f"{c:<10}" for c in cols))
    for r in spd:
        shape = f"{r['B']}, {r['T']}, {r['H']}, {r['HV']}"
        head = f"{shape:<22} "
        if "error" in r:
            print(head + r["error"])
            continue
        print(head + " ".join(f"{r[c]:<10.3f}" if c in r else f"{'-':<10}" for c in cols))


if __name__ == "__main__":
    main()
