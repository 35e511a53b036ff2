"""The Hopper forward's prepared calls (``hopper/prepared.py``): with every kernel stubbed by a recorder (the TileLang
executables and the plan's and scan's Triton kernels), a repeated signature's prepared call issues the launches the
plain forward issues — the same kernels (their compile arguments), in the same order, each argument the same input
view or the same fresh tensor (shape, dtype, strides, which earlier launch's tensor it is) and the same scalars —
and returns tensors of the same kind, for every plan. On the GPU the op's outputs are bitwise the plain
forward's."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from linattn.ops.common import seq_parallel
from linattn.ops.hopper import chunk_fwd, map_bound, prepared, prepass
from linattn.ops.hopper import forward as hopper_fwd
from linattn.ops.hopper import plan as plan_module
from linattn.ops.hopper.plan import DEFAULT, HopperPlan, plan_inputs

from .hopper_twins import hand_plan
from .test_hopper_fwd import ON_HOPPER, gpu_inputs

B, T, H, HV, D = 1, 1024, 2, 4, 64
CASES = {
    "unsegmented": hand_plan(1, BV=64),
    "five_launch": hand_plan(4, BV=64),
    "two_launch": hand_plan(4, planned_walk=True, BV=64),
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
    return rec          # an empty cache: conftest's fresh_prepared_calls


def inputs(with_state: bool, beta_dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, D).bfloat16(), r(B, T, H, D).bfloat16(), r(B, T, HV, D).bfloat16()
    g, beta = -torch.rand(B, T, HV, generator=gen), torch.rand(B, T, HV, generator=gen).to(beta_dtype)
    return q, k, v, g, beta, D ** -0.5, (r(B, HV, D, D) if with_state else None)


def traced_call(rec: Recorder, x, plan: HopperPlan) -> list:
    """One forward_hopper call's launches and returned tensors, each tensor named by its storage (the inputs by
    their names)."""
    rec.trace.clear()
    rec.labels = {t.untyped_storage().data_ptr(): name for name, t in zip("q k v g beta scale h0".split(), x)
                  if isinstance(t, torch.Tensor)}
    o, ht = hopper_fwd.forward_hopper(plan, *x)
    return [(kernel, described) for kernel, described, _ in rec.trace] + [rec.describe(o), rec.describe(ht)]


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("case", list(CASES))
def test_prepared_call_issues_the_plain_forwards_launches(recorder, monkeypatch, case, with_state):
    """The first call takes the plain forward and prepares the signature; the second takes the prepared call: the
    two traces are equal, and the prepared call was taken (the cache holds a call, and the plain forward is not
    entered)."""
    x = inputs(with_state)
    plain = traced_call(recorder, x, CASES[case])
    assert len(prepared._prepared) == 1 and None not in prepared._prepared.values()
    monkeypatch.setattr(hopper_fwd, "forward_plain", None)       # a prepared call must not need it
    again = traced_call(recorder, x, CASES[case])
    assert again == plain
    assert len(plain) == {"unsegmented": 2, "two_launch": 2, "five_launch": 5}[case] + 2


@pytest.mark.parametrize("beta_dtype", [torch.float32, torch.bfloat16], ids=["beta_fp32", "beta_bf16"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_builds_are_the_kernels_the_plain_forward_compiles(recorder, case, with_state, beta_dtype):
    """``prepared.forward_builds`` (what a script precompiles, ``hopper/precompile.py``) names exactly the TileLang
    kernels the plain forward compiles under each plan, in its order: their compile arguments are equal."""
    x = inputs(with_state, beta_dtype)
    launched = [kernel for kernel, _ in traced_call(recorder, x, CASES[case])[:-2] if kernel[0] in ("walk", "prepass")]
    builds = prepared.forward_builds(CASES[case], H, HV, D, D, D ** -0.5, with_state, beta_dtype)
    assert [build() for build in builds] == launched


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
def test_the_scan_takes_the_plans_precision_in_both_paths(recorder, precision):
    """The plan's scan_precision reaches phase B's launch in the plain forward and in the prepared call alike, with
    the whole map as one [K, K] tile (BR = BK) and the next map prefetched at 8 warps."""
    x = inputs(False)
    plan = hand_plan(4, BV=64, config=dataclasses.replace(DEFAULT, scan_precision=precision))
    plain = traced_call(recorder, x, plan)
    assert traced_call(recorder, x, plan) == plain
    (scan,) = [dict(kernel[2]) for kernel, _ in plain[:-2] if kernel[0] == "scan"]
    assert (scan["BR"], scan["PREFETCH"], scan["num_warps"]) == (D, True, 8)
    assert scan["DOT_PREC"] == precision


def test_a_new_signature_is_prepared_anew(recorder):
    """Another shape, dtype of β, initial state or plan is another signature: each prepared after its own plain
    call, each prepared call the same as its plain one."""
    loose = hand_plan(4, BV=64, config=dataclasses.replace(DEFAULT, negligible_m_log2=-20.0))
    for beta_dtype, with_state, plan in ((torch.float32, False, CASES["five_launch"]),
                                         (torch.bfloat16, False, CASES["five_launch"]),
                                         (torch.float32, True, CASES["five_launch"]), (torch.float32, True, loose)):
        x = inputs(with_state, beta_dtype)
        plain = traced_call(recorder, x, plan)
        assert traced_call(recorder, x, plan) == plain
    assert len(prepared._prepared) == 4


def launch_args(rec: Recorder, x, plan: HopperPlan) -> list:
    """One forward_hopper call's launches: each launch's arguments as passed (the tensors themselves)."""
    traced_call(rec, x, plan)
    return [args for _, _, args in rec.trace]


def scratch_args(launches: list, x) -> list:
    """The tensors of ``launches`` that are neither inputs nor views of them, by position (launch, argument)."""
    inputs_at = {t.untyped_storage().data_ptr() for t in x if isinstance(t, torch.Tensor)}
    return [(i, j, a) for i, args in enumerate(launches) for j, a in enumerate(args)
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() not in inputs_at]


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("case", ["unsegmented", "five_launch", "two_launch"])
def test_kept_scratch_is_the_same_launches_with_the_same_tensors(recorder, monkeypatch, case, with_state):
    """The prepared calls issue the plain forward's launches (equal traces), and a second prepared call passes the
    first one's scratch tensors (the same objects) but new outputs: o, the final state and the scan's entering
    states are new."""
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


def test_scratch_is_kept_per_stream_not_per_thread(recorder):
    """Another thread on the same stream takes the kept set (threads that come and go leave nothing behind);
    another signature replaces the stream's set (one set per stream); release_scratch gives every set back; above
    the scratch bound nothing is kept."""
    import threading
    x = inputs(False)
    plan = CASES["two_launch"]
    traced_call(recorder, x, plan)
    here = scratch_args(launch_args(recorder, x, plan), x)
    there = []
    for _ in range(3):
        worker = threading.Thread(target=lambda: there.append(scratch_args(launch_args(recorder, x, plan), x)))
        worker.start()
        worker.join()
    for theirs in there:           # the same kept tensors; the last two, o and the final state, new
        assert [id(a) for *_, a in theirs[:-2]] == [id(a) for *_, a in here[:-2]]
        assert not {id(a) for *_, a in theirs[-2:]} & {id(a) for *_, a in here}
    assert len(prepared._scratch) == 1
    y = inputs(False, torch.bfloat16)                  # another signature (β in bf16), on this stream
    traced_call(recorder, y, plan)
    launch_args(recorder, y, plan)
    assert len(prepared._scratch) == 1 and all(a is not b for (*_, a), (*_, b) in zip(
        scratch_args(launch_args(recorder, x, plan), x), here))    # x's set was replaced, so it is new again
    kept = scratch_args(launch_args(recorder, x, plan), x)
    prepared.release_scratch()                          # every set given back: the next call makes a new one
    assert not prepared._scratch
    assert all(a is not b for (*_, a), (*_, b) in zip(scratch_args(launch_args(recorder, x, plan), x), kept))


def test_a_held_set_is_never_shared(monkeypatch):
    """While one call holds its stream's set (its launches being issued), a call on the same stream gets new tensors
    and keeps nothing: two calls' launches never interleave on one set; the set is the first call's again after."""
    made = []

    def make(device):
        made.append(torch.empty(4))
        return made[-1]
    device = torch.device("cpu")
    with prepared.scratch("call", make, device, 16) as first:
        with prepared.scratch("call", make, device, 16) as second:
            assert second is not first and len(prepared._scratch) == 1
    with prepared.scratch("call", make, device, 16) as again:
        assert again is first and len(made) == 2


def test_kept_sets_are_bounded_per_device(monkeypatch):
    """Streams keep a set each, up to the scratch bound per device: a new set pushes the least recently used ones
    out (a set in use stays), another device's sets do not count, and a set above the bound is never kept."""
    streams = iter(range(100))
    monkeypatch.setattr(prepared, "stream_key", lambda device: (device.type, device.index, next(streams)))
    monkeypatch.setattr(plan_module, "CACHE_LIMITS", dataclasses.replace(plan_module.CACHE_LIMITS, scratch_bytes=100))
    a, b = torch.device("meta", 0), torch.device("meta", 1)
    make = lambda device: torch.empty(1, device="meta")  # noqa: E731
    for _ in range(3):
        with prepared.scratch("call", make, a, 40):
            pass
    assert prepared.kept_bytes() == 80 and len(prepared._scratch) == 2        # 120 would pass the bound
    first = next(iter(prepared._scratch))
    with prepared.scratch("call", make, a, 40):
        assert first not in prepared._scratch                                 # the oldest went
    with prepared.scratch("call", make, b, 90):
        pass
    assert prepared.kept_bytes() == 170                                       # per device: 80 on a, 90 on b
    with prepared.scratch("call", make, a, 101):
        pass
    assert prepared.kept_bytes() == 170                                       # too large: not kept
    with prepared.scratch("held", make, a, 60):
        with prepared.scratch("next", make, a, 60):                           # the held set stays
            assert sum(k.nbytes for w, k in prepared._scratch.items() if w[:2] == ("meta", 0)) == 120


