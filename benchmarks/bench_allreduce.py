"""Small collectives inside CUDA graphs: NCCL against torch symmetric memory (one-shot /
two-shot, multicast off), on every GPU of the host (2 H100s: about a minute).

1. Correctness: GroupCoordinator's all-reduce through symmetric memory
   (longserve/distributed/symm_all_reduce.py) against NCCL's, bf16 and float32, eager and replayed
   in a CUDA graph with new inputs: max |difference| (0 expected: a sum of two values rounds once).
2. Per-call latency in a CUDA graph (CALLS calls back to back, replayed; median of replays), bf16,
   8 KB ... 8 MB: NCCL all-reduce, one-shot, two-shot.
3. The ALGORITHMS row those timings give (the fastest path per size, "nccl" where NCCL wins).

    python benchmarks/bench_allreduce.py            # spawns one process per GPU
"""
import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longserve.distributed.parallel_state import GroupCoordinator
from longserve.distributed.symm_all_reduce import SymmAllReduce

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
SIZES = [8 << 10 << i for i in range(11)]  # 8 KB ... 8 MB
CALLS = 20


def graph_us(fn, replays=20):
    """Per-call microseconds of fn() captured CALLS times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def correctness(rank, world, plain, fast):
    """Max |symmetric - NCCL| over the collectives the engine calls, eager and graph-replayed
    (sizes on both sides of the one-shot / two-shot line)."""
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(64, 4096, device="cuda", dtype=dtype) * (rank + 1)
        for rows in (1, 16, 64):  # each algorithm of the table
            ref, got = plain.all_reduce(x[:rows].clone()), fast.all_reduce(x[:rows].clone())
            worst = max(worst, (got.float() - ref.float()).abs().max().item())
    for rows in (16, 64):  # one-shot, then two-shot: captured once, replayed on new inputs
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        y = x.clone()
        fast.all_reduce(y)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fast.all_reduce(y)
        for step in range(3):
            x.normal_()
            y.copy_(x * (rank + step))
            graph.replay()
            ref = plain.all_reduce(x * (rank + step))
            worst = max(worst, (y.float() - ref.float()).abs().max().item())
    return worst


def latency_rows(rank, world, comm):
    rows = []
    for nbytes in SIZES:
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        staged = comm.buf[:nbytes].view(torch.bfloat16)
        out = torch.empty_like(x)
        nccl = graph_us(lambda: dist.all_reduce(x))
        one = graph_us(lambda: comm._reduce("one_shot", staged, x, out))
        two = graph_us(lambda: comm._reduce("two_shot", staged, x, out))
        rows.append((nbytes, nccl, one, two))
    return rows


def suggested_table(rows):
    """(largest bytes, algorithm) rows, ascending: the fastest of NCCL, one-shot and two-shot."""
    table = []
    for nbytes, nccl, one, two in rows:
        alg = min((nccl, "nccl"), (one, "one_shot"), (two, "two_shot"))[1]
        if table and table[-1][1] == alg:
            table[-1] = (nbytes, alg)
        else:
            table.append((nbytes, alg))
    while table and table[-1][1] == "nccl":  # past the last row is NCCL anyway
        table.pop()
    return tuple(table)


def rank_main(rank, world, port, results):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    comm = SymmAllReduce(group, torch.device("cuda", rank), ((64 << 10, "one_shot"), (32 << 20, "two_shot")))
    plain = GroupCoordinator(list(range(world)), rank, group)
    fast = GroupCoordinator(list(range(world)), rank, group)
    fast.symm = comm
    worst = correctness(rank, world, plain, fast)
    rows = latency_rows(rank, world, comm)
    results.put((rank, worst, rows))
    dist.barrier()
    dist.destroy_process_group()


def main():
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    world = torch.cuda.device_count()
    assert world >= 2, "needs two or more GPUs"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = {r: (w, rows) for r, w, rows in (q.get(timeout=600) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    worst = max(w for w, _ in got.values())
    rows = got[0][1]
    print(f"\n### Small collectives in CUDA graphs, {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"\nsymmetric memory vs NCCL, max |difference| of the all-reduce, bf16 "
          f"and float32, eager and graph replays: {worst:.3g} ({'OK' if worst == 0 else 'DIFFERS'})\n")
    print("| bytes | NCCL all-reduce us | one-shot us | two-shot us |\n| --- | --- | --- | --- |")
    for nbytes, *us in rows:
        print(f"| {nbytes >> 10} KB | " + " | ".join(f"{u:.1f}" for u in us) + " |")
    print(f"\nALGORITHMS[{world}] = {suggested_table(rows)}")


if __name__ == "__main__":
    main()
