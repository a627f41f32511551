"""`longserve serve` as a subprocess (engine cores as processes of their own), and its process tree."""
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

from longserve.engine.executor import free_port


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def fixed_ports(n: int) -> int:
    """The first of n free consecutive ports below the kernel's ephemeral range, as a deployment's
    fixed ports are: a core that connects before the front end binds must not draw one of them as
    its connection's own port (a bind then fails: address in use)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for first in range(low - 4000 + os.getpid() % 3000, low - n, n):
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", first + i))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports below the ephemeral range")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (engine cores, their workers, helpers)."""
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except OSError:
        return True


def wait_gone(pids: list[int], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(gone(p) for p in pids)


def concurrently(fn, n: int, timeout: float = 120) -> list:
    """[fn(0), ..., fn(n - 1)], each on a thread of its own (concurrent requests)."""
    out = [None] * n

    def one(i):
        out[i] = fn(i)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out


class Server:
    """`python -m longserve.entrypoints.cli serve ...` on a free port, engine cores in processes."""

    def __init__(self, args: list[str], log_path, port: int | None = None, wait: bool = True):
        self.port = port or free_port()
        self.log_path = log_path
        env = dict(os.environ, LONGSERVE_ENABLE_MULTIPROCESSING="1")
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "longserve.entrypoints.cli", "serve", *args,
                                      "--port", str(self.port), "--uvicorn-log-level", "warning"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        if wait:
            try:
                self.wait_healthy()
            except BaseException:  # the caller never gets it to stop: nothing may be left running
                self.stop()
                raise

    def wait_healthy(self, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log_text()
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def log_text(self) -> str:
        return open(self.log_path).read()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
