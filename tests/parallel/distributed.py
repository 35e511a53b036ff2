"""Run a test body in ``world`` gloo processes (torch.multiprocessing spawn, rendezvous through a file store).

The body is a module-level function ``fn(rank, world, *args)``; an exception on any rank fails the test with that
rank's traceback. Each worker uses one thread: the CI machine has 2 cores shared by all the processes.

A worker whose body passed on every rank destroys its process group and leaves with ``os._exit(0)``, skipping the
interpreter's teardown: a C++ thread of torch.distributed still joinable there can abort the process
(std::terminate, SIGABRT) after every check has passed. For an abort anywhere else faulthandler prints each thread's
Python stack.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, store_path: str, fn, args) -> None:
    faulthandler.enable()
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        # spawn reports the first rank to exit, often a bystander whose peer died: print every rank's cause
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world: int, *args) -> None:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "store"), fn, args), nprocs=world, join=True)
