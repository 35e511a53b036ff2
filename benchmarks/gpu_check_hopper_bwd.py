"""GPU check of the Hopper backward (linattn/ops/hopper/backward.py, issue 45): accuracy, determinism, then time.

(a) the walk alone against its PyTorch twin on the same inputs (each raw output, partials included); then
    accuracy, bf16, with h0 and dht (GVA, K = 64 and 128, T = 65 to 1000, slow decay, a repeated token): relative
    L2 of every gradient against float64 autograd of the token-by-token reference on the same rounded inputs,
    beside the Triton backward's error and the rounded PyTorch baseline's (gpu_check_core.rounded_twin: every
    stage's output rounded to bf16; the bound is Hopper ≤ 2 × baseline); then a bitwise repeat (two runs, the same
    bits).
(b) time (triton.testing.do_bench medians) at the anchor rows 2 (B=8, T=4096, H=HV=16), 3 (B=1, T=32768, H=HV=16)
    and 7 (B=1, T=32768, H=2, HV=8), K = V = 128: the recompute, the fused walk alone (and µs per chunk: walk ms
    over the T/64 chunks each program walks), the reductions (one launch: sums, mask, casts), the whole Hopper
    backward and the Triton backward.
    The walk is unsegmented: rows 3 and 7 run B·HV·2 programs of 512 chunks on 132 SMs.
(c) with ``--partials`` (instead of (a) and (b)): the walk's dq, dk partials stored in fp32 against bf16
    (``dqk_partial_dtype``): the walk against its twin (which rounds its partials the same way) and every
    gradient's error against float64 on (a)'s cases, for both; then at rows 1 (B=1, T=4096, H=HV=16), 2 and 5
    (B=4, T=8192, H=16, HV=32) the walk, the reductions (one launch) and the whole backward, both in one process.

    python benchmarks/gpu_check_hopper_bwd.py --out $OUT       # on an H100/H200, ≈ 3-5 min with compiles
    python benchmarks/gpu_check_hopper_bwd.py --partials --out $OUT     # (c), ≈ 3-4 min with compiles
    python benchmarks/gpu_check_hopper_bwd.py --smoke          # CPU: builds every kernel for sm_90a, ptxas report

Writes hopper_bwd.json under --out after every case (a run cut short keeps what it reached); prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# name, B, T, H, HV, K, V, BV (None: the host's default), gate decay (gpu_check_core.make's: 1/16 the anchors'),
# repeated (one q and one k for every token: the case that punishes bf16 operands of dA and bf16 dq, dk partials;
# the twin puts dk at 1.8× the rounded baseline with fp32 partials)
CASES = [
    ("B2_T300_GVA_K128", 2, 300, 2, 4, 128, 128, None, 1 / 16, False),
    ("B2_T300_GVA_K64", 2, 300, 2, 4, 64, 64, None, 1 / 16, False),
    ("B2_T300_GVA_K64_BV32", 2, 300, 2, 4, 64, 64, 32, 1 / 16, False),
    ("B1_T65_K128", 1, 65, 1, 2, 128, 128, None, 1 / 16, False),
    ("B1_T1000_K128_slow_decay", 1, 1000, 2, 2, 128, 128, None, 1 / 1024, False),
    ("B1_T256_K128_repeated_token", 1, 256, 1, 2, 128, 128, None, 1 / 16, True),
]
ROWS = [  # anchor row, B, T, H, HV (K = V = 128)
    (2, 8, 4096, 16, 16),
    (3, 1, 32768, 16, 16),
    (7, 1, 32768, 2, 8),
]
PARTIAL_ROWS = [  # (c)'s rows: host-bound (1), many pairs (2), GVA with twice the partials per qk head (5)
    (1, 1, 4096, 16, 16),
    (2, 8, 4096, 16, 16),
    (5, 4, 8192, 16, 32),
]
PARTIALS = {"float32": torch.float32, "bfloat16": torch.bfloat16}     # (c)'s dtypes of the dq, dk partials


def kernel_configs() -> list[tuple]:
    """(H, HV, K, V, scale, BV, dq/dk partial dtype) of every walk this script launches ((a), (b) and (c))."""
    config = lambda H, HV, K, V, BV, partials="float32": (H, HV, K, V, K ** -0.5, BV or min(V, 64), partials)
    configs = [config(H, HV, K, V, BV) for _, _, _, H, HV, K, V, BV, _, _ in CASES]
    configs += [config(H, HV, 128, 128, 64) for _, _, _, H, HV in ROWS]
    configs += [config(H, HV, K, V, BV, "bfloat16") for _, _, _, H, HV, K, V, BV, _, _ in CASES]
    configs += [config(H, HV, 128, 128, 64, p) for _, _, _, H, HV in PARTIAL_ROWS for p in PARTIALS]
    return list(dict.fromkeys(configs))


def smoke() -> list[dict]:
    """Build every walk for sm_90a without a GPU and report its shared memory and ptxas figures."""
    from linattn.ops.hopper import backward, chunk_bwd  # noqa: F401  (the host chain imports)
    from linattn.ops.hopper.cubin import compile_sm90a, launch_shared_bytes, ptxas_summary
    out = []
    for config in kernel_configs():
        t0 = time.time()
        kernel = chunk_bwd.compiled_kernel(*config[:6], target="sm_90a", dqk_partial_dtype=PARTIALS[config[6]])
        with tempfile.TemporaryDirectory() as d:
            report = compile_sm90a(kernel.get_kernel_source(), Path(d))[1]
        row = dict(config=config, shared_bytes=launch_shared_bytes(kernel), compile_s=round(time.time() - t0, 1),
                   **ptxas_summary(report))
        print(row, flush=True)
        out.append(row)
    return out


def bf16_inputs(name, B, T, H, HV, K, V, decay, repeated=False):
    """gpu_check_core.make's inputs (unit-norm q, k; h0; ``repeated``: the first token's q and k for every token),
    q, k, v, β and do rounded to bf16, and their float64 ground-truth copies; do and dht fresh normals."""
    import zlib

    from gpu_check_core import make
    x = make(B, T, H, HV, K, V, B, seed=zlib.crc32(name.encode()) % 1000, decay=decay)
    if repeated:
        x["q"], x["k"] = (x[n][:, :1].expand_as(x[n]).clone() for n in ("q", "k"))
    gen = torch.Generator(device="cuda").manual_seed(7)
    x["do"] = torch.randn(B, T, HV, V, device="cuda", dtype=torch.float64, generator=gen)
    dht = torch.randn(B, HV, K, V, device="cuda", dtype=torch.float64, generator=gen).float()
    low = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v", "beta", "do") else t.float()) for n, t in x.items()}
    exact = {n: t.double() for n, t in low.items()}
    return low, exact, dht


def check_case(case, partials: str = "float32") -> dict:
    """Errors of the Hopper backward (its dq, dk partials in ``partials``) and Triton's and of the rounded baseline
    against float64 autograd."""
    from gpu_check_core import grads_of, rel, rounded_twin

    from linattn.ops.gated_delta.reference import gated_delta_rule_reference
    from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton
    from linattn.ops.hopper.backward import chunk_gated_delta_rule_bwd_hopper
    name, B, T, H, HV, K, V, BV, decay, repeated = case
    low, exact, dht = bf16_inputs(name, B, T, H, HV, K, V, decay, repeated)
    scale = K ** -0.5
    args = [low[n] for n in ("q", "k", "v", "g", "beta")]
    ref = grads_of(lambda **a: gated_delta_rule_reference(
        **{n: a[n] for n in ("q", "k", "v", "g", "beta")}, scale=scale, initial_state=a["initial_state"]),
        {n: t for n, t in exact.items() if n != "do"}, exact["do"], dht.double())[2:]
    t0 = time.time()
    hop = chunk_gated_delta_rule_bwd_hopper(*args, scale, low["initial_state"], low["do"], dht, BV,
                                            PARTIALS[partials])
    torch.cuda.synchronize()
    first_s = time.time() - t0
    tri = chunk_gated_delta_rule_bwd_triton(*args, scale, low["initial_state"], None, None, low["do"], dht)
    base = rounded_twin(low, torch.bfloat16, scale, low["do"].double(), dht.double())[2:]
    row = dict(case=name, partials=partials, B=B, T=T, H=H, HV=HV, K=K, V=V, BV=BV, first_call_s=round(first_s, 1),
               nonfinite=sum(int((~torch.isfinite(t)).sum()) for t in hop))
    for label, grads in (("hopper", hop), ("triton", tri), ("base", base)):
        row[label] = {n: rel(a, b) for n, a, b in zip(GRADS, grads, ref)}
    row["vs_triton"] = {n: row["hopper"][n] / max(row["triton"][n], 1e-30) for n in GRADS}
    row["vs_base"] = {n: row["hopper"][n] / max(row["base"][n], 1e-30) for n in GRADS}
    return row


def twin_case(case, partials: str = "float32") -> dict:
    """The walk alone against its twin (``chunk_bwd_ref.chunk_bwd_v_slices_ref``, fp32 on the GPU, the kernel's
    rounding points, dq, dk partials rounded to ``partials``) on the same recomputed gc, T and h: relative L2 of
    each raw output (the partials before any sum), so that a wrong output of the kernel shows apart from the host
    chain around it."""
    from gpu_check_core import rel

    from linattn.ops.hopper import backward, chunk_bwd
    from linattn.ops.hopper import chunk_bwd_ref as bwd
    name, B, T, H, HV, K, V, BV, decay, repeated = case
    BV = BV or min(V, 64)
    low, _, dht = bf16_inputs(name, B, T, H, HV, K, V, decay, repeated)
    scale = K ** -0.5
    gc, a_inv, h = backward.recompute(low["k"], low["v"], low["g"], low["beta"], low["initial_state"])
    got = chunk_bwd.chunk_bwd_hopper(low["q"], low["k"], low["v"], low["do"], backward.head_major_chunks(gc),
                                     backward.head_major_chunks(low["beta"].float()), a_inv, h, dht, scale, BV,
                                     PARTIALS[partials])
    # the twin pads gc past T with the sequence's last value (its γ is the chunk's last row), β with zeros; its
    # "checkpoints" are h itself, one per chunk
    pad = (0, got[3].shape[-1] - T)
    saved = bwd.SavedForward(torch.nn.functional.pad(gc.transpose(1, 2), pad, mode="replicate"),
                             torch.nn.functional.pad(low["beta"].float().transpose(1, 2), pad), a_inv.float(),
                             h.transpose(1, 2).float(), 1)
    twin = bwd.chunk_bwd_v_slices_ref(low["q"], low["k"], low["v"], low["do"], dht, saved, scale, BV,
                                      dqk_partial_dtype=PARTIALS[partials])
    tokens = lambda x: x[..., :T].transpose(-1, -2)       # [NV, B, HV, Lp] → [NV, B, T, HV]
    outputs = dict(dq_partials=(got[0], twin.dq), dk_partials=(got[1], twin.dk), dv=(got[2], twin.dv),
                   dg_partials=(tokens(got[3]), twin.dg), dbeta_partials=(tokens(got[4]), twin.dbeta),
                   dh0=(got[5], twin.dh0))
    return dict(case=name, partials=partials, rel_l2={n: rel(a, b) for n, (a, b) in outputs.items()},
                nonfinite=sum(int((~torch.isfinite(a)).sum()) for a, _ in outputs.values()))


def repeat_case(case) -> dict:
    """Two runs of the Hopper backward on the same inputs: every output bit for bit equal."""
    from linattn.ops.hopper.backward import chunk_gated_delta_rule_bwd_hopper
    name, B, T, H, HV, K, V, BV, decay, repeated = case
    low, _, dht = bf16_inputs(name, B, T, H, HV, K, V, decay, repeated)
    args = ([low[n] for n in ("q", "k", "v", "g", "beta")] + [K ** -0.5, low["initial_state"], low["do"], dht, BV])
    runs = [chunk_gated_delta_rule_bwd_hopper(*args) for _ in range(2)]
    return dict(case=name, bitwise_equal={n: bool(torch.equal(a, b)) for n, a, b in zip(GRADS, *runs)})


def row_inputs(B: int, T: int, H: int, HV: int, K: int = 128, V: int = 128) -> dict:
    """Fresh random inputs of an anchor row (seeded): unit-norm bf16 q, k; bf16 v, do, β; the anchors' gates."""
    torch.manual_seed(0)
    x = dict(q=torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16(),
             k=torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16(),
             v=torch.randn(B, T, HV, V, device="cuda").bfloat16(),
             do=torch.randn(B, T, HV, V, device="cuda").bfloat16(),
             g=torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda")) / 16,
             beta=torch.rand(B, T, HV, device="cuda").bfloat16())
    x["h0"], x["dht"] = (torch.randn(B, HV, K, V, device="cuda") * 0.1 for _ in range(2))
    return x


