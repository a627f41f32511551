"""KV transfer between a producer and a consumer process (prefill/decode disaggregation).

--mode raw (default): the transfer path alone on one rank pair (producer on GPU 0, consumer on
GPU 1; gloo on CPU): the producer packs the request's KV pieces (plan_kv_pieces, pack_piece)
in layer chunks and sends them over the pair's process group, the consumer receives and
unpacks them into its own blocks. Compared with the measured send/recv bandwidth of one
contiguous tensor of the same bytes over the same group (target >= 70%).

--mode engine: two real engines (producer on GPU 0, consumer on GPU 1): the producer
prefills the prompt (one token) and holds its blocks; the consumer pulls them and decodes.
Handover = consumer's time to first token, split into: before the load starts, the pair
group's set-up (first request only: built once per rank pair, then reused), control round
trips, the pull (until its last payload arrived), the rest of the load (the last unpack),
the engine noticing it (together:
to_first_step), and the first step (the last prompt token's forward).
--requests N pulls N prompts one after another over the same pair (target: handover <= 2x
the pull); --connect-eagerly: the consumer builds the pair groups at its start (kv_connect).

--mode itl: ITL (time of the steps that advance them) of --decodes running decodes while
--long-prompts prompts of --tokens arrive every --interval steps, until every long prompt
has its first token: both on one GPU (colocated: one engine prefills them between the
decodes, chunked), or prefilled by a producer on GPU 0 and pulled by the decoding instance
on GPU 1 (disaggregated: the decodes share GPU 1 with the pulls and the last prompt token).
Both schedule synchronously (KV transfer needs it) unless --colocated-async.

Default: Llama-3-8B shape (32 layers, 8 KV heads, head_dim 128, bf16), a 32K-token prompt.
CPU check: --device cpu --tokens 512 --layers 2 (raw) / --model builtin:llama-tiny --tokens 200
(engine, itl; itl also --decodes 4 --decode-tokens 40 --long-prompts 2 --interval 10).
"""
import argparse
import contextlib
import datetime
import json
import os
import time

import numpy as np
import torch

os.environ.setdefault("LONGSERVE_ENABLE_MULTIPROCESSING", "0")  # step timings read the core here
import torch.distributed as dist
import torch.multiprocessing as mp

from longserve.kv_transfer.p2p import as_words
from longserve.kv_transfer.topology import KVLayout, plan_kv_pieces
from longserve.kv_transfer.transfer import PieceRange, pack_piece, payload_shape, unpack_piece
from longserve.kv_transfer.transport import PairGroups, make_pair_group


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def raw_side(rank, port, args, results):
    dev = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    group = make_pair_group(store, "bench", rank, dev, 120)
    layout = KVLayout(args.kv_heads, args.block_size, cache_layout=args.layout)
    nb = -(-args.tokens // args.block_size)
    torch.manual_seed(0)
    blocks = torch.randperm(nb + 8)[:nb].tolist()
    shape = (2, nb + 8, args.block_size, args.kv_heads, args.head_dim)
    caches = [as_words(torch.randn(shape, device=dev, dtype=torch.bfloat16) if rank == 0 else
                       torch.zeros(shape, device=dev, dtype=torch.bfloat16)) for _ in range(args.layers)]  # as the connector
    piece = plan_kv_pieces(layout, layout, 0)[0]
    rng = PieceRange(0, args.tokens, tuple(blocks), tuple(blocks))
    chunks = [slice(i, min(i + args.layers_per_chunk, args.layers)) for i in range(0, args.layers, args.layers_per_chunk)]
    nbytes = sum(c[:, :nb].numel() * c.element_size() for c in caches)
    flat = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)

    def baseline():
        (group.send([flat], 1, 0) if rank == 0 else group.recv([flat], 0, 0)).wait()

    pairs = PairGroups(dev, 120)

    def transfer():  # as P2pConnectorWorker._serve / _pull: pipelined layer chunks
        if rank == 0:
            pairs.send_all(group, (pack_piece(caches[c], piece, layout, layout, rng) for c in chunks))
            return
        def buffer(c):
            shape = payload_shape(piece, layout, layout, rng, c.stop - c.start, caches[0].shape[-1])
            return lambda: torch.empty(shape, dtype=caches[0].dtype, device=dev)
        pairs.recv_all(group, [buffer(c) for c in chunks],
                       lambda i, buf: unpack_piece(caches[chunks[i]], piece, layout, layout, rng, buf))

    times = {}
    for name, fn in (("send/recv one tensor", baseline), ("KV transfer path", transfer)):
        fn()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(args.repeat):
            fn()
        sync(dev)
        times[name] = (time.perf_counter() - t0) / args.repeat
    results.put((rank, times, nbytes))


