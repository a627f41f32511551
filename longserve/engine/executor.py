"""Drive one model replica's workers from the engine process; failures end in bounded time with an
error naming the rank (placement, teardown: docs/architecture.md, 'Layers', executor.py)."""
from __future__ import annotations

import atexit
import contextlib
import datetime
import pickle
import logging
import os
import signal
import threading
import time
import weakref
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from longserve.config import EngineConfig
from longserve.distributed.parallel_state import close_process_groups, launched_by_torchrun
from longserve.distributed.shm_broadcast import ShmRingBuffer
from longserve.kv_transfer.utils import KVOutputAggregator
from longserve.startup import Timeline
from longserve.step_plan import SchedulerOutput
from longserve.worker.launch import WorkerProcs, free_port, start_workers  # noqa: F401 (free_port)
from longserve.worker.step_sampler import ModelRunnerOutput
from longserve.worker.worker import BITMASK, SHUTDOWN, Worker, WorkerFailure, worker_main

logger = logging.getLogger(__name__)
_live: weakref.WeakSet = weakref.WeakSet()  # multi-rank executors not shut down yet


@atexit.register  # runs before multiprocessing's own exit hook (atexit is last-in, first-out)
def shutdown_all() -> None:
    for executor in list(_live):
        executor.shutdown()


