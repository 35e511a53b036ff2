"""ShardPlan: which tokens of a sequence-split batch a rank holds, and how its shard meets its neighbours'.

The global token stream of length T (one row of a packed batch, or each row of a ``[B, T]`` batch) is cut into
contiguous shards, rank r holding ``[bounds[r], bounds[r + 1])``; shards may be unequal or empty. A packed batch's
sequences (``cu_seqlens`` over the global stream) may cross shard boundaries; an unpacked batch is one sequence
``[0, T)`` per row.

A *boundary* ``b`` (the end of one shard, the start of the next) is *open* when a sequence runs across it
(``s_i < b < e_i``): the state after the tokens before ``b`` must travel to the rank that holds the token at ``b``.
Per rank:

* ``continues``: its start boundary is open, so its first local segment starts from a state it does not know;
* ``carries``: its end boundary is open, so a later rank needs the state its last local segment ends in.

The plan is host data (Python ints), built once per batch and shared by every layer of a model.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Segment:
    """The part of global sequence ``seq`` that lies in this rank's shard: local tokens ``[start, end)``."""
    seq: int
    start: int
    end: int


@dataclass(frozen=True)
class ShardPlan:
    """How a batch is split along T across the ranks of ``group``.

    Args:
        bounds: ``R + 1`` global token offsets, rank r holding ``[bounds[r], bounds[r + 1])``.
        seq_offsets: global ``cu_seqlens`` of a packed batch (``B == 1``), or None for an unpacked batch (one
            sequence ``[0, T)`` per row).
        rank: this process's rank in ``group``.
        group: the process group (None: the default group).
    """
    bounds: tuple[int, ...]
    seq_offsets: Optional[tuple[int, ...]]
    rank: int
    group: Optional[dist.ProcessGroup] = None

    def __post_init__(self):
        b = self.bounds
        if len(b) < 2 or b[0] != 0 or any(y < x for x, y in zip(b[:-1], b[1:])):
            raise ValueError(f"bounds must start at 0 and never decrease, got {b}")
        if not 0 <= self.rank < len(b) - 1:
            raise ValueError(f"rank {self.rank} outside the {len(b) - 1} shards of bounds {b}")
        s = self.seq_offsets
        if s is not None and (len(s) < 2 or s[0] != 0 or s[-1] != b[-1] or any(y < x for x, y in zip(s[:-1], s[1:]))):
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T={b[-1]}, got {s}")

    # -------------------------------------------------------------------------------------------- construction
    @classmethod
    def build(cls, local_len: int, cu_seqlens: Optional[torch.Tensor | Sequence[int]] = None,
              group: Optional[dist.ProcessGroup] = None) -> ShardPlan:
        """The plan of a batch whose shard on this rank has ``local_len`` tokens: the lengths of all shards come
        from one all-gather over ``group`` (call it on every rank). ``cu_seqlens``: the *global* offsets of a
        packed batch, the same on every rank, or None."""
        if isinstance(local_len, bool) or not isinstance(local_len, int) or local_len < 0:
            raise ValueError(f"local_len must be a non-negative int, got {local_len!r}")
        world = dist.get_world_size(group)
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        mine = torch.tensor([local_len], dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            dev = torch.device("cuda", torch.cuda.current_device())
            lens, mine = [x.to(dev) for x in lens], mine.to(dev)
        dist.all_gather(lens, mine, group=group)
        return cls.from_lengths([int(x) for x in lens], cu_seqlens, rank=dist.get_rank(group), group=group)

    @classmethod
    def from_lengths(cls, shard_lengths: Sequence[int], cu_seqlens=None, rank: Optional[int] = None,
                     group: Optional[dist.ProcessGroup] = None) -> ShardPlan:
        """The plan from every rank's shard length (no communication). ``rank`` defaults to this process's rank
        in ``group``."""
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shard_lengths):
            raise ValueError(f"shard lengths must be non-negative ints, got {list(shard_lengths)}")
        bounds = [0]
        for n in shard_lengths:
            bounds.append(bounds[-1] + n)
        if cu_seqlens is not None:
            cu_seqlens = tuple(int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor)
                                               else cu_seqlens))
        if rank is None:
            rank = dist.get_rank(group)
        return cls(tuple(bounds), cu_seqlens, rank, group)

    # ----------------------------------------------------------------------------------------------- geometry
    @property
    def world(self) -> int:
        return len(self.bounds) - 1

    @property
    def total_len(self) -> int:
        return self.bounds[-1]

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def end(self) -> int:
        return self.bounds[self.rank + 1]

    @property
    def local_len(self) -> int:
        return self.end - self.start

    @property
    def packed(self) -> bool:
        return self.seq_offsets is not None

    @property
    def offsets(self) -> tuple[int, ...]:
        """Global sequence offsets: ``cu_seqlens``, or ``(0, T)`` for an unpacked batch."""
        return self.seq_offsets if self.seq_offsets is not None else (0, self.total_len)

    @property
    def num_seqs(self) -> int:
        """Sequences per batch row: N of ``cu_seqlens``, 1 unpacked."""
        return len(self.offsets) - 1

    def open_boundary(self, b: int) -> Optional[int]:
        """The sequence that runs across global offset ``b`` (``s_i < b < e_i``), or None."""
        off = self.offsets
        i = bisect.bisect_right(off, b) - 1
        if 0 <= i < len(off) - 1 and off[i] < b < off[i + 1]:
            return i
        return None

    def continues(self, rank: Optional[int] = None) -> bool:
        r = self.rank if rank is None else rank
        return self.open_boundary(self.bounds[r]) is not None

    def carries(self, rank: Optional[int] = None) -> bool:
        r = self.rank if rank is None else rank
        return self.open_boundary(self.bounds[r + 1]) is not None

    @cached_property
    def any_open(self) -> bool:
        """Whether any boundary is open (else every rank is independent and no state travels)."""
        return any(self.open_boundary(b) is not None for b in self.bounds[1:-1])

    @cached_property
    def segments(self) -> tuple[Segment, ...]:
        """This rank's local segments, in order: every global sequence overlapping the shard (a zero-length
        sequence belongs to no shard)."""
        a, b = self.start, self.end
        off = self.offsets
        out = []
        for i in range(len(off) - 1):
            lo, hi = max(off[i], a), min(off[i + 1], b)
            if lo < hi:
                out.append(Segment(i, lo - a, hi - a))
        return tuple(out)

    def local_cu_seqlens(self, device=None) -> Optional[torch.Tensor]:
        """``cu_seqlens`` of the local segments (packed batches only; None unpacked or for an empty shard)."""
        if not self.packed or not self.segments:
            return None
        return torch.tensor([0] + [s.end for s in self.segments], dtype=torch.int32, device=device)

    def positions(self, device=None, start: Optional[int] = None, end: Optional[int] = None) -> torch.Tensor:
        """Position inside its sequence of each token in ``[start, end)`` (default: the shard), int64."""
        start = self.start if start is None else start
        end = self.end if end is None else end
        t = torch.arange(start, end, device=device)
        return t - self.offsets_tensor(device)[self.sequence_ids(device, start, end)]

    def sequence_ids(self, device=None, start: Optional[int] = None, end: Optional[int] = None) -> torch.Tensor:
        """Global sequence index of each token in ``[start, end)`` (default: the shard), int64."""
        start = self.start if start is None else start
        end = self.end if end is None else end
        t = torch.arange(start, end, device=device)
        return torch.searchsorted(self.offsets_tensor(device)[1:], t, right=True)

    def offsets_tensor(self, device=None) -> torch.Tensor:
        return torch.tensor(self.offsets, dtype=torch.int64, device=device)

    def owner(self, t: int) -> int:
        """The rank holding global token ``t``."""
        return next(r for r in range(self.world) if self.bounds[r] <= t < self.bounds[r + 1])

    def sources(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The ranks holding global tokens ``[lo, hi)``: ``(rank, lo_r, hi_r)`` pieces in order."""
        out = []
        for r in range(self.world):
            a, b = max(lo, self.bounds[r]), min(hi, self.bounds[r + 1])
            if a < b:
                out.append((r, a, b))
        return out
