"""Soak test (not in CI): many random requests against a small KV pool, with aborts and
malformed requests mixed in, on a tiny built-in model with tensor parallelism on CPU.

Checks: every good request finishes with the tokens of a run with a big pool (greedy and
seeded sampling, stop strings included); an aborted one holds a prefix of them; every bad
one is refused at the door with its error; the pool is whole at the end; the resident
memory of the driver and the workers does not grow once warm.

    PYTHONPATH=$PWD python benchmarks/soak.py --num-requests 10000 --tp 2
"""
from __future__ import annotations

import os

os.environ.setdefault("LONGSERVE_ENABLE_MULTIPROCESSING", "0")  # the soak steps the core itself
os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread a rank: tp=2 on a small CPU machine

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from longserve import LLM, SamplingParams  # noqa: E402

PREFIXES = [[1, 17, 18, 19, 20, 21, 22, 23], [1, 90, 91, 92, 93], [1, 300, 301]]
BAD = [  # (prompt, params kwargs, the error's words)
    ({"prompt_token_ids": [1, 2.5]}, {}, "must be an integer"),
    ({"prompt": "x", "stream": True}, {}, "unknown prompt keys"),
    ({"prompt_token_ids": []}, {}, "the prompt is empty"),
    ({"prompt_token_ids": [1, 10**6]}, {}, "outside the vocabulary"),
    ({"prompt_token_ids": [1, 2]}, {"logprobs": 10**6}, "logprobs must be in"),
    ({"prompt_token_ids": [1, 2]}, {"max_tokens": 10_000}, "KV blocks"),
]


def rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return kb / 1024


def random_request(rng: random.Random, vocab: int):
    prefix = rng.choice(PREFIXES + [[]])
    prompt = prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(1 if prefix else 2, 16))]
    kw = dict(max_tokens=rng.randint(1, 16), ignore_eos=rng.random() < 0.8)
    if rng.random() < 0.25:
        kw.update(temperature=1.0, top_k=rng.choice([0, 20]), seed=rng.randrange(1 << 30))
    else:
        kw.update(temperature=0.0)
    if rng.random() < 0.1:
        kw["stop"] = [rng.choice("abcdefghij ")]
    return {"prompt_token_ids": prompt}, SamplingParams(**kw)


def make_workload(n: int, seed: int, vocab: int, bad_rate: float, abort_rate: float):
    rng = random.Random(seed)
    items = []
    for i in range(n):
        r = rng.random()
        if r < bad_rate:
            prompt, kw, words = rng.choice(BAD)
            items.append(dict(kind="bad", prompt=prompt, kw=kw, words=words))
        else:
            prompt, params = random_request(rng, vocab)
            abort_after = rng.randint(0, 6) if r < bad_rate + abort_rate else None
            items.append(dict(kind="good", prompt=prompt, params=params, abort_after=abort_after))
    return items


def reference(args, good: list[dict]) -> list[list[int]]:
    llm = LLM(args.model, device="cpu", max_model_len=args.max_model_len, max_num_seqs=256)
    outs = llm.generate([g["prompt"] for g in good], [g["params"] for g in good], use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def soak(args, items: list[dict]) -> dict:
    llm = LLM(args.model, device="cpu", tensor_parallel_size=args.tp, block_size=args.block_size,
              num_gpu_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len)
    rng = random.Random(args.seed + 1)
    with llm.engine.client.paused() as core:  # this thread steps the engine core
        result = soak_core(args, llm.engine, core, rng, collections.deque(items))
    llm.shutdown()
    return result


def soak_core(args, front, core, rng, queue) -> dict:
    live, steps, rss = {}, 0, []
    worker_pids = [p.pid for p in core.executor.procs]
    t0 = time.perf_counter()
    while queue or core.has_work():
        for _ in range(rng.randint(0, args.arrivals_per_step)):
            if not queue:
                break
            item = queue.popleft()
            try:  # the front end's checks at the door
                req = front.make_request(item["prompt"], item.get("params") or SamplingParams(**item["kw"]))
            except (ValueError, TypeError) as e:
                item["error"] = str(e)
                continue
            core.add_request(req)
            item["req"], item["born"] = core.scheduler.requests[req.request_id], steps
            live[req.request_id] = item
        core.step()
        steps += 1
        for rid, item in list(live.items()):
            if item["req"].is_finished:
                del live[rid]
            elif item["abort_after"] is not None and steps - item["born"] >= item["abort_after"]:
                core.abort_requests([rid])
                del live[rid]
        if steps % args.rss_every == 0:
            rss.append([round(rss_mb(), 1)] + [round(rss_mb(p), 1) for p in worker_pids])
    elapsed = time.perf_counter() - t0
    kv = core.kv
    pool_whole = kv.num_free_blocks == kv.num_blocks and not any(kv.ref_cnt)
    return dict(elapsed_s=round(elapsed, 1), steps=steps, pool_whole=pool_whole, rss_mb=rss,
                num_blocks=kv.num_blocks)


def check(items: list[dict], ref: list[list[int]]) -> dict:
    good = [it for it in items if it["kind"] == "good"]
    stats = dict(good=0, aborted=0, bad=0, mismatches=0, bad_not_refused=0, preemptions=0,
                 output_tokens=0, finish_reasons={})
    for it, want in zip(good, ref):
        req = it.get("req")
        if req is None:
            stats["mismatches"] += 1  # a good request was refused
            print("refused:", it.get("error"), file=sys.stderr)
            continue
        got = req.output_token_ids
        stats["preemptions"] += req.num_preemptions
        stats["output_tokens"] += len(got)
        if req.finish_reason == "abort":
            stats["aborted"] += 1
            ok = got == want[:len(got)]
        elif req.sampling_params.stop:  # stop strings end requests in the front end, which this
            stats["good"] += 1          # soak bypasses: the core ran on past the stop
            ok = got[:len(want)] == want
        else:
            stats["good"] += 1
            ok = got == want
            stats["finish_reasons"][req.finish_reason] = stats["finish_reasons"].get(req.finish_reason, 0) + 1
        if not ok:
            stats["mismatches"] += 1
            print(f"mismatch {req.request_id}: {got} != {want}", file=sys.stderr)
    for it in items:
        if it["kind"] == "bad":
            stats["bad"] += 1
            if it["words"] not in it.get("error", ""):
                stats["bad_not_refused"] += 1
                print("bad request not refused as expected:", it, file=sys.stderr)
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:llama-tiny")
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=40, help="the small pool (manager blocks)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--arrivals-per-step", type=int, default=4)
    p.add_argument("--bad-rate", type=float, default=0.05)
    p.add_argument("--abort-rate", type=float, default=0.05)
    p.add_argument("--rss-every", type=int, default=500, help="steps between memory samples")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    vocab = LLM(args.model, device="cpu", num_gpu_blocks=1).config.model.vocab_size
    items = make_workload(args.num_requests, args.seed, vocab, args.bad_rate, args.abort_rate)
    t0 = time.perf_counter()
    ref = reference(args, [it for it in items if it["kind"] == "good"])
    t_ref = time.perf_counter() - t0
    run = soak(args, items)
    stats = check(items, ref)
    rss = run.pop("rss_mb")
    warm = rss[len(rss) // 4] if rss else None
    result = dict(args=vars(args), reference_s=round(t_ref, 1), **run, **stats,
                  rss_mb_warm=warm, rss_mb_end=rss[-1] if rss else None)
    print(json.dumps(result))
    ok = (run["pool_whole"] and stats["mismatches"] == 0 and stats["bad_not_refused"] == 0)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
