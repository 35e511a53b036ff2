"""benchmarks/anchors_warm.py on the CPU: the warm phase's task list, its pool bound and admission (pure), the worker
entry point's pickling, and the phase's pool without a GPU (each task a "no CUDA device" result, nothing raised)."""
from __future__ import annotations

import json
import math
import os
import pickle
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # after the installed packages: no shadowing
import anchors_warm  # noqa: E402
from anchors_warm import CONTEXT_BYTES, FREE_FRACTION, WarmTask, admissible, pool_bound, task_bytes, warm_tasks  # noqa: E402,E501

GiB = 1 << 30
# issue 4's seven rows (B, T, Hqk, Hv), as anchors_forward_table.ROWS holds them
ROWS = {1: (1, 4096, 16, 16), 2: (8, 4096, 16, 16), 3: (1, 32768, 16, 16), 4: (1, 131072, 16, 16),
        5: (4, 8192, 16, 32), 6: (2, 16384, 32, 32), 7: (1, 32768, 2, 8)}
IMPLS = ["fla", "flashqla", "linattn:chunk_gated_delta_rule"]


def test_one_task_per_implementation_and_row_largest_first():
    tasks = warm_tasks(IMPLS, ROWS, train=True, extra=["linattn:chunk_gated_delta_rule"])
    assert sorted((t.impl, t.row) for t in tasks) == sorted((i, r) for i in IMPLS for r in ROWS)
    assert [t.nbytes for t in tasks] == sorted((t.nbytes for t in tasks), reverse=True)
    assert {t.row for t in tasks[:3]} == {4}                    # T = 131072: the largest row starts first
    assert [t.impl for t in tasks[:3]] == IMPLS                 # equal sizes keep the given order
    assert all(t.train and t.extra == ("linattn:chunk_gated_delta_rule",) for t in tasks)
    assert all(t.shape == ROWS[t.row] for t in tasks)
    assert not any(t.train for t in warm_tasks(IMPLS, ROWS, train=False))


def test_task_bytes_scale_with_the_largest_head_count():
    # row 4: one [1, 131072, 16, 128] bf16 tensor is 512 MiB
    assert task_bytes(*ROWS[4]) == anchors_warm.TENSOR_MULTIPLE * 512 * 2 ** 20
    assert task_bytes(4, 8192, 16, 32) == task_bytes(4, 8192, 32, 32) == 2 * task_bytes(4, 8192, 16, 16)


def test_pool_bound_is_cores_and_tasks_and_free_memory_less_contexts():
    tasks = warm_tasks(IMPLS, ROWS, train=True)
    assert pool_bound(tasks, 80 * GiB, 16) == (16, int(80 * GiB * FREE_FRACTION) - 16 * CONTEXT_BYTES)
    assert pool_bound(tasks[:5], 80 * GiB, 16)[0] == 5
    assert pool_bound(tasks, 80 * GiB, 2)[0] == 2
    with pytest.raises(ValueError, match="cores"):
        pool_bound(tasks, 80 * GiB, 0)


def _task(row: int, gib: float) -> WarmTask:
    return WarmTask("x", row, (1, 1, 1, 1), True, (), int(gib * GiB))


def test_admission_fills_the_budget_and_backfills_smaller_tasks():
    pending = [_task(1, 12), _task(2, 12), _task(3, 6), _task(4, 1)]
    assert [t.row for t in admissible(pending, 0, 20 * GiB, idle_workers=8)] == [1, 3, 4]
    assert [t.row for t in admissible(pending, 15 * GiB, 20 * GiB, idle_workers=8)] == [4]
    assert [t.row for t in admissible(pending, 0, 100 * GiB, idle_workers=2)] == [1, 2]
    assert admissible(pending, 0, 100 * GiB, idle_workers=0) == []


def test_a_task_over_the_budget_runs_alone():
    pending = [_task(1, 30), _task(2, 1)]
    assert [t.row for t in admissible(pending, 0, 20 * GiB, idle_workers=4)] == [1]
    assert [t.row for t in admissible(pending, 1, 20 * GiB, idle_workers=4)] == [2]


def test_the_seven_rows_on_an_80_gb_card_never_exceed_the_budget():
    """Simulated: tasks end in the order they started; every task runs once, and the bytes in flight stay within
    the budget at every admission (the worker count too)."""
    tasks = warm_tasks(IMPLS, ROWS, train=True)
    workers, budget = pool_bound(tasks, 79 * GiB, 16)
    pending, running, started, waves = list(tasks), [], [], 0
    while pending or running:
        picked = admissible(pending, sum(t.nbytes for t in running), budget, workers - len(running))
        for task in picked:
            pending.remove(task)
        running += picked
        started += picked
        waves += bool(picked)
        assert len(running) <= workers and sum(t.nbytes for t in running) <= budget
        running.pop(0)
    assert sorted(started, key=id) == sorted(tasks, key=id)
    assert math.isclose(budget / GiB, 79 * FREE_FRACTION - 16 * CONTEXT_BYTES / GiB, rel_tol=1e-6)


def test_the_worker_entry_point_and_its_task_pickle():
    task = warm_tasks(IMPLS, {4: ROWS[4]}, train=True)[0]
    assert pickle.loads(pickle.dumps(task)) == task
    assert pickle.loads(pickle.dumps(anchors_warm.warm_one)) is anchors_warm.warm_one


def test_the_phase_runs_its_pool_without_a_gpu_and_reports_every_task(tmp_path):
    """Spawned workers, one per task here: each returns "no CUDA device" (nothing that needs a GPU runs), writes
    its output into the log directory, and the phase logs one line per task without raising."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("on a GPU the workers would run the implementations")
    lines = []
    tasks = warm_tasks(["a", "b"], {1: ROWS[1]}, train=True)
    seconds, results = anchors_warm.warm(tasks, 80 * GiB, cores=2, log=lines.append, log_dir=str(tmp_path))
    assert seconds > 0 and lines[0].startswith("warm: 2 tasks on 2 workers")
    worker_logs = "".join(p.read_text() for p in tmp_path.glob("worker-*.log"))
    assert "--- a row 1" in worker_logs and "--- b row 1" in worker_logs
    assert sorted(r.task.impl for r in results) == ["a", "b"] and all(r.error == "no CUDA device" for r in results)
    assert sorted(line.split(" row")[0] for line in lines[1:]) == ["warm: a", "warm: b"]
    assert all("error no CUDA device" in line for line in lines[1:])
    saved = json.loads(anchors_warm.to_json(seconds, results))
    assert saved["seconds"] == seconds and sorted(t["impl"] for t in saved["tasks"]) == ["a", "b"]
    assert all(t["charged_MB"] == task_bytes(*ROWS[1]) / 2 ** 20 for t in saved["tasks"])


def test_autotune_caching_is_set_where_unset_and_an_explicit_choice_stays(monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    anchors_warm.cache_autotune_results()
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    anchors_warm.cache_autotune_results()
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"
