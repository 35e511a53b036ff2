"""The hand-off protocol of the role-split Hopper kernel (linattn/ops/hopper/chunk_fwd_roles.py), model-checked on
the CPU: its roles' mbarrier waits and arrivals, in the kernel's order, run under many random interleavings with
mbarrier semantics (arrival counts, phases, parity waits; TMA landing at any later time). Every read must see the
tile of its own chunk (a stale or an overwritten tile is a race), and every schedule must finish (a state where no
role can move is a hang: on the GPU it costs the whole device call). Negative controls: each of four mutations of
the protocol is caught.

The roles below mirror the kernel's code line by line; a change to the kernel's waits, arrivals or buffer use must
be made here too.
"""
from __future__ import annotations

import random

import pytest

STAGES = 2


class MBarrier:
    """An mbarrier: ``count`` arrivals complete a phase; wait(parity) passes once the phase of that parity has
    completed, i.e. while the current phase's parity differs (a fresh barrier passes wait(1) at once)."""

    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def passes(self, parity: int) -> bool:
        return self.phase % 2 != parity


class Race(AssertionError):
    pass


def roles(chunks: int, affine: bool, mutation: str | None = None):
    """The kernel's roles as generators of steps: ("wait", barrier, parity), ("arrive", barrier),
    ("read", tile, chunk), ("write", tile, chunk), ("tma", stage, chunk)."""
    def state():
        for c in range(chunks):
            s = c % STAGES
            if mutation != "state_skips_sb_free":
                yield "wait", "sb_free", (c + 1) % 2
            yield "write", "Sb", c
            yield "arrive", "sb_ready"
            yield "wait", ("full", s), (c // STAGES) % 2
            yield "read", ("gcs", s), c
            yield "wait", "vn_ready", c % 2
            yield "read", ("Ks", s), c
            yield "read", "Vds", c
            yield "arrive", "vn_free"
            yield "arrive", ("empty", s)

    def delta():
        for c in range(chunks):
            s = c % STAGES
            yield "wait", ("full", s), (c // STAGES) % 2
            yield "read", ("gcs", s), c
            yield "wait", "sb_ready", c % 2
            yield "read", ("Ks", s), c
            yield "read", "Sb", c
            yield "arrive", "sb_free"
            yield "read", ("bs", s), c
            yield "read", ("Vs", s), c
            yield "read", ("As", s), c
            if mutation != "delta_skips_vn_free":
                yield "wait", "vn_free", (c + 1) % 2
            yield "write", "Vns", c
            yield "write", "Vds", c
            yield "arrive", "vn_ready"
            yield "arrive", ("empty", s)

    def output():
        for c in range(chunks):
            s = c % STAGES
            yield "wait", ("full", s), (c // STAGES) % 2
            if mutation == "output_releases_early":  # the stage released before Q and K are read
                yield "arrive", ("empty", s)
            yield "read", ("Qs", s), c
            yield "read", ("Ks", s), c
            yield "read", ("gcs", s), c
            yield "wait", "sb_ready", c % 2
            yield "read", ("Qs", s), c
            yield "read", "Sb", c
            yield "arrive", "sb_free"
            yield "wait", "vn_ready", c % 2
            yield "read", "Vns", c
            yield "arrive", "vn_free"
            if mutation != "output_releases_early":
                yield "arrive", ("empty", s)

    def producer():
        for c in range(chunks):
            s = c % STAGES
            parity = (c // STAGES) % 2 if mutation == "producer_wrong_parity" else (c // STAGES + 1) % 2
            yield "wait", ("empty", s), parity
            yield "tma", s, c                        # expect_tx + the loads: they land at any later time
            yield "arrive", ("full", s)

    agents = {"state": state(), "delta": delta(), "producer": producer()}
    if not affine:
        agents["output"] = output()
    return agents


def run(chunks: int, affine: bool, seed: int, mutation: str | None = None) -> None:
    """One random interleaving to the end; raises Race on a wrong tile, AssertionError on a hang."""
    readers = 1 if affine else 2
    bars = {"sb_ready": MBarrier(1), "sb_free": MBarrier(readers), "vn_ready": MBarrier(1),
            "vn_free": MBarrier(readers)}
    for s in range(STAGES):
        bars["full", s] = MBarrier(2)               # the producer's arrival and the loads' transaction count
        bars["empty", s] = MBarrier(1 + readers)
    tiles: dict = {}
    agents = roles(chunks, affine, mutation)
    current = {name: next(gen, None) for name, gen in agents.items()}
    in_flight: list = []                            # loads issued, not landed: (stage, chunk)
    rng = random.Random(seed)
    # each run gives every agent (and the TMA unit) a speed from a wide distribution, so that some schedules have
    # one role far behind the others: the windows where a hand-off could be overtaken
    speed = {name: rng.lognormvariate(0, 2) for name in [*agents, "tma"]}
    while any(step is not None for step in current.values()) or in_flight:
        movable = [n for n, step in current.items()
                   if step is not None and (step[0] != "wait" or bars[step[1]].passes(step[2]))]
        choices = movable + (["tma"] if in_flight else [])
        assert choices, f"hang: {current}"
        pick = rng.choices(choices, weights=[speed[n] for n in choices])[0]
        if pick == "tma":                           # one issued load set lands (all six tiles) and completes tx
            s, c = in_flight.pop(0)
            for name in ("Qs", "Ks", "Vs", "As", "gcs", "bs"):
                tiles[name, s] = c
            bars["full", s].arrive()
            continue
        kind, *args = current[pick]
        if kind == "arrive":
            bars[args[0]].arrive()
        elif kind == "write":
            tiles[args[0]] = args[1]
        elif kind == "read":
            if tiles.get(args[0]) != args[1]:
                raise Race(f"{pick} read {args[0]} for chunk {args[1]}, found chunk {tiles.get(args[0])}")
        elif kind == "tma":
            in_flight.append((args[0], args[1]))
        current[pick] = next(agents[pick], None)


@pytest.mark.parametrize("affine", [False, True], ids=["walk", "affine"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 5, 8])
def test_role_hand_offs_neither_race_nor_hang(chunks, affine):
    for seed in range(300):
        run(chunks, affine, seed)


@pytest.mark.parametrize("mutation", ["state_skips_sb_free", "delta_skips_vn_free", "producer_wrong_parity",
                                      "output_releases_early"])
def test_a_broken_hand_off_is_caught(mutation):
    """Each mutation races (a tile overwritten before its last read, or read before it is written) or hangs in
    some schedule: the check above can fail."""
    caught = 0
    for seed in range(300):
        try:
            run(5, False, seed, mutation)
        except AssertionError:                      # Race, or a hang
            caught += 1
    assert caught > 0, mutation
