"""The command line's edges (issue 47 items 6-9, issue 46 item 8): path errors in one line, no abbreviations,
each subcommand's own usage, help text without reST, lazy imports, and generate before any training."""
import os
import subprocess
import sys

import pytest

from linattn.cli import DESCRIPTION, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("make,message", [
    (lambda p: (p.write_text("x"), p)[1], "exists and is not a directory"),
    (lambda p: (p.write_text("x"), p / "sub")[1], "a parent of it is a file"),
])
def test_out_path_problems_are_one_line_errors(make, message, tmp_path, capsys):
    out = make(tmp_path / "target")
    assert main(["eval", "--profile", "tiny", "--impl", "sdpa", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]


def test_an_unwritable_out_is_refused_before_the_run(monkeypatch, tmp_path, capsys):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    assert main(["eval", "--profile", "tiny", "--impl", "sdpa", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "not writable" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_merge_checks_out_as_well(tiny_run, tmp_path, capsys):
    out, _ = tiny_run
    (tmp_path / "file").write_text("x")
    assert main(["eval", "--merge", str(out), str(out), "--prefer-last", "--out", str(tmp_path / "file")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["eval", "--imp", "sdpa"], ["eval", "--prof", "tiny"], ["eval", "--bogus"],
                                  ["generate", "--temp", "0"]])
def test_no_abbreviations_and_errors_print_the_subcommands_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: linattn {argv[0]}" in err and "unrecognized arguments" in err


def test_profile_choices_match_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    assert "--profile {quick,full,tiny}" in text and "tiny (seconds" in " ".join(text.split())


@pytest.mark.parametrize("cmd", [[], ["info"], ["eval"], ["train"], ["generate"]])
def test_help_has_no_rest_markup_and_whole_sentences(cmd, capsys):
    with pytest.raises(SystemExit):
        main(cmd + ["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":data:" not in text and ":func:" not in text
    if not cmd:
        assert " ".join(DESCRIPTION.split()) in " ".join(text.split()) and DESCRIPTION.endswith(".")


def test_info_imports_no_optional_dependency():
    code = ("import sys, io, contextlib\n"
            "from linattn.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['info']) == 0\n"
            "print(sorted(m for m in ('matplotlib', 'triton', 'rich', 'linattn.eval.cli', 'linattn.apps.train')\n"
            "             if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_generate_before_training_says_to_train_first(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "runs" / "linattn-byte-lm")]) == 2
    err = capsys.readouterr().err
    assert "run `linattn train` first" in err and "--model" in err


def test_runs_are_ignored_by_git():
    with open(os.path.join(ROOT, ".gitignore")) as fh:
        assert "runs/" in {line.strip().lstrip("/") for line in fh}
