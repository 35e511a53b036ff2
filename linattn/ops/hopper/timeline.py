"""The reverse walks' in-kernel timelines (``chunk_bwd.build_kernel(timeline=True)``, launched by
``chunk_bwd.walk_timeline``; ``chunk_bwd_roles.build_kernel(timeline=True)``, launched by
``chunk_bwd_roles.walk_timeline``): which phases of the chunk step take its time. A benchmark's instrument, never the
op's.

Why: the walk's time per step does not move with the load (one program per SM or two waves of them), so the step
is latency-bound, and only times taken inside a program say which of its phases wait.

The stamps: int64 ``[programs, steps, len(POINTS) + 1, warpgroups]``, program = (sequence · HV + value head) · NV + V
slice, step = the walk's step count (step 0: the sequence's last chunk), one column per consumer warpgroup (its first
thread stamps). Entry ``[p, s, i, w]`` for i < len(POINTS) is ``clock64`` (the SM's cycles) when warpgroup w passed
point ``POINTS[i]`` of step s; entry ``[p, s, len(POINTS), w]`` is ``%globaltimer`` (ns, one clock for every SM) read
right after the step's ``start`` stamp. The cycles are exact but per SM and at the SM's clock of the moment; the
global timer is coarse (its updates may be µs apart) but common: each program's cycles per ns are its span of cycles
over its span of global time, first recorded step to last (tens of steps: hundreds of µs), which converts every
interval to µs at that program's own clock. :func:`timeline_phases` does that reduction (pure PyTorch: tested on the
CPU); the GPU script's ``--timeline`` part prints it (benchmarks/gpu_check_hopper_bwd.py).

The role-split walk's stamps have the same layout with one column per role (S, B, A: its threads 0-383) and each
role's own points (:data:`ROLE_POINTS`), the global timer in the last entry of the third axis
(:func:`role_stamps_shape`); :func:`role_timeline` reduces each role's column with its points
(benchmarks/gpu_check_roles_walk.py --timeline).
"""
from __future__ import annotations

from typing import Optional

import torch

# The points stamped in every chunk step, in program order (``chunk_bwd.step_macros``' ``full_step``): each names the
# phase that ends there. "start": the step's first statement after the wait for its gates (gc, which the loop's
# g_last reads; the producer loads it last, after the previous step's finish released its slot); "loads": the other
# seven inputs awaited (the timeline build awaits them all here, the default build each at its first use within the
# recompute and the chain: the one reordering the instrument makes); "x_terms": the X terms, which run under C3, and
# the q side's first dot, dO V_newᵀ, which waits for C3 (a stamp between them, while C3 runs, made ptxas spill);
# "dq_sum" and "dk_sum": the slices' exchange of dq, dk (``chunk_bwd._exchange_macros``' ``sum_out``: the owner's
# awaits and adds, another slice's store and publish; one slice: the plain store); "dv": dv's scale and store.
POINTS = ("start", "loads", "recompute", "chain", "x_terms", "q_side", "dq_sum", "k_side", "dk_sum", "dv", "finish")
# Phases reported: each point's phase (the interval from the point before it), the step from start to finish, and
# "gap": from a step's finish to the next step's start (the loop's statements and the wait for the next chunk's gc,
# issued once this finish released its slot: a load's latency at every step boundary).
PHASES = POINTS[1:] + ("step", "gap")
# The role-split walk's points per role (``chunk_bwd_roles``' role macros), in program order; each names the phase
# that ends there, as above. "top": the loop's head, before the wait for the chunk's tiles; "loads": that wait over
# (the producer issues them once all three roles have left the chunk before); "wait_*": a wait for another role's
# hand-off over; the others: the role's work since its point before, ending with the hand-off or store it names.
ROLE_POINTS = {
    "S": ("top", "loads", "gamma_do", "q_dots", "wait_y", "c3", "wait_ds", "finish"),
    "B": ("top", "loads", "x", "v_new", "wait_p", "p_do", "wait_g", "y", "x_terms", "dv", "dk_first",
          "wait_dkd", "dk", "finish"),
    "A": ("top", "loads", "p", "wait_v", "dp", "dlogd", "wait_y", "dkd", "da_sums", "wait_xt", "finish"),
}
ROLE_SLOTS = max(len(points) for points in ROLE_POINTS.values())
QUANTILES = (0.5, 0.9)


