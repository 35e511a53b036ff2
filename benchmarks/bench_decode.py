"""Decode benchmark (issue 5): gated_delta_rule_decode on one GPU, CUDA-graph replay, beside fla's fused_recurrent.

Checks correctness first (against the float64 reference: pool slots with gaps and a negative slot, 1 and 4 tokens,
fp32 and bf16 pools; bf16-pool drift over 4096 steps; the recurrent training op's forward and backward), then
times, at HV = 32, H = 16, K = V = 128, q/k/v bf16, fused gate / β sigmoid / q-k L2 norm:

* kernel time per step under CUDA-graph replay for B ∈ {1, 64, 256}, state fp32 and bf16, Tq ∈ {1, 4, 8};
* state bandwidth (state bytes read + written per step / time) against the measured device-to-device copy
  bandwidth of the same number of bytes (torch ``copy_`` in this script, same run);
* eager call latency at B = 1 (with and without the host-side slot check);
* a BV / num_warps (/ register cap) sweep of the kernel's tiles at B = 64 and 256, and at B = 64 with 4 tokens
  (to tune ``pick_tiles``), one- and two-warp tiles included; one token runs the kernel's ONE_STEP path
  (``recurrent_kernels.one_step_path``) with tiles of its own (``--sweep-only``: this alone);
* fla's ``fused_recurrent_gated_delta_rule`` on the same inputs if fla is importable (fp32 state, gate and β
  precomputed since its call takes them so; it reads initial_state and writes a new final state: same bytes).

    python benchmarks/bench_decode.py [--out DIR] [--quick | --sweep-only [--layout-sweep]]

Prints one table last and writes bench_decode.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import torch

import linattn
from linattn.eval.decode import copy_gbs, graph_ms
from linattn.ops import common
from linattn.ops.gated_delta import recurrent_kernels as rk
from linattn.ops.gated_delta.reference import gated_delta_rule_reference
from linattn.ops.utils import gate_from_raw, l2norm

H, HV, K, V = 16, 32, 128, 128
DEV = "cuda"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make_step(B, Tq, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)
    return dict(q=r(B, Tq, H, K).to(dtype), k=r(B, Tq, H, K).to(dtype), v=r(B, Tq, HV, V).to(dtype),
                g=r(B, Tq, HV), beta=r(B, Tq, HV))


def gate_params(seed=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return dict(A_log=torch.rand(HV, device=DEV, generator=gen).log() - 2.0,
                dt_bias=torch.randn(HV, device=DEV, generator=gen))


FUSED = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def reference(t, h0, gate):
    q, k = l2norm(t["q"].double()), l2norm(t["k"].double())
    g = gate_from_raw(t["g"].double(), gate["A_log"].double(), gate["dt_bias"].double())
    return gated_delta_rule_reference(q, k, t["v"].double(), g, t["beta"].double().sigmoid(), K ** -0.5,
                                      h0.double())


# ----------------------------------------------------------------------------------------------------------------
# correctness
# ----------------------------------------------------------------------------------------------------------------
def check_decode(rows):
    gate = gate_params()
    for layout in ("kv", "vk"):
        kv = (lambda x: x.transpose(-1, -2)) if layout == "vk" else (lambda x: x)   # the pool seen K-major
        for pool_dtype in (torch.float32, torch.bfloat16):
            for Tq in (1, 4):
                P, slots = 9, [7, 2, -1, 4]
                pool = (torch.randn(P, HV, K, V, device=DEV) * 0.05).to(pool_dtype)
                before = pool.clone()
                pool = kv(pool).contiguous()                  # stored in the layout, the same values
                t = make_step(len(slots), Tq, seed=Tq)
                h0 = torch.stack([before[s].float() if s >= 0 else torch.zeros(HV, K, V, device=DEV)
                                  for s in slots])
                o, inter = linattn.gated_delta_rule_decode(**t, state_pool=pool, state_indices=torch.tensor(
                    slots, device=DEV), output_intermediate_states=True, **gate, **FUSED, state_layout=layout)
                ro, rht = reference(t, h0, gate)
                live = [i for i, s in enumerate(slots) if s >= 0]
                others = [s for s in range(P) if s not in slots]
                rows.append(dict(check=f"decode {layout} pool={str(pool_dtype)[6:]} Tq={Tq}", o_err=rel(o, ro),
                                 state_err=rel(kv(pool)[[slots[i] for i in live]], rht[live]),
                                 inter_last_err=rel(kv(inter[:, -1]), rht),
                                 untouched=bool(torch.equal(kv(pool)[others], before[others]))))
    for name, slots in (("repeated slots", [1, 1]), ("slot >= P", [0, 9])):
        try:
            linattn.gated_delta_rule_decode(**make_step(2, 1), state_pool=torch.zeros(9, HV, K, V, device=DEV),
                                            state_indices=torch.tensor(slots, device=DEV))
            rows.append(dict(check=name, rejected=False))
        except ValueError:
            rows.append(dict(check=name, rejected=True))


def check_drift(rows, steps):
    """One-token steps from a zero state: fp32 and bf16 pools against the float64 reference over all steps."""
    B = 2
    gate = gate_params()
    t = make_step(B, steps, seed=7)
    ro, rht = reference(t, torch.zeros(B, HV, K, V, device=DEV), gate)
    for pool_dtype in (torch.float32, torch.bfloat16):
        pool = torch.zeros(B, HV, K, V, device=DEV, dtype=pool_dtype)
        outs = []
        for s in range(steps):
            o, _ = linattn.gated_delta_rule_decode(**{n: x[:, s:s + 1] for n, x in t.items()}, state_pool=pool,
                                                   check_indices=False, **gate, **FUSED)
            outs.append(o)
        o = torch.cat(outs, 1)
        rows.append(dict(check=f"drift {steps} steps pool={str(pool_dtype)[6:]}", o_err=rel(o, ro),
                         o_err_last256=rel(o[:, -256:], ro[:, -256:]), state_err=rel(pool, rht)))


def check_recurrent_training(rows):
    """The recurrent op's forward + backward (bf16 inputs, fused pre-processing) against float64 autograd."""
    B, T = 2, 64
    gate = gate_params()
    t = make_step(B, T, seed=11)
    t["initial_state"] = torch.randn(B, HV, K, V, device=DEV) * 0.05
    xs = {n: x.detach().clone().requires_grad_() for n, x in {**t, **gate}.items()}
    o, ht = linattn.fused_recurrent_gated_delta_rule(**xs, output_final_state=True, **FUSED)
    rx = {n: x.detach().double().requires_grad_() for n, x in xs.items()}
    q, k = l2norm(rx["q"]), l2norm(rx["k"])
    g = gate_from_raw(rx["g"], rx["A_log"], rx["dt_bias"])
    ro, rht = gated_delta_rule_reference(q, k, rx["v"], g, rx["beta"].sigmoid(), K ** -0.5, rx["initial_state"])
    do, dht = torch.randn_like(ro), torch.randn_like(rht)
    grads = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dht).sum(), list(xs.values()))
    rgrads = torch.autograd.grad((ro * do).sum() + (rht * dht).sum(), list(rx.values()))
    rec = dict(check="recurrent fwd+bwd bf16 T=64", o_err=rel(o, ro), state_err=rel(ht, rht))
    rec.update({f"d{n}_err": rel(a, b) for n, a, b in zip(xs, grads, rgrads)})
    rows.append(rec)


# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------
def graph_time_us(fn, calls_per_graph=20, replays=30):
    """Median µs per call: fn captured calls_per_graph times in one CUDA graph, the graph replayed."""
    return graph_ms(fn, calls_per_graph, replays) * 1e3


def copy_bandwidth(nbytes):
    """(GB/s, µs) of a device-to-device stream of nbytes (read + write counted): the eval's reference, the best of
    a torch copy into a few placements of the destination and an in-place pass (linattn.eval.decode.copy_gbs)."""
    gbs = copy_gbs(torch.device(DEV), 2 * nbytes)
    return gbs, 2 * nbytes / gbs / 1e3


def time_decode(B, Tq, pool_dtype, BV=None, num_warps=None, maxnreg=None, layout="kv"):
    """µs per step of ``gated_delta_rule_decode`` (or, with BV, the kernel at that tile) over a pool in ``layout``
    ("kv" K-major, "vk" V-major)."""
    gate = gate_params()
    t = make_step(B, Tq)
    P = 2 * B + 1
    pool = (torch.randn(P, HV, K, V, device=DEV) * 0.05).to(pool_dtype)
    if layout == "vk":
        pool = pool.transpose(-1, -2).contiguous()
    slots = torch.randperm(P, device=DEV)[:B]                 # pool rows with gaps, in no order
    if BV is None:
        fn = lambda: linattn.gated_delta_rule_decode(**t, state_pool=pool, state_indices=slots, **gate, **FUSED,
                                                     state_layout=layout)
    else:
        tc = {n: x.contiguous() for n, x in t.items()}
        fn = lambda: rk.fused_recurrent_fwd(tc["q"], tc["k"], tc["v"], tc["g"], tc["beta"], K ** -0.5, pool, pool,
                                            None, None, slots, gate["A_log"], gate["dt_bias"], True, True,
                                            BV=BV, num_warps=num_warps, state_vk=layout == "vk")
    table = dict(common.LAUNCH_OPTIONS)
    if maxnreg is not None:
        table["fused_recurrent_fwd"] = dict(maxnreg=maxnreg)
    with common.launch_options_override(table):
        return graph_time_us(fn), t, pool, slots, gate


