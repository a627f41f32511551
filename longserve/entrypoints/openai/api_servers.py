"""`longserve serve --api-server-count N`: a launcher holds the port and starts the cores, then N
API servers, each a whole front end on them (docs/architecture.md, 'Several API servers')."""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from longserve.config import EngineConfig
from longserve.engine.core_client import FrontEnd, PidWatch, start_local_cores, stop_processes
from longserve.engine.core_proc import CoreAddresses

logger = logging.getLogger("longserve.server")


def bound_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to host:port (reuse_port) before any model loads: a taken port fails at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, reuse_port)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror} (is another server running "
                           "there? choose another --port)") from None
    return sock


def run_api_servers(config: EngineConfig, count: int, max_waiting: int, server_kw: dict) -> int:
    """Start the cores and `count` API servers, serve until SIGTERM / Ctrl-C; the exit status."""
    from longserve.engine.executor import free_port
    run_dir = tempfile.mkdtemp(prefix="longserve-serve-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = run_dir  # the API servers inherit it
    holder = bound_socket(server_kw["host"], server_kw["port"], True)  # never listens: holds the port
    server_kw = dict(server_kw, port=holder.getsockname()[1])
    addresses = CoreAddresses([f"ipc://{run_dir}/in-{k}" for k in range(count)],
                              [f"ipc://{run_dir}/out-{k}" for k in range(count)],
                              f"tcp://127.0.0.1:{free_port()}")
    cores = start_local_cores(config, addresses)
    servers = [subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE)
               for _ in range(count)]
    pids = [p.pid for p in servers]
    for k, p in enumerate(servers):
        front_end = FrontEnd(k, addresses, {d: c.pid for d, c in cores.items()})
        p.stdin.write(pickle.dumps((k, config, front_end, max_waiting, server_kw, run_dir, pids)))
        p.stdin.close()
    logger.info("%d API servers on http://%s:%d", count, server_kw["host"], server_kw["port"])
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    while not stopping.is_set() and any(p.poll() is None for p in servers):
        stopping.wait(0.2)
    stop_processes(servers, server_kw["shutdown_timeout"] + 5, terminate=True)  # they drain
    stop_processes(cores.values(), 10, terminate=True)
    holder.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if stopping.is_set() else 1  # else every API server ended by itself


class Siblings:
    """The other API servers as API server `index` sees them (`ServerState.siblings`)."""

    def __init__(self, run_dir: str, index: int, pids: list[int]):
        self.run_dir, self.index = run_dir, index
        self.watches = {k: PidWatch(pid) for k, pid in enumerate(pids) if k != index}
        self.all_ready = False

    def mark_ready(self) -> None:
        open(os.path.join(self.run_dir, f"ready-{self.index}"), "w").close()

    def trouble(self) -> str | None:
        """Why this group of API servers is not whole, or None."""
        dead = [k for k, w in self.watches.items() if w.poll() is not None]
        if dead:
            return f"API server {dead[0]} died"
        if not self.all_ready:
            starting = [k for k in self.watches
                        if not os.path.exists(os.path.join(self.run_dir, f"ready-{k}"))]
            self.all_ready = not starting
            return f"API servers {starting} are still starting" if starting else None
        return None


def api_server_main(index: int, config: EngineConfig, front_end: FrontEnd, max_waiting: int,
                    server_kw: dict, run_dir: str, pids: list[int]) -> int:
    """API server `index`: its own LLMEngine on the launcher's cores, uvicorn on the port."""
    from longserve.engine.llm_engine import LLMEngine
    from longserve.entrypoints.openai.api_server import run_server
    from longserve.worker.worker import exit_with_parent
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s api-server-{index} %(name)s: %(message)s")
    exit_with_parent()
    sock = bound_socket(server_kw["host"], server_kw["port"], reuse_port=True)
    return run_server(lambda: LLMEngine(config, max_waiting, front_end), sock=sock,
                      siblings=Siblings(run_dir, index, pids), **server_kw)


if __name__ == "__main__":
    sys.exit(api_server_main(*pickle.load(sys.stdin.buffer)))
