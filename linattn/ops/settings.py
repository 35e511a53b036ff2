"""The Triton path's (and the Hopper forward's) constants in one dict, for reports: ``linattn eval`` records them
beside the environment so a report says which thresholds, launch options and precisions produced its numbers."""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import asdict
from types import MappingProxyType, ModuleType
from typing import Any, Optional

import torch

# the modules whose module-level ALL_CAPS values decide what the chunked op runs, by the name a report shows
_MODULES = {
    "common": "linattn.ops.common",
    "split_fwd": "linattn.ops.common.split_fwd",
    "seq_parallel": "linattn.ops.common.seq_parallel",
    "triton_chunk": "linattn.ops.gated_delta.triton_chunk",
    "dispatch": "linattn.ops.gated_delta.dispatch",
    "hopper.forward": "linattn.ops.hopper.forward",
    "hopper.plan": "linattn.ops.hopper.plan",
    "hopper.chunk_fwd": "linattn.ops.hopper.chunk_fwd",
    "hopper.prepass": "linattn.ops.hopper.prepass",
    "hopper.varlen": "linattn.ops.hopper.varlen",
}


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data, or None where it is not data (a function, a tensor, a module)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (dict, MappingProxyType)):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list, frozenset, set)):
        return [_plain(v) for v in value]
    return None


def module_constants(module: ModuleType) -> dict:
    """Every module-level ALL_CAPS name of ``module`` whose value is plain data, as JSON-able values."""
    return {name: _plain(value) for name, value in vars(module).items()
            if name.isupper() and not name.startswith("_") and (value is None or _plain(value) is not None)}


def hopper_settings() -> dict:
    """The Hopper forward's configuration: whether TileLang is installed (found, not imported), whether its kernels
    failed to compile in this process (the reason, or None), its plan's tunables (``plan.DEFAULT``) and its caches'
    limits (``plan.CACHE_LIMITS``)."""
    from .hopper import compile as hopper_compile
    from .hopper import plan as hopper_plan
    return {"tilelang_installed": importlib.util.find_spec("tilelang") is not None,
            "compile_failed": hopper_compile.compile_failed(),
            "PLAN": asdict(hopper_plan.DEFAULT), "CACHE_LIMITS": asdict(hopper_plan.CACHE_LIMITS)}


def triton_settings() -> Optional[dict]:
    """The chunked op's Triton and Hopper constants as plain values, by module, plus ``HOPPER``
    (:func:`hopper_settings`), or None where Triton is not importable."""
    if importlib.util.find_spec("triton") is None:
        return None
    out = {}
    for label, path in _MODULES.items():
        try:
            module = importlib.import_module(path)
        except ImportError:
            continue
        out[label] = module_constants(module)
    out["HOPPER"] = hopper_settings()
    return out