def gpu_plan(x: dict):
    """The op's plan for ``x`` (``plan.plan_inputs``)."""
    found, why = plan_inputs(x["q"], x["v"], (x["k"], x["g"], x["beta"], x["initial_state"]), None, None)
    assert found is not None, why
    return found


@ON_HOPPER
@pytest.mark.parametrize("shape", [(8, 4096, 16, 16), (1, 32768, 16, 16), (1, 4096, 16, 16)],
                         ids=["unsegmented", "five_launch", "two_launch"])
def test_prepared_calls_are_bitwise_the_plain_forward_on_the_gpu(shape):
    """Through the public op (the three plans at these shapes), the first call prepares and the second is the
    prepared call: o and the final state bitwise equal to the plain forward's."""
    import linattn
    x = gpu_inputs(*shape, 128, 128)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    with torch.no_grad():
        plain = hopper_fwd.forward_plain(gpu_plan(x), *args, 128 ** -0.5, x["initial_state"])
        outs = [linattn.chunk_gated_delta_rule(**x, output_final_state=True) for _ in range(2)]
    assert len(prepared._prepared) == 1 and None not in prepared._prepared.values()
    for o, ht in outs:
        assert torch.equal(o, plain[0]) and torch.equal(ht, plain[1])


@ON_HOPPER
@pytest.mark.parametrize("shape", [(8, 4096, 16, 16), (1, 32768, 16, 16), (1, 4096, 16, 16)],
                         ids=["unsegmented", "five_launch", "two_launch"])
