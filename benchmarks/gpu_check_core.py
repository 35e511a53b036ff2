"""GPU check of the core op (issue 2): bf16/fp16 forward and backward of the Triton backend against float64.

For every case: relative L2 error of o, the final state and every gradient against a float64 ground truth (the
token-by-token reference for short cases; the float64 chunked PyTorch backend — itself equal to the reference's
autograd to 1e-15 — for long ones), next to a *baseline*: the error PyTorch makes doing the same chunked
computation from the same low-precision inputs with every stage's output rounded to that precision (the error a
kernel that stores intermediates in bf16/fp16 cannot avoid). The bound is kernel error ≤ 2 × baseline.

    python benchmarks/gpu_check_core.py [--quick] [--cases NAME,...] [--forward-path PATH] [--backward-path PATH]
        [--out DIR]

``--backward-path hopper`` gives the Hopper backward every call it can take (the dispatch's work threshold off:
bf16 on sm_90, K and V in 64 and 128, aligned inputs); each row records the backward that ran (``backward``).

Each case's kernel call runs twice: a row lists any output that differs bit for bit between the two
(``not_repeated``: a race; the backward promises the same bits every run).

Prints one table last; writes core_check.json (and core_check.jsonl, line by line) under --out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import zlib
from unittest import mock

import torch
import torch.nn.functional as F

import linattn
from linattn.ops.gated_delta import dispatch
from linattn.ops.gated_delta import torch_chunk as tc
from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path
from linattn.ops.gated_delta.dispatch import FORWARD_PATHS
from linattn.ops.gated_delta.reference import gated_delta_rule_reference

torch.backends.cuda.matmul.allow_tf32 = False
NAMES = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def make(B, T, H, HV, K, V, N, seed, decay=1 / 16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.float64)
    q = F.normalize(r(B, T, H, K), dim=-1)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, HV, V)
    g = F.logsigmoid(r(B, T, HV)) * decay       # 1/16: the anchors' gate distribution
    beta = torch.rand(B, T, HV, device="cuda", generator=gen, dtype=torch.float64)
    h0 = r(N, HV, K, V) * 0.1
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def grads_of(fn, xs, do, dht):
    xs = {n: t.detach().clone().requires_grad_() for n, t in xs.items()}
    o, ht = fn(**xs)
    gr = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dht).sum(),
                             [xs[n] for n in ("q", "k", "v", "g", "beta", "initial_state")])
    return [o.detach(), ht.detach(), *gr]


def rounded_twin(x, dt, scale, do, dht):
    """The chunked computation in PyTorch, fp32 arithmetic, every stage output rounded to dt."""
    r = lambda t: t.to(dt).float()
    B, T, H, K = x["q"].shape
    HV = x["v"].shape[2]
    G = HV // H
    q, k = (r(x[n]).repeat_interleave(G, 2) for n in ("q", "k"))
    v, beta = r(x["v"]), r(x["beta"])
    g = x["g"].float()
    qc, kc, vc, gch, bc = (tc.to_chunks(t) for t in (q, k, v, g, beta))
    doc = tc.to_chunks(r(do))
    h0 = x["initial_state"].float()
    gc = tc.chunk_local_cumsum_ref(gch)
    A_inv = r(tc.kkt_solve_ref(kc, bc, gc))
    w, u = (r(t) for t in tc.wy_ref(A_inv, kc, vc, bc, gc))
    h, vn, ht = tc.state_pass_fwd_ref(w, u, kc, gc, h0)
    vn = r(vn)
    o = r(tc.output_fwd_ref(qc, kc, vn, h, gc, scale))
    dh, dvn, dh0 = tc.state_pass_bwd_ref(qc, kc, w, gc, doc, dht.float(), scale)
    dq, dk, dv, dbeta, dgc = tc.local_bwd_ref(qc, kc, vc, bc, gc, A_inv, w, h, vn, doc, dh, r(dvn), scale)
    dg = tc.chunk_local_cumsum_bwd_ref(dgc)
    un = lambda t: tc.from_chunks(t, T)
    dq = un(dq).view(B, T, H, G, K).sum(3)
    dk = un(dk).view(B, T, H, G, K).sum(3)
    return [un(o), ht, dq, dk, un(dv), un(dg), un(dbeta), dh0]


BACKWARD_PATHS = ("auto", "hopper")


def backward_routing(backward_path: str):
    """The context the checked calls run in: the dispatch as it is ("auto"), or its Hopper work threshold at 1."""
    if backward_path == "hopper":
        return mock.patch.object(dispatch, "HOPPER_BWD_MIN_WORK", 1)
    return contextlib.nullcontext()


def check(case, dt, use_token_ref, forward_path="auto", backward_path="auto"):
    name, B, T, H, HV, K, V, lengths = case
    N = len(lengths) if lengths else B
    # zlib.crc32, not hash(): str hashes change with every process (PYTHONHASHSEED), and with them the inputs
    x = make(B, T, H, HV, K, V, N, seed=zlib.crc32(name.encode()) % 1000, decay=DECAY.get(name, 1 / 16))
    cu = None
    if lengths:
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    scale = K ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(B, T, HV, V, device="cuda", dtype=torch.float64, generator=gen)
    dht = torch.randn(N, HV, K, V, device="cuda", dtype=torch.float64, generator=gen)
    low = {n: (t.to(dt) if n in ("q", "k", "v", "beta") else t.float()) for n, t in x.items()}
    exact = {n: t.to(dt).double() if n in ("q", "k", "v", "beta") else t.float().double() for n, t in x.items()}

    if use_token_ref:
        ref = grads_of(lambda **a: gated_delta_rule_reference(
            **{kk: a[kk] for kk in ("q", "k", "v", "g", "beta")}, scale=scale, initial_state=a["initial_state"],
            cu_seqlens=cu.tolist() if cu is not None else None), exact, do, dht)
    else:
        ref = grads_of(lambda **a: linattn.chunk_gated_delta_rule(**a, scale=scale, cu_seqlens=cu,
                                                                  output_final_state=True, backend="torch"),
                       exact, do, dht)
    torch.cuda.synchronize()
    t0 = time.time()
    kernel = lambda **a: chunk_gated_delta_rule_on_path(forward_path, **a, scale=scale, cu_seqlens=cu,
                                                        output_final_state=True, backend="triton")
    with backward_routing(backward_path):
        tri = grads_of(kernel, low, do, dht)
        torch.cuda.synchronize()
        first_s = time.time() - t0
        again = grads_of(kernel, low, do, dht)     # the same call again: every output bit for bit (no race)
        ran, _ = dispatch.choose_backward_path(low["q"], low["v"], low["g"], do.to(dt), cu, "triton",
                                               initial_state=low["initial_state"])
    row = dict(case=name, dtype=str(dt).split(".")[-1], B=B, T=T, H=H, HV=HV, K=K, V=V, first_call_s=first_s,
               backward=ran, nonfinite=sum(int((~torch.isfinite(t)).sum()) for t in tri),
               not_repeated=[n for n, a, b in zip(NAMES, tri, again) if not torch.equal(a, b)])
    row["err"] = {n: rel(a, b) for n, a, b in zip(NAMES, tri, ref)}
    if cu is None:
        base = rounded_twin(low, dt, scale, do, dht)
        row["base"] = {n: rel(a, b) for n, a, b in zip(NAMES, base, ref)}
    return row


def ratio_cells(row) -> list[str]:
    """One cell per gradient (NAMES) of a ``check`` row for a printed table: kernel error over the baseline's, or the
    kernel error itself where there is no baseline (varlen cases)."""
    base = row.get("base")
    return [f"{row['err'][n] / base[n]:.2f}" if base else f"{row['err'][n]:.1e}" for n in NAMES]


# g = decay · logsigmoid(N(0, 1)), 1/16 unless listed: the anchors' gates (mean −0.05 per token) forget a state
# within a few chunks, so a state carried wrongly across a sequence's segments (sequence parallelism) hides there;
# 1/65536 (mean −1.2e-5) keeps it across the whole sequence
DECAY = {"T32768_slow_decay": 1 / 65536}
CASES = [  # name, B, T, H, HV, K, V, varlen lengths
    ("anchor_B2_T300_K128", 2, 300, 4, 4, 128, 128, None),
    ("T1", 1, 1, 2, 2, 128, 128, None),
    ("T65_K60_V100", 2, 65, 2, 2, 60, 100, None),
    ("GVA_4x_T1000", 1, 1000, 2, 8, 128, 128, None),
    ("K128_V256", 1, 777, 2, 2, 128, 256, None),
    ("K64_V64_T4096", 2, 4096, 4, 4, 64, 64, None),
    ("varlen_K128", 1, 1 + 64 + 500 + 3000 + 77, 2, 4, 128, 128, (1, 64, 500, 3000, 77)),
    ("T32768_K128", 1, 32768, 2, 2, 128, 128, None),
    ("T32768_K64", 1, 32768, 2, 4, 64, 64, None),
    ("T32768_slow_decay", 1, 32768, 2, 2, 128, 128, None),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first three cases")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all, or --quick's)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--forward-path", default="auto", choices=FORWARD_PATHS,
                    help="the forward path for the run (e.g. hopper: the TileLang forward wherever it "
                         "takes the inputs, segmented where its programs alone cannot fill the card; the backward "
                         "is the dispatch's)")
    ap.add_argument("--backward-path", default="auto", choices=BACKWARD_PATHS,
                    help="auto: the dispatch's backward; hopper: the Hopper backward wherever it takes the call")
    a = ap.parse_args()
    cases = CASES[:3] if a.quick else CASES
    if a.cases:
        names = a.cases.split(",")
        unknown = set(names) - {c[0] for c in CASES}
        if unknown:
            ap.error(f"unknown case(s) {sorted(unknown)}; known: {[c[0] for c in CASES]}")
        cases = [c for c in CASES if c[0] in names]
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    log = open(os.path.join(a.out, "core_check.jsonl"), "w")  # one line per case, kept if the run is cut short
    for case in cases:
        for dt in (torch.bfloat16, torch.float16):
            try:
                row = check(case, dt, use_token_ref=case[2] <= 1000, forward_path=a.forward_path,
                            backward_path=a.backward_path)
            except Exception as e:  # keep going: one failing case must not hide the others
                row = dict(case=case[0], dtype=str(dt), error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            torch.cuda.empty_cache()
    with open(os.path.join(a.out, "core_check.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print("\nrelative L2 error vs float64: kernel / rounded-PyTorch baseline (! marks kernel > 2 × baseline)")
    print("%-22s %-9s %-7s " % ("case", "dtype", "bwd") + " ".join("%-16s" % n for n in NAMES))
    for r in rows:
        if "error" in r:
            print(r["case"], r["dtype"], r["error"])
            continue
        cells = []
        for n in NAMES:
            e = r["err"][n]
            b = r.get("base", {}).get(n)
            cells.append(f"{e:.1e}" + (f"/{b:.1e}{'' if e <= 2 * b else '!'}" if b is not None else ""))
        print("%-22s %-9s %-7s " % (r["case"][:22], r["dtype"], r["backward"]) + " ".join("%-16s" % c for c in cells)
              + (f"  NONFINITE={r['nonfinite']}" if r["nonfinite"] else "")
              + (f"  NOT REPEATED: {','.join(r['not_repeated'])}" if r["not_repeated"] else ""))


if __name__ == "__main__":
    main()
