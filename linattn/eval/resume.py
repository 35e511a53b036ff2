"""``linattn eval --resume A [B ...]``: a run that carries over the units earlier runs already measured, and runs
only the rest.

The full profile side by side with fla and FlashQLA does not fit one device session: their compiles (40-120 s per
shape class and direction) take most of a call's budget, and every fresh machine pays them again. A run with
``--resume`` puts each earlier record of the sections it runs into its own report unchanged (with
``carried_from``: the report, its date and commit), skips those units, and spends its budget on the units no
earlier run finished; repeated over sessions, the grid fills up. A record *has a result*, and is carried, unless
it says it was skipped (for time, or because an earlier call of its implementation hung): a pass, a failure, an
error, an out-of-memory and a hang are results (running a hang again would only hang again).

Carried at the granularity of one record: correctness (its cases, and each implementation's reproducibility
check), robustness, performance, decode (drift and step latency) and mixed precision. Scaling, memory, stability
and soak are sweeps or timed runs measured whole: a resumed run measures them again if selected (or take them
from the earlier report with ``--merge``).

``--resume-impls`` limits what is carried to some implementations, e.g. ``fla,flashqla,sdpa`` after a change to
linattn: its records are measured again, the third parties' compiles are not paid again. ``--resume-redo`` names
records to measure again by shell-style patterns on their ids, e.g. ``linattn/*/fp32,linattn/*/fp32/*`` after a
change to linattn's fp32 path only (a pattern's ``*`` also matches ``/``).

Refused, with a :class:`ValueError` naming the file: a report of another profile, device type, GPU model, seed or
``--gates`` (its units are other measurements), or one whose implementation list differs.
"""
from __future__ import annotations

import copy
import fnmatch
import os
from typing import Optional

import torch

from .decode import DecodePath, skip_label
from .saved import load_report

RESUMABLE = ("correctness", "robustness", "performance", "decode", "mixed_precision")


def has_result(rec: dict) -> bool:
    """Whether an earlier record measured something (else the unit runs again)."""
    return rec.get("status") != "skipped" and "skipped" not in rec


def _keyed(section: str, results: dict) -> dict:
    """{unit key: record} of one section of a report, as :meth:`Context.carry` asks for them."""
    if not isinstance(results, dict) or "records" not in results:  # not selected, or not run
        return {}
    out = {r["id"]: r for r in results.get("records", []) if "id" in r}
    if section == "correctness":
        out.update({f"reproducibility/{r['impl']}": r for r in results.get("reproducibility", [])
                    if "error" not in r})
    elif section == "decode":
        out.update({f"drift/{r['id']}": r for r in results.get("drift", []) if "id" in r})
    return out


def _origin(path: str, r: dict) -> dict:
    """Where the records of the report at ``path`` were measured: the report, its date and commit (a merged report:
    its first run's; its records name their own run in ``measured_in``, which :func:`origin_of` prefers)."""
    env = r["environment"]
    runs = env.get("runs") or [env]
    commit = (runs[0].get("commit") or {}).get("sha")
    return {"report": path, "date_utc": runs[0].get("date_utc"), "commit": commit[:12] if commit else None}


def origin_of(rec: dict, origin: dict) -> dict:
    """The ``carried_from`` of a record carried out of a report whose origin is ``origin``: the run the merge
    stamped on it (``measured_in``, :func:`stamp_measured_in`) if any — a merged report's records come from
    several runs, and its first run stands for none of the others."""
    return rec.get("measured_in") or origin


def stamp_measured_in(section: str, results: dict, path: str, r: dict) -> None:
    """``--merge``: give every record of one section taken from the report ``r`` at ``path`` that this report
    measured itself (no ``carried_from``, no ``measured_in`` from an earlier merge) ``measured_in``: that run's
    report, date and commit. Edits ``results`` (the merge's own copy)."""
    origin = _origin(path, r)
    for rec in _keyed(section, results).values():
        if "carried_from" not in rec:
            rec.setdefault("measured_in", origin)


def _check_same_config(path: str, r: dict, profile: str, device: torch.device, seed: int, impls: list,
                       gates: str = "default") -> None:
    meta = r["meta"]
    gpu_here = torch.cuda.get_device_properties(device).name if device.type == "cuda" else None
    gpu_there = (r["environment"].get("gpu") or {}).get("name")
    differ = []
    if meta["profile"] != profile:
        differ.append(f"profile {meta['profile']!r} there, {profile!r} here")
    if torch.device(meta["device"]).type != device.type or gpu_there != gpu_here:
        differ.append(f"device {meta['device']} ({gpu_there or 'no GPU'}) there, {device} ({gpu_here or 'no GPU'})"
                      " here")
    if meta.get("seed") != seed:
        differ.append(f"seed {meta.get('seed')} there, {seed} here")
    if meta.get("gates", "default") != gates:              # reports before --gates drew the default gates
        differ.append(f"--gates {meta.get('gates', 'default')} there, {gates} here")
    there = sorted(i["name"] for i in meta["impls"])
    if there != sorted(impls):
        differ.append(f"--impl {','.join(there)} there, {','.join(sorted(impls))} here")
    if differ:
        raise ValueError(f"--resume {path}: another configuration ({'; '.join(differ)}): its units are not this "
                         "run's")