def time_row(row) -> dict:
    """do_bench medians (ms) of the backward's parts and of the whole, Hopper and Triton, at one anchor row."""
    import triton

    from linattn.ops.gated_delta.triton_bwd import chunk_gated_delta_rule_bwd_triton
    from linattn.ops.hopper import backward, chunk_bwd
    index, B, T, H, HV = row
    K = V = 128
    scale = K ** -0.5
    x = row_inputs(B, T, H, HV)
    q, k, v, do, g, beta, h0, dht = (x[n] for n in ("q", "k", "v", "do", "g", "beta", "h0", "dht"))
    gc, a_inv, h = backward.recompute(k, v, g, beta, h0)
    gc_hm, beta_hm = backward.head_major_chunks(gc), backward.head_major_chunks(beta.float())
    walk = lambda: chunk_bwd.chunk_bwd_hopper(q, k, v, do, gc_hm, beta_hm, a_inv, h, dht, scale, 64)
    dq_p, dk_p, _, dg_p, db_p, _ = walk()
    ms = dict(
        recompute=triton.testing.do_bench(lambda: backward.recompute(k, v, g, beta, h0)),
        walk=triton.testing.do_bench(walk),
        reductions=triton.testing.do_bench(lambda: backward.gradients_from_partials(
            dq_p, dk_p, dg_p, db_p, g, beta.dtype, q.dtype, H)),
        hopper=triton.testing.do_bench(lambda: backward.chunk_gated_delta_rule_bwd_hopper(
            q, k, v, g, beta, scale, h0, do, dht)),
        triton=triton.testing.do_bench(lambda: chunk_gated_delta_rule_bwd_triton(
            q, k, v, g, beta, scale, h0, None, None, do, dht)))
    chunks = -(-T // 64)
    return dict(row=index, B=B, T=T, H=H, HV=HV, K=K, V=V, programs=B * HV * 2, chunks_per_program=chunks,
                ms=ms, walk_us_per_chunk=ms["walk"] * 1000 / chunks)


def time_partials_row(row) -> dict:
    """(c) at one anchor row: do_bench medians (ms) of the walk, the reductions and the whole Hopper backward with
    the dq, dk partials in each of :data:`PARTIALS`, one after the other on the same inputs; the partials' bytes
    the reductions read (GB) and their rate (TB/s)."""
    import triton

    from linattn.ops.hopper import backward, chunk_bwd
    index, B, T, H, HV = row
    scale = 128 ** -0.5
    x = row_inputs(B, T, H, HV)
    q, k, v, do, g, beta, h0, dht = (x[n] for n in ("q", "k", "v", "do", "g", "beta", "h0", "dht"))
    gc, a_inv, h = backward.recompute(k, v, g, beta, h0)
    gc_hm, beta_hm = backward.head_major_chunks(gc), backward.head_major_chunks(beta.float())
    result = dict(row=index, B=B, T=T, H=H, HV=HV, programs=B * HV * 2, ms={}, partials_gb={},
                  reductions_read_tb_s={})
    for name, dtype in PARTIALS.items():
        walk = lambda dtype=dtype: chunk_bwd.chunk_bwd_hopper(q, k, v, do, gc_hm, beta_hm, a_inv, h, dht, scale, 64,
                                                              dtype)
        dq_p, dk_p, _, dg_p, db_p, _ = walk()
        reduce = lambda p=(dq_p, dk_p, dg_p, db_p): backward.gradients_from_partials(*p, g, beta.dtype, q.dtype, H)
        whole = lambda dtype=dtype: backward.chunk_gated_delta_rule_bwd_hopper(q, k, v, g, beta, scale, h0, do, dht,
                                                                               dqk_partial_dtype=dtype)
        result["ms"][name] = dict(walk=triton.testing.do_bench(walk), reductions=triton.testing.do_bench(reduce),
                                  hopper=triton.testing.do_bench(whole))
        read = sum(p.numel() * p.element_size() for p in (dq_p, dk_p, dg_p, db_p)) + g.numel() * 4
        result["partials_gb"][name] = read / 1e9
        result["reductions_read_tb_s"][name] = read / result["ms"][name]["reductions"] / 1e9
        del dq_p, dk_p, dg_p, db_p
    return result


def print_tables(results: dict) -> None:
    print(f"\ndevice: {results.get('device')}")
    print("\nthe walk against its twin on the same gc, T, h (rel L2 of each raw output; ≈ 1e-3 is rounding):")
    for r in results["twin"]:
        print(f"{r['case']:<28}{r.get('rel_l2', r.get('error'))}  nonfinite {r.get('nonfinite')}")
    print(f"\n{'case':<28}" + "".join(f"{n:>9}" for n in GRADS) + "   (rel L2 vs float64; hopper/triton; hopper/base)")
    for r in results["accuracy"]:
        if "error" in r:
            print(f"{r['case']:<28}ERROR {r['error'][:200]}")
            continue
        print(f"{r['case']:<28}" + "".join(f"{r['hopper'][n]:9.1e}" for n in GRADS) + "   hopper")
        print(f"{'':<28}" + "".join(f"{r['triton'][n]:9.1e}" for n in GRADS) + "   triton")
        print(f"{'':<28}" + "".join(f"{r['base'][n]:9.1e}" for n in GRADS) + "   rounded baseline")
        print(f"{'':<28}" + "".join(f"{r['vs_triton'][n]:9.2f}" for n in GRADS) + "   hopper / triton")
        print(f"{'':<28}" + "".join(f"{r['vs_base'][n]:9.2f}" for n in GRADS)
              + f"   hopper / base (goal ≤ 2; worst {max(r['vs_base'].values()):.2f})")
    for r in results["repeat"]:
        print(f"bitwise repeat {r.get('case')}: {r.get('bitwise_equal', r.get('error'))}")
    print(f"\n{'row':<5}{'B,T,H,HV':<18}{'recompute':>10}{'walk':>9}{'µs/chunk':>10}{'reduce':>9}{'hopper':>9}"
          f"{'triton':>9}   (ms, do_bench medians)")
    for r in results["timing"]:
        if "error" in r:
            print(f"{r['row']:<5}ERROR {r['error'][:200]}")
            continue
        ms, shape = r["ms"], f"{r['B']},{r['T']},{r['H']},{r['HV']}"
        print(f"{r['row']:<5}{shape:<18}{ms['recompute']:10.3f}{ms['walk']:9.3f}"
              f"{r['walk_us_per_chunk']:10.2f}{ms['reductions']:9.3f}{ms['hopper']:9.3f}{ms['triton']:9.3f}")


def print_partials_tables(results: dict) -> None:
    """(c)'s tables: per case and partials dtype the walk against its twin and each gradient's error against float64
    (and over the rounded baseline's), then per row and dtype the times."""
    print(f"\ndevice: {results.get('device')}")
    print("\nthe walk against its twin, per dq/dk partials dtype (rel L2 of each raw output):")
    for r in results["partials_twin"]:
        print(f"{r['case']:<28}{r.get('partials', ''):<10}{r.get('rel_l2', r.get('error'))}")
    print(f"\n{'case':<28}{'partials':<10}" + "".join(f"{n:>9}" for n in GRADS)
          + "   (rel L2 vs float64, then hopper / rounded baseline: goal ≤ 2)")
    for r in results["partials_accuracy"]:
        if "error" in r:
            print(f"{r['case']:<28}ERROR {r['error'][:200]}")
            continue
        print(f"{r['case']:<28}{r['partials']:<10}" + "".join(f"{r['hopper'][n]:9.1e}" for n in GRADS))
        print(f"{'':<38}" + "".join(f"{r['vs_base'][n]:9.2f}" for n in GRADS)
              + f"   worst {max(r['vs_base'].values()):.2f}")
    print(f"\n{'row':<5}{'B,T,H,HV':<18}{'partials':<10}{'walk':>9}{'reduce':>9}{'hopper':>9}{'read GB':>9}"
          f"{'TB/s':>7}   (ms, do_bench medians)")
    for r in results["partials_timing"]:
        if "error" in r:
            print(f"{r['row']:<5}ERROR {r['error'][:200]}")
            continue
        shape = f"{r['B']},{r['T']},{r['H']},{r['HV']}"
        for name, ms in r["ms"].items():
            print(f"{r['row']:<5}{shape:<18}{name:<10}{ms['walk']:9.3f}{ms['reductions']:9.3f}{ms['hopper']:9.3f}"
                  f"{r['partials_gb'][name]:9.2f}{r['reductions_read_tb_s'][name]:7.2f}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="CPU: build every kernel for sm_90a (no GPU run)")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--timing-only", action="store_true", help="only part (b), e.g. after (a) ran in another process")
    ap.add_argument("--rows", default=",".join(str(r[0]) for r in ROWS), help="anchor rows to time, e.g. 2,3")
    ap.add_argument("--partials", action="store_true",
                    help="(c) only: fp32 against bf16 dq/dk partials, accuracy and time at rows 1, 2, 5")
    args = ap.parse_args(argv)
    if args.smoke:
        return dict(smoke=smoke())
    name = "hopper_bwd_partials" if args.partials else "hopper_bwd_timing" if args.timing_only else "hopper_bwd"
    out = Path(args.out) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = ("partials_twin", "partials_accuracy", "partials_timing") if args.partials else (
        "twin", "accuracy", "repeat", "timing")
    results = dict(device=torch.cuda.get_device_name(), **{part: [] for part in parts})

    def step(key, fn, item, label, *extra):
        try:
            results[key].append(fn(item, *extra))
        except Exception as e:      # keep the other parts: one failure is a row of the table
            traceback.print_exc()
            results[key].append({label: item[0], "error": f"{type(e).__name__}: {e}", "extra": list(extra)})
        out.write_text(json.dumps(results, indent=1))
        print(json.dumps(results[key][-1]), flush=True)

    if args.partials:
        for case in CASES:
            for partials in PARTIALS:
                step("partials_twin", twin_case, case, "case", partials)
        for case in CASES:
            for partials in PARTIALS:
                step("partials_accuracy", check_case, case, "case", partials)
        for row in PARTIAL_ROWS:
            step("partials_timing", time_partials_row, row, "row")
        print_partials_tables(results)
        return results
    if not args.timing_only:
        for case in CASES:
            step("twin", twin_case, case, "case")
        for case in CASES:
            step("accuracy", check_case, case, "case")
        step("repeat", repeat_case, CASES[0], "case")
    if not args.skip_timing:
        rows = {int(r) for r in args.rows.split(",")}
        for row in ROWS:
            if row[0] in rows:
                step("timing", time_row, row, "row")
    print_tables(results)
    return results


if __name__ == "__main__":
    main()
