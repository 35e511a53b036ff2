"""Hopper-only kernels (sm_90) outside Triton: experimental, not dispatched by the public ops yet (issue 4)."""
