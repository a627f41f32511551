"""Start a replica's worker processes before the starting process has imported torch, so their
imports run beside its own; nothing here imports torch (a worker gets the engine config as
pickled bytes and unpickles it after its own imports)."""
from __future__ import annotations

import multiprocessing as mp
import pickle
import socket
import time
from dataclasses import dataclass

from longserve.distributed.shm_broadcast import ShmRingBuffer


@dataclass
class WorkerProcs:
    procs: list  # multiprocessing.Process of global ranks base + 1 .. base + replica - 1
    plans: ShmRingBuffer | None  # the ring the driver writes each step's plan to
    init_method: str  # the rendezvous: this replica's own, or an expert model's DP world's


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(config_bytes: bytes, base: int, replica: int,
                  init_method: str | None = None) -> WorkerProcs:
    """Spawn global ranks base + 1 .. base + replica - 1 (no init_method: a rendezvous port of their own)."""
    init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    # (a DP rank of an expert model may be a replica of one rank)
    plans = ShmRingBuffer(readers=replica - 1) if replica > 1 else None
    procs = []
    for rank in range(base + 1, base + replica):
        p = ctx.Process(target=_worker_entry, daemon=True,
                        args=(config_bytes, rank, init_method, rank - base, plans.handle, time.time()))
        p.start()
        procs.append(p)
    return WorkerProcs(procs, plans, init_method)


def _worker_entry(config_bytes: bytes, rank: int, init_method: str, local_rank: int, plans: tuple,
                  spawned_at: float) -> None:
    from longserve.worker.worker import worker_main
    worker_main(pickle.loads(config_bytes), rank, init_method, local_rank, plans, spawned_at)
