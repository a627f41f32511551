"""The step plan from rank 0 to its replica's other ranks on this host (docs/architecture.md, 'The
plan ring'). Segment, in 8-byte words, then the slots: reads[r] (messages reader r took),
seq[s] / size[s] (slot s holds message seq[s] - 1, size[s] bytes; MORE: the pickle goes on in the
next slot). Every wait is bounded and raises a TimeoutError naming what it waited for."""
from __future__ import annotations

import os
import pickle
import secrets
import threading
import time
from multiprocessing import shared_memory
from typing import Callable

import numpy as np

SLOTS, SLOT_BYTES = 8, 1 << 18  # 2 MiB a replica: Docker gives /dev/shm 64 MB
MORE = 1 << 63
# a busy engine's next plan comes within ~10 ms: a reader spinning that long takes it at once;
# past it the engine is idle (or the step long) and pauses of up to 1 ms cost little
SPIN_S, MAX_PAUSE_S = 0.01, 1e-3
_fence = threading.Lock()


def fence() -> None:
    _fence.acquire()
    _fence.release()


def wait_for(ready: Callable[[], bool], timeout: float | None, alive: Callable[[], None] | None,
             what: Callable[[], str]) -> None:
    """Poll ready(): spin (yielding the core) for SPIN_S, then sleep in doubling pauses."""
    start, pause = time.monotonic(), 1e-5
    while not ready():
        waited = time.monotonic() - start
        if timeout is not None and waited > timeout:
            raise TimeoutError(f"waited {timeout:g} s for {what()}")
        if alive is not None:
            alive()
        if waited < SPIN_S:
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)


class ShmRingBuffer:
    """The writer: ShmRingBuffer(readers >= 1); reader r (0 .. readers-1) in any process of this
    host: ShmRingBuffer.attach(writer.handle, r); attach(handle) without a reader is the writer.
    The segment's maker (ShmRingBuffer(1, reader=0), rank 0's outputs, is a reader) unlinks it."""

    def __init__(self, readers: int, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES,
                 name: str | None = None, reader: int | None = None):
        self.readers, self.slots, self.slot_bytes, self.reader = readers, slots, slot_bytes, reader
        words = readers + 2 * slots
        self.unlinked = name is not None  # only the maker removes the name
        if name is None:
            name = f"longserve_plans_{os.getpid()}_{secrets.token_hex(4)}"
            self.shm = shared_memory.SharedMemory(name, create=True, size=8 * words + slots * slot_bytes)
        else:
            self.shm = shared_memory.SharedMemory(name)
        self.handle = (name, readers, slots, slot_bytes)
        self.base = 8 * words  # the first slot's offset
        header = np.ndarray((words,), np.uint64, self.shm.buf)
        self.reads = header[:readers]
        self.seq, self.size = header[readers::2], header[readers + 1::2]
        self.count = 0  # messages written (the writer) or taken (a reader)

    @classmethod
    def attach(cls, handle: tuple, reader: int | None = None) -> "ShmRingBuffer":
        name, readers, slots, slot_bytes = handle
        if reader is not None and not 0 <= reader < readers:
            raise ValueError(f"reader must be in 0..{readers - 1}, got {reader}")
        return cls(readers, slots, slot_bytes, name, reader)

    def behind(self, message: int | None = None) -> list[int]:
        """The readers that have not taken `message` (default: the last one written)."""
        message = self.count - 1 if message is None else message
        return [r for r in range(self.readers) if int(self.reads[r]) <= message]

    def enqueue(self, obj, timeout: float | None = None, alive: Callable[[], None] | None = None):
        """Send obj to every reader (as several messages when its pickle outgrows a slot)."""
        data = memoryview(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        for start in range(0, len(data), self.slot_bytes):
            more = MORE if start + self.slot_bytes < len(data) else 0
            self._write(data[start:start + self.slot_bytes], more, timeout, alive)

    def _write(self, chunk: memoryview, more: int, timeout, alive) -> None:
        n, slot = self.count, self.count % self.slots
        old = n - self.slots  # the slot's previous message: every reader must have taken it
        wait_for(lambda: old < 0 or int(self.reads.min()) > old, timeout, alive,
                 lambda: f"reader {', '.join(map(str, self.behind(old)))} to take message {old}")
        fence()
        start = self.base + slot * self.slot_bytes
        self.shm.buf[start:start + len(chunk)] = chunk
        self.size[slot] = len(chunk) | more
        fence()  # the payload is visible before the flag
        self.seq[slot] = n + 1
        self.count = n + 1

    def dequeue(self, timeout: float | None = None, alive: Callable[[], None] | None = None):
        """The writer's next object (a reader's call)."""
        parts, more = [], MORE
        while more:
            n, slot = self.count, self.count % self.slots
            wait_for(lambda: int(self.seq[slot]) == n + 1, timeout, alive,
                     lambda: f"message {n} from the writer")
            fence()
            size, start = int(self.size[slot]), self.base + slot * self.slot_bytes
            parts.append(bytes(self.shm.buf[start:start + (size & ~MORE)]))
            more = size & MORE
            fence()  # the payload is copied before the slot goes back to the writer
            self.reads[self.reader] = n + 1
            self.count = n + 1
        return pickle.loads(parts[0] if len(parts) == 1 else b"".join(parts))

    def unlink(self) -> None:
        """The maker: remove the name from /dev/shm (once every reader has attached, the
        mappings outlive it: nothing is left behind even if this process is killed)."""
        if not self.unlinked:
            self.unlinked = True
            self.shm.unlink()

    def close(self) -> None:
        """Unmap (the maker also unlinks); idempotent."""
        self.unlink()
        self.reads = self.seq = self.size = None  # views of the mapping: it cannot close under them
        self.shm.close()