def load_earlier(paths: list, profile: str, device: torch.device, seed: int, impls: list,
                 carry_impls: Optional[list] = None, redo: Optional[list] = None,
                 gates: str = "default") -> tuple[dict, dict]:
    """({section: {unit key: record}} to carry, the report's ``meta.resumed_from``) from the reports at ``paths``
    (report.json files or their directories; a later one's record wins over an earlier one's for the same unit).
    ``impls``: this run's --impl names; ``carry_impls``: the implementations whose records are carried (all);
    ``redo``: shell-style patterns of unit keys (record ids) not carried, so measured again (none)."""
    unknown = sorted(set(carry_impls or ()) - set(impls))
    if unknown:
        raise ValueError(f"--resume-impls {','.join(unknown)}: not in this run's --impl ({','.join(impls)})")
    earlier: dict = {s: {} for s in RESUMABLE}
    files = []
    for p in paths:
        path = os.path.join(str(p), "report.json") if os.path.isdir(str(p)) else str(p)
        r = load_report(path)
        _check_same_config(path, r, profile, device, seed, impls, gates)
        origin = _origin(path, r)
        for section in RESUMABLE:
            for key, rec in _keyed(section, r.get(section)).items():
                if not has_result(rec) or (carry_impls is not None and rec.get("impl") not in carry_impls):
                    continue
                if any(fnmatch.fnmatchcase(key, pat) for pat in redo or ()):
                    continue
                # the report was loaded here and is not kept: mark its records in place (Context.carry copies
                # each one it hands to a section); carried twice, a record keeps the run that measured it
                rec.setdefault("carried_from", origin_of(rec, origin))
                earlier[section][key] = rec
        files.append(path)
    meta = {"paths": files, "impls": list(carry_impls) if carry_impls is not None else None, "redo": list(redo or ()),
            "records": {s: len(v) for s, v in earlier.items() if v}, "carried": {}}
    return earlier, meta


def _skip_labels(section: str, rec: dict) -> set:
    """How a section's ``skipped_for_time`` names the unit of ``rec`` (the record id, or decode's short forms)."""
    labels = {rec["id"], f"drift {rec['id']}"}
    if section == "decode" and "Tq" in rec:
        labels.add(skip_label(DecodePath(rec["impl"], rec["path"], ()).name, rec["B"], rec["Tq"], rec["pool"]))
    return labels


def fill_in(section: str, results: dict, earlier: list) -> int:
    """``--merge --prefer-last``: put into ``results`` (one section, taken from the last run that selected it)
    every unit an earlier run measured and this one did not (absent, or skipped for time), with ``carried_from``;
    a later run's record wins over an earlier one's. ``earlier``: [(path, report)] in argument order. Edits
    ``results`` (the merge's own copy); returns the number of records put in. Without this, a resumed run that did
    not get to a unit (``--resume-impls`` left it to be measured again) would drop the earlier measurement."""
    if section not in RESUMABLE or not isinstance(results, dict) or "records" not in results:
        return 0
    have = _keyed(section, results)
    added = 0
    for path, r in reversed(earlier):  # the latest earlier run first: its records win
        origin = _origin(path, r)
        for key, rec in _keyed(section, r.get(section)).items():
            mine = have.get(key)
            if not has_result(rec) or (mine is not None and has_result(mine)):
                continue
            rec = copy.deepcopy(rec)
            rec.setdefault("carried_from", origin_of(rec, origin))
            kind = key.split("/", 1)[0]  # _keyed's keys: reproducibility/..., drift/... or a record id
            target = results.setdefault(kind, []) if kind in ("reproducibility", "drift") else results["records"]
            at = next((i for i, x in enumerate(target) if x is mine), None) if mine is not None else None
            if at is None:
                target.append(rec)
            else:
                target[at] = rec
            have[key] = rec
            if "id" in rec and isinstance(results.get("skipped_for_time"), list):
                labels = _skip_labels(section, rec)
                results["skipped_for_time"] = [x for x in results["skipped_for_time"] if x not in labels]
            added += 1
    return added


def describe(meta: dict) -> str:
    """One line for the log and report.md: which reports, what was available to carry, what this run carried."""
    avail = ", ".join(f"{s} {n}" for s, n in meta["records"].items()) or "none"
    done = ", ".join(f"{s} {n}" for s, n in meta.get("carried", {}).items() if n) or "none"
    which = f" (only {','.join(meta['impls'])})" if meta.get("impls") is not None else ""
    which += f" (measured again: {','.join(meta['redo'])})" if meta.get("redo") else ""
    return f"{', '.join(meta['paths'])}{which}: records with a result: {avail}; carried into this run: {done}"
