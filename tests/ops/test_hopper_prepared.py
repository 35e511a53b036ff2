"""The Hopper forward's prepared calls (``hopper/prepared.py``): with every kernel stubbed by a recorder (the TileLang
executables and the plan's and scan's Triton kernels), a repeated signature's prepared call issues the launches the
plain forward issues — the same kernels (their compile arguments), in the same order, each argument the same input
view or the same fresh tensor (shape, dtype, strides, which earlier launch's tensor it is) and the same scalars —
and returns tensors of the same kind; under every module switch; and no upper-case setting of the forward's modules
is left out of the signature unless the forward does not read it. On the GPU the op's outputs are bitwise the plain
forward's."""
from __future__ import annotations

import pytest
import torch

from linattn.ops.common import seq_parallel
from linattn.ops.hopper import chunk_fwd, map_bound, prepared, prepass
from linattn.ops.hopper import forward as hopper_fwd

from .test_hopper_fwd import ON_HOPPER, gpu_inputs

MODULES = {"forward": hopper_fwd, "prepass": prepass, "chunk_fwd": chunk_fwd, "map_bound": map_bound}
# The upper-case settings of those modules the forward does not read: the plan's (triton_chunk and forward.plan
# read them before the call, and the launch keywords they choose are part of the signature), LAUNCH (read only
# where no launch is named, and then nothing is prepared), COMPILE_FAILED (read before the call),
# SPLIT_HEADS_NARROW_FIRST (read on each call, by forward.split_heads_order), and constants
NOT_READ = {
    "forward": {"BT", "FILL_FRACTION", "LAUNCH", "MIN_SEGMENTED_HEAD_TOKENS", "MIN_SEGMENT_CHUNKS", "PREPASSES",
                "SEGMENTED_AUTO", "SEGMENTED_WHEN_CAPTURED", "SMALL_PLAN_IN_WALK", "SMALL_SEGMENTED", "TWO_PER_SM",
                "TWO_PER_SM_LAUNCH", "WIDE_SEGMENTS", "SPLIT_HEADS", "SPLIT_HEADS_NARROW_FIRST"},
    "prepass": {"BT", "D", "LOG2E"},
    "chunk_fwd": {"BT", "COMPILE_FAILED", "WARM_SUBSETS", "HEAD_SPLITS", "ROUTE_UNROLL"},
    "map_bound": {"BT", "LOG2E", "PLAN_FLAG_DTYPES"},
}
B, T, H, HV, D = 1, 1024, 2, 4, 64
LAUNCH = dict(BV=64, threads=256, num_stages=2, async_dots=True, tma_o=True, stsm=True)
CASES = {                                     # forward_hopper's keywords beside LAUNCH
    "unsegmented": dict(),
    "five_launch": dict(segments=4),
    "five_launch_no_skip": dict(segments=4, skip_maps=False),
    "two_launch": dict(segments=4, plan_in_walk=True),
    "split_heads": dict(segments=2, split_heads=True),
}


