"""The shared-memory ring that carries the step plan to the workers on the driver's host
(longserve/distributed/shm_broadcast.py): every reader takes every object in order, across
wrap-around and objects larger than a slot; a reader or writer that stops answering fails a
wait with an error naming it; no segment is left in /dev/shm."""
import glob
import os
import random
import threading
import time

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_utils import _context, run_distributed
from longserve import LLM, SamplingParams
from longserve.distributed.shm_broadcast import ShmRingBuffer


def left_in_dev_shm() -> list[str]:
    """This process's rings still named in /dev/shm."""
    return glob.glob(f"/dev/shm/longserve_plans_{os.getpid()}_*")


def send_through(ring: ShmRingBuffer, objects: list, readers: int) -> dict[int, list]:
    """objects from `ring` to `readers` reader threads; what each reader took."""
    got: dict[int, list] = {}

    def read(r):
        mine = ShmRingBuffer.attach(ring.handle, r)
        got[r] = [mine.dequeue(timeout=10) for _ in objects]
        mine.close()
    threads = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(readers)]
    for t in threads:
        t.start()
    for obj in objects:
        ring.enqueue(obj, timeout=10)
    for t in threads:
        t.join(timeout=20)
    return got


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 700), min_size=1, max_size=30), readers=st.integers(1, 3),
       slots=st.integers(1, 4), slot_bytes=st.sampled_from([64, 200, 1024]))
def test_every_reader_takes_every_object_in_order(sizes, readers, slots, slot_bytes):
    objects = [bytes([i % 256]) * n if i % 3 else {"i": i, "ids": list(range(n))}
               for i, n in enumerate(sizes)]
    ring = ShmRingBuffer(readers, slots, slot_bytes)
    got = send_through(ring, objects, readers)
    assert got == {r: objects for r in range(readers)}
    assert ring.behind() == []
    ring.close()
    assert left_in_dev_shm() == []


def _processes_take_a_seeded_sequence(rank, world):
    """Rank 0 writes, the others read: 60 objects, some over the 4 x 256-byte slots."""
    rng = random.Random(7)
    objects = [(i, b"p" * rng.choice([0, 10, 255, 256, 600, 2000])) for i in range(60)]
    ring = ShmRingBuffer(world - 1, 4, 256) if rank == 0 else None
    handle = [ring.handle if rank == 0 else None]
    dist.broadcast_object_list(handle, src=0)
    ring = ring or ShmRingBuffer.attach(handle[0], rank - 1)
    dist.barrier()  # every reader attached: the name can go
    if rank == 0:
        ring.unlink()
        for obj in objects:
            ring.enqueue(obj, timeout=30)
    got = objects if rank == 0 else [ring.dequeue(timeout=30) for _ in objects]
    ring.close()
    return got == objects, handle[0][0]


@pytest.mark.timeout(120)
def test_reader_processes_take_every_object_and_no_segment_is_left():
    results = run_distributed(_processes_take_a_seeded_sequence, 4)
    assert [ok for ok, _ in results] == [True] * 4
    assert not os.path.exists(f"/dev/shm/{results[0][1]}")


@pytest.mark.timeout(30)
def test_a_reader_that_stops_taking_is_named_and_a_silent_writer_times_out():
    ring = ShmRingBuffer(2, slots=2, slot_bytes=64)
    got = send_through(ring, ["a", "b"], readers=1)  # reader 0 takes both; reader 1 none
    assert got == {0: ["a", "b"]}
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="waited 0.3 s for reader 1 to take message 0"):
        ring.enqueue("c", timeout=0.3)
    assert time.monotonic() - t < 2
    reader = ShmRingBuffer.attach(ring.handle, 1)
    assert [reader.dequeue(), reader.dequeue()] == ["a", "b"]
    with pytest.raises(TimeoutError, match="waited 0.3 s for message 2 from the writer"):
        reader.dequeue(timeout=0.3)
    reader.close()
    ring.close()
    assert left_in_dev_shm() == []


def _take_one_then_die(handle):
    ShmRingBuffer.attach(handle, 0).dequeue(timeout=30)
    os._exit(3)


@pytest.mark.timeout(60)
def test_a_dead_reader_fails_the_writers_wait_through_its_alive_check():
    ring = ShmRingBuffer(1, slots=2, slot_bytes=64)
    proc = _context().Process(target=_take_one_then_die, args=(ring.handle,), daemon=True)
    proc.start()

    def alive():
        if proc.exitcode is not None:
            raise RuntimeError(f"reader 0 died (exit code {proc.exitcode})")
    with pytest.raises(RuntimeError, match=r"reader 0 died \(exit code 3\)"):
        for i in range(4):  # the third waits for the slot of the first, the fourth for the second
            ring.enqueue(i, timeout=50, alive=alive)
    proc.join()
    ring.close()
    assert left_in_dev_shm() == []


@pytest.mark.timeout(240)
def test_the_engine_sends_plans_through_the_ring_and_leaves_no_segment(monkeypatch):
    llm = LLM("builtin:llama-tiny", device="cpu", tensor_parallel_size=2, max_model_len=256)
    out = llm.generate([[1, 5, 6]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.core.executor.plans.count >= 3  # a plan a step, through the ring
    assert left_in_dev_shm() == []  # unlinked once the workers attached: a kill leaks nothing
    llm.shutdown()
    assert left_in_dev_shm() == []
    monkeypatch.setenv("LONGSERVE_TEST_WORKER_EXIT", "1")
    with pytest.raises(RuntimeError, match="worker rank 1 died"):
        LLM("builtin:llama-tiny", device="cpu", tensor_parallel_size=2, max_model_len=256)
    assert left_in_dev_shm() == []  # a failed start removes it too
