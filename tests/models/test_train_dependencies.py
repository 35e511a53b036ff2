"""`linattn train` without its optional packages: refused before any work, and a finished run is never lost.

Packages are made missing by ``sys.modules[name] = None`` (an import of it then raises ImportError), so these tests
run whether or not the ``model`` extra is installed.
"""
import json
import sys

import pytest
import torch

from linattn.apps import train as train_app
from linattn.cli import main
from linattn.models import HybridLM

TINY = ["--hidden-size", "32", "--layers", "2", "--pattern", "GS", "--gdn-heads", "1", "--head-dim", "16",
        "--attn-heads", "2", "--window", "8", "--seq-len", "16", "--batch-size", "2", "--eval-batches", "1",
        "--eval-every", "2", "--steps", "2", "--warmup", "1", "--no-progress", "--threads", "1"]


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text("def add(a, b):\n    return a + b\n\n" * 50)
    return p


def _missing(monkeypatch, *names):
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def no_training(monkeypatch):
    """Fails the test if training starts (the corpus is the first thing a run loads)."""
    def load_corpus(*args, **kwargs):
        raise AssertionError("training started although a needed package is missing")
    monkeypatch.setattr(train_app, "load_corpus", load_corpus)


@pytest.mark.parametrize("missing, extra_args, names", [
    (("safetensors", "safetensors.torch"), ["--no-plot"], ["safetensors"]),
    (("matplotlib",), [], ["matplotlib", "--no-plot"]),
], ids=["safetensors", "matplotlib"])
def test_missing_package_refused_before_training(missing, extra_args, names, tmp_path, text_file, monkeypatch,
                                                 no_training, capsys):
    _missing(monkeypatch, *missing)
    out = tmp_path / "run"
    assert main(["train", *TINY, *extra_args, "--data", str(text_file), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'linattn[model]'" in err
    for name in names:
        assert name in err
    assert not out.exists() or not any(out.iterdir())


def test_no_plot_needs_no_matplotlib(tmp_path, text_file, monkeypatch):
    pytest.importorskip("safetensors")
    _missing(monkeypatch, "matplotlib")
    out = tmp_path / "run"
    assert main(["train", *TINY, "--no-plot", "--data", str(text_file), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "train_log.json").is_file()


def test_finished_run_saved_without_safetensors(tmp_path, text_file, monkeypatch, capsys):
    """safetensors vanishing after the start-up check (or a check it passes wrongly): the weights go to model.pt,
    the log is written, and the model loads back from the folder."""
    _missing(monkeypatch, "safetensors", "safetensors.torch")
    monkeypatch.setattr(train_app, "missing_dependencies", lambda args: [])
    out = tmp_path / "run"
    assert main(["train", *TINY, "--no-plot", "--data", str(text_file), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "model.pt" in captured.err and "pip install 'linattn[model]'" in captured.err
    assert "model.pt" in captured.out
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 2
    loaded = HybridLM.from_pretrained(out)
    saved = torch.load(out / "model.pt", weights_only=True)
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
