"""The front end's handle on its engine cores: `MPClient` (core processes over ZeroMQ) and
`InprocClient` (a core on a thread). docs/architecture.md, 'Engine cores and the front end'."""
from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import queue
import select
import subprocess
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch  # (loaded already: config.py imports it)

from longserve.config import EngineConfig
from longserve.engine.core_launch import start_core_process
from longserve.engine.core_proc import CoreAddresses, EngineCoreProc
from longserve.engine.executor import free_port
from longserve.engine.messages import (ABORT, ADD, SHUTDOWN, UTILITY, WAVE, EngineCoreOutputs,
                                       decode_any, decode_outputs, encode, unpack_result)
from longserve.startup import use_kernel_cache

logger = logging.getLogger("longserve.engine")
HEARTBEAT_TIMEOUT_S = 30.0  # a core heard from within this is alive (it beats every second)
START_TIMEOUT_S = 1800.0  # loading weights and capturing graphs of a large model takes a while
_live: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for client in list(_live):
        client.shutdown()


def core_config(config: EngineConfig, dp_rank: int) -> EngineConfig:
    """A core's copy of the config: dense models' cores are independent replicas (dp = 1 each);
    expert models' cores keep dp and know their rank (one torch.distributed world)."""
    par = config.parallel
    par = (replace(par, data_parallel_rank=dp_rank) if config.dp_lockstep
           else replace(par, data_parallel_size=1, data_parallel_rank=0))
    kvt = config.kv_transfer
    if kvt.kv_role is not None:  # its workers copy the config before the core hosts its KV store
        kvt = replace(kvt, engine_id=kvt.engine_id or uuid.uuid4().hex[:12],
                      kv_port=kvt.kv_port or (0 if kvt.kv_role == "kv_consumer" else free_port()))
    return replace(config, parallel=par, kv_transfer=kvt)


def core_gpus(config: EngineConfig, num_local_cores: int) -> list[list[str]] | None:
    """Each local engine core's GPUs: core i takes the i-th run of replica_size of the visible ones
    (in CUDA_VISIBLE_DEVICES' order, indices or UUIDs, else all; enough of them: the door checked)."""
    if config.device != "cuda":
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = ([d.strip() for d in listed.split(",") if d.strip()] if listed is not None
               else [str(i) for i in range(torch.cuda.device_count())])
    per_core = config.parallel.replica_size
    return [visible[i * per_core:(i + 1) * per_core] for i in range(num_local_cores)]


def dp_addresses(par) -> CoreAddresses:
    """Commands, outputs and an expert model's rendezvous on the rpc port and the next two."""
    host, port = par.data_parallel_address, par.data_parallel_rpc_port
    return CoreAddresses([f"tcp://{host}:{port}"], [f"tcp://{host}:{port + 1}"], f"tcp://{host}:{port + 2}")


def local_dp_ranks(par) -> range:
    local = par.data_parallel_size if par.data_parallel_size_local is None else par.data_parallel_size_local
    return range(par.data_parallel_start_rank, par.data_parallel_start_rank + local)


@dataclass
class FrontEnd:
    """One of several front ends (API-server processes) on cores another process started: its
    index into the addresses, and the pids of this host's cores by DP rank."""
    index: int
    addresses: CoreAddresses
    core_pids: dict[int, int]


