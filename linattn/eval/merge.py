"""``linattn eval --merge A/report.json B/report.json ... --out DIR``: one report from several runs.

A full side-by-side on a GPU does not fit one machine slot, so it is run as several calls with ``--sections``, each
with its own ``--out`` (docs/eval.md, "Splitting a long run across machines"). :func:`merge` joins their
report.json files into one results dict, which :func:`run` writes with the usual writer (report.json, report.md
with plots/, a self-contained report.html: the plots are drawn again from the merged data):

* every section is taken from the run that selected it (``meta.sections``); two runs that selected the same section
  are refused unless ``prefer_last``, which takes it from the last of them (in argument order) and, in the
  sections kept per record (``resume.RESUMABLE``), adds each unit an earlier of them measured and the last did not
  (absent or skipped for time), with ``carried_from`` (:func:`resume.fill_in`; counted in ``meta.filled_in``);
  every record a run measured itself gets ``measured_in`` (that run's report, date and commit), which a later
  ``--resume`` or merge of the merged report copies into ``carried_from`` instead of the merge's first run.
  The scorecard is not taken from any run: it is computed again from the merged sections (:func:`scorecard.run`).
* the environment section is the first run's, with every run's own environment (date, commit, GPU, versions,
  wall time, sections) under ``environment.runs``; the NVML summary per section comes from the run that ran it.
* runs of different profiles, device types or GPU names, or implementation lists (or an implementation available
  in one run and not in another) are refused, and so are partial runs (``"partial": true``: interrupted, or still
  running) unless ``allow_partial``; the merged report is then partial and lists its ``missing_sections``.
* ``meta.merged_from`` lists the inputs: path, selected and finished sections, the sections taken from each, and
  what each took as cached (``--warm-from``; the merged ``meta.warm_from`` is None).

Every refusal is a :class:`ValueError` whose message names the files and what differs.
"""
from __future__ import annotations

import copy
import json
import os

import torch

from . import SECTIONS, scorecard, stopped_during
from .report import prepare_out_dir, write_all
from .resume import fill_in, stamp_measured_in
from .saved import load_report

MERGED = tuple(s for s in SECTIONS if s not in ("environment", "scorecard"))  # taken whole from one run
# the environment fields compared across runs (a difference is reported, not refused)
_VERSION_KEYS = ("linattn", "python", "torch", "cuda", "triton", "driver")


def _gpu(r: dict):
    return (r["environment"].get("gpu") or {}).get("name")


def _where(r: dict) -> str:
    return f"{r['meta']['device']} ({_gpu(r) or 'no GPU'})"


def _check_same_run_config(runs: list) -> None:
    (p0, r0), rest = runs[0], runs[1:]
    impls0 = {i["name"]: i for i in r0["meta"]["impls"]}
    for p, r in rest:
        if r["meta"]["profile"] != r0["meta"]["profile"]:
            raise ValueError(f"cannot merge runs of different profiles: {p0} ran profile "
                             f"{r0['meta']['profile']!r}, {p} profile {r['meta']['profile']!r}")
        if torch.device(r["meta"]["device"]).type != torch.device(r0["meta"]["device"]).type or _gpu(r) != _gpu(r0):
            raise ValueError(f"cannot merge runs on different devices: {p0} ran on {_where(r0)}, "
                             f"{p} on {_where(r)}")
        gates, gates0 = r["meta"].get("gates", "default"), r0["meta"].get("gates", "default")
        if gates != gates0:
            raise ValueError(f"cannot merge runs of different gates: {p0} ran --gates {gates0}, {p} --gates {gates}")
        impls = {i["name"]: i for i in r["meta"]["impls"]}
        if set(impls) != set(impls0):
            raise ValueError(f"cannot merge runs of different implementation lists: {p0} ran --impl "
                             f"{','.join(impls0)}, {p} --impl {','.join(impls)}")
        for name, i in impls.items():
            if bool(i["available"]) != bool(impls0[name]["available"]):
                ok, no = ((p0, p) if impls0[name]["available"] else (p, p0))
                why = (impls0[name] if no == p0 else i).get("reason")
                raise ValueError(f"cannot merge: implementation {name} ran in {ok} but was skipped in {no} ({why})")


