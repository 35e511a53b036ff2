"""GPU check of the edges (issue 46): gates at the end of their range and NaN causality, on every GPU path.

Gate cases (item 1): a −inf log decay (a full forget) at one token, and −3e38 at two tokens of one head (the
chunk-local sums overflow); each path must give the float64 reference's finite answer, forward and backward.
Every path floors g at ``linattn.ops.utils.MIN_LOG_DECAY`` where it first reads it; dg is 0 below the floor.
NaN cases (item 4): a NaN (or Inf) in one token's q, k, v, g or β, planted in one head of the first sequence, must
make exactly the outputs the float64 reference makes non-finite (per (token, value head) row: o at that token and
after it, only at it for q, in the value heads that read it, and their final states): never an earlier token of its
chunk (NaN · 0 in a masked chunk product), another head or another sequence; every row the reference leaves finite
must equal the clean run's exactly; the backward (paths that have one) must run, with finite gradients in the other
sequence; and packed: the two sequences in one row (cu_seqlens), the NaN in the first.

Paths: the op's Triton forward forced to "split", "walk" and "hopper" (the Hopper forward through the op; inputs it
does not take fall back to Triton, marked in the table), "hopper fwd+bwd" (the Hopper backward too, dispatch's pair
threshold lowered for these shapes), the Triton backward, the torch backend on the GPU, the
recurrent op, the decode step (token by token over a pool) and gated linear attention; bf16 and fp16 inputs.

    python benchmarks/gpu_check_edges.py [--paths "hopper fwd+bwd,triton split"] [--dtypes bf16]

Columns: finite (o, final state, every gradient), o_err / ht_err (relative L2 against float64), clean_err (the same
path on the same inputs with the edge gates replaced by ordinary ones: the path's own error level), dg0 (dg at the
edge tokens is exactly 0), grad_err (worst relative L2 of a gradient against float64 autograd, where the latter is
finite); NaN cases: cone (the non-finite rows of o and of the final state are the reference's), before_eq (max
|o − o_clean| over the rows the reference leaves finite; 0 passes), grads_ok (the backward ran and the other
sequence's gradients are finite; blank without a backward).
PASS: finite, o_err and ht_err ≤ 2 × max(clean_err, the rounding floor), dg0; NaN cases: cone, before_eq == 0,
grads_ok.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
from unittest import mock

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import linattn  # noqa: E402
from linattn.ops.gated_delta.chunk import chunk_gated_delta_rule_on_path  # noqa: E402
from linattn.ops.gated_delta.reference import gated_delta_rule_reference  # noqa: E402
from linattn.ops.gated_linear.reference import gated_linear_attention_reference  # noqa: E402
from linattn.ops.utils import flat_offsets  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, T, H, HV, K, V = 2, 300, 4, 8, 128, 128
EDGE_T = 100
GATES = {"g=-inf": [(EDGE_T, 0, float("-inf"))], "g=-3e38 x2": [(70, 1, -3e38), (130, 1, -3e38)]}
# NaN cases: the tensor, the planted element (sequence 0, token EDGE_T; key head 1 for q and k, which value heads 2
# and 3 read; value head 1 otherwise; one entry of q, k and v) and its value
NANS = {"NaN in q": ("q", (0, EDGE_T, 1, 5), float("nan")), "NaN in k": ("k", (0, EDGE_T, 1, 5), float("nan")),
        "NaN in v": ("v", (0, EDGE_T, 1, 5), float("nan")), "Inf in v": ("v", (0, EDGE_T, 1, 5), float("inf")),
        "NaN in g": ("g", (0, EDGE_T, 1), float("nan")), "NaN in beta": ("beta", (0, EDGE_T, 1), float("nan"))}
SCALE = K ** -0.5


def rel(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2.0)
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    do, dht = torch.randn(B, T, HV, V, generator=gen), torch.randn(B, HV, K, V, generator=gen)
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta)
    return {n: t.to(DEV) for n, t in x.items()}, h0.to(DEV), do.to(DEV, dtype), dht.to(DEV)


def op_call(fn, path=None, **kw):
    """``fn`` on the inputs; ``path``: the chunked op with its forward forced there (chunk_gated_delta_rule_on_path)."""
    if path is not None:
        fn = functools.partial(chunk_gated_delta_rule_on_path, path)

    def call(x, h0):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=SCALE, initial_state=h0, output_final_state=True,
                  **kw)
    return call


def decode_call(x, h0):
    pool = h0.clone()
    outs = [linattn.gated_delta_rule_decode(*(x[n][:, t:t + 1] for n in ("q", "k", "v", "g", "beta")), pool,
                                            scale=SCALE, backend="triton")[0] for t in range(T)]
    return torch.cat(outs, 1), pool


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def hopper_backward_call():
    """The op with the Hopper forward and, at these few pairs, the Hopper backward too: dispatch's pair threshold
    lowered for the row's calls (``run`` enters ``call.context``), so its input shapes stay the check's."""
    from linattn.ops.gated_delta import dispatch
    call = op_call(linattn.chunk_gated_delta_rule, "hopper", backend="triton")
    call.context = lambda: mock.patch.object(dispatch, "HOPPER_BWD_MIN_WORK", 1)
    return call


PATHS = {  # name: (call, has a backward, reference)
    "triton split": (op_call(linattn.chunk_gated_delta_rule, "split", backend="triton"), True, "gdn"),
    "triton walk": (op_call(linattn.chunk_gated_delta_rule, "walk", backend="triton"), False, "gdn"),
    "hopper": (op_call(linattn.chunk_gated_delta_rule, "hopper", backend="triton"), False, "gdn"),
    "hopper fwd+bwd": (hopper_backward_call(), True, "gdn"),
    "torch": (op_call(linattn.chunk_gated_delta_rule, backend="torch"), True, "gdn"),
    "recurrent": (op_call(linattn.fused_recurrent_gated_delta_rule, backend="triton"), True, "gdn"),
    "decode": (decode_call, False, "gdn"),
    "gla": (op_call(linattn.gated_linear_attention), True, "gla"),
}


def hopper_runs(x):
    """Whether the forced "hopper" path really runs the Hopper forward for these inputs (else the Triton one)."""
    try:
        from linattn.ops.hopper import chunk_fwd
        return chunk_fwd.unsupported_reason(x["q"], x["v"]) is None
    except Exception:
        return False


def hopper_builds() -> list:
    """The Hopper kernels the "hopper" paths launch at this check's shapes (``hopper.precompile.Build``s): the
    forward's under its plan (forced, as the path is; the packed case pads both sequences to one length) and the
    backward's (gpu_check_hopper_bwd's configs: the walk, the recompute's states walk and pre-pass), each pre-pass
    and walk for β in fp32 and in bf16 (they take β's dtype). A build no path launches costs a worker, not time:
    they all compile side by side."""
    from gpu_check_hopper_bwd import kernel_build, recompute_launch

    from linattn.ops.hopper import plan, prepared
    from linattn.ops.hopper.varlen import padded_rows
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    builds = []
    for rows in (T, padded_rows(flat_offsets(B, T))):
        chosen = plan.plan(B, HV, V, rows, sms, forced=True)
        for beta_dtype in (torch.float32, torch.bfloat16):
            builds += prepared.forward_builds(chosen, H, HV, K, V, SCALE, True, beta_dtype)
    launch = recompute_launch(B, HV, V, sms)
    configs = [(H, HV, K, V, SCALE, min(V, 64)), ("states", H, HV, K, V, launch["BV"], launch["num_stages"]),
               ("prepass", H, HV, K, "float32"), ("prepass", H, HV, K, "bfloat16")]
    builds += [kernel_build(config, None) for config in configs]
    return list({str(build): build for build in builds}.values())


def reference(kind, x, h0, do, dht):
    """(o, ht, grads) of the float64 reference, autograd through the token loop."""
    leaves = [x[n].double().cpu().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    h = h0.double().cpu().requires_grad_()
    fn = gated_delta_rule_reference if kind == "gdn" else gated_linear_attention_reference
    o, ht = fn(*leaves, SCALE, h)
    grads = torch.autograd.grad((o * do.double().cpu()).sum() + (ht * dht.double().cpu()).sum(), leaves + [h])
    return o.detach(), ht.detach(), grads


def run(call, backward, x, h0, do, dht):
    with getattr(call, "context", contextlib.nullcontext)():
        return run_call(call, backward, x, h0, do, dht)


def run_call(call, backward, x, h0, do, dht):
    if not backward:
        with torch.no_grad():
            o, ht = call(x, h0)
        return o, ht, None
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    h = h0.clone().requires_grad_()
    o, ht = call(leaves, h)
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), [*leaves.values(), h])
    return o.detach(), ht.detach(), grads


def gate_row(name, dtype, case, edits):
    call, backward, kind = PATHS[name]
    x, h0, do, dht = inputs(dtype)
    clean = run(call, False, x, h0, do, dht)
    rclean = reference(kind, x, h0, do, dht)
    for t, hv, value in edits:
        x["g"][0, t, hv] = value
    o, ht, grads = run(call, backward, x, h0, do, dht)
    ro, rht, rgrads = reference(kind, x, h0, do, dht)
    floor = rel(ro.to(dtype), ro)
    finite = bool(torch.isfinite(o).all() and torch.isfinite(ht).all()
                  and (grads is None or all(torch.isfinite(d).all() for d in grads)))
    row = dict(path=name, dtype=str(dtype)[6:], case=case, finite=finite, o_err=rel(o, ro), ht_err=rel(ht, rht),
               clean_err=max(rel(clean[0], rclean[0]), rel(clean[1], rclean[1])), floor=floor)
    ok = finite and max(row["o_err"], row["ht_err"]) <= 2 * max(row["clean_err"], floor)
    if grads is not None:
        dg0 = all(grads[3][0, t, hv].item() == 0 for t, hv, _ in edits)
        errs = []
        for d, rd in zip(grads, rgrads):
            m = torch.isfinite(rd)
            errs.append(rel(d.cpu()[m], rd[m]))
        row.update(dg0=dg0, grad_err=max(errs))
        ok = ok and dg0
    row["PASS"] = ok
    return row


def nan_row(name, dtype, case):
    call, backward, kind = PATHS[name]
    field, index, value = NANS[case]
    x, h0, do, dht = inputs(dtype)
    clean = run(call, False, x, h0, do, dht)[0]
    x[field][index] = value
    o, ht, _ = run(call, False, x, h0, do, dht)
    fn = gated_delta_rule_reference if kind == "gdn" else gated_linear_attention_reference
    ro, rht = fn(*(x[n].double().cpu() for n in ("q", "k", "v", "g", "beta")), SCALE, h0.double().cpu())
    rbad = ~torch.isfinite(ro).all(-1)                                   # [B, T, HV]
    cone = bool(torch.equal(~torch.isfinite(o.cpu()).all(-1), rbad)
                and torch.equal(~torch.isfinite(ht.cpu()).flatten(2).all(-1), ~torch.isfinite(rht).flatten(2).all(-1)))
    keep = ~rbad
    diff = (o.cpu()[keep].float() - clean.cpu()[keep].float()).abs().max().item()  # NaN compares as NaN: reported
    row = dict(path=name, dtype=str(dtype)[6:], case=case, cone=cone, before_eq=diff)
    ok = cone and diff == 0
    if backward:
        grads = run(call, True, x, h0, do, dht)[2]
        row["grads_ok"] = all(bool(torch.isfinite(d[1]).all()) for d in grads)
        ok = ok and row["grads_ok"]
    row["PASS"] = ok
    return row


# the packed case: the two batch rows as two sequences of one row (cu_seqlens), the NaN in v of the first; the chunked
# GDN paths (forward path, keywords)
VARLEN_PATHS = {"triton split": ("split", dict(backend="triton")), "triton walk": ("walk", dict(backend="triton")),
                "hopper": ("hopper", dict(backend="triton")), "torch": ("auto", dict(backend="torch"))}


def nan_varlen_row(name, dtype):
    """"NaN in v, packed": the NaN must stay in its sequence (the second must equal its clean run exactly)."""
    path, kw = VARLEN_PATHS[name]
    x, h0, _, _ = inputs(dtype)
    x = {n: t.reshape(1, B * T, *t.shape[2:]) for n, t in x.items()}
    offsets = flat_offsets(B, T)
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEV)

    def call(x):
        with torch.no_grad():
            return chunk_gated_delta_rule_on_path(path, x["q"], x["k"], x["v"], x["g"], x["beta"], scale=SCALE,
                                                  initial_state=h0, output_final_state=True, cu_seqlens=cu, **kw)
    clean = call(x)[0]
    x["v"][0, EDGE_T, 1, 5] = float("nan")
    o, ht = call(x)
    ro, rht = gated_delta_rule_reference(*(x[n].double().cpu() for n in ("q", "k", "v", "g", "beta")), SCALE,
                                         h0.double().cpu(), offsets)
    rbad = ~torch.isfinite(ro).all(-1)
    cone = bool(torch.equal(~torch.isfinite(o.cpu()).all(-1), rbad)
                and torch.equal(~torch.isfinite(ht.cpu()).flatten(2).all(-1), ~torch.isfinite(rht).flatten(2).all(-1)))
    diff = (o.cpu()[~rbad].float() - clean.cpu()[~rbad].float()).abs().max().item()
    return dict(path=name, dtype=str(dtype)[6:], case="NaN in v, packed", cone=cone, before_eq=diff,
                PASS=cone and diff == 0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated path names (default: all)")
    ap.add_argument("--dtypes", default="bf16,fp16", help="comma-separated: bf16, fp16")
    args = ap.parse_args(argv)
    names = args.paths.split(",")
    unknown = [n for n in names if n not in PATHS] + [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        raise SystemExit(f"unknown path or dtype {unknown}; paths: {list(PATHS)}, dtypes: {list(DTYPES)}")
    hopper_paths = any(n.startswith("hopper") for n in names) and "bf16" in args.dtypes.split(",")
    if hopper_paths and hopper_runs(inputs(torch.bfloat16)[0]):
        from linattn.ops.hopper.precompile import precompile
        print(precompile(hopper_builds()), flush=True)    # the Hopper paths' compiles, side by side
    rows = []
    for dtype in (DTYPES[d] for d in args.dtypes.split(",")):
        for name in names:
            if name.startswith("hopper") and not hopper_runs(inputs(dtype)[0]):
                rows.append(dict(path=name, dtype=str(dtype)[6:], case="(falls back to Triton: not run)"))
                continue
            for case, edits in GATES.items():
                try:
                    rows.append(gate_row(name, dtype, case, edits))
                except Exception as e:   # a path that fails is a row, not the end of the check
                    rows.append(dict(path=name, dtype=str(dtype)[6:], case=case, error=f"{type(e).__name__}: {e}"))
                print(rows[-1], flush=True)
            for case in NANS:
                try:
                    rows.append(nan_row(name, dtype, case))
                except Exception as e:
                    rows.append(dict(path=name, dtype=str(dtype)[6:], case=case, error=f"{type(e).__name__}: {e}"))
                print(rows[-1], flush=True)
            if name in VARLEN_PATHS:
                try:
                    rows.append(nan_varlen_row(name, dtype))
                except Exception as e:
                    rows.append(dict(path=name, dtype=str(dtype)[6:], case="NaN in v, packed",
                                     error=f"{type(e).__name__}: {e}"))
                print(rows[-1], flush=True)
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (interpreter)"
    print(f"\n{card}, B={B} T={T} H={H} HV={HV} K=V={K}, edge token {EDGE_T}")
    cols = ("path", "dtype", "case", "finite", "o_err", "ht_err", "clean_err", "floor", "dg0", "grad_err",
            "cone", "before_eq", "grads_ok", "PASS", "error")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[c]:.2e}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
