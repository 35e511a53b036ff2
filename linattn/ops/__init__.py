"""Operators: kernels, their PyTorch twins and the autograd/dispatch glue."""