def _check_complete(runs: list, allow_partial: bool) -> None:
    if allow_partial:
        return
    for p, r in runs:
        if r.get("partial") or r["meta"].get("partial"):
            stop = r["meta"].get("interrupted")
            why = (f"interrupted by {stop.get('signal')} during {stopped_during(stop)}" if stop
                   else "written while its run was still going, or its run was killed")
            raise ValueError(f"{p} is a partial report ({why}; sections done: "
                             f"{', '.join(r.get('sections_done', [])) or 'none'}); pass --allow-partial to merge it "
                             "anyway (the merged report is then marked partial)")


def _pick_sources(runs: list, prefer_last: bool) -> dict:
    """section -> index of the run it is taken from."""
    source, clashes = {}, []
    for name in MERGED:
        chosen = [i for i, (_, r) in enumerate(runs) if name in r["meta"]["sections"]]
        if len(chosen) > 1 and not prefer_last:
            clashes.append(f"{name} (" + ", ".join(runs[i][0] for i in chosen) + ")")
        if chosen:
            source[name] = chosen[-1]
    if clashes:
        raise ValueError("more than one run selected the same section: " + "; ".join(clashes)
                         + "; pass --prefer-last to take each such section from the last run (in argument order) "
                           "that selected it")
    return source


def _run_environments(path: str, r: dict) -> list:
    """The environment of each run behind a report (one, or the runs of a merged report), with its wall time."""
    env = r["environment"]
    if env.get("runs"):
        return [copy.deepcopy(e) for e in env["runs"]]
    e = copy.deepcopy(env)
    e.update({"path": path, "wall_s": r["meta"].get("wall_s"), "time_budget_s": r["meta"].get("time_budget_s"),
              "sections": list(r["meta"]["sections"]), "sections_done": list(r.get("sections_done", [])),
              "partial": bool(r.get("partial"))})
    return [e]


def _environment(runs: list, source: dict) -> dict:
    env_runs = [e for p, r in runs for e in _run_environments(p, r)]
    env = {k: v for k, v in copy.deepcopy(runs[0][1]["environment"]).items() if k != "runs"}
    # the NVML summary of each section from the run that ran it (the trace stays the first run's)
    sampled = [(i, r["environment"].get("nvml") or {}) for i, (_, r) in enumerate(runs)]
    base = next((nv for _, nv in sampled if nv.get("available")), None)
    if base is not None:
        nv = copy.deepcopy(base)
        per = {k: v for k, v in base.get("per_section", {}).items() if k == "setup"}
        for name, i in source.items():
            got = (sampled[i][1].get("per_section") or {}).get(name)
            if got:
                per[name] = got
        nv["per_section"] = per
        nv["samples"] = sum(x.get("samples", 0) for _, x in sampled if x.get("available"))
        env["nvml"] = nv
    differ = {}
    for key in _VERSION_KEYS + ("commit",):
        vals = [e.get(key) for e in env_runs]
        if key == "commit":
            vals = [(c or {}).get("sha") for c in vals]
        if len({json.dumps(v) for v in vals}) > 1:
            differ[key] = vals
    env["differences"] = differ
    warnings = [f"{e['path']}: {e['warning']}" for e in env_runs if e.get("warning")]
    if differ:
        warnings.append("the runs differ in " + ", ".join(differ) + " (see environment.runs)")
    env["warning"] = "; ".join(warnings) or None
    env["runs"] = env_runs
    return env


