"""Bitwise fingerprints of the public op's outputs and gradients, and its forward time, over the paths a refactor
must not change.

A refactor that claims "the default paths' results are unchanged" proves it here: run this script on the tree before
and after (both in one device call, on one card), and compare the two JSON files. Every case draws fixed-seed
inputs, runs ``chunk_gated_delta_rule`` as a user calls it (default dispatch) forward and backward, and records the
sha256 of o, the final state and every gradient. ``--time`` adds the forward's do_bench median (ms) per case, so the
same run gives the before/after speed side by side (alternate the two trees' processes to see the card's drift).

    PYTHONPATH=<tree> python benchmarks/output_digest.py [--time] [--cases NAME,...] --out digests.json
    python benchmarks/output_digest.py --compare before.json after.json

Gates: "anchors" (bench_anchors' draw, logsigmoid(randn)/16), "mixed" (Mamba-style per-head rates: some heads
forget within a chunk, others keep their state for a whole segment), "slow" (1/65536 of the anchors': every state
map counts).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys

import torch
import torch.nn.functional as F

# name: (B, T, H, HV, K, V, dtype, gates, varlen lengths or None, with initial state, backward)
CASES = {
    "row1": (1, 4096, 16, 16, 128, 128, "bf16", "anchors", None, False, True),
    "row2": (8, 4096, 16, 16, 128, 128, "bf16", "anchors", None, False, True),
    "row3": (1, 32768, 16, 16, 128, 128, "bf16", "anchors", None, False, False),
    "row3_mixed": (1, 32768, 16, 16, 128, 128, "bf16", "mixed", None, False, False),
    "row3_slow": (1, 32768, 16, 16, 128, 128, "bf16", "slow", None, False, False),
    "row4": (1, 131072, 16, 16, 128, 128, "bf16", "anchors", None, False, False),
    "row4_mixed": (1, 131072, 16, 16, 128, 128, "bf16", "mixed", None, False, False),
    "row5": (4, 8192, 16, 32, 128, 128, "bf16", "anchors", None, False, False),
    "row6": (2, 16384, 32, 32, 128, 128, "bf16", "anchors", None, False, False),
    "row6_mixed": (2, 16384, 32, 32, 128, 128, "bf16", "mixed", None, False, False),
    "row7": (1, 32768, 2, 8, 128, 128, "bf16", "anchors", None, False, False),
    "row7_mixed": (1, 32768, 2, 8, 128, 128, "bf16", "mixed", None, False, False),
    "row1_mixed_h0": (1, 4096, 16, 16, 128, 128, "bf16", "mixed", None, True, True),
    "row2_h0": (8, 4096, 16, 16, 128, 128, "bf16", "anchors", None, True, False),
    "k64": (2, 4096, 4, 8, 64, 64, "bf16", "anchors", None, True, True),
    "odd_T": (2, 1000, 4, 4, 128, 128, "bf16", "anchors", None, True, True),
    "varlen": (1, 3 * 4096, 16, 16, 128, 128, "bf16", "anchors", (4096, 4096, 4096), True, True),
    "varlen_ragged": (1, 1 + 64 + 500 + 3000 + 77, 2, 4, 128, 128, "bf16", "anchors", (1, 64, 500, 3000, 77), True,
                      True),
    "fp16": (2, 4096, 16, 16, 128, 128, "fp16", "anchors", None, True, True),
    "fp32": (1, 2048, 4, 4, 128, 128, "fp32", "anchors", None, True, True),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def gates(g: torch.Tensor, kind: str) -> torch.Tensor:
    """The log decays of a case: ``g`` is the anchors' draw; see the module docstring for the others."""
    if kind == "anchors":
        return g
    if kind == "slow":
        return g / 65536
    gen = torch.Generator().manual_seed(3)
    HV = g.shape[-1]
    A = torch.exp(torch.rand(HV, generator=gen) * math.log(16))
    dt = torch.exp(math.log(1e-3) + torch.rand(HV, generator=gen) * math.log(100))
    return g * ((A * dt).to(g.device) / -g.mean())