def process_state(pid: int) -> str:
    """One letter of /proc/<pid>/stat: R running, S sleeping, T stopped, Z zombie; '?' if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


class Executor:
    """Owns the replica's first rank (here, or with rank0_own_process in its own process: `driver`
    is None, `results` brings its outputs) and the other ranks' processes. An expert model's DP
    ranks share one world, `init_method`'s: this replica's are base .. base + replica_size - 1."""

    def __init__(self, config: EngineConfig, init_method: str | None = None,
                 timeline: Timeline | None = None, started: WorkerProcs | None = None):
        self.config, self.world = config, config.parallel.world_size
        self.timeline = timeline or Timeline()
        self.started = started  # workers its process started before importing torch
        self.base = config.parallel.data_parallel_rank * config.parallel.replica_size
        self.init_method = init_method
        self.timeout = config.parallel.distributed_timeout_s
        self.procs: list = []
        self.driver: Worker | None = None
        self.failure: str | None = None
        self.plans: ShmRingBuffer | None = None  # the plan to the spawned workers
        self.results: ShmRingBuffer | None = None  # rank 0's outputs (its own process)
        self.ready: dict = {}  # rank 0's start-up report (Worker.ready_report)
        self.cores_group = None  # expert DP: the DP cores' own gloo group (the waves' end check)
        self.port: int | None = None
        self._closing, self._step = False, 0
        self._step_lock = threading.RLock()  # held in a step: teardown frees no memory under one
        self._owns_groups, self._threads = False, None
        self._torchrun = self.world > 1 and launched_by_torchrun()
        self.own = own = config.parallel.rank0_own_process
        if self.world > 1 and not self._torchrun and not own:
            make_room_for_process_group()  # (first: the engine it shuts down restores its threads)
        self._threads = torch.get_num_threads()  # restored at shutdown
        self._owns_groups = self.world > 1 and not own
        try:
            with self._waiting_for("the engine was starting"):
                if self.world == 1 and not own:
                    self.driver = Worker(config, timeline=self.timeline)
                elif self._torchrun:
                    self.driver = self._join_torchrun(config)
                else:
                    self.driver = self._spawn(config)
                if not own:
                    num_blocks = self.driver.determine_num_blocks()
                    self.driver.init_cache(num_blocks)
                    self.ready = self.driver.ready_report(num_blocks, own_phases=False)
            self.num_blocks = self.ready["num_blocks"]
            connector = None if own else self.driver.runner.kv_connector
            # every rank of the replica holds part of each request's KV (TP x PCP; DCP is in TP)
            self.kv_aggregator = None if connector is None else \
                KVOutputAggregator.from_connector(connector, self.driver.ps.model.world_size)
        except BaseException:
            self._teardown()  # a failed start leaves no worker, group or port behind
            raise
        if self.world > 1 or self.procs:
            _live.add(self)

    @property
    def worker_ranks(self) -> range:
        """The global ranks of this replica's spawned workers (procs[i] is worker_ranks[i])."""
        first = self.base if self.own else self.base + 1
        return range(first, self.base + self.config.parallel.replica_size)

    def _spawn(self, config: EngineConfig) -> Worker | None:
        w = self.started or start_workers(pickle.dumps(config), self.base, config.parallel.replica_size,
                                          self.init_method, rank0=config.parallel.rank0_own_process)
        self.procs, self.plans, self.results = w.procs, w.plans, w.results
        self.port = int(w.init_method.rsplit(":", 1)[1])  # the rendezvous (free again after shutdown)
        self._watchdog = threading.Thread(target=watch, args=(weakref.ref(self),), daemon=True)
        self._watchdog.start()
        driver = None
        if not self.own:
            driver = Worker(config, self.base, w.init_method, 0, alive_check=self._raise_if_failed,
                            timeline=self.timeline)
        else:  # rank 0 reports once every rank is ready
            self.ready = self._take_result()
            self.timeline.mark("workers")
            self.results.unlink()
        if config.dp_lockstep:  # (the world's store exists once rank 0 has joined)
            self.cores_group = cores_group(w.init_method, config.parallel, self.timeout)
        if self.plans is not None:
            self.plans.unlink()  # every worker attached before it joined: no name left to leak
        return driver

    def any_across_dp(self, flag: bool) -> bool:
        """Lockstep DP: whether any DP rank's core says so (an all-reduce over the cores)."""
        t, options = torch.tensor([int(flag)]), dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self.cores_group.allreduce([t], options).wait()
        return bool(t.item())

    def _take_result(self):
        """Rank 0's next message from its own process (a step's output, or its start-up report)."""
        message = self.results.dequeue(self.timeout, self._raise_if_failed)
        if isinstance(message, WorkerFailure):
            self.failure = f"worker rank {self.base} failed: {message.message}"
            raise RuntimeError(self.failure)
        return message

    def _raise_if_failed(self) -> None:
        if self.failure:
            raise RuntimeError(self.failure)

    def _join_torchrun(self, config: EngineConfig) -> Worker:
        if int(os.environ["WORLD_SIZE"]) != self.world:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes; the parallel "
                             f"config needs {self.world}")
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
        if rank != 0:
            worker_main(config, rank, "env://", local)
            raise SystemExit(0)  # a worker's job ends with the driver's shutdown
        return Worker(config, 0, "env://", local)

    @contextlib.contextmanager
    def _waiting_for(self, what: str):
        """Explain a failure while rank 0 waits for `what` (naming the rank to blame)."""
        try:
            yield
        except Exception as e:
            if self.world == 1 and not self.own:
                raise
            deadline = time.monotonic() + 2.0  # a closed connection: let the watchdog see who died
            while self.procs and self.failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            timed_out = "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()
            if self.failure is None and timed_out:
                self.failure = self._unresponsive(what)
            if self.failure is None:
                raise
            where = "" if self.failure.endswith(what) else f" while {what}"
            raise RuntimeError(f"{self.failure}{where}; the engine cannot continue") from e

    def _unresponsive(self, what: str) -> str:
        """The failure naming the workers to blame: stopped ones, else those behind the plan."""
        stopped = [r for r, p in zip(self.worker_ranks, self.procs) if process_state(p.pid) == "T"]
        behind = [self.worker_ranks[r] for r in (self.plans.behind() if self.plans else [])]
        ranks = (", ".join(map(str, stopped)) + " (its process is stopped)" if stopped
                 else ", ".join(map(str, behind or self.worker_ranks)))
        return f"worker rank {ranks} did not respond within {self.timeout:g} s while {what}"

    def execute_async(self, out: SchedulerOutput) -> "PendingStep":
        """Launch a step: every rank gets its plan, rank 0's kernels are queued; see PendingStep."""
        if self.failure:
            raise RuntimeError(f"{self.failure}; this engine cannot run: build a new LLM")
        if self._closing:
            raise RuntimeError("the engine was shut down; build a new LLM")
        with defer_interrupt():  # a Ctrl-C lands after the step, with every rank in step
            self._step += 1
            if self.world > 1 or self.own:
                self._in_step(f"taking the plan of step {self._step}", self._send_plan, out)
            output = None if self.own else \
                self._in_step(f"running step {self._step}", self.driver.execute, out, False)
            return PendingStep(self, self._step, output)

    def wait_for_kv_progress(self, timeout_s: float) -> None:
        """While only KV transfers are in flight: until this rank's connector reports progress (a
        load ended, a pull was served), at most timeout_s (other ranks' connectors are polled)."""
        event = None if self.own else getattr(self.driver.runner.kv_connector, "progress", None)
        if event is None:
            time.sleep(timeout_s)
            return
        event.wait(timeout_s)
        event.clear()  # (a later set is seen by the next wait; what it reports, by the next step)

    def _send_plan(self, plan) -> None:
        if self.plans is None:  # torchrun (ranks perhaps on other hosts), or no worker
            self.driver.ps.model.broadcast_object(plan)
        else:
            self.plans.enqueue(plan, self.timeout, self._raise_if_failed)

    def _in_step(self, what: str, fn, *args):
        """fn(*args) inside a launched step: a failure stops the ranks (they fell out of step)."""
        with defer_interrupt(), self._step_lock:
            try:
                with self._waiting_for(what):
                    return fn(*args)
            except BaseException as e:
                self._fell_out_of_step(e)
                raise

    def _fell_out_of_step(self, e: BaseException) -> None:
        """The other ranks are somewhere inside the step: stop them."""
        if self.world > 1 or self.own:
            self.failure = self.failure or (f"step {self._step} was cut short on rank 0 by "
                                            f"{type(e).__name__} (the ranks fell out of step; "
                                            "the workers were stopped)")
            self._teardown()

    def _aggregate(self, result):
        """With a KV connector: every rank's report, united (KV transfer runs with dp == 1)."""
        if self.kv_aggregator is None:
            return result
        return self.kv_aggregator.aggregate(self.driver.ps.model.gather_object(result))

    def shutdown(self) -> None:
        """Stop the workers and free the groups, ports and memory; idempotent. All ranks close their
        groups together (NCCL's teardown is collective); a worker left after min(timeout, 10 s) is killed."""
        if self._closing:
            return
        self._closing = True
        goodbye = False
        if (self.own or self.world > 1 and self.driver is not None) and self.failure is None:
            with contextlib.suppress(Exception):
                self._send_plan(SHUTDOWN)
                goodbye = True
        self._teardown(peers_present=goodbye)

    def _teardown(self, peers_present: bool = False) -> None:
        """Without every rank present (a failure, a failed start) the workers are killed first
        and the groups aborted: nothing waits for a rank that is gone."""
        self._closing = True
        _live.discard(self)
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join(timeout=2)
        if not peers_present:
            kill_and_reap(self.procs)
        if self.driver is not None:  # first: NCCL frees a communicator once no CUDA graph holds it
            idle = self._step_lock.acquire(timeout=1.0)  # else a step runs on another thread
            self.driver.close(release=idle)  # (held if it raises: no step may start anyway)
            if idle:
                self._step_lock.release()
        if self._owns_groups:
            close_process_groups(peers_present)
        if self.driver is not None:
            self.driver.store = None  # rank 0 hosts the rendezvous store: its port is free again
        if peers_present:
            reap(self.procs, min(self.timeout, 10.0))
        for ring in (self.plans, self.results):
            if ring is not None:
                ring.close()
        self.plans = self.results = None
        if self._threads is not None:
            torch.set_num_threads(self._threads)

    def __del__(self):  # an engine dropped without shutdown() (the atexit hook holds no reference)
        with contextlib.suppress(Exception):
            self.shutdown()


