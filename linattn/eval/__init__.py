"""``linattn eval``: evidence for choosing a gated-delta-rule operator on your own hardware and shapes.

One module per report section (correctness, perf, decode, scaling, memory, stability, robustness, soak,
mixed_precision, environment, scorecard), a registry of implementations (impls), the shapes and profiles (cases),
the writers (report: json / md / self-contained html) and the regression diff (compare). ``cli`` wires them together.
"""
SECTIONS = ("environment", "correctness", "performance", "decode", "scaling", "memory", "stability", "robustness",
            "soak", "mixed_precision", "scorecard")
