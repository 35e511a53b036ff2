"""Compiling many Hopper kernels at once, one process per CPU core, before a script first launches them.

Why: a TileLang compile of one of these kernels takes 4-25 s, nearly all of it in one single-threaded nvcc, and a
process compiles its kernels one after another as it first launches them (the ``compiled_kernel`` functions of
``chunk_fwd.py``, ``chunk_bwd.py``, ``prepass.py`` and ``walk_launch.py``, each cached per process). TileLang keeps a
disk cache of compiled kernels shared by every process of the machine (``$TILELANG_CACHE_DIR``, default
``~/.tilelang/cache``): an entry's key hashes the prim_func's script, the target, the pass configs, the execution
backend and TileLang's version, and a process that compiles a prim_func already in the cache loads its library
instead (≈ 0.1-0.3 s). :func:`precompile` fills that cache in parallel; the caller then compiles as before and every
compile is a cache hit.

How the keys are kept equal: a :class:`Build` names the very function the caller will call (a ``compiled_kernel``)
and its arguments, and a worker calls it as it is. The worker then builds the same prim_func and reaches
``compile.compile_prim_func`` with the same ``target`` (None: this machine's GPU, detected the same way in every
process of it) and the same pass configs, so its cache entry is the one the caller looks up.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import time
from typing import Any, Callable, Iterable, Optional


@dataclasses.dataclass(frozen=True)
class Build:
    """One kernel to compile: ``compile(*args, **kwargs)``, where ``compile`` is a module-level function that
    compiles through ``compile.compile_prim_func`` (``chunk_bwd.compiled_kernel``, ``walk_launch.states_kernel``,
    ...). Picklable (the function travels by its qualified name), so a worker process can run it."""
    compile: Callable
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)

    def __call__(self) -> Any:
        return self.compile(*self.args, **self.kwargs)

    def __str__(self) -> str:
        shown = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.compile.__module__}.{self.compile.__qualname__}({', '.join(shown)})"


@dataclasses.dataclass(frozen=True)
class PrecompileReport:
    """What :func:`precompile` did: how many builds it compiled (``compiled``), which failed and why
    (``failures``: the build and the error's text), its wall time and its worker processes."""
    compiled: int
    failures: tuple[tuple[Build, str], ...]
    seconds: float
    workers: int

    def __str__(self) -> str:
        text = f"precompiled {self.compiled} kernels in {self.seconds:.1f} s on {self.workers} processes"
        return text + "".join(f"\n  failed: {build}: {error}" for build, error in self.failures)


def _compile_in_worker(build: Build) -> Optional[str]:
    """Run ``build`` in a worker (its kernel lands in TileLang's disk cache; the kernel object itself stays here);
    the error's text if it fails, else None."""
    try:
        build()
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:500]
    return None


def precompile(builds: Iterable[Build], workers: Optional[int] = None) -> PrecompileReport:
    """Compile ``builds`` in ``workers`` processes (None: one per usable core, at most one per build), so that each
    kernel is in TileLang's disk cache when this process compiles it. Never raises for a failed build: the failure
    is in the report, and this process's own compile of that kernel raises it where it is used (a worker's
    environment could differ: an error there is no verdict). The workers are spawned, not forked: a forked child of
    a process that has initialised CUDA cannot use it. Nothing to do where TileLang is absent or its cache is off
    (``TILELANG_DISABLE_CACHE``): the report then says 0 compiled."""
    builds = list(builds)
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if not builds or not _disk_cache_on():
        return PrecompileReport(0, (), 0.0, 0)
    workers = min(len(builds), workers or usable_cores())
    start = time.perf_counter()
    failures = []
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            pending = {pool.submit(_compile_in_worker, build): build for build in builds}
            for future in concurrent.futures.as_completed(pending):
                try:
                    error = future.result()
                except Exception as e:      # the worker died, or the build did not pickle
                    error = f"{type(e).__name__}: {e}"[:500]
                if error is not None:
                    failures.append((pending[future], error))
    except Exception as e:                  # the pool itself could not start
        failures = [(build, f"{type(e).__name__}: {e}"[:500]) for build in builds]
    return PrecompileReport(len(builds) - len(failures), tuple(failures), time.perf_counter() - start, workers)


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the platform tells it, else all of them)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _disk_cache_on() -> bool:
    """Whether TileLang imports and keeps its disk cache (what :func:`precompile` fills)."""
    from .compile import tilelang_available
    if not tilelang_available():
        return False
    from tilelang import env
    return env.is_cache_enabled()