def stamps_shape(programs: int, steps: int, warpgroups: int = 2) -> tuple[int, int, int, int]:
    """The stamps tensor's shape: :data:`POINTS`' clocks and the step's global time, per consumer warpgroup."""
    return programs, steps, len(POINTS) + 1, warpgroups


def recorded_steps(steps: Optional[int], chunks: int) -> int:
    """The chunk steps a timeline build stamps: the first ``steps`` (a positive int; None: every one) of ``chunks``."""
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ValueError(f"steps must be a positive int or None, got {steps!r}")
    return chunks if steps is None else min(steps, chunks)


def role_stamps_shape(programs: int, steps: int) -> tuple[int, int, int, int]:
    """The role-split walk's stamps: :data:`ROLE_SLOTS` clocks (each role's points first) and the global time, per
    role."""
    return programs, steps, ROLE_SLOTS + 1, len(ROLE_POINTS)


def cycles_per_ns(stamps: torch.Tensor) -> torch.Tensor:
    """Each program's and warpgroup's SM clock ``[programs, warpgroups]`` (cycles per ns): the ``start`` clocks' span
    over the global timer's span, first step to last of ``stamps`` (at least two steps)."""
    if stamps.shape[1] < 2:
        raise ValueError(f"the clock needs at least two recorded steps, got {stamps.shape[1]}")
    start, timer = stamps[:, :, 0].double(), stamps[:, :, -1].double()
    span_ns = timer[:, -1] - timer[:, 0]
    if (span_ns <= 0).any():
        raise ValueError("the global timer did not advance over a program's recorded steps: record more steps")
    return (start[:, -1] - start[:, 0]) / span_ns


def phase_us(stamps: torch.Tensor, clock: Optional[torch.Tensor] = None,
             points: tuple[str, ...] = POINTS) -> dict[str, torch.Tensor]:
    """Every phase of ``points`` (each but the first; :data:`PHASES` for the slice walk's), the step and the gap in
    µs ``[programs, steps, warpgroups]`` (``gap`` has no value for the last step: NaN), at each program's ``clock``
    (cycles per ns, ``[programs, warpgroups]``; None: :func:`cycles_per_ns`)."""
    if stamps.dim() != 4 or stamps.shape[2] != len(points) + 1 or stamps.dtype != torch.int64:
        raise ValueError(f"stamps must be int64 [programs, steps, {len(points) + 1}, warpgroups], got "
                         f"{stamps.dtype} {tuple(stamps.shape)}")
    if (stamps < 0).any():
        raise ValueError("stamps holds unwritten entries (−1): a point the kernel never stamped")
    clock = cycles_per_ns(stamps) if clock is None else clock.double()
    cycles = stamps[:, :, :len(points)].double()
    us = lambda c: c / clock[:, None] / 1000
    out = {name: us(cycles[:, :, i + 1] - cycles[:, :, i]) for i, name in enumerate(points[1:])}
    out["step"] = us(cycles[:, :, -1] - cycles[:, :, 0])
    gap = torch.full_like(out["step"], float("nan"))
    gap[:, :-1] = us(cycles[:, 1:, 0] - cycles[:, :-1, -1])
    out["gap"] = gap
    return out


def _quantiles(x: torch.Tensor) -> dict[str, float]:
    """Median and p90 of the finite values of ``x`` (NaN where none)."""
    x = x[torch.isfinite(x)]
    if x.numel() == 0:
        return {f"p{round(q * 100)}": float("nan") for q in QUANTILES}
    return {f"p{round(q * 100)}": torch.quantile(x, q).item() for q in QUANTILES}


