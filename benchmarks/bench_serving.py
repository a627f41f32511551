"""Online serving: `longserve serve` under a Poisson request-rate sweep, against offline
`LLM.generate` on the same workload, in one run.

Workload: N prompts x (input-len random token ids + output-len tokens), greedy, ignore_eos.
Per rate: time to first token and inter-token latency (p50 / p99), output tokens/s, through
our own async client (httpx, streamed /v1/completions with vLLM's `return_token_ids`, so every
step's tokens arrive in a chunk even when their text is held back). Also, in the same run:
offline `LLM.generate` output tokens/s on the same workload (the saturation target: the
server at rate=inf within 5% of it), the same through an in-process core (the client's cost),
and one decode step at batch 1 (the low-load target: p50 ITL within 1.1x of it). Writes JSON and, with matplotlib installed, a plot.

Engine flags (everything this script does not know) go both to the offline LLM and to the
server, e.g. on one GPU:
  python benchmarks/bench_serving.py --num-prompts 256 --input-len 1024 --output-len 256 \
      --rates 1,4,16,64,inf -- --model builtin:qwen3-0.6b-shape --load-format dummy \
      --max-num-seqs 256 --max-model-len 1300
and at tiny sizes on CPU:
  python benchmarks/bench_serving.py --num-prompts 16 --input-len 32 --output-len 16 \
      --rates 2,inf -- --model builtin:llama-tiny --device cpu --max-model-len 256

`--workload mixed`: long and short prompts in one Poisson stream (by default 16 x 32K and
256 x 1K, shuffled by the run's seed: every layout gets the same requests at the same times),
TTFT / ITL / output tokens/s of each class as well; no offline run. `--workload long-under-decode`:
the short prompts all at once, then (`--long-at` seconds later) the long ones, while the short
ones decode: the long ones' TTFT, and the short ones' ITL p50 / p99 while a long prompt
prefills against their p50 over the run (a chunked prefill's stall, issue 42's served row):
  python benchmarks/bench_serving.py --workload long-under-decode --short-num 32 --long-num 1 \
      --long-len 131072 --output-len 1024 --rates inf --skip-offline -- --model builtin:llama3-8b-shape \
      --load-format dummy -pcp 4 --max-model-len 140000 With `--url` it drives any
endpoint, e.g. `longserve proxy` in front of a disaggregated pair (docs/benchmarks.md has the
four-GPU recipe); the flags after `--` then only name the model:
  python benchmarks/bench_serving.py --workload mixed --long-num 2 --long-len 256 --short-num 16 \
      --short-len 32 --output-len 16 --rates 4 --url http://127.0.0.1:8000 -- --model builtin:llama-tiny
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np

from longserve import SamplingParams
from longserve.engine.executor import free_port
from longserve.engine_args import EngineArgs
from longserve.entrypoints.cli import make_llm


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab, 10 ** 9) - 100, (n, length)).tolist()


def workload(args, vocab: int, seed: int) -> tuple[list[list[int]], list[str]]:
    """One run's prompts and each one's class. uniform: num-prompts x input-len ("all");
    mixed: long-num x long-len ("long") and short-num x short-len ("short") in a seeded order,
    the same for every layout given the same seed."""
    if args.workload == "uniform":
        return random_prompts(vocab, args.num_prompts, args.input_len, seed), ["all"] * args.num_prompts
    prompts = (random_prompts(vocab, args.long_num, args.long_len, seed)
               + random_prompts(vocab, args.short_num, args.short_len, seed + 1000))
    labels = ["long"] * args.long_num + ["short"] * args.short_num
    if args.workload == "long-under-decode":  # the short ones first (arrival_delays)
        return prompts[args.long_num:] + prompts[:args.long_num], labels[args.long_num:] + labels[:args.long_num]
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[i] for i in order], [labels[i] for i in order]


def vocab_size(engine_args) -> int:
    from longserve.models.builtin import model_config, resolve_model
    return model_config(resolve_model(engine_args.model, engine_args.seed)).vocab_size


# ---- offline: the same workload through LLM.generate, and one decode step -------------
def sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def offline(engine_args, args, vocab: int, multiprocessing: bool) -> dict:
    """`LLM.generate` on the workload: through an engine-core process (the server's path), or
    with the core on a thread of this process (the old in-process engine)."""
    os.environ["LONGSERVE_ENABLE_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    llm = make_llm(engine_args)
    device, n = llm.config.device, args.num_prompts
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm = [{"prompt_token_ids": p} for p in random_prompts(vocab, n, args.input_len, 7)]
    llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(vocab, n, args.input_len, 0)]
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    sync(device)
    elapsed = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    step = decode_step_time(llm, vocab, args.input_len)
    llm.shutdown()
    del llm, outs
    gc.collect()
    if device == "cuda":
        import torch
        torch.cuda.empty_cache()
    return dict(elapsed_s=round(elapsed, 3), out_tok_s=round(n_out / elapsed, 1),
                decode_step_ms=round(1e3 * step, 3))


def decode_step_time(llm, vocab: int, ctx: int) -> float:
    """Median step period of the engine core (host work included) while one request decodes
    at context ~ctx, as the core times it."""
    since = len(llm.engine.call("decode_step_log"))
    [prompt] = random_prompts(vocab, 1, ctx, 3)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=34, ignore_eos=True),
                 use_tqdm=False)
    times = [dt for _, dt, _ in llm.engine.call("decode_step_log", since)]
    return float(np.median(times[2:]))


# ---- the server ----------------------------------------------------------------------
def front_end_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) of the server's front-end processes: `pid` and its
    descendants, less the engine cores (spawned: `-m longserve.engine`; forked: named
    longserve-core) and theirs."""
    if pid is None:
        return 0.0
    kids: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except (OSError, IndexError, ValueError):
            pass
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f, open(f"/proc/{p}/comm") as g:
                if b"longserve.engine\x00" in f.read() or g.read().startswith("longserve-core"):
                    continue
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            continue
        todo += kids.get(p, [])
    return total


def start_server(extra: list[str], port: int, timeout: float, log=None) -> subprocess.Popen:
    """`longserve serve` with these flags, once /health answers 200 (its output to `log`)."""
    cmd = [sys.executable, "-m", "longserve.entrypoints.cli", "serve", *extra, "--port", str(port),
           "--max-waiting", "1000000", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
    import httpx
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not become healthy")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)


async def one_request(client, model: str, prompt: list[int], max_tokens: int, delay: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                stream=True, return_token_ids=True)
    sent, times, counts = time.perf_counter(), [], []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            k = len(chunk["choices"][0].get("token_ids") or [])
            if k:
                times.append(time.perf_counter())
                counts.append(k)
    itl = [(b - a) / k for a, b, k in zip(times, times[1:], counts[1:]) for _ in range(k)]
    return dict(sent=sent, ttft=times[0] - sent, itl=itl, done=times[-1], tokens=sum(counts), times=times)


async def send_all(url: str, model: str, prompts: list, max_tokens: int, delays, t0: float) -> list:
    import httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        return await asyncio.gather(*[one_request(client, model, p, max_tokens, d, t0)
                                      for p, d in zip(prompts, delays)])


def client_part(*args) -> list:
    return asyncio.run(send_all(*args))


def pooled_client_part(*args) -> tuple[int, list]:  # in a client process of its own
    return os.getpid(), client_part(*args)


class Clients:
    """`procs` client processes, started once for the whole sweep. Each imports this script
    (and torch) when it starts, seconds on a busy host: a run's clock starts only once every
    one is ready, else the late ones send their share of an "all at once" burst a second late."""

    def __init__(self, procs: int):
        from multiprocessing import get_context
        ctx = get_context("spawn")
        ready = ctx.Barrier(procs + 1)
        self.procs, self.pool = procs, ctx.Pool(procs, initializer=ready.wait)
        ready.wait(timeout=300)

    def run(self, url: str, model: str, prompts: list, max_tokens: int, delays) -> list:
        """Every k-th request from client k; the responses in the prompts' order."""
        t0 = time.perf_counter() + 0.2  # perf_counter is system-wide: one clock for all
        parts = [self.pool.apply_async(pooled_client_part, (url, model, prompts[k::self.procs],
                                                            max_tokens, delays[k::self.procs], t0))
                 for k in range(self.procs)]
        pids, parts = zip(*(p.get() for p in parts))
        assert len(set(pids)) == self.procs, "a client process ran two parts one after the other"
        return [parts[i % self.procs][i // self.procs] for i in range(len(prompts))]

    def close(self) -> None:
        self.pool.terminate()


def latency(res: list[dict], span: float) -> dict:
    """These requests' output tokens per second of the run (`span`), TTFT and ITL p50 / p99."""
    ttft = np.array([r["ttft"] for r in res])
    itl = np.array([x for r in res for x in r["itl"]] or [0.0])
    ms = lambda a, q: round(1e3 * float(np.percentile(a, q)), 2)  # noqa: E731
    return dict(out_tok_s=round(sum(r["tokens"] for r in res) / span, 1),
                ttft_p50_ms=ms(ttft, 50), ttft_p99_ms=ms(ttft, 99), itl_p50_ms=ms(itl, 50),
                itl_p99_ms=ms(itl, 99))


def stall_during_long_prefill(res: list[dict], labels: list[str]) -> dict:
    """The short requests' ITL while a long prompt prefills (from its arrival to its first token)
    against their p50 over the whole run: what a chunked prefill costs the decodes beside it."""
    long = [r for r, k in zip(res, labels) if k == "long"]
    start, end = min(r["sent"] for r in long), max(r["sent"] + r["ttft"] for r in long)
    gaps = [b - a for r, k in zip(res, labels) if k == "short"
            for a, b in zip(r["times"], r["times"][1:]) if start < b <= end]
    p50 = latency([r for r, k in zip(res, labels) if k == "short"], 1.0)["itl_p50_ms"]
    ms = lambda q: round(1e3 * float(np.percentile(gaps or [0.0], q)), 2)  # noqa: E731
    return dict(gaps=len(gaps), itl_p50_ms=ms(50), itl_p99_ms=ms(99), short_itl_p50_ms=p50,
                p99_over_p50=round(ms(99) / p50, 2) if p50 else None)


def arrival_delays(args, labels: list[str], rate: float, seed: int) -> np.ndarray:
    """Seconds after the start each request is sent: Poisson at `rate` (inf: all at once), or
    (long-under-decode) the short ones at once and the long ones --long-at seconds later."""
    if args.workload == "long-under-decode":
        return np.array([args.long_at if k == "long" else 0.0 for k in labels])
    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(labels)) if rate == float("inf") else rng.exponential(1 / rate, len(labels))
    return np.cumsum(gaps) - gaps[0]


def run_rate(url: str, model: str, prompts: list, max_tokens: int, delays, rate: float,
             clients: Clients | None = None, server_pid: int | None = None,
             labels: list[str] | None = None, stall: bool = False) -> dict:
    """clients: send from those processes (every k-th request each, on one clock), so parsing
    the SSE stream is not one core's; else from this one. server_pid: also the front end's CPU
    time per output token (API servers, not cores). labels: each request's class; with two or
    more, the latencies of each class as well; stall: stall_during_long_prefill too."""
    cpu0 = front_end_cpu_s(server_pid)
    if clients is None:
        res = client_part(url, model, prompts, max_tokens, delays, time.perf_counter())
    else:
        res = clients.run(url, model, prompts, max_tokens, delays)
    assert all(r["tokens"] == max_tokens for r in res), "a request came back short"
    t_first = min(r["sent"] for r in res)
    span = max(r["done"] for r in res) - t_first
    ttft = np.array([r["ttft"] for r in res])
    slowest = [dict(index=int(i), sent_s=round(res[i]["sent"] - t_first, 2), ttft_ms=round(1e3 * ttft[i], 1))
               for i in np.argsort(-ttft)[:4]]  # where a TTFT tail comes from
    n_out = sum(r["tokens"] for r in res)
    done = np.array([r["done"] - t_first for r in res])  # a tail of late finishers: imbalance
    row = dict(rate=rate, duration_s=round(span, 3), req_s=round(len(res) / span, 3),
               done_s_p10_p50_p90_max=[round(float(np.percentile(done, q)), 3) for q in (10, 50, 90, 100)],
               front_end_cpu_us_per_token=round(1e6 * (front_end_cpu_s(server_pid) - cpu0) / n_out, 1),
               **latency(res, span), slowest=slowest)
    if labels and len(set(labels)) > 1:
        row["classes"] = {c: dict(n=labels.count(c), **latency([r for r, k in zip(res, labels) if k == c], span))
                          for c in sorted(set(labels))}
    if stall:
        row["stall"] = stall_during_long_prefill(res, labels)
    return row


def sweep(args, model: str, vocab: int, url: str, server_pid: int | None = None) -> list[dict]:
    clients = Clients(args.client_procs) if args.client_procs > 1 else None
    try:
        if not args.no_warm_up:
            warm, labels = workload(args, vocab, 7)  # the same batch shapes as the timed runs
            run_rate(url, model, warm, 8, arrival_delays(args, labels, float("inf"), 0), float("inf"), clients)
        rows = []
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            prompts, labels = workload(args, vocab, 100 + i)  # no prefix-cache hits
            rows.append(run_rate(url, model, prompts, args.output_len, arrival_delays(args, labels, rate, i),
                                 rate, clients, server_pid, labels, args.workload == "long-under-decode"))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if clients is not None:
            clients.close()
    return rows


# ---- report --------------------------------------------------------------------------
def report(result: dict, out: str) -> None:
    off, rows = result["offline"], result["rates"]
    print("\n| request rate (req/s) | achieved req/s | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['rate']} | {r['req_s']} | {r['out_tok_s']} | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | "
              f"{r['itl_p50_ms']} / {r['itl_p99_ms']} |")
    if any("classes" in r for r in rows):
        print("\n| request rate (req/s) | class | requests | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            for name, c in r.get("classes", {}).items():
                print(f"| {r['rate']} | {name} | {c['n']} | {c['out_tok_s']} | {c['ttft_p50_ms']} / "
                      f"{c['ttft_p99_ms']} | {c['itl_p50_ms']} / {c['itl_p99_ms']} |")
    for r in rows:
        if "stall" in r:
            st = r["stall"]
            print(f"\nshort requests' ITL while the long prompt prefills ({st['gaps']} gaps): p50 "
                  f"{st['itl_p50_ms']} ms, p99 {st['itl_p99_ms']} ms = {st['p99_over_p50']}x their p50 over "
                  f"the run ({st['short_itl_p50_ms']} ms; target <= 2x)")
    if off:
        print(f"| offline LLM.generate (engine-core process) | | {off['out_tok_s']} | | decode step at "
              f"batch 1: {off['decode_step_ms']} |")
        inproc = result["offline_inproc"]
        if inproc:
            print(f"| offline LLM.generate (core in process) | | {inproc['out_tok_s']} | | decode "
                  f"step at batch 1: {inproc['decode_step_ms']} |")
        t = result["targets"]
        print(f"\nsaturation: server / offline output tok/s = {t['saturation_over_offline']} (target >= 0.95); "
              f"offline process / in-process = {t['offline_mp_over_inproc']} (target >= 0.97); "
              f"lowest rate: p50 ITL / decode step = {t['low_load_itl_over_step']} (target <= 1.1)")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    plot(rows, os.path.splitext(out)[0] + ".png")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    x = [r["req_s"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")):
        a.plot(x, [r[key] for r in rows], marker="o", label=label)
    for key, label in (("itl_p50_ms", "ITL p50"), ("itl_p99_ms", "ITL p99")):
        b.plot(x, [r[key] for r in rows], marker="o", label=label)
    for ax, title in ((a, "time to first token"), (b, "inter-token latency")):
        ax.set(xlabel="achieved request rate (req/s)", ylabel="ms", title=title, yscale="log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--workload", choices=("uniform", "mixed", "long-under-decode"), default="uniform",
                    help="mixed: --long-num x --long-len and --short-num x --short-len prompts, latencies "
                         "per class (no offline run); long-under-decode: the long ones arrive --long-at "
                         "seconds after the short ones")
    ap.add_argument("--long-num", type=int, default=16)
    ap.add_argument("--long-len", type=int, default=32768)
    ap.add_argument("--short-num", type=int, default=256)
    ap.add_argument("--short-len", type=int, default=1024)
    ap.add_argument("--long-at", type=float, default=2.0, help="long-under-decode: the long prompts' arrival (s)")
    ap.add_argument("--rates", default="1,4,16,64,inf", help="request rates (req/s), inf: all at once")
    ap.add_argument("--out", default="serving.json", help="JSON results (the plot goes next to it)")
    ap.add_argument("--url", default=None, help="an already running server (skips starting one)")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--client-procs", type=int, default=1, help="client processes sending the requests")
    ap.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for /health")
    ap.add_argument("--server-args", default="", help="flags for the server only, e.g. '--api-server-count 2'")
    ap.add_argument("--no-inproc", action="store_true", help="offline through the core process only")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="no warm-up requests: the first rate is a fresh server's first traffic")
    ap.add_argument("--fail-on-compile", action="store_true",
                    help="fail the run when a kernel compiles after the engine is ready")
    args, extra = ap.parse_known_args()
    if args.fail_on_compile:  # the engine's processes inherit it (longserve/stalls.py)
        os.environ["LONGSERVE_FAIL_ON_COMPILE"] = "1"
    extra = [x for x in extra if x != "--"]
    engine_ap = argparse.ArgumentParser()
    EngineArgs.add_cli_args(engine_ap)
    engine_args = engine_ap.parse_args(extra)
    vocab = vocab_size(engine_args)
    shape = (dict(num_prompts=args.num_prompts, input_len=args.input_len) if args.workload == "uniform" else
             dict(long_num=args.long_num, long_len=args.long_len, short_num=args.short_num,
                  short_len=args.short_len))
    result = dict(workload=dict(kind=args.workload, **shape, output_len=args.output_len),
                  engine_flags=extra, offline=None)
    if not args.skip_offline and args.workload == "uniform":
        result["offline_inproc"] = (None if args.no_inproc else
                                    offline(engine_args, args, vocab, multiprocessing=False))
        result["offline"] = offline(engine_args, args, vocab, multiprocessing=True)
        print(json.dumps({k: result[k] for k in ("offline", "offline_inproc")}), flush=True)
    proc = None
    if args.url is None:
        port = free_port()
        proc = start_server(extra + shlex.split(args.server_args), port, args.server_timeout)
        args.url = f"http://127.0.0.1:{port}"
    try:
        result["rates"] = sweep(args, engine_args.model, vocab, args.url, proc and proc.pid)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if result["offline"]:
        rows, off = result["rates"], result["offline"]
        sat = max(rows, key=lambda r: r["rate"])
        low = min(rows, key=lambda r: r["rate"])
        result["targets"] = dict(saturation_over_offline=round(sat["out_tok_s"] / off["out_tok_s"], 3),
                                 low_load_itl_over_step=round(low["itl_p50_ms"] / off["decode_step_ms"], 3),
                                 offline_mp_over_inproc=round(
                                     off["out_tok_s"] / result["offline_inproc"]["out_tok_s"], 3)
                                 if result["offline_inproc"] else None)
    report(result, args.out)


if __name__ == "__main__":
    main()
