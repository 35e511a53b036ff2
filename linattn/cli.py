"""The ``linattn`` command: ``info`` here; ``eval``, ``train`` and ``generate`` live beside their code and are
imported only when asked for, so ``linattn info`` and ``linattn --help`` stay fast and need no optional dependency."""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import re
import sys

DESCRIPTION = ("Gated DeltaNet linear attention: check the install (info), measure implementations on your shapes "
               "(eval), train and sample a small byte-level model (train, generate).")
# subcommand -> module with `add_arguments(parser)` and `run(args) -> int`, and its one-line help
SUBCOMMANDS = {
    "eval": ("linattn.eval.cli", "evaluate gated-delta-rule implementations (correctness, speed, memory, ...)"),
    "train": ("linattn.apps.train", "train a small byte-level hybrid GDN / sliding-window LM (--quick on a CPU)"),
    "generate": ("linattn.apps.generate", "sample text from a model written by `linattn train`"),
}
_RST_LITERAL = re.compile(r"``([^`]+)``")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The subcommands' descriptions are their modules' docstrings (reST): on a terminal ``x`` reads as `x`, and
    the docstring's own line breaks and indented examples are kept."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(_RST_LITERAL.sub(r"`\1`", text))

    def _expand_help(self, action) -> str:
        return _RST_LITERAL.sub(r"`\1`", super()._expand_help(action))


def info() -> dict:
    """Versions, device and backends. Triton is looked up, not imported (seconds, and nothing here runs a kernel);
    on a GPU the default backend's choice imports it."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    import torch

    from . import __version__
    from .ops.utils import select_backend
    d = {
        "linattn": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": None,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    has_triton = find_spec("triton") is not None
    if has_triton:
        try:
            d["triton"] = version("triton")
        except PackageNotFoundError:
            d["triton"] = "installed (version unknown)"
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d["default_backend"] = select_backend(None, dev)
    d["backends"] = ["reference", "torch"] + (["triton"] if has_triton else [])
    return d


def _chosen(argv: list) -> str | None:
    """The subcommand ``argv`` names (its first word not starting with '-'), if it is one of :data:`SUBCOMMANDS`."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in SUBCOMMANDS else None


def build_parser(argv: list) -> tuple[argparse.ArgumentParser, dict]:
    """The parser, with the arguments of the one subcommand ``argv`` names (only its module is imported), and the
    subparsers by name."""
    parser = argparse.ArgumentParser(prog="linattn", description=DESCRIPTION, allow_abbrev=False,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{info,eval,train,generate}")
    subs = {"info": sub.add_parser("info", help="print versions, device and available backends", allow_abbrev=False,
                                   formatter_class=HelpFormatter)}
    chosen = _chosen(argv)
    for name, (mod, help_) in SUBCOMMANDS.items():
        subs[name] = p = sub.add_parser(name, help=help_, description=help_, allow_abbrev=False,
                                        formatter_class=HelpFormatter)
        if name != chosen:
            continue
        try:
            importlib.import_module(mod).add_arguments(p)
        except ImportError as e:  # an optional dependency is missing: say which, when the subcommand is used
            p.set_defaults(_import_error=e)
    return parser, subs


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subs = build_parser(argv)
    chosen = _chosen(argv)
    missing = chosen and subs[chosen].get_default("_import_error")
    if missing and not {"-h", "--help"} & set(argv):  # its options are unknown: say what to install, not that
        print(f"linattn {chosen}: {missing} (pip install 'linattn[eval]')", file=sys.stderr)
        return 2
    # unknown words are the subcommand's error, printed with its usage (argparse would print the top level's)
    args, extra = parser.parse_known_args(argv)
    if extra:
        subs[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
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
    normal exit tears such a thread down mid-call (``terminate called after throwing …``, exit 134 on an H200, after
    the reports were written). So while one is alive the process leaves with ``os._exit`` after flushing its
    output, with main's status."""
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
