"""Reading a saved ``report.json`` back: the one loader that ``--merge``, ``--resume``, ``--warm-from`` and
``--compare`` share (it imports nothing of theirs, so they can all import it)."""
from __future__ import annotations

import json
import os

from . import SECTIONS


def load_report(path: str) -> dict:
    """A report.json (or a directory holding one), checked to be a ``linattn eval`` report; ValueError otherwise."""
    if os.path.isdir(path):
        path = os.path.join(path, "report.json")
    try:
        with open(path) as fh:
            r = json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such report") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    meta = r.get("meta") if isinstance(r, dict) else None
    missing = [k for k in SECTIONS if not isinstance(r, dict) or k not in r]
    missing += [f"meta.{k}" for k in ("profile", "device", "sections", "impls") if not isinstance(meta, dict)
                or k not in meta]
    if missing:
        raise ValueError(f"{path} is not a linattn eval report.json (missing {', '.join(missing)})")
    return r
