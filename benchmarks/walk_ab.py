"""A/B of reverse-walk builds in one process (issue 45): this tree's ``linattn.ops.hopper.chunk_bwd`` against
copies of other branches' ``chunk_bwd.py`` placed beside it, e.g.

    git show my-branch:linattn/ops/hopper/chunk_bwd.py > linattn/ops/hopper/chunk_bwd_mine.py
    python benchmarks/walk_ab.py chunk_bwd_mine [--timeline] [--rows 2,7,3,5]

(an untracked copy travels to the device with the working tree; delete it after). Every kernel is compiled first
in parallel processes. Per row (2: B=8 T=4096 H=HV=16; 3: B=1 T=32768 H=HV=16; 5: B=4 T=8192 H=16 HV=32; 7: B=1
T=32768 H=2 HV=8; K = V = 128, the anchors' gates, h0 and dht) and build: its walk's outputs against this tree's
(bitwise, else the max relative difference per output), a bitwise repeat, do_bench ms of the walk alone
(unsegmented) and of the whole backward with the build's walk and warm-ups swapped in; ``--timeline``: every
build's in-kernel timeline at row 2 (µs per phase of the chunk step). A table last.

``--roles``: the same for the role-split walk: this tree's ``chunk_bwd_roles`` against copies of another commit's
``chunk_bwd_roles.py`` (the whole backward with the copy's walk swapped in where the planner takes the role-split
walk; the warm-ups are this tree's), e.g. a reverted candidate:

    git show d469316:linattn/ops/hopper/chunk_bwd_roles.py > linattn/ops/hopper/roles_scan.py
    python benchmarks/walk_ab.py roles_scan --roles --timeline --rows 2,7"""
import importlib
import json
import sys

import torch
import triton
from gpu_check_hopper_bwd import row_inputs

from linattn.ops.hopper import backward, backward_prepared, chunk_bwd, chunk_bwd_roles, timeline

ROWS = {2: (8, 4096, 16, 16), 3: (1, 32768, 16, 16), 7: (1, 32768, 2, 8), 5: (4, 8192, 16, 32)}


def precompile_all(mods: dict, rows: list, roles: bool) -> None:
    """Every kernel of the run compiled in parallel processes into TileLang's disk cache first (serially they take
    ≈ 20 s each): each build's walk (and the slice walk's warm-ups) per row's heads, its timeline at row 2, and the
    recompute's kernels (gpu_check_hopper_bwd's rows 2, 3, 7; row 5's compile at first use)."""
    import gpu_check_hopper_bwd as g

    from linattn.ops.hopper.precompile import Build, precompile
    builds = [g.kernel_build(c, None) for c in g.recompute_configs()]
    scale = 128 ** -0.5
    width = () if roles else (64,)      # the role-split walk's kernel takes no BV
    for m in mods.values():
        for H, HV in {ROWS[i][2:] for i in rows}:
            builds.append(Build(m.compiled_kernel, (H, HV, 128, 128, scale) + width))
            if not roles:
                builds.append(Build(m.compiled_warm_kernel, (H, HV, 128, 128, scale, 64)))
        builds.append(Build(m.compiled_kernel, (16, 16, 128, 128, scale) + width, dict(timeline=True)))
    print(precompile(builds), flush=True)


def walk_of(m, roles: bool, args: tuple, scale: float):
    """The walk of build ``m`` on the recomputed ``args`` (q, k, v, dO, gc, β, T, h, dht)."""
    if roles:
        return lambda: m.chunk_bwd_roles_hopper(*args, scale)
    return lambda: m.chunk_bwd_hopper(*args, scale, 64)


def swapped_in(m, roles: bool) -> list:
    """(module, attribute, build m's function) that the whole backward calls for its walk (and warm-ups), and no
    prepared calls: a signature prepared under one build would launch that build's kernels under every other."""
    plain = [(backward_prepared, "prepared_call", lambda key: None)]
    if roles:
        return plain + [(chunk_bwd_roles, "chunk_bwd_roles_hopper", m.chunk_bwd_roles_hopper)]
    return plain + [(chunk_bwd, "chunk_bwd_hopper", m.chunk_bwd_hopper),
                    (chunk_bwd, "reverse_warm_ups_hopper", m.reverse_warm_ups_hopper)]


