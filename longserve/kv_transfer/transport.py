"""The byte transport: a process group per (producer rank, consumer rank) pair from the producer's
TCPStore, and a pull's control messages in that store (docs/architecture.md, 'KV transfer')."""
from __future__ import annotations

import datetime
import pickle
import threading
import time
import uuid

import torch
import torch.distributed as dist


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=td(timeout_s), wait_for_workers=False)


def make_pair_group(store: dist.Store, key: str, rank: int, device: torch.device, timeout_s: float):
    prefix = dist.PrefixStore(f"pair/{key}", store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        # NCCL's watchdog ends the whole process ~60 s after an op outlives this timeout: it must
        # never beat this side's own wait (<= timeout_s), which gives up and aborts the group
        opts._timeout = td(2 * timeout_s + 10)
        group = dist.ProcessGroupNCCL(prefix, rank, 2, opts)
    else:
        group = dist.ProcessGroupGloo(prefix, rank, 2, td(timeout_s))
    # warm: NCCL builds the pair's communicator here, not inside the first pull
    t = torch.zeros(1, device=device)
    wait_work(group.send([t], 1, 0) if rank == 0 else group.recv([t], 0, 0), timeout_s, device)
    return group


def wait_work(work, timeout_s: float, device: torch.device) -> None:
    """Wait for a send/recv, at most timeout_s. gloo: wait(timeout). NCCL: poll is_completed() every
    50 us, then wait() (orders this thread's stream after it): NCCL's wait(timeout) polls coarsely."""
    if device.type != "cuda":
        work.wait(td(timeout_s))
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"a KV send/recv did not complete within {timeout_s:.1f} s")
        time.sleep(50e-6)
    work.wait()


class PairGroups:
    """This rank's pair groups by pair name (and epoch), built once; `num_created` counts them."""

    def __init__(self, device: torch.device, timeout_s: float):
        self.device, self.timeout_s = device, timeout_s
        self.groups: dict[str, object] = {}
        self.num_created = 0
        self._lock = threading.Lock()

    def get(self, store: dist.Store, key: str, rank: int):
        with self._lock:
            group = self.groups.get(key)
        if group is None:
            group = make_pair_group(store, key, rank, self.device, self.timeout_s)
            with self._lock:
                self.groups[key] = group
                self.num_created += 1
        return group

    def close(self) -> None:
        """Abort every pair group: the other engine of a pair does not close with this one,
        and a graceful NCCL teardown would wait for it."""
        with self._lock:
            keys = list(self.groups)
        for key in keys:
            self.drop(key)

    def drop(self, key: str) -> None:
        """Forget a failed pair's group; NCCL's is aborted: a send or receive the other side
        never matched would otherwise stay posted on the device for good."""
        with self._lock:
            group = self.groups.pop(key, None)
        if group is not None and self.device.type == "cuda":
            group.abort()

    def send_all(self, group, payloads, deadline: float | None = None) -> None:
        """Send the payloads (made when asked: i+1 is packed while i is on the wire) with tags 0, 1,
        ...; no wait outlasts `deadline` (time.time(): a lease's end)."""
        pending = []  # (send, its tensor): a tensor is kept alive until its send is done
        for tag, t in enumerate(payloads):
            pending.append((group.send([t], 1, tag), t))
            if len(pending) > 1:
                wait_work(pending.pop(0)[0], self._until(deadline), self.device)
        for work, _ in pending:
            wait_work(work, self._until(deadline), self.device)

    def recv_all(self, group, buffers: list, consume) -> None:
        """Receive into buffers[i] (a callable that allocates it) with tag i, then
        consume(i, buf); the receive of i+1 is posted before i is consumed."""
        def post(i):
            buf = buffers[i]()
            return group.recv([buf], 0, i), buf
        pending = post(0) if buffers else None
        for i in range(len(buffers)):
            work, buf = pending
            pending = post(i + 1) if i + 1 < len(buffers) else None
            wait_work(work, self.timeout_s, self.device)
            consume(i, buf)

    def _until(self, deadline: float | None) -> float:
        return self.timeout_s if deadline is None else max(0.05, min(self.timeout_s, deadline - time.time()))


def queue_key(engine_id: str, rank: int) -> str:
    return f"pullq/{engine_id}/{rank}"


def post_pull(store: dist.Store, engine_id: str, rank: int, msg: dict) -> None:
    """Push a pull message onto a producer rank's queue (one round trip)."""
    store.queue_push(queue_key(engine_id, rank), pickle.dumps(msg))


def next_message(store: dist.Store, engine_id: str, rank: int) -> dict:
    """Block until the next message on this producer rank's queue (the store's timeout
    bounds the wait; a closed store raises)."""
    return pickle.loads(store.queue_pop(queue_key(engine_id, rank), True))


def reply_key(pair: str) -> str:
    """A fresh key for one message's answer (a late answer to a message given up on stays unread)."""
    return f"reply/{pair}/{uuid.uuid4().hex[:8]}"


def take_reply(store: dist.Store, key: str) -> int:
    """Wait for the answer under key (at most the store's timeout), read it and delete it."""
    word = int(store.get(key))
    store.delete_key(key)
    return word


def release_key(engine_id: str, req_id: str) -> str:
    return f"release/{engine_id}/{req_id}"
