"""Does the pre-pass overlap the walk? The unsegmented Hopper forward cut into P parts along the batch: the pre-pass
of each part on one side stream, then each part's walk on a stream of its own once its part's pre-pass is done, so
part p's walk runs beside the pre-pass of the parts after it and beside the other parts' walks (the walks of the
parts together fill the card as the whole one does). forward_hopper (P = 1) against P = 2, 4, 8 where P divides B:
do_bench median ms, host µs per call, o and the final state bitwise against P = 1's, and the GPU's time alone: the
call captured in a CUDA graph, its replay timed (the streams' launches cost host time the eager call may not hide).

    PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks python benchmarks/overlap_check.py [B,T,H,HV ...]
"""
import functools
import sys

import torch
from hopper_fwd_check import bench, graph_ms, host_us, low_precision, make  # this folder is on sys.path

from linattn.ops.hopper.forward import LAUNCH, forward_hopper
from linattn.ops.hopper.prepass import BETA_IN_A_INV, prepass_hopper
from linattn.ops.hopper.walk_launch import chunk_fwd_hopper_hm

STREAMS = {}


def streams(n):
    if n not in STREAMS:
        STREAMS[n] = [torch.cuda.Stream() for _ in range(n)]
    return STREAMS[n]


def overlapped(q, k, v, g, beta, scale, h0, parts):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = torch.empty_like(v)
    ht = torch.empty(B, HV, K, V, dtype=torch.float32, device=q.device)
    main = torch.cuda.current_stream()
    side, *walks = streams(parts + 1)
    side.wait_stream(main)
    cuts = [slice(p * B // parts, (p + 1) * B // parts) for p in range(parts)]
    done, pre = [], []
    with torch.cuda.stream(side):
        for cut in cuts:
            pre.append(prepass_hopper(k[cut], g[cut], beta[cut]))
            done.append(torch.cuda.Event())
            done[-1].record(side)
    for cut, (gc_hm, beta_hm, a_inv, _), event, stream in zip(cuts, pre, done, walks):
        stream.wait_stream(main)
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            chunk_fwd_hopper_hm(q[cut], k[cut], v[cut], gc_hm, beta_hm, a_inv, scale,
                                h0[cut] if h0 is not None else None, out=(o[cut], ht[cut]), beta_in_a_inv=BETA_IN_A_INV,
                                **LAUNCH)
    for stream in walks:
        main.wait_stream(stream)
    for x in pre if not torch.cuda.is_current_stream_capturing() else []:   # made on the side stream, read on
        for t in x[:3]:                                                      # the walks'
            for stream in walks:
                t.record_stream(stream)
    return o, ht


shapes = [tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]] or \
    [(8, 4096, 16, 16), (4, 8192, 16, 32), (2, 16384, 32, 32)]
table = []
for B, T, H, HV in shapes:
    low = low_precision(make(B, T, H, HV, 128, 128))
    args = [low[n] for n in ("q", "k", "v", "g", "beta")] + [128 ** -0.5, low["initial_state"]]
    with torch.no_grad():
        base = forward_hopper(*args, **LAUNCH)
        for parts in [1] + [p for p in (2, 4, 8) if B % p == 0]:
            fn = (functools.partial(forward_hopper, *args, **LAUNCH) if parts == 1 else
                  functools.partial(overlapped, *args, parts))
            o, ht = fn()
            row = dict(shape=(B, T, H, HV), parts=parts, ms=bench(fn), host_us=host_us(fn),
                       graph_ms=graph_ms(fn), bitwise=bool(torch.equal(o, base[0]) and torch.equal(ht, base[1])))
            table.append(row)
            print(row, flush=True)
print("\n| B, T, H, HV | parts | ms | host µs | graph replay ms | o, state bitwise = P 1 |")
print("|---|---|---|---|---|---|")
for r in table:
    print(f"| {r['shape']} | {r['parts']} | {r['ms']:.4f} | {r['host_us']:.0f} | {r['graph_ms']:.4f} | "
          f"{r['bitwise']} |")
