"""The ``linattn`` command: ``info`` here; ``eval`` and the other subcommands live beside their code and are
imported only when asked for, so ``linattn info`` stays fast and needs no optional dependency."""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys

# subcommand -> module with `add_arguments(parser)` and `run(args) -> int`
SUBCOMMANDS = {
    "eval": ("linattn.eval.cli", "evaluate gated-delta-rule implementations (correctness, speed, memory, ...)"),
    "train": ("linattn.apps.train", "train a small byte-level hybrid GDN / sliding-window LM (--quick on a CPU)"),
    "generate": ("linattn.apps.generate", "sample text from a model written by `linattn train`"),
}


def info() -> dict:
    import torch

    from . import __version__
    from .ops.utils import select_backend, triton_available
    d = {
        "linattn": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": None,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    if triton_available():
        import triton
        d["triton"] = triton.__version__
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d["default_backend"] = select_backend(None, dev)
    d["backends"] = ["reference", "torch"] + (["triton"] if triton_available() else [])
    return d


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="linattn", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="print versions, device and available backends")
    for name, (mod, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_)
        try:
            importlib.import_module(mod).add_arguments(p)
        except ImportError as e:  # an optional dependency is missing: say which, when the subcommand is used
            p.set_defaults(_import_error=e)
    args = parser.parse_args(argv)
    if args.cmd == "info":
        for key, val in info().items():
            print(f"{key:16s} {val}")
        return 0
    if getattr(args, "_import_error", None) is not None:
        print(f"linattn {args.cmd}: {args._import_error} (pip install 'linattn[eval]')", file=sys.stderr)
        return 2
    return importlib.import_module(SUBCOMMANDS[args.cmd][0]).run(args)


def entry() -> None:
    """The console script: :func:`main`, then exit with its status. A call ``linattn eval`` abandoned in a worker
    thread (a hang, or a unit the time budget cut) may still be running inside CUDA or a JIT compiler, and Python's
    normal exit tears such a thread down mid-call: on the H200 that aborted a run after its reports were written
    (``terminate called after throwing …``, ``FATAL: exception not rethrown``, exit 134; docs/performance.md run 15).
    So while one is alive the process leaves with ``os._exit`` after flushing its output, with main's status."""
    rc = main()
    context = sys.modules.get("linattn.eval.context")
    alive = context.abandoned_threads() if context is not None else []
    if alive:
        print(f"linattn: {len(alive)} abandoned call(s) still running in worker threads; exiting without waiting "
              "for them", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    entry()
