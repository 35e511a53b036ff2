"""`linattn train` and `linattn generate` end to end, on a tiny model (seconds on a CPU)."""
import json

import pytest
import torch

pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'linattn[model]')")
pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'linattn[model]')")

from linattn.apps.data import ByteBatches, load_corpus  # noqa: E402
from linattn.cli import main  # noqa: E402

TINY = ["--hidden-size", "32", "--layers", "3", "--pattern", "GS", "--gdn-heads", "1", "--head-dim", "16",
        "--attn-heads", "2", "--window", "8", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1",
        "--warmup", "5", "--lr", "1e-2", "--no-progress", "--threads", "1"]


@pytest.fixture
def text_file(tmp_path):
    # a repetitive text: a model that learns anything drives its loss far below log(256) = 5.5 nats quickly
    p = tmp_path / "corpus.txt"
    p.write_text("def add(a, b):\n    return a + b\n\n" * 300)
    return p


def test_train_writes_checkpoint_log_plot_and_loss_falls(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(text_file), "--steps", "30", "--eval-every", "15",
                 "--out", str(out)]) == 0
    for name in ("config.json", "model.safetensors", "train_log.json", "loss.png"):
        assert (out / name).is_file(), name
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 30 and len(log["log"]["loss"]) == 30
    assert log["final_loss"] < 0.6 * log["first_loss"], (log["first_loss"], log["final_loss"])
    assert log["final_val_loss"] < log["first_val_loss"]
    assert "tokens/s" in capsys.readouterr().out

    assert main(["generate", "--model", str(out), "--prompt", "def ", "--max-new-tokens", "20",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text) > 10


def test_train_grad_checkpointing_runs(tmp_path, text_file):
    assert main(["train", *TINY, "--data", str(text_file), "--steps", "2", "--eval-every", "2",
                 "--grad-checkpointing", "--no-plot", "--out", str(tmp_path / "ck")]) == 0


@pytest.mark.parametrize("argv, match", [
    (["train", "--data", "/nonexistent/file.txt"], "no such file"),
    (["train", "--dtype", "fp16", "--device", "cpu"], "CUDA"),
    (["train", "--steps", "0"], "--steps"),
    (["generate", "--model", "/nonexistent/run"], "run `linattn train` first"),
], ids=["missing-data", "fp16-on-cpu", "zero-steps", "missing-model"])
def test_cli_errors_are_clear(argv, match, tmp_path, capsys):
    assert main(argv + (["--out", str(tmp_path)] if argv[0] == "train" else [])) == 2
    assert match in capsys.readouterr().err


def test_stdlib_corpus_and_batches():
    data = load_corpus(None, max_bytes=50_000)
    assert data.dtype == torch.uint8 and len(data) == 50_000
    assert bytes(data[:8].tolist()) == b"# file: "
    b = ByteBatches(data, seq_len=16, batch_size=3)
    x, y = b.next()
    assert x.shape == y.shape == (3, 16) and torch.equal(x[:, 1:], y[:, :-1])
    v1 = [t[0] for t in b.val_batches(2)]
    v2 = [t[0] for t in b.val_batches(2)]
    assert all(torch.equal(p, q) for p, q in zip(v1, v2))