class PendingStep:
    """A launched step; result() waits for its sampled ids, watched like any wait on the other ranks."""

    def __init__(self, executor: Executor, step: int, output: ModelRunnerOutput | None):
        self.executor, self.step, self.output = executor, step, output
        self.deferred = False  # its sampling waits for a grammar bitmask (the core says)

    def sample(self, bitmask: tuple) -> None:
        """A structured step: sample with the grammar bitmask (rank 0 samples and broadcasts the ids)."""
        ex, what = self.executor, f"sampling step {self.step}"
        if ex.own:  # rank 0 in its own process: the bitmask goes the plan's way
            ex._in_step(what, ex._send_plan, (BITMASK, bitmask))
        else:
            ex._in_step(what, ex.driver.runner.sampling.sample_deferred, self.output, bitmask)

    def result(self) -> ModelRunnerOutput | None:
        ex = self.executor
        if ex.own:
            return ex._in_step(f"running step {self.step}", ex._take_result)
        return ex._in_step(f"running step {self.step}",
                           lambda: ex._aggregate(None if self.output is None else self.output.resolve()))


@contextlib.contextmanager
def defer_interrupt():
    """Hold a Ctrl-C (SIGINT) until the block ends: a step must finish on every rank or the
    ranks fall out of step. A second Ctrl-C interrupts at once. Main thread only (signals)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pending = []

    def hold(signum, frame):
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt


def kill_and_reap(procs: list) -> None:
    """SIGKILL (it ends a stopped process too) every live worker, then wait for each."""
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join(timeout=5)


def reap(procs: list, timeout_s: float) -> None:
    """Wait for the workers to exit by themselves; kill (and name) any still there after timeout_s."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0.01))
    failed = [(p.pid, p.exitcode) for p in procs if p.exitcode not in (0, None)]
    if failed:
        logger.warning("worker processes exited with an error (pid, exit code): %s", failed)
    stuck = [p for p in procs if p.exitcode is None]
    if stuck:
        logger.warning("worker processes %s did not exit within %.0f s; killing them",
                       [p.pid for p in stuck], timeout_s)
        kill_and_reap(stuck)


