"""The step plan of a 512-decode step from rank 0 to the other ranks of its host: the gloo
broadcast (GroupCoordinator.broadcast_object, one fixed buffer) against the shared-memory ring
(longserve/distributed/shm_broadcast.py), on CPU processes.

Per plan: `send` is rank 0's time in the call (host time of the engine core); `deliver` is the
time from the send's start until the last rank has the plan unpickled (time.perf_counter is
one clock for every process of a Linux host). Rank 0 pauses --gap-ms between plans, as a step
would. Medians and 90th percentiles in microseconds.

    python benchmarks/bench_plan_broadcast.py --ranks 2 4
"""
import argparse
import os
import pickle
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longserve.distributed.parallel_state import GroupCoordinator
from longserve.distributed.shm_broadcast import ShmRingBuffer
from longserve.engine.executor import free_port
from longserve.step_plan import DecodeRows, SchedulerOutput


def decode_plan(batch: int) -> SchedulerOutput:
    """A steady decode step as the server plans it: ids like the OpenAI server's, placeholders
    for the tokens still on the device, a new block for one request in 16."""
    rows = DecodeRows(req_ids=[f"chatcmpl-{i:032x}-0" for i in range(batch)],
                      num_computed=[1000 + 7 * i for i in range(batch)], token_ids=[-1] * batch,
                      seed_offsets=[37 + i for i in range(batch)],
                      new_blocks={i: [5000 + i] for i in range(0, batch, 16)})
    return SchedulerOutput(finished_req_ids=["chatcmpl-done-0"], new_block_ids=[5000, 5016],
                           decodes=rows)


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(int(q * len(xs)), len(xs) - 1)] * 1e6


def run_rank(rank: int, world: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    group = GroupCoordinator(list(range(world)), rank, dist.group.WORLD, dist.group.WORLD)
    ring = ShmRingBuffer(world - 1) if rank == 0 else None
    handle = [ring.handle if ring else None]
    dist.broadcast_object_list(handle, src=0)
    ring = ring or ShmRingBuffer.attach(handle[0], rank - 1)
    dist.barrier()
    if rank == 0:
        ring.unlink()
    plan = decode_plan(args.batch)
    paths = {"gloo": (group.broadcast_object, lambda: group.broadcast_object(None)),
             "shm": (lambda obj: ring.enqueue(obj, timeout=60), lambda: ring.dequeue(timeout=60))}
    for name, (send, receive) in paths.items():
        dist.barrier()
        sends, arrivals = [], []
        for _ in range(args.warmup + args.iters):
            if rank == 0:
                time.sleep(args.gap_ms / 1e3)
                t0 = time.perf_counter()
                send((t0, plan))
                sends.append(time.perf_counter() - t0)
            else:
                t0, _ = receive()
                arrivals.append(time.perf_counter() - t0)
        everyone = [None] * world if rank == 0 else None
        dist.gather_object(arrivals[args.warmup:], everyone, dst=0)
        if rank == 0:
            deliver = [max(per_rank) for per_rank in zip(*everyone[1:])]
            results.put((world, name, sends[args.warmup:], deliver))
    ring.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--gap-ms", type=float, default=2.0)
    args = p.parse_args()
    size = len(pickle.dumps(decode_plan(args.batch), protocol=pickle.HIGHEST_PROTOCOL))
    print(f"plan of {args.batch} decodes: {size / 1024:.1f} KB pickled; {os.cpu_count()} CPUs")
    print(f"{'ranks':>5} {'path':>5} {'send p50':>9} {'send p90':>9} {'deliver p50':>12} "
          f"{'deliver p90':>12}  (us)")
    ctx = mp.get_context("spawn")
    for world in args.ranks:
        results, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=run_rank, args=(r, world, port, args, results))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        rows = [results.get(timeout=600) for _ in range(2)]
        for proc in procs:
            proc.join()
        for _, name, sends, deliver in rows:
            print(f"{world:>5} {name:>5} {pct(sends, .5):>9.0f} {pct(sends, .9):>9.0f} "
                  f"{statistics.median(deliver) * 1e6:>12.0f} {pct(deliver, .9):>12.0f}")


if __name__ == "__main__":
    main()