def make_case(B, T, H, HV, K, V, dtype, gate_kind, lengths, with_h0):
    gen = torch.Generator(device="cuda").manual_seed(2)
    dt = DTYPES[dtype]
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q = F.normalize(r(B, T, H, K), dim=-1).to(dt)
    k = F.normalize(r(B, T, H, K), dim=-1).to(dt)
    v = r(B, T, HV, V).to(dt)
    g = gates(F.logsigmoid(r(B, T, HV)) / 16, gate_kind).float()
    beta = torch.rand(B, T, HV, device="cuda", generator=gen).to(dt)
    cu = None
    N = B
    if lengths is not None:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        N = len(lengths)
    h0 = r(N, HV, K, V) * 0.1 if with_h0 else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)


def digest(t) -> str:
    if t is None:
        return "none"
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def run_case(name, spec, time_it):
    from triton.testing import do_bench

    import linattn
    B, T, H, HV, K, V, dtype, gate_kind, lengths, with_h0, backward = spec
    x = make_case(B, T, H, HV, K, V, dtype, gate_kind, lengths, with_h0)
    fn = lambda **kw: linattn.chunk_gated_delta_rule(**kw, output_final_state=True)
    record = dict(case=name)
    with torch.no_grad():
        o, ht = fn(**x)
        torch.cuda.synchronize()
        record.update(o=digest(o), ht=digest(ht), o_finite=bool(o.float().isfinite().all()))
        if time_it:
            record["fwd_ms"] = do_bench(lambda: fn(**x), warmup=25, rep=100, return_mode="median")
    if backward:
        leaves = {n: t.detach().clone().requires_grad_() if t is not None and n != "cu_seqlens" else t
                  for n, t in x.items()}
        o, ht = fn(**leaves)
        gen = torch.Generator(device="cuda").manual_seed(5)
        do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
        dht = torch.randn(ht.shape, device="cuda", generator=gen)
        names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if leaves[n] is not None]
        grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [leaves[n] for n in names])
        record.update({f"d{n}": digest(gr) for n, gr in zip(names, grads)})
    return record


def compare(a_path, b_path) -> int:
    a = {r["case"]: r for r in json.load(open(a_path))}
    b = {r["case"]: r for r in json.load(open(b_path))}
    bad = 0
    print(f"{'case':16s} {'bitwise':10s} {'ms A':>8s} {'ms B':>8s} {'B/A':>6s}")
    for name in a:
        if name not in b:
            print(f"{name:16s} missing in B")
            bad += 1
            continue
        keys = [k for k in a[name] if k not in ("case", "fwd_ms")]
        diff = [k for k in keys if a[name].get(k) != b[name].get(k)]
        bad += bool(diff)
        ta, tb = a[name].get("fwd_ms"), b[name].get("fwd_ms")
        ratio = f"{tb / ta:6.3f}" if ta and tb else "   n/a"
        print(f"{name:16s} {'same' if not diff else 'DIFF ' + ','.join(diff):10s} "
              f"{ta or float('nan'):8.3f} {tb or float('nan'):8.3f} {ratio}")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--time", action="store_true", help="also time each case's forward (do_bench median ms)")
    ap.add_argument("--out", default="digests.json")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two digest files and exit")
    a = ap.parse_args()
    if a.compare:
        sys.exit(1 if compare(*a.compare) else 0)
    names = a.cases.split(",") if a.cases else list(CASES)
    import linattn
    print(torch.cuda.get_device_name(), "linattn from", linattn.__file__, flush=True)
    records = []
    for name in names:
        try:
            record = run_case(name, CASES[name], a.time)
        except Exception as error:  # one case's failure is a record, not the end of the run
            record = dict(case=name, error=f"{type(error).__name__}: {str(error)[:200]}")
        print(json.dumps(record), flush=True)
        records.append(record)
        with open(a.out, "w") as fh:      # after every case: a run cut at its limit keeps what it reached
            json.dump(records, fh, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
