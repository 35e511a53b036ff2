"""A/B of the TileLang pre-pass against an earlier version of ``linattn/ops/hopper/prepass.py`` given as a file
(e.g. ``git show REV:linattn/ops/hopper/prepass.py > ab_old/prepass.py``, carried to the device): for each shape,
both pre-passes alone and forward_hopper on each (do_bench median ms), gc and β bitwise against each other, A_inv
against the pre-pass's twin (fp32) and against each other, the map bound's chunk sums against their float64 twin
(``map_bound.chunk_bounds_ref``), and o against float64. Shapes: issue 4's rows 2, 3, 5 and 7 (the forward as
``forward.plan`` cuts it), and two small ones with T not a multiple of 64 (the rows past the end):

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python benchmarks/prepass_ab.py ab_old/prepass.py [B,T,H,HV ...]
        [--set NAME=VALUE ...]

``--set``: a module setting of today's pre-pass changed before the run (an int), e.g. a flag against the same file
with it off: ``cp linattn/ops/hopper/prepass.py ab_old/prepass.py`` then ``--set T_ROW_PAD=8``.

(the new version is timed first, then the old: run it twice with the order in mind where small kernels differ; both
forward_hopper calls take the plain forward, ``hopper.prepared.PREPARED`` off)
"""
import functools
import importlib.util
import sys

import torch
from hopper_fwd_check import bench, prepass_case, rel  # this folder is on sys.path

from linattn.ops.hopper import forward as forward_module
from linattn.ops.hopper import prepared, prepass
from linattn.ops.hopper.forward import forward_hopper
from linattn.ops.hopper.map_bound import chunk_bounds_ref

SHAPES = [(8, 4096, 16, 16), (1, 32768, 16, 16), (4, 8192, 16, 32), (1, 32768, 2, 8), (2, 300, 4, 4),
          (1, 1000, 2, 8)]


def load_old(path):
    """The earlier pre-pass as a module of the same package (its relative imports resolve to today's)."""
    spec = importlib.util.spec_from_file_location("linattn.ops.hopper.prepass_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# both versions through the plain forward: today's module would run the prepared call after its first one, the
# loaded file the plain call (its swapped pre-pass keeps prepared from preparing), so run 36's forward figures
# compared the two paths, not the two pre-passes
prepared.PREPARED = False
args = sys.argv[2:]
for name, value in (a.split("=") for a, flag in zip(args[1:], args) if flag == "--set"):
    if not hasattr(prepass, name):
        raise SystemExit(f"prepass has no setting {name}")
    setattr(prepass, name, int(value))
    print(f"today's pre-pass with {name} = {int(value)}", flush=True)
old = load_old(sys.argv[1])
SHAPES = [tuple(int(x) for x in a.split(",")) for a, flag in zip(args, [None] + args)
          if a[0].isdigit() and flag != "--set"] or SHAPES
table = []
for B, T, H, HV in SHAPES:
    low, launch, S, args, ref, twin = prepass_case(B, T, H, HV)
    with torch.no_grad():
        bound_twin = chunk_bounds_ref(low["k"], low["g"], low["beta"], S)
        outs = {}
        for name, module in (("new", prepass), ("old", old)):
            pre = functools.partial(module.prepass_hopper, low["k"], low["g"], low["beta"], S)
            forward_module.prepass_hopper = module.prepass_hopper      # forward_hopper's pre-pass
            fwd = functools.partial(forward_hopper, *args, **launch)
            gc, beta, a_inv, bound = pre()
            o = fwd()[0]
            outs[name] = (gc, beta, a_inv, o)
            row = dict(shape=(B, T, H, HV), segments=S, version=name, prepass_ms=bench(pre), forward_ms=bench(fwd),
                       a_inv=rel(a_inv.float(), twin), bound_err=float((bound.double() - bound_twin).abs().max()),
                       o=rel(o, ref))
            table.append(row)
            print(row, flush=True)
        forward_module.prepass_hopper = prepass.prepass_hopper
        (gc0, b0, a0, o0), (gc1, b1, a1, o1) = outs["old"], outs["new"]
        print(dict(shape=(B, T, H, HV), gc_beta_bitwise=bool(torch.equal(gc0, gc1) and torch.equal(b0, b1)),
                   a_inv_max_diff=float((a0.float() - a1.float()).abs().max()), o_vs_old=rel(o1, o0)), flush=True)
print("\n| B, T, H, HV | S | version | pre-pass ms | forward ms | A_inv vs twin | bound max err | o rel. error |")
print("|---|---|---|---|---|---|---|---|")
for r in table:
    print(f"| {r['shape']} | {r['segments']} | {r['version']} | {r['prepass_ms']:.4f} | {r['forward_ms']:.4f} | "
          f"{r['a_inv']:.2e} | {r['bound_err']:.1e} | {r['o']:.3e} |")
