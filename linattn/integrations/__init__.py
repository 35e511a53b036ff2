"""Integrations of linattn's operators into other libraries (imported on demand: each needs its library)."""
