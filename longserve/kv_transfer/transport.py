"""The byte transport: one torch.distributed process group per (producer rank, consumer
rank) pair, built from the producer's TCPStore (ProcessGroupGloo on CPU, ProcessGroupNCCL on
GPU); producer is rank 0 of the pair, consumer rank 1. Control messages go through the store.

A pull: the consumer rank appends a message to the producer rank's queue in the store
(`pull/<engine>/<rank>/<seq>`), waits for the reply key ("ok" or why not), then receives the
pieces' payloads over the pair's group. A failed pair is dropped and rebuilt under a new
epoch on the next pull.
"""
from __future__ import annotations

import datetime
import pickle
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
        opts._timeout = td(timeout_s)
        return dist.ProcessGroupNCCL(prefix, rank, 2, opts)
    return dist.ProcessGroupGloo(prefix, rank, 2, td(timeout_s))


class PairGroups:
    """This rank's pair groups, keyed by pair name and epoch."""

    def __init__(self, device: torch.device, timeout_s: float):
        self.device, self.timeout_s = device, timeout_s
        self.groups: dict[str, object] = {}

    def get(self, store: dist.Store, key: str, rank: int):
        if key not in self.groups:
            self.groups[key] = make_pair_group(store, key, rank, self.device, self.timeout_s)
        return self.groups[key]

    def drop(self, key: str) -> None:
        self.groups.pop(key, None)

    def send_all(self, group, payloads) -> None:
        """Send the payloads (an iterator that makes each when asked) with tags 0, 1, ...:
        payload i+1 is packed while payload i is on the wire."""
        pending = None
        for tag, t in enumerate(payloads):
            work = (group.send([t], 1, tag), t)  # keep t alive until its send is done
            if pending is not None:
                pending[0].wait(td(self.timeout_s))
            pending = work
        if pending is not None:
            pending[0].wait(td(self.timeout_s))

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
            work.wait(td(self.timeout_s))
            consume(i, buf)


# ---- control messages over the store ---------------------------------------------------------
def queue_key(engine_id: str, rank: int) -> str:
    return f"pullq/{engine_id}/{rank}"


def post_pull(store: dist.Store, engine_id: str, rank: int, msg: dict) -> str:
    """Append a pull message to a producer rank's queue; returns the key its reply comes under."""
    msg = dict(msg, reply_key=f"reply/{uuid.uuid4().hex}")
    seq = store.add(queue_key(engine_id, rank), 1) - 1
    store.set(f"{queue_key(engine_id, rank)}/{seq}", pickle.dumps(msg))
    return msg["reply_key"]


def wait_key(store: dist.Store, key: str, timeout_s: float, poll_s: float = 0.002) -> bool:
    """Poll for a key (store.wait's timeouts log a warning each time)."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def wait_reply(store: dist.Store, key: str, timeout_s: float) -> str:
    if not wait_key(store, key, timeout_s):
        raise TimeoutError(f"the producer did not answer a pull within {timeout_s} s")
    reply = store.get(key).decode()
    store.delete_key(key)
    return reply


def release_key(engine_id: str, req_id: str) -> str:
    return f"release/{engine_id}/{req_id}"
