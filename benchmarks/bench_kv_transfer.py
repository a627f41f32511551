"""KV transfer between a producer and a consumer process (prefill/decode disaggregation).

--mode raw (default): the transfer path alone on one rank pair (producer on GPU 0, consumer on
GPU 1; gloo on CPU): the producer packs the request's KV pieces (plan_kv_pieces, pack_piece)
in layer chunks and sends them over the pair's process group, the consumer receives and
unpacks them into its own blocks. Compared with the measured send/recv bandwidth of one
contiguous tensor of the same bytes over the same group (target >= 70%).

--mode engine: two real engines (producer on GPU 0, consumer on GPU 1): the producer
prefills the prompt (one token) and holds its blocks; the consumer pulls them and decodes.
Handover = consumer's time to first token (pull + one-token forward), against the raw
transfer time of the same bytes (target <= 2x).

Default: Llama-3-8B shape (32 layers, 8 KV heads, head_dim 128, bf16), a 32K-token prompt.
CPU check: --device cpu --tokens 512 --layers 2 (raw) / --model builtin:llama-tiny (engine).
"""
import argparse
import datetime
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
    caches = [torch.randn(shape, device=dev, dtype=torch.bfloat16) if rank == 0 else
              torch.zeros(shape, device=dev, dtype=torch.bfloat16) for _ in range(args.layers)]
    piece = plan_kv_pieces(layout, layout, 0)[0]
    rng = PieceRange(0, args.tokens, tuple(blocks), tuple(blocks))
    chunks = [slice(i, min(i + args.layers_per_chunk, args.layers)) for i in range(0, args.layers, args.layers_per_chunk)]
    nbytes = sum(c[:, :nb].numel() * 2 for c in caches)
    flat = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)

    def baseline():
        (group.send([flat], 1, 0) if rank == 0 else group.recv([flat], 0, 0)).wait()

    pairs = PairGroups(dev, 120)

    def transfer():  # as P2pConnectorWorker._serve / _pull: pipelined layer chunks
        if rank == 0:
            pairs.send_all(group, (pack_piece(caches[c], piece, layout, layout, rng) for c in chunks))
            return
        def buffer(c):
            shape = payload_shape(piece, layout, layout, rng, c.stop - c.start, args.head_dim)
            return lambda: torch.empty(shape, dtype=torch.bfloat16, device=dev)
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
    print(f"{nbytes / (1 << 30):.2f} GiB of KV ({args.tokens} tokens, {args.layers} layers) on {args.device}")
    print("| path | time (ms) | GB/s | of send/recv |\n| --- | --- | --- | --- |")
    for name, t in times.items():
        print(f"| {name} | {1000 * t:.1f} | {nbytes / t / 1e9:.1f} | {base / t:.0%} |")
    print(json.dumps({"bytes": nbytes, **{k: round(v, 5) for k, v in times.items()}}))


def engine_side(role, args, conn):
    if args.device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = "0" if role == "kv_producer" else "1"
    from longserve import LLM, SamplingParams
    kw = dict(device=args.device, max_model_len=args.tokens + 64, enable_prefix_caching=False,
              kv_transfer_config={"kv_role": role, "kv_lease_s": 120, "kv_transfer_timeout_s": 120})
    if args.model.endswith("-shape"):
        kw.update(load_format="dummy", dtype="bfloat16")
    llm = LLM(args.model, **kw)
    vocab = llm.config.model.vocab_size
    prompt = {"prompt_token_ids": np.random.default_rng(0).integers(10, vocab - 10, args.tokens).tolist()}
    greedy = dict(temperature=0, ignore_eos=True)
    if role == "kv_producer":
        llm.generate([{"prompt_token_ids": prompt["prompt_token_ids"][:64]}], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
        t0 = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)[0]
        conn.send((out.kv_transfer_params, time.perf_counter() - t0))
        while not conn.poll(0.001) or conn.recv() != "stop":
            if llm.engine.has_kv_transfers():
                llm.engine.step()
    else:
        llm.generate([{"prompt_token_ids": prompt["prompt_token_ids"][:64]}], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
        params = conn.recv()
        out = llm.generate([prompt], SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": params}, **greedy),
                           use_tqdm=False)[0]
        conn.send((out.metrics["time_to_first_token"], llm.engine.stats()))
    llm.shutdown()


def run_engine(args):
    ctx = mp.get_context("spawn")
    (p_conn, p_child), (c_conn, c_child) = ctx.Pipe(), ctx.Pipe()
    procs = [ctx.Process(target=engine_side, args=("kv_producer", args, p_child)),
             ctx.Process(target=engine_side, args=("kv_consumer", args, c_child))]
    for p in procs:
        p.start()
    params, prefill_s = p_conn.recv()
    c_conn.send(params)
    handover_s, stats = c_conn.recv()
    p_conn.send("stop")
    for p in procs:
        p.join(120)
    print(f"prompt {args.tokens} tokens: producer prefill {prefill_s * 1000:.1f} ms; consumer time to "
          f"first token (pull + one-token step) {handover_s * 1000:.1f} ms; loaded "
          f"{stats.get('kv_connector_num_loaded_tokens')} tokens, computed {stats['num_prompt_tokens_computed']}")
    print(json.dumps({"prefill_s": prefill_s, "handover_s": handover_s, **stats}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["raw", "engine"], default="raw")
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
    run_raw(args) if args.mode == "raw" else run_engine(args)


if __name__ == "__main__":
    main()
