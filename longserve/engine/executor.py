"""Drive the workers of one model replica from the engine process.

The engine process is rank 0 and runs its own worker in-process. With more ranks on
this host it spawns one process per other rank; each step the plan is broadcast over a
gloo group and every rank runs it. A watchdog notices a dead worker: the driver's next
(or current) collective fails fast, and the error names the rank and its exit code.
Under torchrun every rank already exists: ranks other than 0 enter the worker loop.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import torch.multiprocessing as mp

from longserve.config import EngineConfig
from longserve.step_plan import DPStepPlan, SchedulerOutput
from longserve.worker.model_runner import ModelRunnerOutput
from longserve.worker.worker import SHUTDOWN, Worker, worker_main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


class Executor:
    """Owns rank 0's worker and, when world_size > 1, the other ranks' processes."""

    def __init__(self, config: EngineConfig):
        self.config = config
        world = config.parallel.world_size
        self.procs: list = []
        self.failure: str | None = None
        self._closing = False
        try:
            if world == 1:
                self.driver = Worker(config)
            elif launched_by_torchrun():
                self.driver = self._join_torchrun(config, world)
            else:
                self.driver = self._spawn(config, world)
            self.num_blocks = self.driver.determine_num_blocks()
            self.driver.init_cache(self.num_blocks)
        except BaseException:
            self._closing = True  # a failed start leaves no worker behind
            self._kill_all()
            raise

    def _spawn(self, config: EngineConfig, world: int) -> Worker:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        for rank in range(1, world):
            p = ctx.Process(target=worker_main, args=(config, rank, init_method), daemon=True)
            p.start()
            self.procs.append(p)
        threading.Thread(target=self._watch, daemon=True).start()
        return Worker(config, 0, init_method, alive_check=self._raise_if_failed)

    def _raise_if_failed(self) -> None:
        if self.failure:
            raise RuntimeError(f"{self.failure} while the engine was starting")

    def _join_torchrun(self, config: EngineConfig, world: int) -> Worker:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes; the parallel "
                             f"config needs {world}")
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
        if rank != 0:
            worker_main(config, rank, "env://", local)
            raise SystemExit(0)  # a worker's job ends with the driver's shutdown
        return Worker(config, 0, "env://", local)

    def _watch(self) -> None:
        """Poll the children (only this thread reaps them); when one dies, record why and
        stop the rest."""
        while not self.failure and not self._closing:
            for rank, p in enumerate(self.procs, start=1):
                p.join(timeout=0.2)
                if p.exitcode is not None and not self._closing:
                    self.failure = f"worker rank {rank} died (exit code {p.exitcode})"
                    self._kill_all()
                    return

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def execute(self, out: SchedulerOutput | DPStepPlan) -> ModelRunnerOutput | None:
        if self.failure:
            raise RuntimeError(self.failure)
        try:
            self.driver.ps.world.broadcast_object(out)  # the model group when dp == 1
            return self.driver.execute(out)
        except Exception as e:
            # a peer's closed connection usually means it died: give the watchdog a moment
            deadline = time.monotonic() + 5.0
            while self.procs and self.failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.failure:
                raise RuntimeError(f"{self.failure}; the engine cannot continue") from e
            raise

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.config.parallel.world_size > 1 and not self.failure:  # spawned or torchrun
            try:
                self.driver.ps.world.broadcast_object(SHUTDOWN)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
        self._kill_all()
        self.driver.close()
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
