"""Applications behind ``linattn train`` and ``linattn generate``: a byte-level hybrid LM, end to end."""