def cores_group(init_method: str, par, timeout_s: float):
    """The DP cores' own gloo group (not in the workers' world): the world's store, under a prefix."""
    url, timeout = urlparse(init_method), datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(url.hostname, url.port, is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("cores", store), par.data_parallel_rank,
                                 par.data_parallel_size, timeout)


def make_room_for_process_group() -> None:
    """torch.distributed has one default group a process: shut down the engine holding it."""
    for old in list(_live):
        if not old._torchrun:
            logger.warning("a multi-process engine is already running in this process; shutting "
                           "it down (one at a time: call LLM.shutdown() or use `with LLM(...)`)")
            old.shutdown()
            old.failure = old.failure or "this engine was shut down when a newer one was built"
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process (not by "
                           "LongServe); call torch.distributed.destroy_process_group() first, "
                           "or launch every rank with torchrun")


def watch(ref: weakref.ref) -> None:
    """The watchdog (the only reaper while the engine runs): a dead worker records the failure and
    kills the others so that rank 0's pending collective fails at once."""
    while True:
        ex = ref()
        # no children (a DP rank of an expert model is a replica of one rank): nothing to watch,
        # and the loop below would spin holding the GIL (it starved CUDA-graph capture)
        if ex is None or ex.failure or ex._closing or not ex.procs:
            return
        for p in ex.procs:
            p.join(timeout=0.1)
        dead = [(p.exitcode, rank) for rank, p in zip(ex.worker_ranks, ex.procs) if p.exitcode is not None]
        if dead and not ex._closing:  # one killed by a signal is the cause, not those it took down
            code, rank = min(dead, key=lambda d: (d[0] >= 0, d[1]))
            ex.failure = f"worker rank {rank} died (exit code {code})"
        if ex.failure:
            for p in ex.procs:
                if p.exitcode is None:
                    p.kill()
            return
        del ex
