"""One process per rank: join the process groups, load the model, size the KV cache, run steps."""
from __future__ import annotations

import datetime
import gc
import os
import sys
import time
import traceback
from typing import Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from longserve.config import EngineConfig
from longserve.distributed.parallel_state import build_parallel_state
from longserve.step_plan import DPStepPlan, SchedulerOutput
from longserve.worker.dp_step import execute_dp_step
from longserve.worker.model_runner import ModelRunner, ModelRunnerOutput
from longserve.worker.utils import MemorySnapshot, request_memory

SHUTDOWN = "shutdown"


def rendezvous(init_method: str, rank: int, world: int, timeout_s: float,
               alive_check: Callable[[], None] | None = None) -> dist.Store:
    """The TCP store every rank joins (rank 0 hosts it). Each other rank says hello; rank 0
    waits for the hellos in one-second rounds and calls `alive_check` between them, so a rank
    that dies before joining fails start-up at once instead of after the whole timeout."""
    url = urlparse(init_method)
    store = dist.TCPStore(url.hostname, url.port, world, is_master=rank == 0,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    if rank != 0:
        store.set(f"hello/{rank}", "1")
        return store
    keys, deadline = [f"hello/{r}" for r in range(1, world)], time.monotonic() + timeout_s
    while True:
        if alive_check is not None:
            alive_check()
        try:
            store.wait(keys, datetime.timedelta(seconds=1))
            return store
        except RuntimeError as e:  # DistStoreError: not all there yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not join within {timeout_s:.0f} s") from e


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None,
                 local_rank: int | None = None, alive_check: Callable[[], None] | None = None):
        self.config, self.rank = config, rank
        world = config.parallel.world_size
        if config.device == "cuda":
            local_rank = rank % max(torch.cuda.device_count(), 1) if local_rank is None else local_rank
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            self.init_snapshot = MemorySnapshot.measure(self.device)
        else:
            self.device = torch.device("cpu")
        if world > 1 and not dist.is_initialized():
            timeout = config.parallel.distributed_timeout_s
            where = dict(init_method=init_method)
            if init_method.startswith("tcp://"):  # spawned here; torchrun's env:// joins as is
                where = dict(store=rendezvous(init_method, rank, world, timeout, alive_check))
            dist.init_process_group("nccl" if config.device == "cuda" else "gloo", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=timeout),
                                    **where)
        self.ps = build_parallel_state(config.parallel, rank)
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.ps, self.device)

    def determine_num_blocks(self) -> int:
        """KV blocks every rank can hold (the minimum over ranks: one block id space)."""
        cache = self.config.cache
        if cache.num_blocks is not None:
            n = cache.num_blocks
        elif self.device.type == "cuda":
            n = self._cuda_num_blocks()
        else:
            n = cache.cpu_kv_cache_bytes // self.runner.kv_bytes_per_block()
        if self.config.parallel.world_size > 1:
            t = torch.tensor([n], device=self.device if self.device.type == "cuda" else "cpu")
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            n = int(t.item())
        if n < 1:
            per_block = self.runner.kv_bytes_per_block()
            raise ValueError(
                f"the KV cache has room for no block (one block of block_size={cache.block_size} "
                f"needs {per_block} bytes a rank); raise cpu_kv_cache_gb / gpu_memory_utilization "
                "or lower block_size")
        return n

    def _cuda_num_blocks(self) -> int:
        budget = request_memory(self.init_snapshot, self.config.cache)
        activation_peak = self.runner.profile_peak_memory()
        used_now = MemorySnapshot.measure(self.device).used  # weights, context, other processes
        graphs_reserve = 0 if self.config.enforce_eager else 512 << 20
        free_for_kv = budget - used_now - activation_peak - graphs_reserve
        return max(free_for_kv // self.runner.kv_bytes_per_block(), 0)

    def init_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        if self.device.type == "cuda" and not self.config.enforce_eager:
            self.runner.capture_cudagraphs()

    def execute(self, out: SchedulerOutput | DPStepPlan) -> ModelRunnerOutput | None:
        if isinstance(out, DPStepPlan):  # data parallel: every DP rank's plan
            return execute_dp_step(self, out)
        return self.runner.execute(out)

    def close(self) -> None:
        """Drop the model, KV cache and graphs so the device memory is free for the next engine."""
        self.runner = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def worker_main(config: EngineConfig, rank: int, init_method: str,
                local_rank: int | None = None) -> None:
    """Entry of a spawned worker: follow the driver's steps until it says shutdown."""
    if os.environ.get("LONGSERVE_TEST_WORKER_EXIT") == str(rank):  # test hook: die before joining
        os._exit(7)
    try:
        worker = Worker(config, rank, init_method, local_rank)
        worker.init_cache(worker.determine_num_blocks())
        run_worker_loop(worker)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # peers see the closed connection at once instead of waiting for a timeout
    dist.destroy_process_group()


def run_worker_loop(worker: Worker) -> None:
    while True:
        out = worker.ps.world.broadcast_object(None)
        if out == SHUTDOWN:
            return
        worker.execute(out)