def d2d_copy_s(nbytes: int, repeat: int) -> float | None:
    """The plain device-to-device copy of `nbytes` from GPU 0 to GPU 1 in one process (the
    link's practical ceiling), seconds; None without two GPUs."""
    if torch.cuda.device_count() < 2:
        return None
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda:0")
    dst = torch.empty_like(src, device="cuda:1")
    dst.copy_(src)  # peer access and the copy engine's first use
    for d in (0, 1):
        torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src)
    for d in (0, 1):
        torch.cuda.synchronize(d)
    return (time.perf_counter() - t0) / repeat


def run_raw(args):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=raw_side, args=(r, store.port, args, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = [results.get(timeout=600) for _ in range(2)]
    for p in procs:
        p.join(60)
    times = next(t for r, t, _ in out if r == 1)  # the consumer's view: until its blocks hold the KV
    nbytes = out[0][2]
    base = times["send/recv one tensor"]
    copy = d2d_copy_s(nbytes, args.repeat) if args.device == "cuda" else None
    if copy is not None:
        times = {"plain device-to-device copy (one process)": copy, **times}
    print(f"{nbytes / (1 << 30):.2f} GiB of KV ({args.tokens} tokens, {args.layers} layers) on {args.device}")
    print("| path | time (ms) | GB/s | of send/recv | of the plain copy |\n| --- | --- | --- | --- | --- |")
    for name, t in times.items():
        of_copy = f"{copy / t:.0%}" if copy else "-"
        print(f"| {name} | {1000 * t:.1f} | {nbytes / t / 1e9:.1f} | {base / t:.0%} | {of_copy} |")
    print(json.dumps({"bytes": nbytes, **{k: round(v, 5) for k, v in times.items()}}))


def engine_llm(role, args, gpu):
    if args.device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    from longserve import LLM
    kvt = {"kv_role": role, "kv_lease_s": 120, "kv_transfer_timeout_s": 120}
    if args.connect_eagerly:  # the consumer builds the pair groups at its start
        kvt.update({"kv_port": args.kv_port} if role == "kv_producer" else
                   {"kv_connect": [f"127.0.0.1:{args.kv_port}"]})
    kw = dict(device=args.device, max_model_len=args.tokens + 64, enable_prefix_caching=False,
              kv_transfer_config=kvt)
    if args.model.endswith("-shape"):
        kw.update(load_format="dummy", dtype="bfloat16")
    llm = LLM(args.model, **kw)
    rng = np.random.default_rng(0)
    vocab = llm.config.model.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(10, vocab - 10, args.tokens).tolist()}
               for _ in range(args.requests)]
    return llm, prompts


def producer_side(args, conn):
    from longserve import SamplingParams
    llm, prompts = engine_llm("kv_producer", args, "0")
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]["prompt_token_ids"][:64]}], one, use_tqdm=False)
    prof = None
    while True:
        if conn.poll(0.05):
            msg = conn.recv()
            if prof is not None:  # the previous request's pull is over
                prof.stop()
                prof.export_chrome_trace(os.path.join(args.profile, "producer.json"))
                prof = None
            if msg == "stop":
                break
            t0 = time.perf_counter()
            out = llm.generate([prompts[msg]], one, use_tqdm=False)[0]
            if args.profile and msg == 1:
                prof = profiler()
                prof.start()
            conn.send((out.kv_transfer_params, time.perf_counter() - t0))
    llm.shutdown()


