"""Host time of eager CP decode, per step and per layer, on CPU ranks joined by gloo.

Each layout runs its ranks as processes (tiny built-in model, float32, enforce_eager), one
prefill of a few requests, then decode steps built as the engine builds them. Per decode
step it reports (median over steps, rank 0):
  step     : the whole step (inputs, forward, sampling), divided by the layers too;
  attn     : the attention layers' forward (store KV, paged attention, the CP exchange);
  colls    : collectives per layer inside attention, and per step in all;
  ops      : ATen ops per layer inside attention (each is host work in eager mode on a GPU too),
             and with --backend triton (TRITON_INTERPRET=1) the Triton kernel launches per layer.
On CPU every microsecond is host time; the tiny model keeps the arithmetic negligible, so
this is the Python/launch/collective-call overhead that eager decode pays per layer.

    python benchmarks/bench_decode_host.py                  # this checkout
    PYTHONPATH=/tmp/old python benchmarks/bench_decode_host.py   # another checkout: before
    TRITON_INTERPRET=1 python benchmarks/bench_decode_host.py --backend triton   # the GPU path's ops
"""
import argparse
import os
import socket
import statistics
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

LAYOUTS = {"one": {}, "pcp2": dict(prefill_context_parallel_size=2),
           "tp2-dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2)}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "broadcast", "all_to_all")


def count_collectives(counter: dict) -> None:
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def counted(*a, _fn=fn, **k):
            counter["all"] += 1
            counter["attn"] += counter["in_attn"]
            return _fn(*a, **k)
        setattr(dist, name, counted)


class OpCounter(TorchDispatchMode):
    def __init__(self, acc: dict):
        super().__init__()
        self.acc = acc

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.acc["ops"] += not self.acc["in_kernel"]  # not the interpreter's own tensor work
        return func(*args, **(kwargs or {}))


def count_launches(acc: dict) -> None:
    """Wrap every Triton kernel of the attention module: launches per layer."""
    from longserve.attention import triton_kernels as tk
    for name in [n for n in vars(tk) if n.startswith("_") and n.endswith("_kernel")]:
        kernel = getattr(tk, name)

        class Counted:
            def __getitem__(self, grid, _k=kernel):
                def launch(*a, **k):
                    acc["launches"] += 1
                    acc["in_kernel"] = 1
                    try:
                        return _k[grid](*a, **k)
                    finally:
                        acc["in_kernel"] = 0
                return launch
        setattr(tk, name, Counted())


def time_attention(runner, acc: dict) -> None:
    fwd = runner.backend.forward

    def timed(self, *a, **k):
        t, acc["in_attn"] = time.perf_counter(), 1
        try:
            with OpCounter(acc):
                return fwd(*a, **k)
        finally:
            acc["attn_s"] += time.perf_counter() - t
            acc["in_attn"] = 0
    runner.backend.forward = types.MethodType(timed, runner.backend)


def rank_main(rank, world, port, layout, args, results):
    torch.set_num_threads(1)
    from longserve.engine_args import EngineArgs
    from longserve.sampling_params import SamplingParams
    from longserve.step_plan import ScheduledRequest, SchedulerOutput
    from longserve.worker.worker import Worker
    L, B, steps = args.prompt_len, args.batch, args.steps
    cfg = EngineArgs(args.model, device="cpu", load_format="dummy", enforce_eager=True,
                     max_model_len=L + steps + 64, async_scheduling=False, cpu_kv_cache_gb=0.05,
                     attention_backend=args.backend, **LAYOUTS[layout]).create_engine_config()
    w = Worker(cfg, rank, f"tcp://127.0.0.1:{port}")
    w.init_cache(w.determine_num_blocks())
    runner, acc = w.runner, dict(attn_s=0.0, in_attn=0, all=0, attn=0, ops=0, launches=0,
                                 in_kernel=0)
    count_collectives(acc)
    count_launches(acc)
    time_attention(runner, acc)
    per_req = -(-(L + steps + 1) // cfg.cache.block_size)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    reqs = [ScheduledRequest(f"r{i}", [3 + (i + j) % 200 for j in range(L)], 0,
                             list(range(i * per_req, (i + 1) * per_req)), True, True, params)
            for i in range(B)]
    w.execute(SchedulerOutput(reqs))
    rows = []
    for s in range(steps):
        step = SchedulerOutput([ScheduledRequest(f"r{i}", [5], L + s, [], False, True)
                                for i in range(B)])
        acc.update(attn_s=0.0, all=0, attn=0, ops=0, launches=0)
        t = time.perf_counter()
        w.execute(step)
        rows.append((time.perf_counter() - t, acc["attn_s"], acc["attn"], acc["all"], acc["ops"],
                     acc["launches"]))
    layers = len(runner.layers)
    warm = rows[args.warmup:]
    med = lambda i: statistics.median(r[i] for r in warm)  # noqa: E731
    results.put((rank, dict(layers=layers, step_ms=med(0) * 1e3, attn_ms=med(1) * 1e3,
                            attn_colls=med(2), all_colls=med(3), ops=med(4), launches=med(5))))
    w.close()


def run_layout(layout: str, args) -> dict:
    kw = LAYOUTS[layout]  # dcp splits the tp group: it adds no ranks
    world = kw.get("tensor_parallel_size", 1) * kw.get("prefill_context_parallel_size", 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, layout, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return got[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:qwen3-tiny")
    ap.add_argument("--layouts", default="pcp2,tp2-dcp2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backend", default="torch", help="torch, or triton (with TRITON_INTERPRET=1)")
    args = ap.parse_args()
    import longserve
    print(f"longserve from {os.path.dirname(longserve.__file__)}; {args.model}, batch {args.batch}, "
          f"context {args.prompt_len}, {args.steps - args.warmup} decode steps (median, rank 0)")
    print("| layout | layers | step ms | step ms / layer | attn ms / layer | attn colls / layer "
          "| colls / step | attn ATen ops / layer | Triton launches / layer |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for layout in args.layouts.split(","):
        r = run_layout(layout, args)
        n = r["layers"]
        print(f"| {layout} | {n} | {r['step_ms']:.2f} | {r['step_ms'] / n:.3f} | "
              f"{r['attn_ms'] / n:.3f} | {r['attn_colls'] / n:g} | {r['all_colls']:g} | "
              f"{r['ops'] / n:g} | {r['launches'] / n:g} |", flush=True)


if __name__ == "__main__":
    main()
