"""One process per rank: join the process groups, load the model, size the KV cache, run steps."""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from longserve.config import EngineConfig
from longserve.distributed.parallel_state import build_parallel_state, close_process_groups
from longserve.distributed.shm_broadcast import ShmRingBuffer
from longserve.stalls import freeze_after_warm_up
from longserve.startup import Timeline
from longserve.step_plan import SchedulerOutput
from longserve.worker.model_runner import ModelRunner
from longserve.worker.step_sampler import ModelRunnerOutput
from longserve.worker.step_trace import StepTrace
from longserve.worker.piecewise_graphs import piecewise_pool_bytes
from longserve.worker.utils import MemorySnapshot, request_memory

SHUTDOWN = "shutdown"
BITMASK = "bitmask"  # (BITMASK, bitmask): sample the step before with it (rank 0 in its own process)
JOIN_TIMEOUT_S = 60.0  # the least time a spawned process gets to start and join


def rendezvous(init_method: str, rank: int, world: int, timeout_s: float,
               alive_check: Callable[[], None] | None = None) -> dist.Store:
    """The TCP store every rank joins (rank 0 hosts it and polls for the others' hellos every 50 ms,
    calling `alive_check` between polls, so a rank that dies before joining fails start-up at once).
    Joining may take JOIN_TIMEOUT_S: a new process imports torch first."""
    url = urlparse(init_method)
    store = dist.TCPStore(url.hostname, url.port, world, is_master=rank == 0,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    if rank != 0:
        store.set(f"hello/{rank}", "1")
        return store
    join_s = max(timeout_s, JOIN_TIMEOUT_S)
    keys, deadline = [f"hello/{r}" for r in range(1, world)], time.monotonic() + join_s
    while not store.check(keys):
        if alive_check is not None:
            alive_check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers did not join within {join_s:.0f} s")
        time.sleep(0.05)
    return store


def limit_cpu_threads(local_ranks: int) -> None:
    """Give this rank its share of the cores this process may use, less one for the front end: every
    step's parallel regions wait for the slowest thread (one per core: much slower beside a busy
    process). Never raises the count; OMP_NUM_THREADS set: the user chose."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, min(torch.get_num_threads(), ((cores or 1) - 1) // local_ranks)))


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None,
                 local_rank: int | None = None, alive_check: Callable[[], None] | None = None,
                 timeline: Timeline | None = None):
        self.config, self.rank, self.store = config, rank, None
        self.timeline = timeline or Timeline()
        world = config.parallel.world_size
        limit_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if config.device == "cuda":
            local_rank = rank % max(torch.cuda.device_count(), 1) if local_rank is None else local_rank
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            self.init_snapshot = MemorySnapshot.measure(self.device)
            self.timeline.mark("CUDA context")
        else:
            self.device = torch.device("cpu")
        if world > 1 and not dist.is_initialized():
            timeout = config.parallel.distributed_timeout_s
            where = dict(init_method=init_method)
            if init_method.startswith("tcp://"):  # spawned here; torchrun's env:// joins as is
                # kept until close(): rank 0 hosts it, the others may use it while groups close
                self.store = rendezvous(init_method, rank, world, timeout, alive_check)
                where = dict(store=self.store)
            dist.init_process_group("nccl" if config.device == "cuda" else "gloo", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=timeout),
                                    **where)
            self.timeline.mark("rendezvous")  # rank 0: until the last rank has imported torch
        self.ps = build_parallel_state(config.parallel, rank)
        self.timeline.mark("process groups")
        self.cudagraph_capture_s: float | None = None
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.ps, self.device)
        self.timeline.mark("weights")
        self.trace = StepTrace(rank, self.device)

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
            raise ValueError(
                f"the KV cache has room for no block (one block of block_size={cache.block_size} needs "
                f"{self.runner.kv_bytes_per_block()} bytes a rank); raise cpu_kv_cache_gb / "
                "gpu_memory_utilization or lower block_size")
        self.timeline.mark("KV sizing")
        return n

    def _cuda_num_blocks(self) -> int:
        budget = request_memory(self.init_snapshot, self.config.cache)
        activation_peak = self.runner.profile_peak_memory()
        used_now = MemorySnapshot.measure(self.device).used  # weights, context, other processes
        graphs_reserve = 0 if self.config.enforce_eager else (512 << 20) + piecewise_pool_bytes(
            self.config, activation_peak)
        free_for_kv = budget - used_now - activation_peak - graphs_reserve
        return max(free_for_kv // self.runner.kv_bytes_per_block(), 0)

    def init_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.register_kv_caches(self.runner.kv_cache_dict, self.runner.kv_scales())
        self.timeline.mark("KV cache")
        if self.device.type == "cuda" and not self.config.enforce_eager:
            t0 = time.perf_counter()
            self.runner.capture_cudagraphs()
            self.cudagraph_capture_s = round(time.perf_counter() - t0, 2)
            self.timeline.mark("CUDA graphs")

    def ready_report(self, num_blocks: int, own_phases: bool = True) -> dict:
        """Rank 0's start-up report to its core: the KV pool, the devices, the ranks' phases (the
        others leave theirs in the store once ready; own_phases: rank 0's are not the core's)."""
        replica = self.config.parallel.replica_size
        ranks = {self.rank: self.timeline.phases} if own_phases else {}
        if self.store is not None:
            ranks |= {r: json.loads(self.store.get(f"startup/{r}"))
                      for r in range(self.rank + 1, self.rank + replica)}
        device = "cpu" if self.device.type != "cuda" else torch.cuda.get_device_name(self.device)
        return dict(num_blocks=num_blocks, cudagraph_capture_s=self.cudagraph_capture_s, ranks=ranks,
                    kv_bytes_per_block=self.runner.kv_bytes_per_block(), device_names=[device] * replica)

    def execute(self, out: SchedulerOutput, resolve: bool = True) -> ModelRunnerOutput | None:
        """resolve=False: return once the step is queued; output.resolve() waits for the ids."""
        self.trace.before_step()
        result = self.runner.execute(out)
        self.trace.after_step()
        return result.resolve() if resolve and result is not None else result

    def close(self, release: bool = True) -> None:
        """Drop the model, KV cache and graphs so the device memory is free for the next engine
        (and no graph holds an NCCL communicator: see close_process_groups); `release`: free the
        memory now (not while a step on another thread uses it)."""
        if self.runner is not None and hasattr(self.runner.kv_connector, "close"):
            self.runner.kv_connector.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay in flight while its graph goes
        if self.runner is not None:  # the graphs go now even if something still holds the runner
            self.runner.graphs = self.runner.piecewise = None
            if release:
                release_memory(self.runner)
        self.runner = self.ps = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def release_memory(runner) -> None:
    """Free the KV caches (on a GPU the weights too) whatever still holds them: an engine's objects
    may outlive it (a caller's reference, a thread); the next engine checks the free memory."""
    tensors = list(runner.kv_cache_dict.values())
    if runner.device.type == "cuda":
        tensors += [*runner.model.parameters(), *runner.model.buffers()]
    for t in tensors:
        with contextlib.suppress(RuntimeError):  # a storage not resizable (e.g. borrowed): left to gc
            t.untyped_storage().resize_(0)


def exit_with_parent(poll_s: float = 0.5) -> None:
    """End this process when its parent is gone, even by SIGKILL (a thread watches the pid)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="longserve-parent-watch", daemon=True).start()


def worker_main(config: EngineConfig, rank: int, init_method: str,
                local_rank: int | None = None, plans: tuple | None = None,
                spawned_at: float | None = None, results: tuple | None = None) -> None:
    """Entry of a worker: follow the driver's steps until SHUTDOWN. `plans`: (the handle of the
    driver's ring, this rank's reader) when spawned on its host, else plans come by gloo (torchrun);
    `results`: rank 0 in a process of its own sends the core its outputs. Phases go to the store."""
    timeline = Timeline(spawned_at)
    timeline.mark("process start + imports")
    if os.environ.get("LONGSERVE_TEST_WORKER_EXIT") == str(rank):  # test hook: die before joining
        os._exit(7)
    # Ctrl-C reaches the whole process group: the driver decides (drain, then SHUTDOWN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()  # also ends a wait for the next plan whose writer is gone
    outbox = results and ResultSender(ShmRingBuffer.attach(results))
    try:
        ring = plans and ShmRingBuffer.attach(*plans)  # before joining: see _spawn
        worker = Worker(config, rank, init_method, local_rank, timeline=timeline)
        num_blocks = worker.determine_num_blocks()
        worker.init_cache(num_blocks)
        if worker.store is not None:
            worker.store.set(f"startup/{rank}", json.dumps(timeline.phases))
        if outbox is not None:
            outbox.send(worker.ready_report(num_blocks))
        run_worker_loop(worker, ring, outbox)
    except Exception as e:
        traceback.print_exc()
        sys.stderr.flush()
        if outbox is not None:  # the core raises it (the watchdog would only see an exit code)
            outbox.send(WorkerFailure(f"{type(e).__name__}: {e}"), flush_s=2.0)
        os._exit(1)  # peers see the closed connection at once instead of waiting for a timeout
    # the goodbye: the model and its CUDA graphs first (NCCL frees a communicator only once no graph
    # that captured it is left), then all ranks close their groups together (a collective teardown)
    worker.close()
    close_process_groups(peers_present=True)


def run_worker_loop(worker: Worker, plans: ShmRingBuffer | None = None,
                    outbox: "ResultSender | None" = None) -> None:
    freeze_after_warm_up()
    waiting = None  # rank 0 in its own process: a step's output waiting for its grammar bitmask
    while True:  # no timeout on a plan: the engine may idle; the driver watches its workers
        out = worker.ps.model.broadcast_object(None) if plans is None else plans.dequeue()
        if out == SHUTDOWN:
            return
        if isinstance(out, tuple):  # (BITMASK, the bitmask) of the step before (only rank 0 samples)
            if outbox is not None:
                worker.runner.sampling.sample_deferred(waiting, out[1])
                outbox.send(waiting)
            continue
        # asynchronous scheduling: queue the step, take the next plan (ids reach it on the device)
        result = worker.execute(out, resolve=not worker.config.scheduler.async_scheduling)
        if worker.runner.kv_connector is not None:  # the driver unites the connectors' reports
            worker.ps.model.gather_object(result)
        elif outbox is not None and result is not None and result.deferred is not None:
            waiting = result
        elif outbox is not None:
            outbox.send(result)


@dataclass
class WorkerFailure:
    """Why rank 0's process (its own, not the core's) ends: the core raises it."""
    message: str


class ResultSender:
    """Rank 0 in a process of its own: a thread sends each step's output to the core once its ids
    are on the host, while the next step is launched (the ids' event wait releases the GIL)."""

    def __init__(self, ring: ShmRingBuffer):
        self.ring, self.queue = ring, queue.SimpleQueue()
        # a short switch interval: the ids' event hands this thread the GIL at once (else <= 5 ms)
        sys.setswitchinterval(min(sys.getswitchinterval(), 2e-4))
        threading.Thread(target=self._run, name="longserve-results", daemon=True).start()

    def send(self, message, flush_s: float = 0.0) -> None:
        """Queue `message` (a ModelRunnerOutput, None, a start-up report or a WorkerFailure); flush_s:
        wait that long for it to leave."""
        self.queue.put(message)
        if flush_s:
            left = threading.Event()
            self.queue.put(left)
            left.wait(flush_s)

    def _run(self) -> None:
        while True:
            message = self.queue.get()
            if isinstance(message, threading.Event):
                message.set()
                continue
            try:
                if isinstance(message, ModelRunnerOutput):
                    message.resolve()
                self.ring.enqueue(message)  # (no timeout: exit_with_parent ends a wait on a gone core)
            except BaseException:  # the core would wait for this step's output: end at once
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
