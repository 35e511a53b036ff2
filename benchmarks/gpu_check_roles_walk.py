"""The role-split walk (``hopper/chunk_bwd_roles.py``) beside the walk the backward runs (``hopper/chunk_bwd.py``),
on an sm_90 GPU: the same recomputed inputs into both, each output's relative L2 difference (the slices' dg, dβ
partials added), the role-split walk's outputs run twice (bit for bit), then both walks timed (do_bench medians, ms)
at anchor shapes. ``--op``: then the whole backward with the role-split walk in place of the other
(``chunk_bwd.chunk_bwd_hopper`` patched in this process only) through ``gpu_check_core.check``: each gradient's error
against float64 over the rounded baseline's (the core bound: ≤ 2). ``--timeline``: at each timed row also the
walk's timeline build (``chunk_bwd_roles.walk_timeline``): its outputs against the walk's (bit for bit), its time
(the instrument's cost), and per role the µs of each phase of the chunk step (``timeline.ROLE_POINTS``): which role
waits for which hand-off, and which one bounds the step. ``--alone`` (with ``--timeline``): also each role's phases
in the timeline build where that role alone works and the others only hand off (``walk_timeline(busy=...)``): what
each phase costs without the other roles' work on the SM beside it.

    S=/tmp/site; mkdir -p $S && tar -C $S -xJf .anchors/anchors-site.tar.xz
    PYTHONPATH=$S:$PWD:$PWD/benchmarks python benchmarks/gpu_check_roles_walk.py [--op] --out $OUT

Writes roles_walk.json under --out; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

OUTPUTS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# (name, B, T, H, HV, with dht): odd lengths (a last chunk of 44 and 40 rows), GVA, and anchor row 2
CASES = [("B2_T300_H16", 2, 300, 16, 16, True), ("B1_T1000_H2_HV8", 1, 1000, 2, 8, True),
         ("row2_B8_T4096_H16", 8, 4096, 16, 16, False)]
TIMED = [("row2", 8, 4096, 16, 16), ("row7", 1, 32768, 2, 8), ("row5", 4, 8192, 16, 32)]
K = V = 128


def inputs(name, B, T, H, HV, with_dht: bool) -> dict:
    """``gpu_check_hopper_bwd.bf16_inputs``' (the anchors' gates, an initial state; dht where asked) after the
    backward's recompute (``backward.solve`` and ``states``): the walk's inputs."""
    import gpu_check_hopper_bwd

    from linattn.ops.hopper import backward
    low, _, dht = gpu_check_hopper_bwd.bf16_inputs(name, B, T, H, HV, K, V, 1 / 16)
    gc, beta_hm, a_inv, bound = backward.solve(low["k"], low["g"], low["beta"])
    h = backward.states(low["k"], low["v"], gc, beta_hm, a_inv, bound, low["initial_state"])
    return dict(q=low["q"], k=low["k"], v=low["v"], do=low["do"], gc=gc, beta=beta_hm, a_inv=a_inv, h=h,
                dht=dht if with_dht else None)


def walk_inputs(x: dict) -> list:
    """:func:`inputs`' tensors in the walks' argument order."""
    return [x[n] for n in ("q", "k", "v", "do", "gc", "beta", "a_inv", "h", "dht")]


def walks(x: dict, scale: float):
    """(the slice walk's call, the role-split walk's) on the same inputs; both return dg, dβ ``[NV, B, HV, Lp]``."""
    from linattn.ops.hopper import chunk_bwd, chunk_bwd_roles
    args = walk_inputs(x)
    want = x["dht"] is not None
    return (lambda: chunk_bwd.chunk_bwd_hopper(*args, scale, want_dh0=want),
            lambda: chunk_bwd_roles.chunk_bwd_roles_hopper(*args, scale, want_dh0=want))


def comparable(outputs, T: int) -> list:
    """dq, dk, dv, dg, dβ, dh0 with the slices' dg, dβ added and the head-major rows past T (padding) left out."""
    dq, dk, dv, dg, dbeta, dh0 = outputs
    return [dq, dk, dv, dg.sum(0)[..., :T], dbeta.sum(0)[..., :T], dh0]


def compare(case) -> dict:
    import gpu_check_hopper_bwd
    name, B, T, H, HV, with_dht = case
    x = inputs(name, B, T, H, HV, with_dht)
    print(f"{name}: inputs ready", flush=True)
    old, new = walks(x, K ** -0.5)
    slices, roles = comparable(old(), T), comparable(new(), T)
    torch.cuda.synchronize()
    print(f"{name}: both walks ran", flush=True)
    again = comparable(new(), T)
    row = dict(case=name, difference={}, bitwise_repeat={}, finite={})
    for n, a, b, c in zip(OUTPUTS, roles, slices, again):
        row["difference"][n] = float("nan") if a is None else gpu_check_hopper_bwd.difference(a, b)["rel_l2"]
        row["bitwise_repeat"][n] = bool(a is None or torch.equal(a, c))
        row["finite"][n] = bool(a is None or torch.isfinite(a).all().item())
    return row


