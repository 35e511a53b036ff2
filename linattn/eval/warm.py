"""``linattn eval --warm-from A [B ...]``: the compile signatures earlier runs on this machine compiled, whose kernels
this run may load from the disk caches (Triton's, TileLang's) instead of compiling them.

A long profile is run as several ``--sections`` calls, each a new process, on one machine kept warm between them
(docs/eval.md, "GPU runs with fla and FlashQLA"). Each report's ``meta.compiles`` lists every signature its process
ran a first call on (compiled, or itself loaded from a cache: either way the cache holds it now). :func:`load_cached`
reads them into :attr:`Context.cached`, which the estimator charges :data:`context.CACHE_LOAD_S` instead of a compile.

Refused, with a :class:`ValueError` naming the file: a report from another device type or GPU model, or with
another torch or Triton version (their caches are keyed on those: nothing would load). Not taken, and said why in
``meta.warm_from.not_cached``: an implementation whose cache needs a setting (:data:`context.CACHE_NEEDS_ENV`: fla's
autotune results are cached only with TRITON_CACHE_AUTOTUNING) that the earlier run or this process lacks.
Implementations without an entry in :data:`context.CACHE_LOAD_S` compile nothing worth caching and are not taken.
"""
from __future__ import annotations

import os

import torch

from . import environment
from .context import CACHE_LOAD_S, CACHE_NEEDS_ENV, Sig
from .saved import load_report

_TRUE = ("1", "true", "on")  # what Triton's getenv_bool reads as set


def _is_set(env: dict, name: str) -> bool:
    return str(env.get(name, "")).strip().lower() in _TRUE


def _identity(env: dict) -> dict:
    """What a kernel cache entry is only valid for, from an ``environment`` section."""
    return {"device type": torch.device(env.get("device") or "cpu").type,
            "GPU": (env.get("gpu") or {}).get("name"), "torch": env.get("torch"), "triton": env.get("triton")}


def _sig(d: dict) -> Sig:
    """A ``meta.compiles`` entry (JSON: lists) back to the signature the estimator compares."""
    return Sig(d["family"], tuple(d["kernel"]), d["dtype"], tuple(d["dims"]), tuple(d["flags"]))


def load_cached(paths: list, device: torch.device, impls: list) -> tuple[dict, dict]:
    """({impl: {Sig}} this run may take as cached, the report's ``meta.warm_from``) from the reports at ``paths``
    (report.json files or their directories), for the implementations ``impls`` of this run."""
    here = _identity(environment.collect(device))
    cached: dict = {}
    not_cached: dict = {}
    files = []
    for p in paths:
        path = os.path.join(str(p), "report.json") if os.path.isdir(str(p)) else str(p)
        r = load_report(path)
        envs = r["environment"].get("runs") or [r["environment"]]  # a merged report: each of its runs
        for env in envs:
            there = _identity(env)
            differ = [f"{k} {there[k]!r} there, {here[k]!r} here" for k in here if there[k] != here[k]]
            if differ:
                raise ValueError(f"--warm-from {path}: made on another machine or software ({'; '.join(differ)}): "
                                 "the kernels its run cached would not load here")
        for impl, compiles in (r["meta"].get("compiles") or {}).items():
            if impl not in impls or impl not in CACHE_LOAD_S:
                continue
            var = CACHE_NEEDS_ENV.get(impl)
            if var and not all(_is_set(e.get("env") or {}, var) for e in envs):
                not_cached.setdefault(impl, []).append(f"{var} was not set in the run of {path}")
                continue
            if var and not _is_set(os.environ, var):
                not_cached.setdefault(impl, []).append(f"{var} is not set in this process")
                continue
            cached.setdefault(impl, set()).update(_sig(c) for c in compiles)
        files.append(path)
    meta = {"paths": files, "cached_signatures": {k: len(v) for k, v in cached.items()},
            "not_cached": {k: sorted(set(v)) for k, v in not_cached.items()}}
    return cached, meta


def describe(meta: dict) -> str:
    """One line for the log and report.md: which reports, how many signatures per implementation, what was not."""
    counts = ", ".join(f"{k} {n}" for k, n in meta["cached_signatures"].items()) or "none"
    text = f"{', '.join(meta['paths'])}: signatures taken as cached: {counts}"
    for impl, why in meta.get("not_cached", {}).items():
        text += f"; {impl} not taken ({'; '.join(why)})"
    return text
