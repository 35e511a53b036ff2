"""What every section receives: device, profile, implementations, the time budget and the progress display.

Also the device-neutral helpers the sections share: ``sync``, peak-memory measurement (the CUDA caching
allocator's counters on GPU; the PyTorch profiler's allocation events on CPU), the process's resident set (soak),
and ``run_with_timeout`` (robustness and soak must survive a call that never returns).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .cases import Profile
from .impls import Impl


@dataclass
class Context:
    device: torch.device
    profile: Profile
    impls: list[Impl]
    deadline: float  # time.monotonic() value after which sections stop starting new work
    seed: int = 0
    progress: Optional[Callable[[str], None]] = None  # called with a short description after each unit of work
    peak_tflops: Optional[float] = None  # user overrides of the roofline ceilings
    peak_gbs: Optional[float] = None
    notes: list = field(default_factory=list)

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"

    def available(self, kind: Optional[str] = None) -> list[Impl]:
        return [i for i in self.impls if i.available and (kind is None or i.kind == kind)]

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def out_of_time(self, reserve_s: float = 0.0) -> bool:
        return self.remaining() <= reserve_s

    @contextlib.contextmanager
    def share(self, parts_left: int):
        """Run the block with a fair share of the remaining time, ``1 / parts_left`` of it; time the block leaves
        unused stays for the parts after it. (Without this, the first sweep of a section could starve the rest.)"""
        old = self.deadline
        self.deadline = time.monotonic() + max(0.0, self.remaining()) / max(1, parts_left)
        try:
            yield
        finally:
            self.deadline = old

    def step(self, desc: str) -> None:
        if self.progress is not None:
            self.progress(desc)

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)


def error_record(e: BaseException) -> dict:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return {"type": type(e).__name__, "message": msg[:300]}


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


# --------------------------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def rss_supported() -> bool:
    try:
        _rss_bytes()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _quiet_stderr():
    """Silence fd 2 (the profiler's C++ side prints start/stop lines there) and restore it afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of live CPU tensor bytes allocated by ``fn`` (exact: the profiler's allocation events, replayed)."""
    from torch.profiler import ProfilerActivity, profile
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.profiler.DeviceType.CPU)
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


def measure_peak(ctx: Context, fn: Callable[[], object]) -> dict:
    """Run ``fn`` once; return the peak memory it added above what was allocated before it.

    GPU: ``max_memory_allocated`` minus ``memory_allocated`` before (the caching allocator's counters), plus
    active/reserved bytes after (fragmentation). CPU: the allocation and free events the PyTorch profiler records,
    replayed in order (exact for tensor memory; the profiler slows the call, so it is never timed at the same time).
    """
    if ctx.gpu:
        ctx.sync()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        base = torch.cuda.memory_allocated(ctx.device)
        out = fn()
        ctx.sync()
        peak = torch.cuda.max_memory_allocated(ctx.device) - base
        del out
        stats = torch.cuda.memory_stats(ctx.device)
        return {"peak_bytes": int(peak), "method": "cuda_allocator",
                "active_bytes": int(stats.get("active_bytes.all.current", 0)),
                "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0))}
    return {"peak_bytes": int(cpu_peak_bytes(fn)), "method": "cpu_profiler"}


def allocated_bytes(ctx: Context) -> Optional[int]:
    if ctx.gpu:
        return int(torch.cuda.memory_allocated(ctx.device))
    return _rss_bytes() if rss_supported() else None


def empty_cache(ctx: Context) -> None:
    if ctx.gpu:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------
# calls that may hang
# --------------------------------------------------------------------------------------------------------------
def run_with_timeout(fn: Callable[[], object], timeout_s: float,
                     device: Optional[torch.device] = None) -> tuple[str, object]:
    """Run ``fn`` in a worker thread; return ``("ok", result)``, ``("error", exception)`` or ``("hang", None)``.

    A thread cannot be killed: a hung call is left running as a daemon and reported; the suite moves on. (A process
    would be killable but cannot share the caller's CUDA context and tensors, which is what is being tested.)
    """
    box: dict = {}

    def target():
        try:
            if device is not None and device.type == "cuda":
                # a new thread starts on CUDA device 0; kernels launch on the current device
                torch.cuda.set_device(device)
            box["result"] = fn()
        except BaseException as e:  # recorded, not raised: the report says which inputs raise what
            box["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        return "hang", None
    if "error" in box:
        return "error", box["error"]
    return "ok", box.get("result")