def print_timeline(m, roles: bool, args: tuple, scale: float, name: str) -> None:
    """Build m's in-kernel timeline at row 2 (every role's, for the role-split walk)."""
    if roles:
        _, stamps = m.walk_timeline(*args, scale, steps=64)
        for role, summary in timeline.role_timeline(stamps.cpu()).items():
            print(timeline.format_table(summary, f"row 2 {name} role {role}"), flush=True)
        return
    _, stamps = m.walk_timeline(*args, scale, 64, steps=64)
    print(timeline.format_table(timeline.timeline_phases(stamps.cpu()), f"row 2 {name}"), flush=True)


def build_row(index: int, mods: dict, timeline_on: bool, roles: bool) -> list:
    """Every build's results at one row (module docstring); the reference is this tree's walk (the first build)."""
    B, T, H, HV = ROWS[index]
    x = row_inputs(B, T, H, HV)
    q, k, v, do, g, beta, h0, dht, scale = (x[n] for n in ("q", "k", "v", "do", "g", "beta", "initial_state",
                                                          "dht", "scale"))
    NT = -(-T // 64)
    gc_hm, beta_hm, a_inv, bound = backward.solve(k, g, beta)
    h = backward.states(k, v, gc_hm, beta_hm, a_inv, bound, h0)
    args = (q, k, v, do, gc_hm, beta_hm, a_inv, h, dht)
    walk = lambda m: walk_of(m, roles, args, scale)
    whole = lambda: backward.chunk_gated_delta_rule_bwd_hopper(q, k, v, g, beta, scale, h0, do, dht)
    ref = walk(next(iter(mods.values())))()
    rows = []
    for name, m in mods.items():
        got, again = walk(m)(), walk(m)()
        swaps = swapped_in(m, roles)
        saved = [(module, attr, getattr(module, attr)) for module, attr, _ in swaps]
        for module, attr, fn in swaps:
            setattr(module, attr, fn)
        try:
            whole()
            bwd_ms = triton.testing.do_bench(whole)
        finally:
            for module, attr, fn in saved:
                setattr(module, attr, fn)
        walk_ms = triton.testing.do_bench(walk(m))
        r = dict(row=index, build=name, bitwise_old=all(torch.equal(x, y) for x, y in zip(ref, got)),
                 max_rel=[((x.float() - y.float()).abs().max() / x.float().abs().max().clamp_min(1e-30)).item()
                          for x, y in zip(ref, got)],
                 repeat=all(torch.equal(x, y) for x, y in zip(got, again)), walk_ms=walk_ms,
                 us_per_chunk=walk_ms * 1000 / NT, bwd_ms=bwd_ms)
        print(json.dumps(r), flush=True)
        rows.append(r)
        if index == 2 and timeline_on:
            print_timeline(m, roles, args, scale, name)
    return rows


def main():
    names = [a for a in sys.argv[1:] if not a.startswith("--") and not a[0].isdigit()]
    rows = [int(r) for r in sys.argv[sys.argv.index("--rows") + 1].split(",")] if "--rows" in sys.argv else list(ROWS)
    roles = "--roles" in sys.argv
    mods = {"this tree": chunk_bwd_roles if roles else chunk_bwd,
            **{n: importlib.import_module(f"linattn.ops.hopper.{n}") for n in names}}
    precompile_all(mods, rows, roles)
    table = [r for index in rows for r in build_row(index, mods, "--timeline" in sys.argv, roles)]
    print(f"\n{torch.cuda.get_device_name()}\nrow  build             bitwise  repeat  walk ms (µs/chunk)   backward ms")
    for r in table:
        print(f"{r['row']:>3}  {r['build']:<16}  {r['bitwise_old']!s:>7}  {r['repeat']!s:>6}  {r['walk_ms']:.3f} "
              f"({r['us_per_chunk']:.1f})   {r['bwd_ms']:.3f}")


if __name__ == "__main__":
    main()
