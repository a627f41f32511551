"""Start a replica's worker processes: forked from a forked core; from a forkserver where torch is
imported here already; else spawned before the core imports torch (docs/architecture.md, 'Start-up');
no torch import at module level here."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
from dataclasses import dataclass

from longserve.distributed.shm_broadcast import ShmRingBuffer


@dataclass
class WorkerProcs:
    procs: list  # multiprocessing.Process of global ranks base + 1 (base with rank0) .. base + replica - 1
    plans: ShmRingBuffer | None  # the ring the driver writes each step's plan to
    init_method: str  # the rendezvous: this replica's own, or an expert model's DP world's
    results: ShmRingBuffer | None = None  # rank 0 in a process of its own: its outputs, in order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(config_bytes: bytes, base: int, replica: int, init_method: str | None = None,
                  fork: bool = False, rank0: bool = False) -> WorkerProcs:
    """Start global ranks base + 1 .. base + replica - 1, and base too with `rank0` (its outputs
    come back through `results`); no init_method: a rendezvous port of their own; `fork`: this
    process was forked with torch imported (engine/core_launch.py)."""
    init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
    ctx = _context(fork)
    first = base if rank0 else base + 1
    # (a DP rank of an expert model may be a replica of one rank)
    plans = ShmRingBuffer(readers=base + replica - first) if base + replica > first else None
    results = ShmRingBuffer(readers=1, reader=0) if rank0 else None
    procs = []
    for rank in range(first, base + replica):
        p = ctx.Process(target=_worker_entry, daemon=True, args=(
            config_bytes, rank, init_method, rank - base, (plans.handle, rank - first),
            time.time(), results.handle if rank0 and rank == base else None, dict(os.environ)))
        p.start()
        procs.append(p)
    return WorkerProcs(procs, plans, init_method, results)


def _context(fork: bool):
    """fork: a forked core's workers. Torch imported here (an engine core on a thread of the front
    end: tests, notebooks): a forkserver that imported torch and the worker once forks each worker,
    ~2 s of imports saved a worker (forking this threaded process itself is not safe). Else spawn."""
    if fork:
        return mp.get_context("fork")
    if "torch" not in sys.modules or sys.platform != "linux":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "longserve.worker.worker"])  # (once it runs: no effect)
    return ctx


def _worker_entry(config_bytes: bytes, rank: int, init_method: str, local_rank: int, plans: tuple,
                  spawned_at: float, results: tuple | None, env: dict) -> None:
    os.environ.clear()  # the engine's environment now, not the one the forkserver started with
    os.environ.update(env)
    name_process(f"longserve-rank{rank}")  # (forked: it has what its core's in_forked_child set)
    from longserve.worker.worker import worker_main
    worker_main(pickle.loads(config_bytes), rank, init_method, local_rank, plans, spawned_at, results)
    # done, its groups closed: exit here. multiprocessing's exit path joins the threads it knows of,
    # which in a worker forked from a core forked off a server's thread fails (exit code 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def name_process(name: str) -> None:
    """What `top` shows (a forked process has its parent's command line; Linux, <= 15 chars)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