def profiler():
    """--profile: the second request's handover, every thread's ops and the device's kernels."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile
    cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    return profile(activities=[ProfilerActivity.CPU, *cuda], with_stack=False,
                   experimental_config=_ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True))


def record_steps(engine) -> list:
    """Wrap the executor: (start, end) of every step that ran a non-empty plan (launch to result)."""
    steps, launch = [], engine.executor.execute_async

    def timed(out):
        t0, pending = time.perf_counter(), launch(out)
        if not out.is_empty:
            result = pending.result

            def timed_result():
                r = result()
                steps.append((t0, time.perf_counter()))
                return r
            pending.result = timed_result
        return pending
    engine.executor.execute_async = timed
    return steps


def handover_parts(out, timing: dict, steps: list) -> dict:
    """Split the consumer's time to first token (s): before the load starts, the load's
    parts (group set-up, control round trips, the pull, the rest of the load), the engine
    noticing the load is done, and the first step (the last prompt token)."""
    first = next(s for s in steps if s[0] >= timing["end"])
    ttft = out.metrics["time_to_first_token"]
    arrival = first[1] - ttft  # the first token is stamped as that step returns
    load = timing["end"] - timing["start"]
    control = timing["post_s"] + timing["status_s"]
    parts = dict(before_load=timing["start"] - arrival, group_setup=timing["setup_s"],
                 post=timing["post_s"], status=timing["status_s"], pull=timing["pull_s"],
                 load_other=load - timing["setup_s"] - control - timing["pull_s"],
                 notice=first[0] - timing["end"], first_step=first[1] - first[0])
    return dict(parts, to_first_step=ttft - parts["first_step"], handover=ttft)


def consumer_side(args, conn):
    from longserve import SamplingParams
    llm, prompts = engine_llm("kv_consumer", args, "1")
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]["prompt_token_ids"][:64]}],
                 SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    worker = llm.engine.core.executor.driver.runner.kv_connector  # rank 0's connector (in this process)
    steps, rows = record_steps(llm.engine.core), []
    for i in range(args.requests):
        conn.send(i)
        params = conn.recv()
        created = worker.groups.num_created
        prof = profiler() if args.profile and i == 1 else contextlib.nullcontext()
        with prof:
            out = llm.generate([prompts[i]], SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": params},
                                                            **greedy), use_tqdm=False)[0]
        if args.profile and i == 1:
            prof.export_chrome_trace(os.path.join(args.profile, "consumer.json"))
        assert out.error is None and len(out.outputs[0].token_ids) == 2, out
        timing = worker.timings[out.request_id]
        assert timing["ok"], "the pull failed (the prompt was recomputed): see the log"
        row = handover_parts(out, timing, steps)
        rows.append(dict(row, groups_created=worker.groups.num_created - created))
    conn.send((rows, llm.engine.core_stats()))
    llm.shutdown()


def run_engine(args):
    from longserve.engine.executor import free_port
    args.kv_port = free_port()
    ctx = mp.get_context("spawn")
    (p_conn, p_child), (c_conn, c_child) = ctx.Pipe(), ctx.Pipe()
    procs = [ctx.Process(target=producer_side, args=(args, p_child)),
             ctx.Process(target=consumer_side, args=(args, c_child))]
    for p in procs:
        p.start()
    prefill_s = []
    while True:  # relay: the consumer asks for request i, the producer prefills it
        msg = c_conn.recv()
        if isinstance(msg, tuple):
            rows, stats = msg
            break
        p_conn.send(msg)
        params, secs = p_conn.recv()
        prefill_s.append(secs)
        c_conn.send(params)
    p_conn.send("stop")
    for p in procs:
        p.join(120)
    print(f"pair groups built {'at the consumer start (kv_connect)' if args.connect_eagerly else 'at the first pull'}")
    print(f"prompt {args.tokens} tokens on {args.device}; producer prefill "
          f"{', '.join(f'{1000 * s:.0f}' for s in prefill_s)} ms; consumer loaded "
          f"{stats.get('kv_connector_num_loaded_tokens')} tokens, computed {stats['num_prompt_tokens_computed']}")
    names = list(rows[0])
    print("| request | " + " | ".join(f"{n} (ms)" if n != "groups_created" else n for n in names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for i, r in enumerate(rows):
        label = f"#{i + 1}" + (" (first on the pair)" if i == 0 else "")
        print(f"| {label} | " + " | ".join(f"{1000 * r[n]:.1f}" if n != "groups_created" else str(r[n])
                                           for n in names) + " |")
    for i, r in enumerate(rows):
        print(f"request {i + 1}: until the first step starts / pull = {r['to_first_step'] / r['pull']:.2f}x "
              f"(target <= 2x); time to first token / pull = {r['handover'] / r['pull']:.2f}x")
    print(json.dumps({"prefill_s": prefill_s, "handover": rows, **stats}))


# ---- ITL of running decodes while long prompts arrive ---------------------------------------
def itl_engine(args, kv_role=None, gpu="0"):
    if args.device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    from longserve import LLM
    kw = dict(device=args.device, max_model_len=args.tokens + args.decode_tokens + 64)
    if kv_role:
        kw["kv_transfer_config"] = {"kv_role": kv_role, "kv_lease_s": 300, "kv_transfer_timeout_s": 300}
    else:  # as the consumer (KV transfer runs synchronously), unless --colocated-async
        kw["async_scheduling"] = args.colocated_async
    if args.model.endswith("-shape"):
        kw.update(load_format="dummy", dtype="bfloat16")
    llm = LLM(args.model, **kw)
    vocab = llm.config.model.vocab_size
    rng = np.random.default_rng(0)
    long_prompts = [{"prompt_token_ids": rng.integers(10, vocab - 10, args.tokens).tolist()}
                    for _ in range(args.long_prompts)]
    return llm, long_prompts


def itl_decode_loop(llm, args, arrive, ready):
    """Run --decodes decodes; long prompt k arrives at step k * --interval (arrive(k)); ready()
    gives the requests to add now (long prompts whose prefill is done elsewhere, or those
    just arrived). Runs until every long prompt has its first token and the decodes made
    --decode-tokens tokens. Returns the times (s) of the steps that advanced the decodes."""
    from longserve import SamplingParams
    room = llm.config.scheduler.max_model_len - 8
    with llm.engine.client.paused() as core:  # this thread steps the core

        def add(req):
            core.add_request(req)
            return core.scheduler.requests[req.request_id]
        decodes = [add(llm.engine.make_request({"prompt_token_ids": [5 + i, 6, 7, 8]}, SamplingParams(
            temperature=0, max_tokens=room, ignore_eos=True))) for i in range(args.decodes)]
        while any(r.num_computed_tokens == 0 for r in decodes):
            core.step()
        longs, times, step = [], [], 0
        while step < args.decode_tokens or len(longs) < args.long_prompts or not all(r.is_finished for r in longs):
            if step % args.interval == 0 and step // args.interval < args.long_prompts:
                arrive(step // args.interval)
            longs += [add(req) for req in ready()]
            before = [len(r.output_token_ids) for r in decodes]
            t = time.perf_counter()
            core.step()
            if any(len(r.output_token_ids) > b for r, b in zip(decodes, before)):
                times.append(time.perf_counter() - t)
            step += 1
        core.abort_requests([r.request_id for r in decodes])
    return times


def itl_producer(args, conn):
    """Prefill the long prompts the consumer asks for, in order; hold their KV for the pulls."""
    from longserve import SamplingParams
    llm, prompts = itl_engine(args, "kv_producer", "0")
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    conn.send("ready")
    while True:
        if conn.poll(0.05):
            k = conn.recv()
            if k == "stop":
                break
            conn.send(llm.generate([prompts[k]], one, use_tqdm=False)[0].kv_transfer_params)
    llm.shutdown()


def itl_decoder(args, peer, result):
    """Run the decodes; long prompts are prefilled here (peer None: colocated) or by the
    producer at the other end of `peer` and pulled (disaggregated)."""
    from longserve import SamplingParams
    llm, prompts = itl_engine(args, "kv_consumer" if peer else None, "1" if peer else "0")
    eng, arrived, pulled = llm.engine, [], []

    def params(extra=None):
        return SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                              extra_args=extra and {"kv_transfer_params": extra})

    def arrive(k):
        if peer:
            peer.send(k)
        else:
            arrived.append(eng.make_request(prompts[k], params()))

    def ready():
        while peer and peer.poll(0):  # the producer answers in order
            pulled.append(eng.make_request(prompts[len(pulled)], params(peer.recv())))
            arrived.append(pulled[-1])
        out = arrived[:]
        arrived.clear()
        return out
    if peer:
        assert peer.recv() == "ready"
    t0 = time.perf_counter()
    times = itl_decode_loop(llm, args, arrive, ready)
    result.send((times, time.perf_counter() - t0, llm.engine.core_stats()))
    if peer:
        peer.send("stop")
    llm.shutdown()


def run_itl(args):
    ctx = mp.get_context("spawn")
    rows = {}
    for mode in ("colocated", "disaggregated") if args.itl_mode == "both" else (args.itl_mode,):
        result, result_child = ctx.Pipe()
        procs = []
        if mode == "colocated":
            procs.append(ctx.Process(target=itl_decoder, args=(args, None, result_child)))
        else:
            p_end, d_end = ctx.Pipe()
            procs.append(ctx.Process(target=itl_producer, args=(args, p_end)))
            procs.append(ctx.Process(target=itl_decoder, args=(args, d_end, result_child)))
        for p in procs:
            p.start()
        while not result.poll(1):  # a side that died fails the run instead of hanging it
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit(f"{mode}: a process failed (exit codes {[p.exitcode for p in procs]})")
        times, wall, stats = result.recv()
        for p in procs:
            p.join(120)
        ms = 1000 * np.asarray(times)
        rows[mode] = dict(itl_p50_ms=float(np.percentile(ms, 50)), itl_p99_ms=float(np.percentile(ms, 99)),
                          itl_max_ms=float(ms.max()), steps=len(ms), wall_s=wall,
                          loaded_tokens=stats.get("kv_connector_num_loaded_tokens", 0))
    print(f"{args.decodes} running decodes (at least {args.decode_tokens} steps), {args.long_prompts} prompts of "
          f"{args.tokens} tokens arriving every {args.interval} steps, on {args.device}")
    print("| mode | ITL p50 (ms) | ITL p99 (ms) | max (ms) | decode steps | wall (s) | KV tokens pulled |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode, r in rows.items():
        print(f"| {mode} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['itl_max_ms']:.1f} | "
              f"{r['steps']} | {r['wall_s']:.1f} | {r['loaded_tokens']} |")
    print(json.dumps(rows))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["raw", "engine", "itl"], default="raw")
    ap.add_argument("--requests", type=int, default=2, help="engine: requests on the same pair, one after another")
    ap.add_argument("--profile", metavar="DIR",
                    help="engine: a torch profiler trace of the second request's handover on each side (DIR/consumer.json, DIR/producer.json)")
    ap.add_argument("--connect-eagerly", action="store_true",
                    help="engine: the consumer builds its pair groups at start (kv_connect)")
    ap.add_argument("--itl-mode", default="both", choices=["both", "colocated", "disaggregated"],
                    help="itl: which set-ups to run (one per call keeps each call short)")
    ap.add_argument("--colocated-async", action="store_true",
                    help="itl: the colocated engine schedules asynchronously (default: synchronously, as the consumer)")
    ap.add_argument("--decodes", type=int, default=16, help="itl: running decode requests")
    ap.add_argument("--decode-tokens", type=int, default=256, help="itl: steps the decodes run at least")
    ap.add_argument("--long-prompts", type=int, default=4, help="itl: long prompts that arrive")
    ap.add_argument("--interval", type=int, default=40, help="itl: steps between long prompts")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layout", default="NHD", choices=["NHD", "HND"])
    ap.add_argument("--layers-per-chunk", type=int, default=8, help="as the p2p connector: layers / 4")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default="builtin:llama3-8b-shape")
    args = ap.parse_args()
    {"raw": run_raw, "engine": run_engine, "itl": run_itl}[args.mode](args)


if __name__ == "__main__":
    main()
