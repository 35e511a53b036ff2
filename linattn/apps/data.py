"""Byte-level text corpora: the Python standard library's own source (present on every machine) or a user's file.

Bytes are tokens (vocabulary 256), so no tokenizer is needed and any text works. The corpus is split once into a
training part and a held-out tail, and batches are random windows of ``seq_len + 1`` bytes.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Optional

import torch

VOCAB_SIZE = 256


def stdlib_files() -> list[Path]:
    """The ``.py`` files of the running interpreter's standard library, sorted (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def load_corpus(path: Optional[str] = None, max_bytes: Optional[int] = None) -> torch.Tensor:
    """The corpus as a uint8 tensor: ``path``'s bytes, or the standard library's sources concatenated in a fixed
    order (each preceded by a ``# file:`` line, so the model sees where one file ends and the next begins)."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"--data {path}: no such file")
        data = p.read_bytes()[:max_bytes]
    else:
        chunks, total = [], 0
        for f in stdlib_files():
            b = b"# file: " + f.name.encode() + b"\n" + f.read_bytes() + b"\n"
            chunks.append(b)
            total += len(b)
            if max_bytes is not None and total >= max_bytes:
                break
        data = b"".join(chunks)[:max_bytes]
    if len(data) < 1024:
        raise ValueError(f"the corpus holds {len(data)} bytes; at least 1024 are needed")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteBatches:
    """Random windows of a byte corpus: ``inputs [B, L]`` and ``targets [B, L]`` (the next byte of each input).

    The last ``val_fraction`` of the corpus is held out for :meth:`val_batches`.
    """

    def __init__(self, data: torch.Tensor, seq_len: int, batch_size: int, val_fraction: float = 0.02, seed: int = 0):
        n_val = max(int(len(data) * val_fraction), seq_len + 2)
        if len(data) - n_val < seq_len + 2:
            raise ValueError(f"corpus of {len(data)} bytes is too short for seq_len={seq_len}")
        self.train, self.val = data[:-n_val], data[-n_val:]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        w = data[idx].long()
        return w[:, :-1], w[:, 1:]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        return self._windows(self.train, starts)

    def val_batches(self, n_batches: int):
        """A fixed set of held-out batches (the same every call), evenly spaced over the held-out tail."""
        span = len(self.val) - self.seq_len - 1
        starts = torch.linspace(0, span, n_batches * self.batch_size).long()
        for i in range(n_batches):
            yield self._windows(self.val, starts[i * self.batch_size:(i + 1) * self.batch_size])
