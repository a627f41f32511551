"""How an engine-core process starts: forked from the front end where that is safe and free
(fork_is_safe: no `import torch` in the core and its workers, ~4 s on a GPU host), else spawned.
No torch import at module level here; docs/architecture.md, "Start-up"."""
from __future__ import annotations

import ctypes
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
import warnings

from longserve.worker.launch import name_process, start_workers


def core_main(workers: dict | None, config_bytes: bytes, rest: bytes, forked: bool = False) -> int:
    """An engine-core process: start its workers, then serve as the core; the exit status."""
    name_process("longserve-core")
    try:
        procs = None
        if workers is not None:
            procs = start_workers(config_bytes, **workers, fork=forked)
        from longserve.engine.core_proc import run_engine_core
        run_engine_core(pickle.loads(config_bytes), *pickle.loads(rest), workers=procs)
        return 0
    except SystemExit as e:  # SIGTERM, or a failed start
        return e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:  # the caller skips the interpreter's teardown (torch's finalizers take seconds)
        sys.stdout.flush()
        sys.stderr.flush()


def fork_is_safe(config) -> bool:
    """Fork where it costs nothing (docs/architecture.md, 'Start-up'): a GPU engine, or a CPU engine
    whose ranks get one thread each anyway; LONGSERVE_START_METHOD chooses; never after cuInit."""
    method = os.environ.get("LONGSERVE_START_METHOD")
    if method is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        one_thread = "OMP_NUM_THREADS" not in os.environ and (cores - 1) // config.parallel.world_size <= 1
        method = "fork" if config.device == "cuda" or one_thread else "spawn"
    return method == "fork" and sys.platform == "linux" and "torch" in sys.modules and not cuda_driver_started()


def cuda_driver_started() -> bool:
    """Whether cuInit ran here (then a forked child cannot use CUDA); before it, the driver answers
    cuDeviceGetCount with CUDA_ERROR_NOT_INITIALIZED (3); a driver not even loaded has not run."""
    try:
        with open("/proc/self/maps") as f:
            if not any("libcuda.so" in line for line in f):
                return False  # (not loaded here for the question: the child inherits what is)
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return driver.cuDeviceGetCount(ctypes.byref(ctypes.c_int())) != 3


class ForkedProcess:
    """A child of os.fork() running fn(*args) -> exit status, read like subprocess.Popen."""

    def __init__(self, fn, *args):
        sys.stdout.flush()  # else the child writes what is buffered here a second time
        sys.stderr.flush()
        self.returncode = None
        with warnings.catch_warnings():  # "multi-threaded, fork() may deadlock": the child uses
            warnings.simplefilter("ignore", DeprecationWarning)  # none of this process's threads
            self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                code = fn(*args)
            finally:
                os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else
                pid, status = self.pid, 1 << 8
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def terminate(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def in_forked_child(env: dict) -> None:
    """First thing in a forked core, before any torch op or worker (its workers inherit it)."""
    os.environ.update(env)  # before CUDA reads it: this core's GPUs
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the front end's handlers,
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)  # nor its event loop's: a signal here would wake the front end's loop
    import torch
    # the front end's OpenMP threads stayed behind: a parallel region would wait for them forever
    torch.set_num_threads(1)


def _forked_core(env: dict, workers: dict | None, config_bytes: bytes, rest: bytes) -> int:
    in_forked_child(env)
    return core_main(workers, config_bytes, rest, forked=True)


def start_core_process(config, dp_rank: int, addresses, gpus: list[str] | None):
    """Start DP rank `dp_rank`'s engine core, seeing only its GPUs (a Popen or a ForkedProcess)."""
    env = {} if gpus is None else {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    par = config.parallel
    workers = None if par.replica_size == 1 and not par.rank0_own_process else dict(
        base=par.data_parallel_rank * par.replica_size, replica=par.replica_size,
        init_method=addresses.dist_init if config.dp_lockstep else None, rank0=par.rank0_own_process)
    args = (workers, pickle.dumps(config), pickle.dumps((dp_rank, addresses, time.time())))
    if fork_is_safe(config):
        return ForkedProcess(_forked_core, env, *args)
    proc = subprocess.Popen([sys.executable, "-m", "longserve.engine"], stdin=subprocess.PIPE,
                            env={**os.environ, **env})
    proc.stdin.write(pickle.dumps(args))
    proc.stdin.close()
    return proc
