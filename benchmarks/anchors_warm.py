"""The anchors table's warm phase: every implementation's first forward (+ backward) at every row, in spawned worker
processes side by side, before the table times anything.

Why: a fresh GPU machine compiles each implementation's kernels on its first call at a shape, one after another in
the timing process (FlashQLA's TileLang kernels 2-40 s each, ours 8-25 s each, fla's Triton kernels and their
autotune), so a three-row forward + backward table spent its whole call compiling. The compiles land in disk caches
that every process of the machine shares: TileLang's (``$TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``; both
FlashQLA's ``@tilelang.jit`` kernels and ours go through ``tilelang.compile`` → ``cache.cached``) and Triton's
(``~/.triton/cache``: compiled kernels, and autotune results where the autotuner caches them: fla's
``fla_cache_autotune`` kernels by default (``FLA_CACHE_RESULTS=1``), every ``triton.autotune`` with
``TRITON_CACHE_AUTOTUNING=1``, which :func:`cache_autotune_results` sets when unset). fla's cached configs are then
the ones its autotune picked in a worker while other workers used the card; ``FLA_CACHE_RESULTS=0
TRITON_CACHE_AUTOTUNING=0`` keep autotune results per process, so the timed process tunes them alone again (its
Triton binaries still load from the cache). A worker runs the very call the table times
(``bench_anchors.load_impls``' implementation, ``make_inputs``' inputs, seed 2), so it compiles the same kernels with
the same keys; the table's first calls then load them. Ours run the op too rather than ``hopper.precompile``'s
per-kernel builds: the backward's kernels at a shape have no builds list of their own, an op run compiles exactly
what the table launches, and its serial chain (H100, row 2: ≈ 40 s) is shorter than FlashQLA's (≈ 80 s), which bounds
the phase anyway.

Bounded by the card's memory: each task is charged :func:`task_bytes` (a multiple of its row's largest input), and
a task starts only while the tasks in flight plus it fit the budget (the card's free memory less each worker's CUDA
context); workers: one per usable CPU core at most (the compiles are single-threaded nvcc / ptxas runs).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

# One fwd + bwd's memory as a multiple of the row's largest [B, T, heads, 128] bf16 tensor X: the inputs and do
# (4 X) and the fwd + bwd's peak beyond them (peak_extra_MB on the H100 at row 2: linattn's 12.75 X, FlashQLA's
# 6.7 X; o and the gradients included), 16.75 X for the largest, with a margin for fla's (not measured) and its
# autotune, which runs every config on the same buffers.
TENSOR_MULTIPLE = 20
CONTEXT_BYTES = 1 << 30      # a worker's CUDA context, cuBLAS workspace and allocator slack
FREE_FRACTION = 0.9          # of the card's free memory at the start, the rest left to fragmentation
HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class WarmTask:
    """One implementation's first call at one row: ``impl`` (a ``load_impls`` name), the row's number and shape
    (B, T, H, HV; K = V = 128), ``train`` (forward + backward, else the forward), the extra ``load_impls`` specs the
    worker loads (``extra``) and the memory the task is charged (``nbytes``)."""
    impl: str
    row: int
    shape: tuple[int, int, int, int]
    train: bool
    extra: tuple[str, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class WarmResult:
    """What a worker did: the task, its seconds (imports excluded), its peak allocation (MB) and its error, if any."""
    task: WarmTask
    seconds: float
    peak_MB: float
    error: Optional[str] = None


def task_bytes(B: int, T: int, H: int, HV: int) -> int:
    """The memory charged to one fwd + bwd at this shape (:data:`TENSOR_MULTIPLE` of its largest input)."""
    return TENSOR_MULTIPLE * B * T * max(H, HV) * HEAD_DIM * 2


def warm_tasks(impls: Iterable[str], rows: dict, train: bool, extra: Iterable[str] = ()) -> list[WarmTask]:
    """One task per (implementation, row) of ``rows`` ({row: (B, T, H, HV)}), largest first (the longest compiles
    start first; among equal sizes, in the given order)."""
    extra = tuple(extra)
    tasks = [WarmTask(impl, row, tuple(shape), train, extra, task_bytes(*shape))
             for row, shape in rows.items() for impl in impls]
    return sorted(tasks, key=lambda t: -t.nbytes)


def pool_bound(tasks: list[WarmTask], free_bytes: int, cores: int) -> tuple[int, int]:
    """(workers, task budget in bytes): one worker per core at most, one per task at most; the budget is
    :data:`FREE_FRACTION` of the card's free memory less each worker's :data:`CONTEXT_BYTES`."""
    if cores < 1:
        raise ValueError(f"cores must be at least 1, got {cores}")
    workers = max(1, min(len(tasks), cores))
    return workers, int(free_bytes * FREE_FRACTION) - workers * CONTEXT_BYTES


def admissible(pending: list[WarmTask], in_flight_bytes: int, budget: int, idle_workers: int) -> list[WarmTask]:
    """The pending tasks to start now, in order: each that fits the budget beside those in flight and those picked
    before it, while a worker is idle. A task larger than the budget starts alone (nothing in flight), so every
    task runs."""
    picked = []
    for task in pending:
        if len(picked) == idle_workers:
            break
        if in_flight_bytes + task.nbytes <= budget or (in_flight_bytes == 0 and not picked):
            picked.append(task)
            in_flight_bytes += task.nbytes
    return picked


def _anchors_path() -> str:
    return str(Path(__file__).resolve().parents[1] / ".anchors")


def warm_one(task: WarmTask) -> WarmResult:
    """The worker: ``task``'s implementation loaded as the table loads it, one call on bench_anchors' inputs at the
    row's shape, then ``torch.autograd.grad`` over every input with ``train``, else one call under no_grad, on the
    GPU. Never raises: an error is in the result (the table's own first call then compiles, and reports it)."""
    import torch
    print(f"--- {task.impl} row {task.row} {task.shape}", flush=True)
    if not torch.cuda.is_available():
        return WarmResult(task, float("nan"), 0.0, "no CUDA device")
    try:
        if _anchors_path() not in sys.path:
            sys.path.insert(0, _anchors_path())
        from bench_anchors import load_impls, make_inputs
        fn = load_impls(list(task.extra))[task.impl]
        B, T, H, HV = task.shape
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        # the table's inputs ask for gradients in both modes, and its forward figure runs under no_grad (the
        # implementations may choose other kernels without autograd: FlashQLA's is_train)
        xs = make_inputs(B, T, H, HV, HEAD_DIM, HEAD_DIM, torch.bfloat16, seed=2, requires_grad=True)
        o = fn(*xs, HEAD_DIM ** -0.5)[0]
        if task.train:
            torch.autograd.grad(o, xs, torch.randn_like(o))
        else:
            with torch.no_grad():
                fn(*xs, HEAD_DIM ** -0.5)
        torch.cuda.synchronize()
        seconds, error = time.perf_counter() - start, None
    except Exception as e:
        seconds, error = float("nan"), f"{type(e).__name__}: {e}"[:300]
    peak = torch.cuda.max_memory_allocated() / 2 ** 20
    xs = o = fn = None
    prepared = sys.modules.get("linattn.ops.hopper.prepared")
    if prepared is not None:
        prepared.release_scratch()    # our op's kept scratch, which empty_cache does not reach
    torch.cuda.empty_cache()          # the worker may take a larger task next
    return WarmResult(task, seconds, peak, error)


def cache_autotune_results() -> None:
    """``TRITON_CACHE_AUTOTUNING=1`` where unset, so that every Triton autotuner created after (fla's, on its
    import) keeps its results in Triton's disk cache; spawned workers inherit it."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


def _write_output_to(log_dir: Optional[str]) -> None:
    """A worker's initializer: its stdout and stderr (the compilers' logs and warnings, many per task) into
    ``log_dir/worker-<pid>.log``, so that they do not bury the table's own output; left as they are without one."""
    if log_dir is None:
        return
    os.makedirs(log_dir, exist_ok=True)
    fd = os.open(os.path.join(log_dir, f"worker-{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
        os.dup2(fd, stream.fileno())
    os.close(fd)


def warm(tasks: list[WarmTask], free_bytes: int, cores: int, log=print,
         log_dir: Optional[str] = None) -> tuple[float, list[WarmResult]]:
    """Run ``tasks`` in spawned workers under :func:`pool_bound`, admitting by :func:`admissible`, their output into
    ``log_dir`` (:func:`_write_output_to`); logs each result as it comes and returns the phase's wall seconds and
    the results, in the order they came. Never raises for a task or a broken pool: what did not warm compiles in
    the table's own first calls."""
    workers, budget = pool_bound(tasks, free_bytes, cores)
    log(f"warm: {len(tasks)} tasks on {workers} workers, memory budget {budget / 2 ** 30:.1f} GiB"
        + (f", their output in {log_dir}" if log_dir else ""))
    start = time.perf_counter()
    pending, running, results = list(tasks), {}, []
    context = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_write_output_to,
                                                    initargs=(log_dir,)) as pool:
            while pending or running:
                in_flight = sum(t.nbytes for t in running.values())
                for task in admissible(pending, in_flight, budget, workers - len(running)):
                    pending.remove(task)
                    running[pool.submit(warm_one, task)] = task
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    task = running.pop(future)
                    try:
                        result = future.result()
                    except Exception as e:      # the worker died (killed for memory, a crash)
                        result = WarmResult(task, float("nan"), 0.0, f"{type(e).__name__}: {e}"[:300])
                    results.append(result)
                    log(f"warm: {task.impl} row {task.row} {result.seconds:.1f} s, peak {result.peak_MB:.0f} MB"
                        + (f", error {result.error}" if result.error else "")
                        + f" (at {time.perf_counter() - start:.0f} s)")
    except Exception as e:      # a broken pool: what did not warm compiles in the table's own first calls
        log(f"warm: stopped, {len(pending) + len(running)} tasks not warmed: {type(e).__name__}: {e}"[:400])
    return time.perf_counter() - start, results


def to_json(seconds: float, results: list[WarmResult]) -> str:
    """The phase as ``$OUT/warm.json``: its seconds and each task's row, seconds, charged and peak MB and error (the
    charged and peak figures side by side calibrate :data:`TENSOR_MULTIPLE`)."""
    return json.dumps(dict(seconds=seconds, tasks=[
        dict(impl=r.task.impl, row=r.task.row, seconds=r.seconds, charged_MB=r.task.nbytes / 2 ** 20,
             peak_MB=r.peak_MB, error=r.error) for r in results]), indent=1)
