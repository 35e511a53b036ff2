"""benchmarks/gpu_check_roles_walk.py's op check on the CPU: one task per case in a pool of spawned workers, the
role-split walk patched into each worker's backward, rows in the core check's case order and dtypes, unknown cases
rejected. A stand-in ``gpu_check_core`` (its CASES and a ``check`` that reports what it ran) takes the real one's
place."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # after the installed packages: no shadowing
import gpu_check_roles_walk  # noqa: E402

STAND_IN = '''
import os
CASES = [("short", 1, 300, 1, 1, 8, 8, None), ("long", 1, 2000, 1, 1, 8, 8, None), ("tiny", 1, 5, 1, 1, 8, 8, None)]
def check(case, dtype, use_token_ref, backward_path):
    from linattn.ops.hopper import chunk_bwd
    return dict(case=case[0], dtype=str(dtype), pid=os.getpid(), walk=chunk_bwd.chunk_bwd_hopper.__name__,
                token_ref=use_token_ref, backward_path=backward_path)
'''


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    (tmp_path / "gpu_check_core.py").write_text(STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path))              # the spawned workers take the parent's sys.path
    monkeypatch.delitem(sys.modules, "gpu_check_core", raising=False)


def test_each_case_is_a_worker_task_with_the_role_split_walk(stand_in):
    rows = gpu_check_roles_walk.patched_op_check(["tiny", "short"], ["bfloat16", "float16"])
    assert [(r["case"], r["dtype"]) for r in rows] == [("short", "torch.bfloat16"), ("short", "torch.float16"),
                                                         ("tiny", "torch.bfloat16"), ("tiny", "torch.float16")]
    assert all(r["walk"] == "role_split_walk" and r["backward_path"] == "hopper" for r in rows)
    assert [r["token_ref"] for r in rows] == [True, True, True, True]
    assert rows[0]["pid"] == rows[1]["pid"] and rows[2]["pid"] == rows[3]["pid"]     # a case's dtypes: one task


def test_unknown_cases_are_rejected(stand_in):
    with pytest.raises(ValueError, match="unknown --op case"):
        gpu_check_roles_walk.patched_op_check(["short", "nope"], ["bfloat16"])
