"""A virtual clock for the eval's time budget: the tests' scheduling does not depend on the machine's speed.

Everything in ``linattn.eval`` that budgets, times or times out work reads :attr:`Context.clock` (the CLI passes its
``clock`` on). A test gives it a :class:`VirtualClock`, which moves only when told: by the test itself, or by a
stand-in op that charges a fixed number of seconds per call (:class:`Costed`, :class:`SlowCompiler`,
:func:`never_returns`), so a slow or loaded machine changes how long a test takes, never which units fit or time out.
"""
import functools
import threading

from linattn.cli import main
from linattn.eval import cli as eval_cli
from linattn.eval import decode, impls

OP_S = 0.02  # virtual seconds each call of an implementation costs in a whole `linattn eval` run (run_eval)
STUCK_S = 100.0  # virtual seconds a stuck call has run when it is first checked (never_returns)


class VirtualClock:
    """A monotonic clock (seconds) that stands still until :meth:`advance` moves it."""

    def __init__(self, start: float = 1000.0):
        self.now = start
        self._lock = threading.Lock()  # stand-in ops may run in run_with_timeout's worker threads

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds

    def __deepcopy__(self, memo):  # one clock: a copied op (mixed precision trains copies of its model) shares it
        return self


class Costed:
    """An implementation's op whose every call costs ``seconds`` of ``clock`` (its real time does not count)."""

    def __init__(self, fn, clock: VirtualClock, seconds: float):
        self.fn, self.clock, self.seconds = fn, clock, seconds

    def __call__(self, x):
        self.clock.advance(self.seconds)
        return self.fn(x)


class SlowCompiler:
    """linattn's op behind a fake JIT: the process's first call costs ``first`` s of ``clock`` (its compile), the
    first call of each new (dtype, T == 1, option) combination ``inc`` s (a specialisation of kernels compiled
    before)."""

    def __init__(self, fn, clock: VirtualClock, first: float, inc: float):
        self.fn, self.clock, self.first, self.inc, self.seen = fn, clock, first, inc, set()

    def __call__(self, x):
        key = (x["q"].dtype, x["q"].shape[1] == 1, x["q"].shape[2], x["v"].shape[-1], x.get("cu_seqlens") is not None,
               x.get("initial_state") is not None, x.get("A_log") is not None, bool(x.get("use_qk_l2norm_in_kernel")))
        if key not in self.seen:
            self.clock.advance(self.inc if self.seen else self.first)
            self.seen.add(key)
        return self.fn(x)


def never_returns(gate: threading.Event, clock: VirtualClock, seconds: float = STUCK_S):
    """A call that does not return until ``gate`` is set (a hang, or an endless first autotune): it has run for
    ``seconds`` of ``clock`` as soon as it starts (more than any test's time-out, so one expires at once). A
    function, not an object: mixed precision deep-copies its model, and with it an object's gate."""

    def call(*args):
        clock.advance(seconds)
        gate.wait(60)
    return call


def run_eval(monkeypatch, clock: VirtualClock, argv: list, op_s: float = OP_S) -> int:
    """``linattn eval`` (``main(argv)``) on ``clock``, every call of an implementation's op and of a decode step
    costing ``op_s`` of it (on top of whatever ``impls.build`` already charges: a test may patch it first)."""
    build, make_step = impls.build, decode.make_step

    def build_costed(name, device):
        impl = build(name, device)
        if impl.fn is not None:
            impl.fn = Costed(impl.fn, clock, op_s)
        return impl

    monkeypatch.setattr(impls, "build", build_costed)
    monkeypatch.setattr(decode, "make_step", lambda path, state: Costed(make_step(path, state), clock, op_s))
    monkeypatch.setattr(eval_cli, "Evaluation", functools.partial(eval_cli.Evaluation, clock=clock))
    return main(["eval", *argv])