def test_kept_scratch_is_bitwise_the_plain_forward_on_the_gpu(monkeypatch, shape):
    """Through the public op with kept scratch: two inputs in turn (x, y, x, y), each call after the first two a
    prepared one on the other input's kept scratch, every (o, final state) bitwise the plain forward's of its
    input. Each kept tensor starts poisoned (NaN where it is a float), so a read of one the call did not write
    shows."""
    import linattn
    xs = [gpu_inputs(*shape, 128, 128, seed=seed) for seed in (0, 1)]
    with torch.no_grad():
        plain = [hopper_fwd.forward_plain(gpu_plan(x), *(x[n] for n in ("q", "k", "v", "g", "beta")), 128 ** -0.5,
                                          x["initial_state"]) for x in xs]
    # the unsegmented and five-launch shapes hold more than the scratch bound (A_inv alone is 64 MiB): raised so that
    # every plan's scratch is kept here
    monkeypatch.setattr(plan_module, "CACHE_LIMITS", dataclasses.replace(plan_module.CACHE_LIMITS,
                                                                         scratch_bytes=1 << 32))
    real_scratch = prepared.scratch

    def poisoned(owner, make, device, nbytes):
        def make_poisoned(device):
            held = make(device)
            for t in (*held[:-1], *held.extra):
                t.view(torch.uint8).fill_(0xFF)             # NaN in every float lane, −1 in int32
            return held
        return real_scratch(owner, make_poisoned, device, nbytes)
    monkeypatch.setattr(prepared, "scratch", poisoned)
    with torch.no_grad():
        for i in (0, 1, 0, 1):
            o, ht = linattn.chunk_gated_delta_rule(**xs[i], output_final_state=True)
            assert torch.equal(o, plain[i][0]) and torch.equal(ht, plain[i][1]), i
    assert len(prepared._scratch) == 1


@ON_HOPPER
def test_threads_sharing_a_stream_never_share_a_set_on_the_gpu():
    """Two threads calling the op on one stream (the default) with their own inputs, many times each: every result
    bitwise its input's plain forward, so no call read a set while another call's launches were writing it; one set
    is kept in the end (per stream, not per thread)."""
    import threading

    import linattn
    xs = [gpu_inputs(1, 4096, 16, 16, 128, 128, seed=seed) for seed in (2, 3)]
    with torch.no_grad():
        plain = [hopper_fwd.forward_plain(gpu_plan(x), *(x[n] for n in ("q", "k", "v", "g", "beta")), 128 ** -0.5,
                                          x["initial_state"]) for x in xs]
    results = [[], []]

    def calls(i):
        with torch.no_grad():
            for _ in range(50):
                results[i].append(linattn.chunk_gated_delta_rule(**xs[i], output_final_state=True))
    workers = [threading.Thread(target=calls, args=(i,)) for i in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    torch.cuda.synchronize()
    for i in (0, 1):
        assert len(results[i]) == 50
        assert all(torch.equal(o, plain[i][0]) and torch.equal(ht, plain[i][1]) for o, ht in results[i]), i
    assert len(prepared._scratch) == 1