class Recorder:
    """Stands in for the kernels: TileLang's compiled kernels are their compile arguments, their executables and the
    Triton kernels append each launch to ``trace`` (and keep its tensors alive, so no storage is reused within a
    call and a tensor's storage names it)."""

    def __init__(self):
        self.trace = []
        self.labels = {}

    def describe(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        storage = x.untyped_storage().data_ptr()
        label = self.labels.setdefault(storage, f"t{len(self.labels)}")
        return (tuple(x.shape), x.dtype, x.stride(), x.storage_offset(), label)

    def executable(self, kernel):
        return lambda *args: self.trace.append((kernel, [self.describe(a) for a in args], args))

    def triton(self, name, real):
        recorder = self

        class Kernel:
            arg_names = list(real.arg_names)
            do_not_specialize = list(getattr(real, "do_not_specialize", None) or
                                     getattr(real, "kwargs", {}).get("do_not_specialize", ()))

            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    recorder.trace.append(((name, tuple(grid), tuple(sorted(kwargs.items()))),
                                           [recorder.describe(a) for a in args], args))
                return run
        return Kernel()


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(chunk_fwd, "compiled_kernel", lambda *a, **kw: ("walk", a, tuple(sorted(kw.items()))))
    monkeypatch.setattr(prepass, "compiled_kernel", lambda *a, **kw: ("prepass", a, tuple(sorted(kw.items()))))
    for module in (chunk_fwd, prepass):
        monkeypatch.setattr(module, "launcher", rec.executable)
    monkeypatch.setattr(map_bound, "segment_plan_kernel", rec.triton("plan", map_bound.segment_plan_kernel))
    monkeypatch.setattr(seq_parallel, "affine_scan_kernel", rec.triton("scan", seq_parallel.affine_scan_kernel))
    monkeypatch.setattr(prepared, "PREPARED", True)      # an empty cache: conftest's fresh_prepared_calls
    return rec


def inputs(with_state: bool, beta_dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, D).bfloat16(), r(B, T, H, D).bfloat16(), r(B, T, HV, D).bfloat16()
    g, beta = -torch.rand(B, T, HV, generator=gen), torch.rand(B, T, HV, generator=gen).to(beta_dtype)
    return q, k, v, g, beta, D ** -0.5, (r(B, HV, D, D) if with_state else None)


def traced_call(rec: Recorder, x, kw: dict) -> list:
    """One forward_hopper call's launches and returned tensors, each tensor named by its storage (the inputs by
    their names)."""
    rec.trace.clear()
    rec.labels = {t.untyped_storage().data_ptr(): name for name, t in zip("q k v g beta scale h0".split(), x)
                  if isinstance(t, torch.Tensor)}
    o, ht = hopper_fwd.forward_hopper(*x, **kw, **LAUNCH)
    return [(kernel, described) for kernel, described, _ in rec.trace] + [rec.describe(o), rec.describe(ht)]


@pytest.mark.parametrize("lean, overlap", [(False, False), (True, False), (True, True)],
                         ids=["plain_segments", "lean_segments", "overlapped_warm"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("case", list(CASES))
def test_prepared_call_issues_the_plain_forwards_launches(recorder, monkeypatch, case, with_state, lean, overlap):
    """The first call takes the plain forward and prepares the signature; the second takes the prepared call: the
    two traces are equal, and the prepared call was taken (the cache holds a call, and the plain forward is not
    entered). With OVERLAP_WARM the five launches' phase C is two (its warmed segments and the others)."""
    monkeypatch.setattr(hopper_fwd, "LEAN_SEGMENTS", lean)
    monkeypatch.setattr(hopper_fwd, "OVERLAP_WARM", overlap)
    x = inputs(with_state)
    plain = traced_call(recorder, x, CASES[case])
    assert len(prepared._prepared) == 1 and None not in prepared._prepared.values()
    monkeypatch.setattr(hopper_fwd, "_forward_hopper_plain", None)       # a prepared call must not need it
    again = traced_call(recorder, x, CASES[case])
    assert again == plain
    assert len(plain) == {"unsegmented": 2, "two_launch": 2, "split_heads": 3}.get(case, 6 if overlap else 5) + 2
    if case == "split_heads":       # the cold heads' narrow walk first, then the others' wide one
        assert [(dict(kernel[2])["head_split"], kernel[1][4]) for kernel, _ in plain[-4:-2]] == [(2, 64), (1, 64)]
    if overlap and case.startswith("five_launch"):          # the subsets: the others' walk first, then the warmed
        subsets = [dict(kernel[2]).get("warm_subset") for kernel, _ in plain[-4:-2]]
        assert subsets == [2, 1]


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
@pytest.mark.parametrize("whole_map", [False, True], ids=["row_blocks", "whole_map"])
def test_the_scan_takes_its_switches_in_both_paths(recorder, monkeypatch, whole_map, precision):
    """forward.SCAN_WHOLE_MAP and SCAN_PRECISION reach phase B's launch in the plain forward and in the prepared
    call alike: the whole map as one [K, K] tile (BR = BK) with the next map prefetched at 8 warps, else row blocks
    of 32 at 4; the products at the precision set."""
    monkeypatch.setattr(hopper_fwd, "SCAN_WHOLE_MAP", whole_map)
    monkeypatch.setattr(hopper_fwd, "SCAN_PRECISION", precision)
    x = inputs(False)
    plain = traced_call(recorder, x, CASES["five_launch"])
    assert traced_call(recorder, x, CASES["five_launch"]) == plain
    (scan,) = [dict(kernel[2]) for kernel, _ in plain[:-2] if kernel[0] == "scan"]
    assert (scan["BR"], scan["PREFETCH"], scan["num_warps"]) == ((D, True, 8) if whole_map else (32, False, 4))
    assert scan["DOT_PREC"] == precision


def test_a_new_signature_is_prepared_anew(recorder):
    """Another shape, dtype of β or initial state is another signature: each prepared after its own plain call,
    each prepared call the same as its plain one."""
    for beta_dtype, with_state in ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True)):
        x = inputs(with_state, beta_dtype)
        plain = traced_call(recorder, x, CASES["five_launch"])
        assert traced_call(recorder, x, CASES["five_launch"]) == plain
    assert len(prepared._prepared) == 3


def flipped(value):
    """Another value of a module switch."""
    if value is None:                 # an optional size (prepass.T_HI_ROW_PAD): one
        return 4
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2
    if isinstance(value, float):
        return value / 2
    if value in ("tf32x3", "tf32"):   # forward.SCAN_PRECISION
        return "tf32" if value == "tf32x3" else "tf32x3"
    raise TypeError(value)


# PREPASS and A_INV_DTYPE lead to the Triton pre-pass (the interpreter: slow here, and never prepared);
# EXECUTION_BACKEND and DIRECT_LAUNCH act inside the stubbed launcher. The coverage test below holds them too
FLIPS = [(module, name) for module, names in prepared.SWITCHES.items() for name in names
         if name not in ("PREPASS", "A_INV_DTYPE", "EXECUTION_BACKEND", "DIRECT_LAUNCH")]


@pytest.mark.parametrize("module,name", FLIPS, ids=[f"{m}.{n}" for m, n in FLIPS])
def test_a_flipped_switch_prepares_anew(recorder, monkeypatch, module, name):
    """A prepared signature, then one switch flipped: the next two calls (the plain forward, then the new value's
    prepared call) are what the plain forward does under the new value (its trace with PREPARED off), not the
    prepared call of the old one."""
    x = inputs(True)
    traced_call(recorder, x, CASES["five_launch"])
    monkeypatch.setattr(MODULES[module], name, flipped(getattr(MODULES[module], name)))
    after = [traced_call(recorder, x, CASES["five_launch"]) for _ in range(2)]
    monkeypatch.setattr(prepared, "PREPARED", False)
    plain = traced_call(recorder, x, CASES["five_launch"])
    assert after == [plain, plain]


def test_every_setting_the_forward_reads_is_in_the_signature():
    """Each upper-case module setting of the forward's modules is in prepared.SWITCHES or in NOT_READ (with its
    reason above): a new switch must be placed in one of them."""
    for module, names in prepared.SWITCHES.items():
        # settings only: not a module, nor what Triton's interpreter leaves in a kernel's globals (T, a TypeVar)
        settings = {n for n, value in vars(MODULES[module]).items() if n.isupper() and not n.startswith("_") and
                    isinstance(value, (bool, int, float, str, type(None), torch.dtype, dict, tuple))}
        assert set(names) <= settings, (module, set(names) - settings)
        assert settings == set(names) | NOT_READ[module], (module, settings ^ (set(names) | NOT_READ[module]))


def test_uncovered_configurations_take_the_plain_forward(recorder):
    """The role-split kernel and the segmented forward without warm-ups are not prepared (the cache keeps None for
    them, so build does not run again), and their calls still take the plain forward."""
    x = inputs(False)
    kw = dict(segments=4, warm_up=False)
    first = traced_call(recorder, x, kw)
    assert list(prepared._prepared.values()) == [None]
    assert traced_call(recorder, x, kw) == first


def launch_args(rec: Recorder, x, kw: dict) -> list:
    """One forward_hopper call's launches: each launch's arguments as passed (the tensors themselves)."""
    traced_call(rec, x, kw)
    return [args for _, _, args in rec.trace]


def scratch_args(launches: list, x) -> list:
    """The tensors of ``launches`` that are neither inputs nor views of them, by position (launch, argument)."""
    inputs_at = {t.untyped_storage().data_ptr() for t in x if isinstance(t, torch.Tensor)}
    return [(i, j, a) for i, args in enumerate(launches) for j, a in enumerate(args)
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() not in inputs_at]


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("case", ["unsegmented", "five_launch", "two_launch"])
def test_kept_scratch_is_the_same_launches_with_the_same_tensors(recorder, monkeypatch, case, with_state):
    """With REUSE_SCRATCH, the prepared calls issue the plain forward's launches (equal traces), and a second
    prepared call passes the first one's scratch tensors (the same objects) but new outputs: o, the final state and
    the scan's entering states are new (the plan's four flags are scratch since session 30)."""
    monkeypatch.setattr(prepared, "REUSE_SCRATCH", True)
    x = inputs(with_state)
    plain = traced_call(recorder, x, CASES[case])
    first, second = (launch_args(recorder, x, CASES[case]) for _ in range(2))
    assert traced_call(recorder, x, CASES[case]) == plain
    kept = {id(a) for _, _, a in scratch_args(first, x)} & {id(a) for _, _, a in scratch_args(second, x)}
    # the pre-pass's four outputs and A_inv itself (the pre-pass writes it through a view), and the stand-ins: h0
    # without a state, skip_m unsegmented, phase A's h0 and its maps, and the plan's four flags
    expected = 5 + (not with_state and case != "five_launch") + {"unsegmented": 1, "five_launch": 6}.get(case, 0)
    assert len(kept) == expected, [(i, j) for i, j, a in scratch_args(second, x) if id(a) in kept]
    assert all(a is not b for a, b in zip(first[-1][-2:], second[-1][-2:]))        # the last launch's o and ht


def test_scratch_is_kept_per_thread_and_only_for_the_latest_signature(recorder, monkeypatch):
    """Another thread gets its own scratch; another signature on the same thread replaces the kept set (one set per
    thread and stream); release_scratch gives every set back; above SCRATCH_MAX_BYTES nothing is kept."""
    import threading
    monkeypatch.setattr(prepared, "REUSE_SCRATCH", True)
    x = inputs(False)
    kw = CASES["two_launch"]
    traced_call(recorder, x, kw)
    here = scratch_args(launch_args(recorder, x, kw), x)
    there = []
    worker = threading.Thread(target=lambda: there.append(scratch_args(launch_args(recorder, x, kw), x)))
    worker.start()
    worker.join()
    assert not {id(a) for *_, a in here} & {id(a) for *_, a in there[0]}
    assert len(prepared._scratch) == 2
    y = inputs(False, torch.bfloat16)                  # another signature (β in bf16), on this thread
    traced_call(recorder, y, kw)
    launch_args(recorder, y, kw)
    assert len(prepared._scratch) == 2 and all(a is not b for (*_, a), (*_, b) in zip(
        scratch_args(launch_args(recorder, x, kw), x), here))      # x's set was replaced, so it is new again
    kept = scratch_args(launch_args(recorder, x, kw), x)
    prepared.release_scratch()                          # every set given back: the next call makes a new one
    assert not prepared._scratch
    assert all(a is not b for (*_, a), (*_, b) in zip(scratch_args(launch_args(recorder, x, kw), x), kept))
    prepared.release_scratch()
    monkeypatch.setattr(prepared, "SCRATCH_MAX_BYTES", 0)
    a, b = (scratch_args(launch_args(recorder, x, kw), x) for _ in range(2))
    assert all(s is not t for (*_, s), (*_, t) in zip(a, b)) and not prepared._scratch


@ON_HOPPER
@pytest.mark.parametrize("shape", [(8, 4096, 16, 16), (1, 32768, 16, 16), (1, 4096, 16, 16)],
                         ids=["unsegmented", "five_launch", "two_launch"])
def test_prepared_calls_are_bitwise_the_plain_forward_on_the_gpu(monkeypatch, shape):
    """Through the public op on the H200 ("auto": the three plans at these shapes), PREPARED off, then on twice (the
    first call prepares, the second is the prepared call): o and the final state bitwise equal."""
    import linattn
    from linattn.ops.gated_delta import triton_chunk
    monkeypatch.setattr(triton_chunk, "FORWARD_PATH", "auto")
    monkeypatch.setattr(prepared, "_prepared", {})
    x = gpu_inputs(*shape, 128, 128)
    outs = []
    for on in (False, True, True):
        monkeypatch.setattr(prepared, "PREPARED", on)
        with torch.no_grad():
            outs.append(linattn.chunk_gated_delta_rule(**x, output_final_state=True))
    assert len(prepared._prepared) == 1 and None not in prepared._prepared.values()
    for o, ht in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(ht, outs[0][1])


@ON_HOPPER
@pytest.mark.parametrize("shape", [(8, 4096, 16, 16), (1, 32768, 16, 16), (1, 4096, 16, 16)],
                         ids=["unsegmented", "five_launch", "two_launch"])
def test_kept_scratch_is_bitwise_the_plain_forward_on_the_gpu(monkeypatch, shape):
    """Through the public op on the H200 with REUSE_SCRATCH: two inputs in turn (x, y, x, y), each call after the
    first two a prepared one on the other input's kept scratch, every (o, final state) bitwise the plain forward's
    of its input. Each kept tensor starts poisoned (NaN where it is a float), so a read of one the call did not
    write shows."""
    import linattn
    from linattn.ops.gated_delta import triton_chunk
    monkeypatch.setattr(triton_chunk, "FORWARD_PATH", "auto")
    xs = [gpu_inputs(*shape, 128, 128, seed=seed) for seed in (0, 1)]
    monkeypatch.setattr(prepared, "PREPARED", False)
    with torch.no_grad():
        plain = [linattn.chunk_gated_delta_rule(**x, output_final_state=True) for x in xs]
    monkeypatch.setattr(prepared, "PREPARED", True)
    monkeypatch.setattr(prepared, "REUSE_SCRATCH", True)
    # the unsegmented and five-launch shapes hold more than SCRATCH_MAX_BYTES (A_inv alone is 64 MiB): raised so that
    # every plan's scratch is kept here (run 33 found the cap had kept nothing there, the check below)
    monkeypatch.setattr(prepared, "SCRATCH_MAX_BYTES", 1 << 32)
    real_scratch = prepared.scratch

    def poisoned(owner, make, device, nbytes):
        fresh = (owner, torch.cuda.current_stream(device).cuda_stream) not in poisoned.seen
        held = real_scratch(owner, make, device, nbytes)
        if fresh:
            poisoned.seen.add((owner, torch.cuda.current_stream(device).cuda_stream))
            for t in (*held[:-1], *held.extra):
                t.view(torch.uint8).fill_(0xFF)             # NaN in every float lane, −1 in int32
        return held
    poisoned.seen = set()
    monkeypatch.setattr(prepared, "scratch", poisoned)
    with torch.no_grad():
        for i in (0, 1, 0, 1):
            o, ht = linattn.chunk_gated_delta_rule(**xs[i], output_final_state=True)
            assert torch.equal(o, plain[i][0]) and torch.equal(ht, plain[i][1]), i
    assert len(prepared._scratch) == 1
