"""Host time of a decode step at a large batch, split by where it goes (CPU, tiny model).

One engine core in this process steps builtin:llama-tiny (float32, eager) with B requests
decoding at once (asynchronous scheduling, streamed, each with a stop string that never
matches), and the front end's OutputProcessor takes every step's outputs. Timers wrapped around
the engine's functions split each decode-only step (median over steps, ms):
  schedule : Scheduler.schedule (planning, the plan's decode columns)
  plan     : pickle of the SchedulerOutput (what a multi-GPU core sends its workers)
  inputs   : the worker's input preparation (blocks, step_rows, block table, prepare_step)
  forward  : the model (not host work on a GPU: the tiny model's CPU time, shown apart)
  sample   : sampling (on a GPU mostly a launch; here the tiny vocab's CPU time)
  apply    : Scheduler.update_from_output (sampled ids in, stop checks, prefix cache)
  outputs  : the step's outputs (EngineCore._outputs: plain tokens as columns, the rest a
             struct a request) and their msgpack round trip
  front    : OutputProcessor.process (detokenizing, stop strings, stream deltas)
  other    : the rest of the step (the executor's and the runner's own code)
  host     : the step but forward and sample: the per-step host work that bounds a multi-GPU step

    python benchmarks/bench_step_host.py --batches 128 512 --repeat 3   # median of 3 runs a part
    PYTHONPATH=/tmp/old python benchmarks/bench_step_host.py   # another checkout: before
"""
import argparse
import os
import pickle
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

PARTS = ("schedule", "plan", "inputs", "forward", "sample", "apply", "outputs", "front")


def timed(acc: dict, part: str, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[part] += time.perf_counter() - t
    return wrapper


def instrument(core, front, acc: dict) -> None:
    from longserve.engine.messages import decode_outputs, encode
    from longserve.worker import model_runner as mr
    runner, sched = core.executor.driver.runner, core.scheduler
    sched.schedule = timed(acc, "schedule", sched.schedule)
    sched.update_from_output = timed(acc, "apply", sched.update_from_output)
    mr.step_rows, mr.prepare_step = timed(acc, "inputs", mr.step_rows), timed(acc, "inputs", mr.prepare_step)
    runner._add_blocks = timed(acc, "inputs", runner._add_blocks)
    runner._block_table = timed(acc, "inputs", runner._block_table)
    runner.fill_placeholders = timed(acc, "inputs", runner.fill_placeholders)
    runner.run_model = timed(acc, "forward", runner.run_model)
    runner.sampling.sample = timed(acc, "sample", runner.sampling.sample)
    execute = core.executor.execute_async

    def send(out):  # the plan as a multi-GPU core would send it (one rank here: not sent)
        t = time.perf_counter()
        pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        acc["plan"] += time.perf_counter() - t
        return execute(out)
    core.executor.execute_async = send
    outputs = core._outputs

    def wire(out, finished):  # the core's deltas, through the socket's encoding to the front end
        return decode_outputs(encode(outputs(out, finished)))
    core._outputs = timed(acc, "outputs", wire)
    front.process = timed(acc, "front", front.process)


def run(batch: int, args) -> dict:
    from longserve.engine.core import EngineCore
    from longserve.engine.messages import EngineCoreRequest
    from longserve.engine.output_processor import OutputProcessor, RequestStream
    from longserve.engine_args import EngineArgs
    from longserve.sampling_params import SamplingParams
    from longserve.tokenizer import load_tokenizer
    cfg = EngineArgs(args.model, device="cpu", enforce_eager=True, max_num_seqs=batch,
                     max_model_len=args.prompt_len + args.steps + 64,
                     cpu_kv_cache_gb=1.0).create_engine_config()
    core = EngineCore(cfg)
    tok = load_tokenizer(cfg.model).tokenizer
    front = OutputProcessor(tok)  # (LLMEngine's)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True,
                            stop=["never-in-the-text"] if args.stop else None)
    rng = np.random.default_rng(0)
    for i in range(batch):
        req = EngineCoreRequest(f"r{i}", rng.integers(3, 500, args.prompt_len).tolist(), params)
        core.add_request(req)
        front.add(req, RequestStream(req.request_id), 0)
    acc = defaultdict(float)
    instrument(core, front, acc)
    rows = []
    for _ in range(args.steps):
        acc.clear()
        t = time.perf_counter()
        front.process(core.step())
        if core.decode_steps and core.decode_steps[-1][0] == batch:
            rows.append(dict(acc, step=time.perf_counter() - t))
    core.shutdown()
    rows = rows[args.warmup:]
    med = {p: 1e3 * statistics.median(r.get(p, 0.0) for r in rows) for p in PARTS + ("step",)}
    med["other"] = med["step"] - sum(med[p] for p in PARTS)  # the executor's, the step's own
    med["host"] = med["step"] - med["forward"] - med["sample"]
    return dict(batch=batch, steps=len(rows), **med)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:llama-tiny")
    ap.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--no-stop", dest="stop", action="store_false", help="no stop strings")
    ap.add_argument("--repeat", type=int, default=1, help="runs a batch; each part's median of them")
    ap.add_argument("--profile", action="store_true", help="cProfile the largest batch's run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import longserve
    print(f"longserve from {os.path.dirname(longserve.__file__)}; {args.model}, {args.steps} steps "
          f"(median of the decode-only ones after {args.warmup}), ms per step")
    print("| batch | " + " | ".join(PARTS) + " | other | host | step |")
    print("|" + " --- |" * (len(PARTS) + 4))
    for b in args.batches:
        if args.profile and b == max(args.batches):
            import cProfile
            import pstats
            prof = cProfile.Profile()
            r = prof.runcall(run, b, args)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        else:  # (a shared machine: the median of several runs, part by part)
            runs = [run(b, args) for _ in range(args.repeat)]
            r = {p: statistics.median(x[p] for x in runs) for p in runs[0]}
        print(f"| {b} | " + " | ".join(f"{r[p]:.2f}" for p in PARTS + ("other", "host", "step")) + " |",
              flush=True)


if __name__ == "__main__":
    main()
