"""Test-wide setup.

* Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before triton.jit decorates
  anything, so it is set here, before linattn is imported.
* Fresh allocations are poisoned with NaN (floating dtypes) so an output a kernel forgets to write fails the test
  instead of passing on whatever the allocator returned.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

_empty, _empty_like, _new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty


def _poison(t):
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.device.type != "meta":
        with torch.no_grad():
            t.fill_(float("nan"))
    return t


def _poisoned_empty(*args, **kwargs):
    return _poison(_empty(*args, **kwargs))


def _poisoned_empty_like(*args, **kwargs):
    return _poison(_empty_like(*args, **kwargs))


def _poisoned_new_empty(self, *args, **kwargs):
    return _poison(_new_empty(self, *args, **kwargs))


@pytest.fixture(autouse=True)
def poison_fresh_allocations(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", _poisoned_empty_like)
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned_new_empty)
    yield


@pytest.fixture(autouse=True)
def fresh_prepared_calls(monkeypatch):
    """Each test starts with no prepared Hopper forward (``ops/hopper/prepared.py``) or backward
    (``ops/hopper/backward_prepared.py``), no kept scratch and no route of the op's (``ops/hopper/route.py``): one
    test's signatures, made under its stand-ins, are not another's."""
    from linattn.ops.hopper import backward_prepared, prepared, route
    monkeypatch.setattr(prepared, "_prepared", {})
    monkeypatch.setattr(backward_prepared, "_prepared", {})
    monkeypatch.setattr(prepared, "_scratch", {})
    monkeypatch.setattr(route, "_routes", {})
    yield


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)
    yield
