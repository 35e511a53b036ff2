"""The CUDA source TileLang generates for every Hopper kernel the default forward and the Hopper backward's recompute
launch, built on the CPU.

Each configuration is launched through the same entry points the forward and the recompute use
(``walk_launch.chunk_fwd_hopper_hm``, ``walk_launch.chunk_states_hopper`` and ``prepass.prepass_hopper``) with small
CPU tensors of the right shapes; ``tilelang.compile`` is replaced by a
lowering for sm_90a (the same passes and pass configs, no nvcc) that keeps the generated CUDA, after the
uniform-warpgroup rewrite where the launch applies it, and the launch itself by a no-op. So what is recorded is
what a GPU would compile, for the keyword sets the forward passes (``forward.LAUNCH``, ``fitted_launch``'s BV=64,
the affine walk with ``skip_m``, the warm walks, the planned warm walk, the pre-pass; the recompute's states walk,
its segments' phases A and C, and its pre-pass without β on T).

    python tests/ops/hopper_sources.py write DIR      # one .cu per configuration, named by its parameters
    python tests/ops/hopper_sources.py compare DIR    # byte-compare today's sources with DIR's
    python tests/ops/hopper_sources.py compare DIR walk_H16   # only the configurations whose name has this

A kernel that must keep its generated code across a change (a refactor, a comment) is compared this way on the
CPU before its GPU check.
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch

# the shapes the configurations are compiled for: (H, HV, K, V); the sizes B and T are symbolic in every kernel
SHAPES = ((16, 16, 128, 128), (2, 8, 128, 128), (16, 16, 64, 64), (4, 4, 128, 256))
# the default launch (forward.LAUNCH) and the keywords the forward adds; only those the entry point still takes are
# passed, and a keyword it no longer takes must be one whose behaviour has become the only one
LAUNCH = dict(threads=256, num_stages=2, async_dots=True, tma_o=True, stsm=True, beta_in_a_inv=True)
PLAN_THRESHOLD = -30.0            # forward.NEGLIGIBLE_M_LOG2, the planned warm walk's threshold
SEGMENTS = 2


class _Recorded:
    """What ``tilelang.compile`` returns under :func:`recording`: the generated source, and a no-op launch."""

    launched: list = []

    def __init__(self, source: str):
        self.source = source

    def __call__(self, *args):
        _Recorded.launched.append(self.source)


def _lower_to_source(func, target=None, execution_backend=None, pass_configs=None, **_):
    """``tilelang.compile``'s stand-in: the prim_func lowered for sm_90a under the caller's pass configs."""
    import tilelang
    from tilelang import tvm
    sm90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with tvm.transform.PassContext(opt_level=3, config=pass_configs or {}), sm90:
        return _Recorded(tilelang.lower(func, target=sm90).kernel_source)


def _keywords(entry: Callable, options: dict) -> dict:
    """``options`` less the keywords ``entry`` does not take (those must be the ones made the only behaviour)."""
    taken = inspect.signature(entry).parameters
    dropped = {n: v for n, v in options.items() if n not in taken}
    assert all(v is True for v in dropped.values()), dropped
    return {n: v for n, v in options.items() if n in taken}


def _walk_inputs(H, HV, K, V, beta_dtype, B=1, T=64 * SEGMENTS):
    from linattn.ops.hopper.chunk_fwd import padded_length
    bf = torch.bfloat16
    q, k = torch.zeros(B, T, H, K, dtype=bf), torch.zeros(B, T, H, K, dtype=bf)
    v = torch.zeros(B, T, HV, V, dtype=bf)
    Tp = padded_length(T)
    return q, k, v, torch.zeros(B, HV, Tp), torch.zeros(B, HV, Tp, dtype=beta_dtype), torch.zeros(B, T, HV, 64,
                                                                                                     dtype=bf)


def configurations() -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, a call that launches it) for each default kernel configuration."""
    from linattn.ops.hopper import prepass, walk_launch
    walk = walk_launch.chunk_fwd_hopper_hm
    for H, HV, K, V in SHAPES:
        shape = f"H{H}_HV{HV}_K{K}_V{V}"
        # β's dtype changes only the signature of the tensor the walk ignores: both at the first shape
        beta_dtypes = (torch.float32, torch.bfloat16) if (H, HV, K, V) == SHAPES[0] else (torch.float32,)
        for beta_dtype in beta_dtypes:
            bt = str(beta_dtype).removeprefix("torch.")
            for BV in (128, 64):
                if V % BV:
                    continue
                launch = dict(LAUNCH, BV=BV)
                name = f"walk_{shape}_BV{BV}_beta-{bt}"
                scale = K ** -0.5

                def plain(h0, H=H, HV=HV, K=K, V=V, beta_dtype=beta_dtype, launch=launch, scale=scale):
                    q, k, v, gc, b, a = _walk_inputs(H, HV, K, V, beta_dtype)
                    state = torch.zeros(1, HV, K, V) if h0 else None
                    walk(q, k, v, gc, b, a, scale, state, **_keywords(walk, launch))

                yield f"{name}_plain_h0", lambda plain=plain: plain(True)
                yield f"{name}_plain_no-h0", lambda plain=plain: plain(False)
                if K % BV == 0:
                    for lean in (True, False):
                        def affine(H=H, HV=HV, K=K, V=V, beta_dtype=beta_dtype, launch=launch, scale=scale,
                                   lean=lean):
                            q, k, v, gc, b, a = _walk_inputs(H, HV, K, V, beta_dtype)
                            skip_m = torch.zeros(1, HV, dtype=torch.int32)
                            walk(q, k, v, gc, b, a, scale, None, affine=True, skip_m=skip_m, lean=lean,
                                 **_keywords(walk, launch))

                        yield f"{name}_affine_skip-m_{'lean' if lean else 'full'}", affine

                def warm(H=H, HV=HV, K=K, V=V, beta_dtype=beta_dtype, launch=launch, scale=scale):
                    q, k, v, gc, b, a = _walk_inputs(H, HV, K, V, beta_dtype)
                    T = q.shape[1]
                    gc, b = (x.new_zeros(SEGMENTS, HV, T // SEGMENTS) for x in (gc, b))
                    h_in = torch.zeros(SEGMENTS, HV, K, V)
                    walk(q, k, v, gc, b, a, scale, h_in, warm_chunks=torch.zeros(SEGMENTS, HV, dtype=torch.int32),
                         lean=True, **_keywords(walk, launch))

                yield f"{name}_warm_lean", warm
                for h0 in (True, False):
                    def planned(h0=h0, H=H, HV=HV, K=K, V=V, beta_dtype=beta_dtype, launch=launch, scale=scale):
                        q, k, v, gc, b, a = _walk_inputs(H, HV, K, V, beta_dtype)
                        T = q.shape[1]
                        gc, b = (x.new_zeros(SEGMENTS, HV, T // SEGMENTS) for x in (gc, b))
                        bound = torch.zeros(SEGMENTS, HV, T // SEGMENTS // 64)
                        state = torch.zeros(1, HV, K, V) if h0 else None
                        walk(q, k, v, gc, b, a, scale, state, warm_bound=bound, warm_threshold=PLAN_THRESHOLD,
                             lean=True, **_keywords(walk, launch))

                    yield f"{name}_planned-warm_lean_{'h0' if h0 else 'no-h0'}", planned
            for segments in (1, SEGMENTS):
                def pre(H=H, HV=HV, K=K, beta_dtype=beta_dtype, segments=segments):
                    T = 64 * SEGMENTS
                    prepass.prepass_hopper(torch.zeros(1, T, H, K, dtype=torch.bfloat16), torch.zeros(1, T, HV),
                                           torch.zeros(1, T, HV, dtype=beta_dtype), segments)

                yield f"prepass_H{H}_HV{HV}_K{K}_beta-{bt}_segments{segments}", pre
        yield from recompute_configurations(H, HV, K, V, beta_dtypes)


def recompute_configurations(H: int, HV: int, K: int, V: int, beta_dtypes: tuple
                             ) -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, a call that launches it) for the Hopper backward's recompute at one shape: the states walk (β fp32,
    as ``backward.recompute`` passes it) at each BV, with and without h0, its segments' phase C (the warm states
    walk) and phase A (the affine walk with β in X, lean maps), and the pre-pass without β on T for each of
    ``beta_dtypes``."""
    from linattn.ops.hopper import prepass, walk_launch
    shape = f"H{H}_HV{HV}_K{K}_V{V}"
    for BV in (128, 64):
        if V % BV:
            continue
        for h0 in (True, False):
            def states(H=H, HV=HV, K=K, V=V, BV=BV, h0=h0):
                _, k, v, gc, b, t = _walk_inputs(H, HV, K, V, torch.float32)
                walk_launch.chunk_states_hopper(k, v, gc, b, t, torch.zeros(1, HV, K, V) if h0 else None, BV=BV,
                                                threads=LAUNCH["threads"], num_stages=LAUNCH["num_stages"])

            yield f"states_{shape}_BV{BV}_{'h0' if h0 else 'no-h0'}", states

        def warm_states(H=H, HV=HV, K=K, V=V, BV=BV):
            _, k, v, gc, b, t = _walk_inputs(H, HV, K, V, torch.float32)
            T = k.shape[1]
            gc, b = (x.new_zeros(SEGMENTS, HV, T // SEGMENTS) for x in (gc, b))
            walk_launch.chunk_states_hopper(k, v, gc, b, t, torch.zeros(SEGMENTS, HV, K, V), BV=BV,
                                            threads=LAUNCH["threads"], num_stages=LAUNCH["num_stages"],
                                            warm_chunks=torch.zeros(SEGMENTS, HV, dtype=torch.int32))

        def states_maps(H=H, HV=HV, K=K, V=V, BV=BV, m_only=False):
            _, k, v, gc, b, t = _walk_inputs(H, HV, K, V, torch.float32)
            walk_launch.states_maps(k, v, gc, b, t, torch.zeros(1, HV, dtype=torch.int32), m_only=m_only, BV=BV,
                                    threads=LAUNCH["threads"], num_stages=LAUNCH["num_stages"])

        yield f"states_{shape}_BV{BV}_warm_lean", warm_states
        if K % BV == 0:
            yield f"states_{shape}_BV{BV}_maps_lean", states_maps
            yield f"states_{shape}_BV{BV}_maps_lean_m-only", lambda maps=states_maps: maps(m_only=True)

    for beta_dtype in beta_dtypes:
        def pre(H=H, HV=HV, K=K, beta_dtype=beta_dtype):
            T = 64 * SEGMENTS
            prepass.prepass_hopper(torch.zeros(1, T, H, K, dtype=torch.bfloat16), torch.zeros(1, T, HV),
                                   torch.zeros(1, T, HV, dtype=beta_dtype), beta_in_a_inv=False)

        yield f"prepass_H{H}_HV{HV}_K{K}_beta-{str(beta_dtype).removeprefix('torch.')}_no-beta-in-T", pre


def sources(only: str = "") -> Iterator[tuple[str, str]]:
    """(configuration name, its generated CUDA) for every :func:`configurations` entry whose name contains
    ``only``."""
    import tilelang

    from linattn.ops.hopper import chunk_fwd, prepass

    def forget_compiled():
        """The launchers' caches emptied, so that no recorded stand-in outlives the recording (nor a real kernel
        hides a configuration from it)."""
        for cache in (chunk_fwd.compiled_kernel, prepass.compiled_kernel, chunk_fwd.launcher):
            cache.cache_clear()

    real = tilelang.compile
    tilelang.compile = _lower_to_source
    forget_compiled()
    try:
        for name, launch in configurations():
            if not any(o in name for o in only.split(",")):
                continue
            _Recorded.launched.clear()
            launch()
            assert len(_Recorded.launched) == 1, (name, len(_Recorded.launched))
            yield name, _Recorded.launched[0]
    finally:
        tilelang.compile = real
        forget_compiled()


def main(argv: list[str]) -> int:
    mode, folder, only = argv[1], Path(argv[2]), (argv[3] if len(argv) > 3 else "")
    if mode == "write":
        folder.mkdir(parents=True, exist_ok=True)
        for name, source in sources(only):
            (folder / f"{name}.cu").write_text(source)
            print(name, len(source), flush=True)
        return 0
    if mode != "compare":
        raise SystemExit(f"usage: {argv[0]} write|compare DIR")
    differ = 0
    seen = set()
    for name, source in sources(only):
        seen.add(f"{name}.cu")
        before = folder / f"{name}.cu"
        same = before.exists() and before.read_text() == source
        differ += not same
        print(("identical " if same else "DIFFERENT " if before.exists() else "NEW       ") + name, flush=True)
    wanted = only.split(",")
    for gone in sorted(p.name for p in folder.glob("*.cu")
                       if p.name not in seen and any(o in p.name for o in wanted)):
        differ += 1
        print("MISSING   " + gone)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
