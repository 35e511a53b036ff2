"""``linattn eval``: evidence for choosing a gated-delta-rule operator on your own hardware and shapes.

One module per report section (correctness, perf, decode, scaling, memory, stability, robustness, soak,
mixed_precision, environment, scorecard), a registry of implementations (impls), the shapes and profiles (cases),
the writers (report: json / md / self-contained html) and the regression diff (compare). ``cli`` wires them together.
"""
SECTIONS = ("environment", "correctness", "performance", "decode", "scaling", "memory", "stability", "robustness",
            "soak", "mixed_precision", "scorecard")


def stopped_during(stop: dict) -> str:
    """Where an interrupted run stopped, from ``meta.interrupted``: the section, the gap after one, or the setup
    (reports written before the ``during`` field existed have only ``section``)."""
    return stop.get("during") or stop.get("section") or "setup"
