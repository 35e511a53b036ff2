"""A model of the role-split walk's hand-offs (linattn/ops/hopper/chunk_bwd_roles.py), read from the kernel's own
source: each role macro's statements become events (mbarrier waits and arrives, shared-memory reads and writes by
element-wise code, wgmma reads that last until their ``wait_wgmma``, TMA writes, proxy fences), and a scheduler
runs the four roles over a few chunks in random interleavings with the mbarriers' phase and parity rules. It finds
deadlocks, waits that fall two phases behind (parity aliasing), accesses of one shared tile by two roles that no
hand-off orders (vector clocks), and generic writes that wgmma reads without a proxy fence between."""
from __future__ import annotations

import ast
import dataclasses
import functools
import random
from pathlib import Path

HOPPER = Path(__file__).resolve().parents[2] / "linattn" / "ops" / "hopper"
SOURCE = HOPPER / "chunk_bwd_roles.py"
SPLIT_SOURCE = HOPPER / "chunk_bwd.py"     # the hi + lo split S calls (``chunk_bwd.hi_lo_split_macro``'s ``split``)
ROLES = ("chain", "value_side", "key_side", "producer")
LETTERS = {"chain": "S", "value_side": "B", "key_side": "A"}   # the consumer roles as the kernel's ``busy`` names them


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str               # wait, arrive, read, write, wgmma, retire, tma, fence
    slots: tuple = ()       # shared tiles read or written ("vec.ROW" for a row of the vector tile)
    barrier: str = ""
    phase: str = ""         # which phase a wait expects: "s" (this chunk's), "s-1", "0"
    when: str = ""          # "s>0": only from the second chunk


@functools.cache
def _module() -> ast.Module:
    return ast.parse(SOURCE.read_text())


def _assigned(tree: ast.AST, name: str) -> ast.Assign:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
                and n.targets[0].id == name)


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def shared_slots() -> set:
    """The shared tiles ``alloc_tiles`` allocates."""
    alloc = _function(_module(), "alloc_tiles")
    return {kw.arg for kw in _assigned(alloc, "shared").value.keywords}


def sums_aliases() -> dict:
    """A's column-sum tiles and the slots they take at K = V = 128 (``SUMS_SLOTS``): the model checks the stricter
    plan, each access of one counted as an access of its slot."""
    node = next(n for n in _module().body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
                and n.targets[0].id == "SUMS_SLOTS")
    return {kw.arg: ast.literal_eval(kw.value) for kw in node.value.keywords}


def vector_rows() -> set:
    """The names of the vector tile's rows (``GC, BETA, ... = range(n)``)."""
    node = next(n for n in _module().body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Tuple)
                and "GC" in [e.id for e in n.targets[0].elts])
    return {e.id for e in node.targets[0].elts}


def arrival_counts() -> dict:
    alloc = _function(_module(), "alloc_tiles")
    node = _assigned(alloc, "arrivals")
    return {kw.arg: eval(ast.unparse(kw.value)) for kw in node.value.keywords}      # integer expressions


