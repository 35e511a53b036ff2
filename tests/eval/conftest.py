"""The one tiny end-to-end run the report tests share (tests/eval/test_cli.py, test_verdict.py)."""
import contextlib
import io
import json

import pytest

from linattn.cli import main


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """(out dir, report.json as a dict); the terminal summary it printed (not a terminal: 80 columns) is in
    ``out / "summary.txt"``."""
    out = tmp_path_factory.mktemp("eval")
    printed = io.StringIO()
    # a generous budget: a slow CI machine must not cut the sweeps the tests check
    with contextlib.redirect_stdout(printed):
        rc = main(["eval", "--profile", "tiny", "--impl", "linattn,fla,sdpa", "--device", "cpu", "--out", str(out),
                   "--no-progress", "--time-budget", "900"])
    assert rc == 0
    (out / "summary.txt").write_text(printed.getvalue())
    with open(out / "report.json") as fh:
        return out, json.load(fh)