def sweep_point(state_bytes, rec, *args, **kwargs):
    """One point of a tile sweep: ``rec`` with the µs of ``time_decode(*args, **kwargs)`` and the state GB/s, or
    the error (a tile that does not compile is a row, not the end of the sweep)."""
    try:
        us = time_decode(*args, **kwargs)[0]
        rec.update(us=us, state_GBps=state_bytes / us / 1e3)
    except Exception as e:
        rec.update(error=str(e)[:80])
    return rec


def time_fla(B, Tq):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fr
    gate = gate_params()
    t = make_step(B, Tq)
    g = gate_from_raw(t["g"], gate["A_log"], gate["dt_bias"])
    beta = t["beta"].sigmoid().to(torch.bfloat16)
    h0 = torch.randn(B, HV, K, V, device=DEV) * 0.05
    fn = lambda: fla_fr(t["q"], t["k"], t["v"], g, beta, scale=K ** -0.5, initial_state=h0,
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return graph_time_us(fn)


def eager_latency_us(fn, n=1000):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return times[n // 2], times[int(n * 0.95)], times[int(n * 0.99)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="fewer drift steps, no tile sweep")
    ap.add_argument("--sweep-only", action="store_true", help="the tile sweep alone (no checks, timings, eager)")
    ap.add_argument("--layout-sweep", action="store_true",
                    help="with --sweep-only: instead of the tile sweep, the tiles of one token (ONE_STEP) and of 4 "
                         "tokens over K-major and V-major pools side by side")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    props = torch.cuda.get_device_properties(0)
    meta = dict(card=props.name, sms=props.multi_processor_count, date=time.strftime("%Y-%m-%d %H:%M"),
                commit=commit, torch=torch.__version__, triton=__import__("triton").__version__)
    print(json.dumps(meta), flush=True)

    checks, timings, sweep, eager = [], [], [], {}
    if not a.sweep_only:
        check_decode(checks)
        check_recurrent_training(checks)
        check_drift(checks, 512 if a.quick else 4096)
    for r in checks:
        print(json.dumps(r), flush=True)

    copy = {}
    for B in (1, 64, 256) if not a.sweep_only else ():
        for pool_dtype in (torch.float32, torch.bfloat16):
            state_bytes = B * HV * K * V * pool_dtype.itemsize * 2          # read + write once per step
            if (B, pool_dtype) not in copy:
                copy[(B, pool_dtype)] = copy_bandwidth(max(state_bytes // 2, 1 << 20))[0]
            for Tq in (1, 4, 8):
                for layout in ("kv", "vk"):
                    us = time_decode(B, Tq, pool_dtype, layout=layout)[0]
                    rec = dict(impl="linattn" if layout == "kv" else "linattn-vk", B=B, pool=str(pool_dtype)[6:],
                               Tq=Tq, us=us, us_per_token=us / Tq, state_GBps=state_bytes / us / 1e3,
                               copy_GBps=copy[(B, pool_dtype)])
                    rec["pct_of_copy"] = 100 * rec["state_GBps"] / rec["copy_GBps"]
                    timings.append(rec)
                    print(json.dumps(rec), flush=True)
                # fla at Tq = 1 only: its fused_recurrent at B = 64, Tq = 4 (graph capture, same inputs) hit an
                # illegal memory access on the H200 (2026-11-29), which poisons the CUDA context for the rest
                if pool_dtype == torch.float32 and Tq == 1:
                    try:
                        us = time_fla(B, Tq)
                        rec = dict(impl="fla", B=B, pool="float32", Tq=Tq, us=us, us_per_token=us / Tq,
                                   state_GBps=state_bytes / us / 1e3, copy_GBps=copy[(B, pool_dtype)])
                        rec["pct_of_copy"] = 100 * rec["state_GBps"] / rec["copy_GBps"]
                    except Exception as e:  # fla missing or its API differs: say so in the table
                        rec = dict(impl="fla", B=B, pool="float32", Tq=Tq, error=f"{type(e).__name__}: {e}"[:120])
                    timings.append(rec)
                    print(json.dumps(rec), flush=True)

    gate_small = gate_params()
    t1 = make_step(1, 1)
    pool1 = torch.randn(4, HV, K, V, device=DEV) * 0.05
    slot1 = torch.tensor([2], device=DEV)
    for checked in (True, False) if not a.sweep_only else ():
        eager[checked] = eager_latency_us(lambda c=checked: linattn.gated_delta_rule_decode(
            **t1, state_pool=pool1, state_indices=slot1, check_indices=c, **gate_small, **FUSED))

    if a.layout_sweep:
        # the same tiles over a K-major and a V-major pool: a K-major bf16 tile of 32 columns reads 64-byte pieces
        # of rows (half a 128-byte line), a V-major one whole 256-byte rows (the 8 KB slice is one contiguous block).
        # (pick_tiles' state_vk rules)
        tiles = {(torch.bfloat16, 1): [(32, 1), (64, 2), (16, 1), (32, 2), (64, 4), (128, 4), (8, 1)],
                 (torch.float32, 1): [(64, 2), (32, 1), (64, 4), (128, 4), (16, 1), (32, 2)],
                 (torch.bfloat16, 4): [(16, 1), (8, 1), (32, 1), (32, 2)],
                 (torch.float32, 4): [(16, 1), (8, 1), (32, 1), (32, 2)]}
        for (pool_dtype, Tq), tl_ in tiles.items():
            for B in ((64, 256) if Tq == 1 else (64,)):
                state_bytes = B * HV * K * V * pool_dtype.itemsize * 2
                for (BV, nw), layout in ((t, lay) for t in tl_ for lay in ("kv", "vk")):
                    sweep.append(sweep_point(state_bytes, dict(pool=str(pool_dtype)[6:], B=B, Tq=Tq, BV=BV,
                                                               num_warps=nw, maxnreg=None, one_step=Tq == 1,
                                                               layout=layout),
                                             B, Tq, pool_dtype, BV=BV, num_warps=nw, layout=layout))
    elif not a.quick:
        # (BV, warps, maxnreg): the tiles; register caps that fit three programs per SM where the tile alone takes
        # 255 registers (sm_90 ptxas: bf16 BV=64 → 168 registers + 748 spill bytes; fp32 BV=64 → 700); and one- or
        # two-warp tiles, whose reductions over K stay inside a warp (2 barriers per step instead of 16) and whose
        # small register files let more programs share an SM (fp32 BV=16 at 1 warp: 8 per SM, 64 KB of state in
        # flight per SM against 48 KB for BV=32 at 4 warps). Tq = 4 too: multi-token steps are bound by those
        # reductions' latency
        narrow = [(8, 1, None), (16, 1, None), (16, 2, None), (32, 2, None)]
        # and at one token (the ONE_STEP path) the tiles sm_90 ptxas fits more programs per SM with: bf16 BV=32 /
        # 4 warps 128 registers (four per SM), BV=64 / 8 warps 136; fp32 BV=32 / 4 warps 127; the one- and two-warp
        # tiles of pick_tiles' ONE_STEP rule (one warp per 4096 values)
        one_step = {torch.float32: [(64, 2, None), (32, 1, None), (32, 4, None), (128, 4, None), (64, 4, 168),
                                    (64, 8, 128)],
                    torch.bfloat16: [(32, 1, None), (64, 2, None), (16, 1, None), (64, 4, None), (32, 4, None),
                                     (64, 8, None), (64, 4, 168), (32, 2, 168)]}
        for pool_dtype, tiles in ((torch.float32, [(bv, nw, None) for bv in (16, 32, 64) for nw in (4, 8)]
                                   + [(64, 4, 168)] + narrow),
                                  (torch.bfloat16, [(bv, nw, None) for bv in (32, 64, 128) for nw in (4, 8)]
                                   + [(64, 4, 168), (128, 8, 128)] + narrow)):
            for B, Tq in ((64, 1), (256, 1), (64, 4)):
                state_bytes = B * HV * K * V * pool_dtype.itemsize * 2
                runs = tiles + (one_step[pool_dtype] if Tq == 1 else [])
                for BV, nw, maxnreg in dict.fromkeys(runs):
                    sweep.append(sweep_point(state_bytes, dict(pool=str(pool_dtype)[6:], B=B, Tq=Tq, BV=BV,
                                                               num_warps=nw, maxnreg=maxnreg, one_step=Tq == 1),
                                             B, Tq, pool_dtype, BV=BV, num_warps=nw, maxnreg=maxnreg))

    with open(os.path.join(a.out, "bench_decode.json"), "w") as fh:
        json.dump(dict(meta=meta, checks=checks, timings=timings, eager=eager, sweep=sweep), fh, indent=1)

    print(f"\n{meta['card']}  {meta['date']}  commit {meta['commit']}  torch {meta['torch']}  "
          f"triton {meta['triton']}")
    print("\ncorrectness (relative L2 error against float64)")
    for r in checks:
        print("  " + "  ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if eager:
        print("\nB=1 eager call latency, µs (P50 / P95 / P99): "
              f"with slot check {eager[True][0]:.1f} / {eager[True][1]:.1f} / {eager[True][2]:.1f}, "
              f"without {eager[False][0]:.1f} / {eager[False][1]:.1f} / {eager[False][2]:.1f}")
    if sweep:
        print("\ntile sweep, fastest first per (pool, B, Tq); GB/s counts the state read and written once")
        for pool in ("float32", "bfloat16"):
            for B, Tq in ((64, 1), (256, 1), (64, 4)):
                ok = [s for s in sweep if (s["pool"], s["B"], s["Tq"]) == (pool, B, Tq) and "us" in s]
                for s in sorted(ok, key=lambda s: s["us"]):
                    cap = (f" maxnreg={s['maxnreg']}" if s.get("maxnreg") else "") + (
                        " ONE_STEP" if s.get("one_step") else "") + (f" {s['layout']}" if s.get("layout") else "")
                    print(f"  {pool:9s} B={B:3d} Tq={Tq} BV={s['BV']:3d} warps={s['num_warps']}{cap}  "
                          f"{s['us']:8.1f} µs  {s['state_GBps']:6.0f} GB/s")
    print("\nCUDA-graph replay, HV=32 K=V=128, per step")
    print(f"{'impl':10s} {'B':>4s} {'pool':>9s} {'Tq':>3s} {'µs':>9s} {'µs/tok':>8s} {'GB/s':>7s} {'copy':>7s} "
          f"{'%copy':>6s}")
    for r in timings:
        if "error" in r:
            print(f"{r['impl']:10s} {r['B']:4d} {r['pool']:>9s} {r['Tq']:3d}  {r['error']}")
            continue
        print(f"{r['impl']:10s} {r['B']:4d} {r['pool']:>9s} {r['Tq']:3d} {r['us']:9.1f} {r['us_per_token']:8.1f} "
              f"{r['state_GBps']:7.0f} {r['copy_GBps']:7.0f} {r['pct_of_copy']:6.1f}")


if __name__ == "__main__":
    main()