class PidWatch:
    """A process this one did not start, watched through a pidfd: poll() as Popen's."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.returncode = "unknown"

    def poll(self):
        if self.returncode is None and select.select([self._fd], [], [], 0)[0]:
            self.returncode = "unknown"  # the exit status is its parent's to read
            os.close(self._fd)
        return self.returncode


def start_local_cores(config: EngineConfig, addresses: CoreAddresses) -> dict[int, subprocess.Popen]:
    """One process per core of this host, core i on the i-th run of the visible GPUs."""
    use_kernel_cache()  # the cores and their workers inherit it
    ranks = local_dp_ranks(config.parallel)
    gpus = core_gpus(config, len(ranks))
    return {d: start_core_process(core_config(config, d), d, addresses, gpus and gpus[i])
            for i, d in enumerate(ranks)}


class UtilityCalls:
    """Calls of EngineCore methods waiting for their answers (UtilityResult), by call id (ids
    start apart per front end: every front end hears every answer)."""

    def __init__(self, first_id: int = 0):
        self._waiting: dict[int, Future] = {}
        self._ids = itertools.count(first_id)

    def call(self, send, method: str, args: tuple, timeout: float):
        call_id, answer = next(self._ids), Future()
        self._waiting[call_id] = answer
        try:
            send((call_id, method, list(args)))
            return answer.result(timeout)  # a failed call: its RuntimeError
        except TimeoutError:
            raise TimeoutError(f"the engine core did not answer {method} in {timeout} s") from None
        finally:
            self._waiting.pop(call_id, None)

    def resolve(self, utility) -> None:  # (resolve and fail_all run on one thread: no race)
        answer = self._waiting.get(utility.call_id)
        if answer is not None and not answer.done():
            if utility.error is None:
                answer.set_result(unpack_result(utility.result))
            else:
                answer.set_exception(RuntimeError(utility.error))

    def fail_all(self, reason: str) -> None:
        for answer in list(self._waiting.values()):
            if not answer.done():
                answer.set_exception(RuntimeError(reason))


class MPClient:
    def __init__(self, config: EngineConfig, on_outputs, on_dead, front_end: FrontEnd | None = None):
        import zmq
        par = config.parallel
        self.num_cores = par.data_parallel_size
        self.on_outputs, self.on_dead, self.front_end = on_outputs, on_dead, front_end
        self.ctx = zmq.Context()
        self.router, self.pull = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.PULL)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.LINGER, 0)
        addresses = self._bind(par)
        self._send_lock = threading.Lock()
        self._calls = UtilityCalls(front_end.index << 32 if front_end else 0)
        self.dead: dict[int, str] = {}
        self.procs: dict[int, object] = {}
        self._closing = False
        self.last_heard = [time.monotonic()] * self.num_cores
        try:
            self.procs = ({d: PidWatch(pid) for d, pid in front_end.core_pids.items()} if front_end
                          else start_local_cores(config, addresses))
            self.infos = self._handshake(par.distributed_timeout_s)
        except BaseException:
            if front_end is None:
                stop_processes(self.procs.values(), timeout=5)
            self._close_sockets()
            raise
        self._reader = threading.Thread(target=self._read_loop, name="longserve-client", daemon=True)
        _live.add(self)

    def start(self) -> None:
        """Start reading outputs, once the caller can take them (another front end's wave may come)."""
        self._reader.start()

    def _bind(self, par) -> CoreAddresses:
        if self.front_end is not None:
            addresses, k = self.front_end.addresses, self.front_end.index
            self.router.bind(addresses.inputs[k])
            self.pull.bind(addresses.outputs[k])
            return addresses
        if par.data_parallel_rpc_port:  # fixed ports: cores of other hosts connect to them
            self.router.bind(f"tcp://*:{par.data_parallel_rpc_port}")
            self.pull.bind(f"tcp://*:{par.data_parallel_rpc_port + 1}")
            return dp_addresses(par)
        host = "127.0.0.1"
        cmd_port = self.router.bind_to_random_port(f"tcp://{host}")
        out_port = self.pull.bind_to_random_port(f"tcp://{host}")
        return CoreAddresses([f"tcp://{host}:{cmd_port}"], [f"tcp://{host}:{out_port}"],
                             f"tcp://{host}:{free_port()}")

    def _handshake(self, timeout_s: float) -> list[dict]:
        """Wait for every core's `ready` (what it holds), failing fast if one fails or dies."""
        import zmq
        infos: dict[int, dict] = {}
        deadline = time.monotonic() + max(timeout_s, START_TIMEOUT_S)
        while len(infos) < self.num_cores:
            if self.router.poll(100, zmq.POLLIN):
                identity, kind, payload = self.router.recv_multipart()
                index = int.from_bytes(identity, "big")
                if kind == b"failed":
                    raise RuntimeError(f"engine core {index} failed to start: "
                                       f"{decode_any(payload)}")
                infos[index] = decode_any(payload)
            for d, p in self.procs.items():
                if p.poll() is not None and d not in infos:
                    raise RuntimeError(f"engine core {d} died while starting (exit code {p.returncode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine cores {sorted(set(range(self.num_cores)) - set(infos))} "
                                   "did not start in time")
        return [infos[d] for d in range(self.num_cores)]

    def send(self, core: int, kind: bytes, payload) -> None:
        import zmq
        data = encode(payload)
        with self._send_lock:
            try:
                self.router.send_multipart([core.to_bytes(2, "big"), kind, data])
            except zmq.ZMQError as e:  # a core gone (ROUTER_MANDATORY) or the client closed
                raise RuntimeError(f"engine core {core} cannot be reached: {e}") from None

    def add_request(self, core: int, request) -> None:
        self.send(core, ADD, request)

    def abort(self, core: int, request_ids: list[str]) -> None:
        if core not in self.dead:
            self.send(core, ABORT, request_ids)

    def start_wave(self, wave: int) -> None:
        for core in range(self.num_cores):
            if core not in self.dead:
                self.send(core, WAVE, wave)

    def call(self, core: int, method: str, *args, timeout: float = 60.0):
        """Run EngineCore.<method>(*args) in core `core` and return its result."""
        if core in self.dead:
            raise RuntimeError(self.dead[core])
        return self._calls.call(lambda p: self.send(core, UTILITY, p), method, args, timeout)

    def _read_loop(self) -> None:
        import zmq
        try:
            while not self._closing:
                if self.pull.poll(100, zmq.POLLIN):
                    self._handle(decode_outputs(self.pull.recv()))
                self._check_cores()
        except zmq.ZMQError:
            if not self._closing:
                raise

    def _handle(self, msg: EngineCoreOutputs) -> None:
        self.last_heard[msg.engine_index] = time.monotonic()
        if msg.utility is not None:
            self._calls.resolve(msg.utility)
        if msg.failed is not None:
            self._mark_dead(msg.engine_index, f"engine core {msg.engine_index} failed: {msg.failed}")
            return
        self.on_outputs(msg)

    def _check_cores(self) -> None:
        now = time.monotonic()
        for d in range(self.num_cores):  # (a core already dead: _mark_dead ignores it)
            p = self.procs.get(d)
            if p is not None and p.poll() is not None:
                self._mark_dead(d, f"engine core {d} died (exit code {p.returncode})")
            elif p is None and now - self.last_heard[d] > HEARTBEAT_TIMEOUT_S:
                self._mark_dead(d, f"engine core {d} has not been heard from for "
                                   f"{HEARTBEAT_TIMEOUT_S:g} s")

    def _mark_dead(self, core: int, reason: str) -> None:
        if core in self.dead or self._closing:
            return
        self.dead[core] = reason
        self._calls.fail_all(reason)  # a call waits on one core: most likely this one
        self.on_dead(core, reason)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Tell every core to stop, wait for the local ones, kill any that lingers. Idempotent."""
        if self._closing:
            return
        ours = self.front_end is None  # else the cores are their starter's to stop
        for core in set(range(self.num_cores if ours else 0)) - set(self.dead):
            with contextlib.suppress(RuntimeError):
                self.send(core, SHUTDOWN, None)
        self._closing = True  # cores that now exit are not reported dead
        if ours:
            stop_processes(self.procs.values(), timeout)
        if self._reader.is_alive() and threading.current_thread() is not self._reader:
            self._reader.join(timeout=5)
        self._close_sockets()
        _live.discard(self)

    def _close_sockets(self) -> None:
        self._closing = True
        self.router.close()
        self.pull.close()
        self.ctx.term()


def stop_processes(procs, timeout: float, terminate: bool = False) -> None:
    """Wait for processes to end (after SIGTERM with `terminate`); `timeout`, longer than any wait
    inside a core, is the last resort: what outlives it is killed, and named."""
    deadline = time.monotonic() + timeout
    for p in procs:
        if terminate and p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            logger.warning("process %d did not exit within %.0f s; killing it", p.pid, timeout)
            p.kill()
            p.wait(timeout=5)


def run_headless(config: EngineConfig) -> int:
    """A host of engine cores only (`serve --headless`): start this host's DP ranks (they connect to
    the front end) and wait for them; SIGTERM / Ctrl-C stop them. Returns the exit status."""
    import signal
    par = config.parallel
    if not par.data_parallel_rpc_port:
        raise ValueError("--headless needs --data-parallel-rpc-port (and --data-parallel-address)")
    addresses = dp_addresses(par)
    procs = list(start_local_cores(config, addresses).values())
    logger.info("headless: engine cores %s of %d connect to %s", list(local_dp_ranks(par)),
                par.data_parallel_size, addresses.inputs[0])

    def stop(signum, frame):
        for p in procs:
            p.terminate()
    signal.signal(signal.SIGTERM, stop)
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        stop(None, None)
        codes = [p.wait() for p in procs]
    return max(abs(c) for c in codes)


class InprocClient:
    """One engine core in this process: its loop on a thread, outputs handled on that thread."""

    def __init__(self, config: EngineConfig, on_outputs, on_dead):
        from longserve.engine.core import EngineCore
        self.num_cores, self.on_outputs, self.on_dead = 1, on_outputs, on_dead
        self.dead: dict[int, str] = {}
        self.core = EngineCore(config)
        self.infos = [self.core.info()]
        self.inputs: queue.Queue = queue.Queue()
        self.proc = EngineCoreProc(self.core, self.inputs, self._emit)
        self._calls = UtilityCalls()
        self._start_loop()

    def _start_loop(self) -> None:
        self.proc.stopping = False
        self._thread = threading.Thread(target=self._run, name="longserve-engine-core", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def paused(self):
        """The core without its loop: the caller steps it (benchmarks that time single steps).
        Requests it adds there bypass the front end; the loop resumes on exit."""
        self.inputs.put((SHUTDOWN, None))
        self._thread.join()
        try:
            yield self.core
        finally:
            self._start_loop()

    def _run(self) -> None:
        try:
            self.proc.run()
        except BaseException as e:
            logger.exception("engine core failed")
            self.dead[0] = f"engine core 0 failed: {self.core.failure_reason(e)}"
            self._calls.fail_all(self.dead[0])
            self.on_dead(0, self.dead[0])

    def _emit(self, msg: EngineCoreOutputs) -> None:
        if msg.utility is not None:
            self._calls.resolve(msg.utility)
        else:
            self.on_outputs(msg)

    def add_request(self, core: int, request) -> None:
        self.inputs.put((ADD, (request, 0)))

    def abort(self, core: int, request_ids: list[str]) -> None:
        self.inputs.put((ABORT, request_ids))

    def start_wave(self, wave: int) -> None:
        pass  # one core: no lockstep

    def call(self, core: int, method: str, *args, timeout: float = 60.0):
        """Run on the core's thread, between steps (a direct call would race the loop)."""
        if self.dead:
            raise RuntimeError(self.dead[0])
        return self._calls.call(lambda p: self.inputs.put((UTILITY, p)), method, args, timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self.inputs.put((SHUTDOWN, None))
            self._thread.join(timeout)
        self.core.shutdown()