def merge(paths: list, prefer_last: bool = False, allow_partial: bool = False) -> dict:
    """One results dict (every section of :data:`SECTIONS`) from the report.json files at ``paths``."""
    if len(paths) < 2:
        raise ValueError("--merge needs at least two reports")
    paths = [os.path.join(str(p), "report.json") if os.path.isdir(str(p)) else str(p) for p in paths]
    runs = [(p, load_report(p)) for p in paths]
    _check_same_run_config(runs)
    _check_complete(runs, allow_partial)
    source = _pick_sources(runs, prefer_last)

    out, done, missing, filled = {}, ["environment"], [], {}
    for name in MERGED:
        if name not in source:
            out[name] = {"skipped": "not selected in any of the merged runs"}
            missing.append(name)
            continue
        path, r = runs[source[name]]
        out[name] = copy.deepcopy(r[name])
        stamp_measured_in(name, out[name], path, r)  # so that a later --resume names the run that measured each
        if prefer_last:  # the units earlier runs of this section measured and the chosen one did not
            filled[name] = fill_in(name, out[name], [(p, x) for p, x in runs[:source[name]]
                                                     if name in x["meta"]["sections"]])
        if name in r.get("sections_done", []):
            done.append(name)
        else:
            missing.append(name)
    out["environment"] = _environment(runs, source)
    partial = any(r.get("partial") or r["meta"].get("partial") for _, r in runs)
    try:
        out["scorecard"] = scorecard.run(out)
    except Exception as e:  # as in a run: a score it cannot compute must not lose the merged sections
        from .context import error_record
        out["scorecard"] = {"error": error_record(e)}
    if not partial and "error" not in out["scorecard"]:
        done.append("scorecard")

    m0 = runs[0][1]["meta"]
    first_call, compiles = {}, {}
    for i, (_, r) in enumerate(runs):
        for k, v in (r["meta"].get("first_call_max_s") or {}).items():
            if v is not None:
                first_call[k] = max(first_call.get(k) or 0.0, v)
        for k, lst in (r["meta"].get("compiles") or {}).items():
            compiles.setdefault(k, []).extend({**c, "run": i} for c in lst)
    selected = [s for s in SECTIONS if s == "scorecard" or any(s in r["meta"]["sections"] for _, r in runs)]
    merged_from = [{"path": p, "sections": list(r["meta"]["sections"]),
                    "sections_done": list(r.get("sections_done", [])),
                    "taken": [s for s in MERGED if source.get(s) == i],
                    "partial": bool(r.get("partial")), "interrupted": r["meta"].get("interrupted"),
                    "wall_s": r["meta"].get("wall_s"), "time_budget_s": r["meta"].get("time_budget_s"),
                    "date_utc": r["environment"].get("date_utc"), "argv": r["meta"].get("argv"),
                    "seed": r["meta"].get("seed"), "warm_from": r["meta"].get("warm_from"),
                    "resumed_from": r["meta"].get("resumed_from"),
                    **({"merged_from": r["meta"]["merged_from"]} if r["meta"].get("merged_from") else {})}
                   for i, (p, r) in enumerate(runs)]
    out["partial"] = partial
    out["sections_done"] = done
    out["missing_sections"] = missing
    out["meta"] = {**copy.deepcopy(m0),
                   "wall_s": sum(r["meta"].get("wall_s") or 0.0 for _, r in runs),
                   "time_budget_s": sum(r["meta"].get("time_budget_s") or 0.0 for _, r in runs),
                   "sections": selected, "argv": None, "partial": partial, "interrupted": None,
                   "first_call_max_s": first_call, "compiles": compiles, "missing_sections": missing,
                   "warm_from": None,  # per run, in merged_from: the first run's would speak for all
                   "resumed_from": None,
                   "merged_from": merged_from, "prefer_last": prefer_last, "allow_partial": allow_partial,
                   "filled_in": {k: n for k, n in filled.items() if n}}
    return out


def run(paths: list, out_dir: str, prefer_last: bool = False, allow_partial: bool = False) -> tuple[dict, dict]:
    """Merge and write report.json, report.md (+ plots/) and report.html into ``out_dir``; (results, paths)."""
    target = os.path.realpath(out_dir)
    for p in paths:
        d = str(p) if os.path.isdir(str(p)) else os.path.dirname(str(p)) or "."
        if os.path.realpath(d) == target:
            raise ValueError(f"--out {out_dir} holds the input {p}: merging into it would overwrite that run's "
                             "report; choose another --out")
    results = merge(paths, prefer_last=prefer_last, allow_partial=allow_partial)
    prepare_out_dir(out_dir)
    return results, write_all(results, out_dir, figures=True)