def time_case(case) -> dict:
    import triton
    name, B, T, H, HV = case
    old, new = walks(inputs(name, B, T, H, HV, False), K ** -0.5)
    record = dict(case=name, slices_ms=triton.testing.do_bench(old, warmup=25, rep=200),
                  roles_ms=triton.testing.do_bench(new, warmup=25, rep=200))
    # µs per chunk step of one program: the walk's time over its waves (one program per SM) and chunks
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    steps = -(-T // 64)
    for walk, programs in (("slices", 2 * B * HV), ("roles", B * HV)):
        record[f"{walk}_us_per_step"] = record[f"{walk}_ms"] * 1e3 / (-(-programs // sms) * steps)
    return record


def time_timeline(case, alone: bool = False) -> dict:
    """The role-split walk's timeline at a timed row: its outputs against the default build's, both timed, the
    stamps of every step reduced per role (``timeline.role_timeline``). ``alone``: also each role's phases in the
    build where it alone works (``walk_timeline(busy=role)``: the other roles hand off only), and that build's ms."""
    import triton

    from linattn.ops.hopper import chunk_bwd_roles, timeline
    name, B, T, H, HV = case
    args = walk_inputs(inputs(name, B, T, H, HV, False))
    walk = lambda: chunk_bwd_roles.chunk_bwd_roles_hopper(*args, K ** -0.5, want_dh0=False)
    timed = lambda busy=chunk_bwd_roles.ROLES: chunk_bwd_roles.walk_timeline(*args, K ** -0.5, want_dh0=False,
                                                                             busy=busy)
    default, (outputs, stamps) = walk(), timed()
    same = all(a is None and b is None or torch.equal(a, b) for a, b in zip(default, outputs))
    record = dict(case=name, bitwise_same=same, walk_ms=triton.testing.do_bench(walk, warmup=25, rep=200),
                  timeline_ms=triton.testing.do_bench(timed, warmup=25, rep=200),
                  roles=timeline.role_timeline(stamps.cpu()), alone={})
    for role in chunk_bwd_roles.ROLES if alone else ():
        build = lambda busy=role: timed(busy)
        record["alone"][role] = dict(ms=triton.testing.do_bench(build, warmup=25, rep=200),
                                     summary=timeline.role_timeline(build()[1].cpu(), role)[role])
    return record


def alone_table(record: dict) -> str:
    """Per role and phase, the median µs of the later steps with every role busy and with the role alone."""
    lines = [f"{record['case']}: median µs a step, every role busy | the role alone (that build "
             + ", ".join(f"{role} {a['ms']:.3f} ms" for role, a in record["alone"].items()) + ")"]
    for role, a in record["alone"].items():
        together = record["roles"][role]
        for phase in together["phases"]:
            cells = [x[phase]["wg0"]["later"]["p50"] for x in (together, a["summary"])]
            lines.append(f"  {role} {phase:<10} {cells[0]:7.2f} | {cells[1]:7.2f}")
    return "\n".join(lines)


def use_role_split_walk() -> None:
    """The role-split walk in place of the slice walk in this process: the backward calls it as
    ``chunk_bwd.chunk_bwd_hopper`` (its BV argument has no use there)."""
    from linattn.ops.hopper import chunk_bwd, chunk_bwd_roles

    def role_split_walk(q, k, v, do, gc, beta, a_inv, h, dht, scale, BV=None, **kwargs):
        return chunk_bwd_roles.chunk_bwd_roles_hopper(q, k, v, do, gc, beta, a_inv, h, dht, scale, **kwargs)

    chunk_bwd.chunk_bwd_hopper = role_split_walk


def op_rows(name: str, dtypes: tuple) -> list:
    """gpu_check_core.check of case ``name`` in each of ``dtypes`` (names) with the role-split walk (in a worker
    process of :func:`patched_op_check`)."""
    import gpu_check_core
    use_role_split_walk()
    case = next(c for c in gpu_check_core.CASES if c[0] == name)
    return [gpu_check_core.check(case, getattr(torch, d), use_token_ref=case[2] <= 1000, backward_path="hopper")
            for d in dtypes]


def patched_op_check(cases, dtypes) -> list:
    """The op's gradients against float64 (``gpu_check_core.check``) on ``cases`` in ``dtypes`` (names) with the
    role-split walk, one worker process per case: each compiles its shape's kernels on its first call, so the cases
    compile side by side instead of one after another (TileLang's disk cache is the machine's). Each row names the
    backward that ran: a dtype or shape the Hopper backward declines runs the dispatch's."""
    import concurrent.futures
    import multiprocessing

    import gpu_check_core
    known = [c[0] for c in gpu_check_core.CASES]
    unknown = set(cases) - set(known)
    if unknown:
        raise ValueError(f"unknown --op case(s) {sorted(unknown)}; known: {known}")
    ordered = [name for name in known if name in cases]
    with concurrent.futures.ProcessPoolExecutor(len(ordered), mp_context=multiprocessing.get_context("spawn")) as pool:
        results = [pool.submit(op_rows, name, tuple(dtypes)) for name in ordered]
        rows = []
        for future in results:
            for row in future.result():
                rows.append(row)
                print(json.dumps(row, default=str), flush=True)
    return rows


def warm(cases, timed, timeline: bool, alone: bool = False) -> None:
    """Every kernel the run launches compiled first, one process per core, into TileLang's disk cache
    (``hopper.precompile``, with ``gpu_check_hopper_bwd``'s builds of the recompute and the slice walk)."""
    import gpu_check_hopper_bwd as g

    from linattn.ops.hopper import chunk_bwd, chunk_bwd_roles
    from linattn.ops.hopper.plan import plan
    from linattn.ops.hopper.precompile import Build, precompile
    shapes = [(B, T, H, HV, dht) for _, B, T, H, HV, dht in cases]
    shapes += [(B, T, H, HV, False) for _, B, T, H, HV in timed]
    builds = []
    for B, T, H, HV, dht in shapes:
        chosen = plan(B, HV, V, T, g.SMS)
        if chosen is not None and chosen.segments > 1:
            BV = chosen.kernel_launch["BV"]
            configs = [("states_warm", H, HV, K, V, BV), ("states_maps", H, HV, K, V, BV)]
        else:
            launch = g.recompute_launch(B, HV, V)
            configs = [("states", H, HV, K, V, launch["BV"], launch["num_stages"])]
        builds += [g.kernel_build(c, None) for c in configs + [("prepass", H, HV, K)]]
        builds += [Build(chunk_bwd_roles.compiled_kernel, (H, HV, K, V, K ** -0.5, None, dht, stamped))
                   for stamped in ((False, True) if timeline and not dht else (False,))]
        if timeline and alone and not dht:
            builds += [Build(chunk_bwd_roles.compiled_kernel, (H, HV, K, V, K ** -0.5, None, False, True, busy))
                       for busy in chunk_bwd_roles.ROLES]
        builds.append(Build(chunk_bwd.compiled_kernel, (H, HV, K, V, K ** -0.5, 64),
                            dict(target=None, state_grads=dht)))
    print(precompile(list({repr(b): b for b in builds}.values())), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--op", default=None, help="comma-separated gpu_check_core cases to run through the op with "
                                               "the role-split walk")
    ap.add_argument("--op-dtypes", default="bfloat16", help="comma-separated torch dtypes of --op's cases")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--timeline", action="store_true", help="at each timed row also the walk's timeline by role")
    ap.add_argument("--alone", action="store_true", help="with --timeline: also each role's phases with the other "
                                                         "roles idle (their hand-offs alone)")
    ap.add_argument("--cases", default=None, help=f"comma-separated of {[c[0] for c in CASES]} (default: all)")
    ap.add_argument("--timed", default=None, help=f"comma-separated of {[c[0] for c in TIMED]} (default: all)")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    cases = [c for c in CASES if not a.cases or c[0] in a.cases.split(",")]
    timed = [] if a.skip_timing else [c for c in TIMED if not a.timed or c[0] in a.timed.split(",")]
    warm(cases, timed, a.timeline, a.alone)
    result = dict(compare=[], timing=[], timeline=[])
    for case in cases:
        result["compare"].append(compare(case))
        print(json.dumps(result["compare"][-1]), flush=True)
    if timed:
        for case in timed:
            result["timing"].append(time_case(case))
            print(json.dumps(result["timing"][-1]), flush=True)
            if a.timeline:
                result["timeline"].append(time_timeline(case, a.alone))
    if a.op:
        result["op"] = patched_op_check(a.op.split(","), a.op_dtypes.split(","))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "roles_walk.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\n{'case':<22} " + " ".join(f"{n:>9}" for n in OUTPUTS) + "  repeat")
    for r in result["compare"]:
        print(f"{r['case']:<22} " + " ".join(f"{r['difference'][n]:9.1e}" for n in OUTPUTS)
              + f"  {all(r['bitwise_repeat'].values())}")
    from linattn.ops.hopper.timeline import format_table
    for r in result["timeline"]:
        print(f"\n{r['case']}: walk {r['walk_ms']:.3f} ms, timeline build {r['timeline_ms']:.3f} ms, outputs bit for "
              f"bit: {r['bitwise_same']}")
        for role, summary in r["roles"].items():
            print(format_table(summary, f"role {role}"))
        if r["alone"]:
            print(alone_table(r))
    for r in result["timing"]:
        print(f"{r['case']:<8} walk ms: slices {r['slices_ms']:.3f}  roles {r['roles_ms']:.3f}  "
              f"({r['slices_ms'] / r['roles_ms']:.2f}×); µs per step and program: slices "
              f"{r['slices_us_per_step']:.1f}, roles {r['roles_us_per_step']:.1f}")


if __name__ == "__main__":
    main()