def timeline_phases(stamps: torch.Tensor, slices: int = 1, clock: Optional[torch.Tensor] = None,
                    points: tuple[str, ...] = POINTS) -> dict:
    """The timeline's summary: per phase of ``points`` (as :func:`phase_us`'s) and consumer warpgroup (``wg0``, ``wg1``, ...), the median
    (``p50``) and ``p90`` in µs over programs and steps, for the first recorded step (``first``: the prologue's waits
    fall there) and the later ones (``later``). With ``slices`` = NV > 1 the exchange phases (``dq_sum``,
    ``dk_sum``) are also split by role, later steps only: ``owner`` (the step's owner slice, step mod NV, awaits and
    adds the others' tiles) and ``other`` (stores and publishes its own). ``clock``: as :func:`phase_us`'s. Also the
    median clock (``cycles_per_ns``), the spread of the programs' first global times (``start_spread_us``: about 0
    for one wave, a wave's length for two) and the sizes."""
    us = phase_us(stamps, clock, points)
    programs, steps, _, warpgroups = stamps.shape
    first_ns = stamps[:, 0, -1].double()
    summary = dict(programs=programs, steps=steps, warpgroups=warpgroups, slices=slices, phases=tuple(us),
                   cycles_per_ns=_quantiles(cycles_per_ns(stamps) if clock is None else clock.double())["p50"],
                   start_spread_us=(first_ns.max() - first_ns.min()).item() / 1000)
    for name, t in us.items():
        summary[name] = {f"wg{w}": dict(first=_quantiles(t[:, :1, w]), later=_quantiles(t[:, 1:, w]))
                         for w in range(warpgroups)}
    if slices > 1:
        owner = ((torch.arange(steps)[None, :] % slices) == (torch.arange(programs)[:, None] % slices))[:, 1:]
        for name in ("dq_sum", "dk_sum"):
            later = us[name][:, 1:]
            summary[name + "_by_role"] = {f"wg{w}": dict(owner=_quantiles(later[..., w][owner]),
                                                         other=_quantiles(later[..., w][~owner]))
                                          for w in range(warpgroups)}
    return summary


def format_table(summary: dict, title: str = "") -> str:
    """:func:`timeline_phases`' summary as a text table: a line per phase (and per exchange role), median / p90 µs
    per warpgroup, later steps then the first."""
    wgs = [f"wg{w}" for w in range(summary["warpgroups"])]
    cell = lambda d: f"{d['p50']:9.2f} /{d['p90']:6.2f}"
    lines = [f"{title}: {summary['programs']} programs × {summary['steps']} steps, {summary['cycles_per_ns']:.3f} "
             f"cycles/ns, first starts spread over {summary['start_spread_us']:.1f} µs (µs per step, median / p90)",
             f"{'phase':<14}" + "".join(f"{w + ' later':>17}{w + ' first':>17}" for w in wgs)]
    for name in summary["phases"]:
        lines.append(f"{name:<14}" + "".join(cell(summary[name][w]["later"]) + cell(summary[name][w]["first"])
                                             for w in wgs))
    for name in ("dq_sum", "dk_sum"):
        for role in ("owner", "other"):
            if name + "_by_role" in summary:
                by_role = summary[name + "_by_role"]
                lines.append(f"{name + ' ' + role:<14}" + "".join(cell(by_role[w][role]) + " " * 17 for w in wgs))
    return "\n".join(lines)


def role_timeline(stamps: torch.Tensor, roles: str = "".join(ROLE_POINTS)) -> dict[str, dict]:
    """The role-split walk's stamps (:func:`role_stamps_shape`) as one :func:`timeline_phases` summary per role of
    :data:`ROLE_POINTS` in ``roles`` (its column, its points and the global time): the busy roles of a build that
    leaves others idle (``chunk_bwd_roles.build_kernel``'s ``busy``), whose columns are never stamped."""
    if stamps.dim() != 4 or stamps.shape[2:] != (ROLE_SLOTS + 1, len(ROLE_POINTS)):
        raise ValueError(f"stamps must be [programs, steps, {ROLE_SLOTS + 1}, {len(ROLE_POINTS)}], got "
                         f"{tuple(stamps.shape)}")
    if not roles or set(roles) - set(ROLE_POINTS):
        raise ValueError(f"roles must be a non-empty part of {''.join(ROLE_POINTS)!r}, got {roles!r}")
    out = {}
    for r, (role, points) in enumerate(ROLE_POINTS.items()):
        if role not in roles:
            continue
        column = stamps[:, :, :, r:r + 1]
        out[role] = timeline_phases(torch.cat([column[:, :, :len(points)], column[:, :, -1:]], 2), points=points)
    return out