class _Reader:
    """Events of one role macro, in program order; the macros it calls (``split(t)``, any helper macro of the
    kernel's module) inlined, a tile passed as an argument read as the tile; ``if state_grads`` taken as True."""

    def __init__(self, slots: set, macros: dict):
        self.slots, self.macros, self.rows, self.aliases = slots, macros, vector_rows(), sums_aliases()
        self.bound = {}         # a macro's parameter → the tile argument it was called with

    def _slot(self, node) -> str | None:
        """The shared tile a ``t.X`` or ``t.vec[ROW, ...]`` names, else None."""
        if isinstance(node, ast.Subscript):
            if isinstance(node.value, ast.Attribute) and node.value.attr == "vec":
                row = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
                names = [n.id for n in ast.walk(row) if isinstance(n, ast.Name) and n.id in self.rows]
                return "vec." + (names[0] if names else ast.unparse(row))
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.bound:
            node = self.bound[node.id]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "t":
            if node.attr in self.aliases:
                return self.aliases[node.attr]
            if node.attr in self.slots:
                return node.attr
        return None

    def _reads(self, expr) -> tuple:
        found = []
        for n in ast.walk(expr):
            if isinstance(n, ast.Subscript) and self._slot(n):
                found.append(self._slot(n))
        return tuple(dict.fromkeys(found))

    def statements(self, body, out: list, when: str = "") -> None:
        for st in body:
            self.statement(st, out, when)

    def statement(self, st, out: list, when: str) -> None:
        if isinstance(st, ast.For):
            call = st.iter
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "T.serial" and ast.unparse(call.args[0]) \
                    == "t.chunks":
                out.append(("loop", []))
                self.statements(st.body, out[-1][1])
                return
            self.statements(st.body, out, when)
            return
        if isinstance(st, ast.If):
            test = ast.unparse(st.test)
            if test == "state_grads":
                self.statements(st.body, out, when)
            elif test == "s > 0":
                self.statements(st.body, out, "s>0")
            else:                           # t.tx < ...: one warp's TMA issue, taken
                self.statements(st.body, out, when)
            return
        if isinstance(st, ast.Assign):
            target = st.targets[0]
            reads = self._reads(st.value)
            if reads:
                out.append(Event("read", reads, when=when))
            if self._slot(target):
                out.append(Event("write", (self._slot(target),), when=when))
            return
        if isinstance(st, ast.AugAssign):
            reads = self._reads(st.value)
            if reads:
                out.append(Event("read", reads, when=when))
            return
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
            self.call(st.value, out, when)

    def call(self, call: ast.Call, out: list, when: str) -> None:
        name = ast.unparse(call.func)
        args = call.args
        if name == "T.mbarrier_wait_parity":
            parity = ast.unparse(args[1])
            phase = {"s % 2": "s", "(s - 1) % 2": "s-1", "0": "0"}[parity]
            out.append(Event("wait", barrier=args[0].attr, phase=phase, when=when))
        elif name == "T.mbarrier_arrive":
            out.append(Event("arrive", barrier=args[0].attr, when=when))
        elif name == "T.wgmma_gemm":
            reads = tuple(s for s in (self._slot(a) for a in args[:2]) if s)
            out.append(Event("wgmma", reads, when=when))
        elif name == "T.wait_wgmma":
            out.append(Event("retire", (int(ast.literal_eval(args[0])),), when=when))
        elif name == "T.fence_proxy_async":
            out.append(Event("fence", when=when))
        elif name == "T.copy":
            src, dst = (self._slot(a) for a in args[:2])
            if src:
                out.append(Event("read", (src,), when=when))
            if dst:
                out.append(Event("write", (dst,), when=when))
        elif name == "T.tma_copy":
            barrier = next(kw.value.attr for kw in call.keywords if kw.arg == "barrier")
            out.append(Event("tma", (self._slot(args[1]),), barrier=barrier, when=when))
        elif name == "T.reduce_sum":
            reads = self._reads(call)
            if reads:
                out.append(Event("read", reads, when=when))
        elif isinstance(call.func, ast.Name) and call.func.id in self.macros:
            macro = self.macros[call.func.id]
            outer = self.bound
            self.bound = {**outer, **{p.arg: a for p, a in zip(macro.args.args, args) if self._slot(a)}}
            self.statements(macro.body, out, when)
            self.bound = outer


@functools.cache
def role_events(busy: str = "SBA") -> dict:
    """{role: [pre-loop events..., ("loop", [events per chunk]), post-loop events...]} from the kernel's source
    (cached: callers read it, never change it). The consumer roles (S, B, A: chain, value_side, key_side) not in
    ``busy`` are their idle macros (``idle_chain``, ...: the timeline build's hand-offs alone)."""
    # every function of the module a role calls by name is inlined (the roles and their helper macros)
    macros = {f.name: f for f in ast.walk(_module()) if isinstance(f, ast.FunctionDef)}
    macros["split"] = _function(_function(ast.parse(SPLIT_SOURCE.read_text()), "hi_lo_split_macro"), "split")
    reader = _Reader(shared_slots(), macros)
    events = {}
    for role in ROLES:
        idle = role in LETTERS and LETTERS[role] not in busy
        out = []
        reader.statements(macros["idle_" + role if idle else role].body, out)
        events[role] = out
    return events


def expand(events: list, chunks: int) -> list:
    """One role's events over ``chunks`` chunks: (chunk or None, event); ``when="s>0"`` kept from chunk 1 on."""
    flat = []
    for item in events:
        if isinstance(item, tuple) and item[0] == "loop":
            for s in range(chunks):
                flat += [(s, e) for e in item[1] if not (e.when == "s>0" and s == 0)]
        else:
            flat.append((None, item))
    return flat


class ProtocolError(AssertionError):
    pass


