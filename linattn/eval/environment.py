"""Environment: what ran where (versions, commit, device), and GPU utilisation and memory sampled with NVML.

The NVML sampler (nvidia-ml-py, optional) polls the GPU every ``interval_s`` in a thread for the whole run; each
sample is tagged with the section running at the time, so the report can say e.g. that the performance section
kept the GPU 97 % busy. Without a GPU or without nvidia-ml-py the section says so instead of guessing.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import threading
import time
from typing import Optional

import torch


def _git_commit() -> Optional[dict]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
        return {"sha": sha.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> Optional[float]:
    """1-minute load average (runnable processes), or None where the OS does not report it."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_warning(env: dict) -> Optional[str]:
    """A warning when other work competed for the CPU during the run: timings are then unreliable (PyTorch's
    OpenMP threads wait at barriers for descheduled peers, which can multiply small-op latencies many times)."""
    loads = [x for x in (env.get("load_avg_start"), env.get("load_avg_end")) if x is not None]
    cores = env.get("cpu_count") or 1
    if loads and max(loads) > 0.75 * cores + 0.5:
        return (f"the machine was busy (load average up to {max(loads):.1f} on {cores} cores): CPU timings are "
                "unreliable; rerun on an idle machine")
    return None


ENV_VARS = ("TRITON_CACHE_AUTOTUNING", "TRITON_CACHE_DIR", "TRITON_INTERPRET", "TILELANG_CACHE_DIR",
            "CUDA_VISIBLE_DEVICES")


def collect(device: torch.device) -> dict:
    from .. import __version__
    from ..ops.settings import triton_settings
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "linattn": __version__, "commit": _git_commit(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": None, "platform": platform.platform(),
        "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "device": str(device), "gpu": None, "driver": None, "load_avg_start": load_average(),
        # settings that change what a JIT implementation pays on its first calls (docs/eval.md, split runs)
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
        # the Triton path's module settings (forward path, loop stages, widths, precisions): what produced the numbers
        "linattn_settings": triton_settings(),
    }
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:  # triton is optional on CPU machines
        pass
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        env["gpu"] = {"name": prop.name, "capability": f"{prop.major}.{prop.minor}",
                      "memory_bytes": prop.total_memory, "sm_count": prop.multi_processor_count}
    return env


class NvmlSampler:
    """Background GPU sampler; ``summary()`` gives per-section utilisation and memory, or why there is none."""

    def __init__(self, device: torch.device, interval_s: float = 0.2):
        self.device, self.interval_s = device, interval_s
        self.samples: list = []
        self.section = "setup"
        self.reason: Optional[str] = None
        self.driver: Optional[str] = None
        self._stop = threading.Event()
        self._thread = None
        self._nvml = None
        if device.type != "cuda":
            self.reason = "needs a GPU (no CUDA device in this run)"
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._handle = self._find_handle(pynvml, index)
            self.driver = pynvml.nvmlSystemGetDriverVersion()
            self._nvml = pynvml
        except ImportError:
            self.reason = "nvidia-ml-py is not installed (pip install 'linattn[eval]')"
        except Exception as e:  # NVML missing from the driver, permissions, a container without it
            self.reason = f"NVML unavailable: {type(e).__name__}: {e}"

    @staticmethod
    def _find_handle(pynvml, index: int):
        """NVML numbers all GPUs of the machine, CUDA only the visible ones: match by UUID, else by index."""
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
        if uuid:
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except Exception:  # an older driver or a MIG slice: fall back to the index
                pass
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def _loop(self):
        nv = self._nvml
        while not self._stop.is_set():
            try:
                util = nv.nvmlDeviceGetUtilizationRates(self._handle)
                mem = nv.nvmlDeviceGetMemoryInfo(self._handle)
                self.samples.append((time.monotonic(), self.section, util.gpu, util.memory, mem.used))
            except Exception as e:
                self.reason = f"NVML sampling failed: {e}"
                return
            self._stop.wait(self.interval_s)

    def start(self):
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # shutting down is best effort
                pass

    def summary(self) -> dict:
        if not self.samples:
            return {"available": False, "reason": self.reason or "no samples taken"}
        out = {"available": True, "interval_s": self.interval_s, "samples": len(self.samples), "per_section": {}}
        for name in dict.fromkeys(s[1] for s in self.samples):
            rows = [s for s in self.samples if s[1] == name]
            out["per_section"][name] = {
                "samples": len(rows), "gpu_util_mean_pct": sum(r[2] for r in rows) / len(rows),
                "gpu_util_max_pct": max(r[2] for r in rows), "mem_util_mean_pct": sum(r[3] for r in rows) / len(rows),
                "memory_used_max_bytes": max(r[4] for r in rows)}
        t0 = self.samples[0][0]
        step = max(1, len(self.samples) // 300)
        out["trace"] = [{"t_s": s[0] - t0, "section": s[1], "gpu_util_pct": s[2], "memory_used_bytes": s[4]}
                        for s in self.samples[::step]]
        return out
