"""Run a function on N CPU processes joined by a gloo process group (forked from a
forkserver that has torch imported, so each run costs well under a second).

    results = run_distributed(fn, world_size, *args)   # [fn(0, N, *args), fn(1, N, *args), ...]

`fn` must be importable by the children (a module-level function of a test module).
A child's exception is re-raised in the parent with the child's traceback; a child that
hangs fails the call after `timeout` seconds; every child is stopped before returning.
"""
from __future__ import annotations

import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    """A forkserver that imported torch once: each run forks from it instead of paying the
    torch import per process (seconds on a small CPU machine). Falls back to spawn."""
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy"])
    return ctx


def _worker(rank: int, world_size: int, port: int, timeout: float, results, fn, args) -> None:
    torch.set_num_threads(1)  # N processes share a few cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        value = fn(rank, world_size, *args)
        pickle.dumps(value)  # fail here, with a traceback, if the result cannot travel
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """fn(rank, world_size, *args) on `world_size` processes; returns their results by rank."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, timeout, results, fn, args),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    ok = False
    try:
        out = _collect(results, procs, world_size, timeout)
        ok = True
        return out
    finally:
        _stop(procs, grace_s=5.0 if ok else 0.0)


def _collect(results, procs, world_size: int, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    out: dict[int, object] = {}
    while len(out) < world_size:
        try:
            rank, ok, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"distributed worker died with exit code {dead[0].exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test did not finish in {timeout:.0f}s "
                                   f"(ranks done: {sorted(out)})")
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
        out[rank] = value
    return [out[r] for r in range(world_size)]


def _stop(procs, grace_s: float) -> None:
    """Join, then terminate what is left (a rank stuck in a collective after another failed)."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()