def simulate(chunks: int = 3, seed: int = 0, busy: str = "SBA") -> dict:
    """Run the four roles over ``chunks`` chunks in one random interleaving (the consumer roles not in ``busy``
    idle: :func:`role_events`); raise :class:`ProtocolError` on a deadlock, a wait two phases behind, an unordered
    pair of accesses, or a wgmma read of a generic write with no fence between. Returns counts of what ran."""
    rng = random.Random(seed)
    counts = arrival_counts()
    roles = {r: expand(e, chunks) for r, e in role_events(busy).items()}
    wgmma_slots = {s for evs in roles.values() for _, e in evs if e.kind == "wgmma" for s in e.slots}
    pc = dict.fromkeys(roles, 0)
    # vector clocks over the roles and, per TMA barrier, its copies' landing: a copy's write is ordered before only
    # what waited its own barrier's phase (a later barrier's phase may complete first)
    actors = list(roles) + [f"tma:{b}" for b in counts]
    clock = {r: dict.fromkeys(actors, 0) for r in roles}
    arrived = dict.fromkeys(counts, 0)          # arrivals in the barrier's current phase
    completed = dict.fromkeys(counts, 0)        # phases completed
    phase_clock = {b: {} for b in counts}       # (barrier, phase) → joined clock of its arrivals and copies
    pending_tma = {}                            # barrier → [(slot, clock)] the TMA writes before it completes
    accesses = {}                               # slot → [(role, kind, clock)]
    in_flight = {r: [] for r in roles}          # wgmma reads not yet retired: lists of slots
    unfenced = {r: set() for r in roles}        # slots written by generic code since the role's last fence
    steps = 0

    def join(a, b):
        return {q: max(a[q], b.get(q, 0)) for q in a}

    def access(role, slot, kind):
        clock[role][role] += 1
        accesses.setdefault(slot, []).append((role, kind, dict(clock[role])))

    def expected_phase(ev, chunk):
        return {"s": chunk, "s-1": (chunk or 0) - 1, "0": 0}[ev.phase]

    while any(pc[r] < len(roles[r]) for r in roles):
        ready = []
        for r in roles:
            if pc[r] >= len(roles[r]):
                continue
            chunk, ev = roles[r][pc[r]]
            if ev.kind == "wait":
                want = expected_phase(ev, chunk)
                if completed[ev.barrier] > want + 1:
                    raise ProtocolError(f"{r} waits for {ev.barrier}'s phase {want} (chunk {chunk}) after phase "
                                        f"{completed[ev.barrier] - 1} completed: parity aliasing")
                if completed[ev.barrier] < want + 1:
                    continue
            ready.append(r)
        if not ready:
            stuck = {r: (roles[r][pc[r]][0], roles[r][pc[r]][1].barrier) for r in roles if pc[r] < len(roles[r])}
            raise ProtocolError(f"deadlock: {stuck}")
        r = rng.choice(ready)
        chunk, ev = roles[r][pc[r]]
        pc[r] += 1
        steps += 1
        if ev.kind == "wait":
            want = expected_phase(ev, chunk)
            if want >= 0:
                clock[r] = join(clock[r], phase_clock[ev.barrier][want])
        elif ev.kind == "arrive":
            clock[r][r] += 1
            b, p = ev.barrier, completed[ev.barrier]
            phase_clock[b][p] = join(phase_clock[b].get(p, dict.fromkeys(actors, 0)), clock[r])
            arrived[b] += 1
            if arrived[b] == counts[b] // 128:      # one event stands for a warpgroup's 128 arrivals
                arrived[b] = 0
                completed[b] += 1
                for slot, c in pending_tma.pop(b, []):  # the TMA's writes land before its barrier's phase completes
                    landed = {**c, f"tma:{b}": completed[b]}
                    accesses.setdefault(slot, []).append(("tma", "write", landed))
                    phase_clock[b][p] = join(phase_clock[b][p], landed)
        elif ev.kind == "read":
            for s in ev.slots:
                access(r, s, "read")
        elif ev.kind == "write":
            for s in ev.slots:
                access(r, s, "write")
                if s in wgmma_slots:
                    unfenced[r].add(s)
        elif ev.kind == "wgmma":
            for s in ev.slots:
                if s in unfenced[r]:
                    raise ProtocolError(f"{r} reads {s} by wgmma after writing it with no proxy fence between")
                access(r, s, "read")
            in_flight[r].append(ev.slots)
        elif ev.kind == "retire":
            keep = ev.slots[0]
            retired, in_flight[r] = in_flight[r][:len(in_flight[r]) - keep], in_flight[r][len(in_flight[r]) - keep:]
            for slots in retired:
                for s in slots:
                    access(r, s, "read")
        elif ev.kind == "fence":
            unfenced[r].clear()
        elif ev.kind == "tma":
            clock[r][r] += 1
            pending_tma.setdefault(ev.barrier, []).append((ev.slots[0], dict(clock[r])))
        if ev.kind == "arrive" and ev.barrier != "init":
            for s in unfenced[r]:
                if any(s in e.slots for q in roles if q != r for _, e in roles[q] if e.kind == "wgmma"):
                    raise ProtocolError(f"{r} hands {s} on ({ev.barrier}) to a wgmma with no proxy fence after "
                                        f"writing it")
    _check_order(accesses)
    return dict(steps=steps, phases=dict(completed))


def _before(a: dict, b: dict) -> bool:
    return all(a[q] <= b.get(q, 0) for q in a)


def _check_order(accesses: dict) -> None:
    """Every pair of accesses to one tile by two roles, one of them a write, ordered by the hand-offs."""
    for slot, seen in accesses.items():
        writes = [(r, c) for r, kind, c in seen if kind == "write"]
        for wr, wc in writes:
            for r, kind, c in seen:
                if r == wr or (wr == "tma" and r == "producer"):
                    continue
                if not (_before(wc, c) or _before(c, wc)):
                    raise ProtocolError(f"{slot}: {wr}'s write and {r}'s {kind} are not ordered by a hand-off")
