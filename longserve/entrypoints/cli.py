"""The `longserve` command: `generate`, `chat`, `bench` and `serve`, with vLLM's flag names."""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from longserve.engine_args import EngineArgs


def make_llm(args):
    from longserve import LLM
    return LLM(**vars(EngineArgs.from_cli_args(args)))


def sampling_from_args(args):
    from longserve import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.sampling_seed,
                          ignore_eos=args.ignore_eos, stop=args.stop or None)


DEFAULT_CHAT_PROMPTS = ["What is the capital of France?", "Name three primary colors."]
DEFAULT_PROMPTS = ["Once upon a time", "Context parallelism splits a prompt"]


def cmd_generate(args) -> None:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    t0 = time.perf_counter()
    llm = make_llm(args)
    t_load = time.perf_counter() - t0
    # with no prompts given, a model with a chat template is asked questions
    chat = args.chat or (not prompts and llm.engine.tokenizer_info.chat_template is not None)
    prompts = prompts or (DEFAULT_CHAT_PROMPTS if chat else DEFAULT_PROMPTS)
    t1 = time.perf_counter()
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sampling_from_args(args))
        for o, p in zip(outs, prompts):
            o.prompt = p  # print the question, not the rendered template
    else:
        outs = llm.generate(prompts, sampling_from_args(args))
    elapsed = time.perf_counter() - t1
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        print(json.dumps({"prompt": o.prompt, "text": o.outputs[0].text,
                          "finish_reason": o.outputs[0].finish_reason}))
    ttft = [o.metrics["time_to_first_token"] for o in outs]
    print(f"model {args.model} on {llm.config.device} ({llm.config.dtype}): load {t_load:.2f} s, "
          f"{len(outs)} prompts, {n_out} tokens in {elapsed:.2f} s ({n_out / elapsed:.1f} tok/s), "
          f"mean time to first token {1000 * float(np.mean(ttft)):.1f} ms", file=sys.stderr)
    llm.shutdown()


def cmd_chat(args) -> None:
    """`longserve chat`: one answer per line of stdin, the history kept (streamed on a terminal, a
    JSON line each when piped); with --prompt or --prompt-file, generate --chat."""
    if args.prompt or args.prompt_file:
        return cmd_generate(args)
    llm, params, history, tty = make_llm(args), sampling_from_args(args), [], sys.stdin.isatty()
    try:
        for line in iter(lambda: _read_line(tty), None):
            history.append({"role": "user", "content": line})
            request = llm.engine.make_request(llm.engine.encode_chat(history), params)
            answer = ""
            for out in llm.engine.add_request(request):
                answer += out.text
                print(out.text if tty else "", end="", flush=True)
            print("" if tty else json.dumps({"prompt": line, "text": answer,
                                             "finish_reason": out.finish_reason}), flush=True)
            history.append({"role": "assistant", "content": answer})
    except KeyboardInterrupt:
        print(file=sys.stderr)
    finally:
        llm.shutdown()


def _read_line(tty: bool) -> str | None:
    while True:
        try:
            line = input("> " if tty else "").strip()
        except EOFError:
            return None
        if line:
            return line


def cmd_bench(args) -> None:
    from longserve import SamplingParams
    llm = make_llm(args)
    rng = np.random.default_rng(args.seed)
    vocab = llm.config.model.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(10, vocab - 10, args.input_len).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = np.array([o.metrics["time_to_first_token"] for o in outs])
    result = dict(model=args.model, device=llm.config.device, num_prompts=args.num_prompts,
                  input_len=args.input_len, output_len=args.output_len, elapsed_s=round(elapsed, 3),
                  output_tok_s=round(n_out / elapsed, 1),
                  total_tok_s=round((n_out + args.num_prompts * args.input_len) / elapsed, 1),
                  ttft_mean_ms=round(1000 * float(ttft.mean()), 2),
                  ttft_p50_ms=round(1000 * float(np.median(ttft)), 2))
    print(json.dumps(result))
    llm.shutdown()


def engine_config(args):
    return EngineArgs.from_cli_args(args).create_engine_config()


def cmd_serve(args) -> None:
    """`longserve serve MODEL`: the OpenAI-compatible HTTP server (see entrypoints/openai);
    with --headless, only this host's engine cores of a multi-host DP deployment."""
    import logging

    from longserve.engine.llm_engine import LLMEngine
    from longserve.entrypoints.openai.api_servers import bound_socket, run_api_servers
    args.model = args.model_tag or args.model
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.headless:
        from longserve.engine.core_client import run_headless
        sys.exit(run_headless(engine_config(args)))
    server_kw = dict(served_names=args.served_model_name or [args.model], host=args.host, port=args.port,
                     api_key=args.api_key, chat_template=args.chat_template,
                     shutdown_timeout=args.shutdown_timeout, log_level=args.uvicorn_log_level,
                     log_requests=args.enable_log_requests, max_request_body_mb=args.max_request_body_mb)
    count = args.api_server_count or (1 if args.data_parallel_rpc_port else args.data_parallel_size)
    if count > 1:
        if args.data_parallel_rpc_port:
            raise ValueError("--api-server-count > 1 does not work with --data-parallel-rpc-port yet")
        sys.exit(run_api_servers(engine_config(args), count, args.max_waiting, server_kw))
    sock = bound_socket(args.host, args.port)  # a taken port fails here, before any model loads
    from longserve.entrypoints.openai.api_server import run_server
    sys.exit(run_server(lambda: LLMEngine(engine_config(args), max_waiting=args.max_waiting), sock=sock,
                        **server_kw))


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", help="the model (same as --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on /v1")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use (default: the model argument)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file or text); default: the tokenizer's")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests waiting to run before new ones get 503")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds the server may take to stop after Ctrl-C / SIGTERM: requests in "
                        "flight drain until a second before it, then end with an error")
    p.add_argument("--max-request-body-mb", type=float, default=8.0,
                   help="a larger request body gets 413 before it is read")
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log one INFO line per request (id, prompt tokens, sampling params)")
    p.add_argument("--api-server-count", "-asc", type=int, default=None,
                   help="API-server processes on the port, each a front end to every engine core "
                        "(default: the DP size; 1 with --data-parallel-rpc-port)")
    p.add_argument("--headless", action="store_true",
                   help="run only this host's engine cores (they connect to the front end at "
                        "--data-parallel-address:--data-parallel-rpc-port)")


def add_generate_args(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompt-file", help="a file with one prompt per line")
    for flag, type_, default in (("--max-tokens", int, 32), ("--temperature", float, 0.0), ("--top-k", int, 0),
                                 ("--top-p", float, 1.0), ("--sampling-seed", int, None)):
        gen.add_argument(flag, type=type_, default=default)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the model's chat template")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="longserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, doc in (("generate", "generate text for prompts"),
                      ("chat", "a conversation on stdin (a terminal or a pipe); --prompt: generate --chat")):
        gen = sub.add_parser(name, help=doc)
        EngineArgs.add_cli_args(gen)
        add_generate_args(gen)
        gen.set_defaults(func=cmd_chat if name == "chat" else cmd_generate, chat=name == "chat")
    bench = sub.add_parser("bench", help="offline throughput and time to first token")
    EngineArgs.add_cli_args(bench)
    for flag, default in (("--input-len", 128), ("--output-len", 32), ("--num-prompts", 16)):
        bench.add_argument(flag, type=int, default=default)
    bench.set_defaults(func=cmd_bench)
    serve = sub.add_parser("serve", help="serve the OpenAI HTTP API (completions, chat, metrics)")
    EngineArgs.add_cli_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    proxy = sub.add_parser("proxy", help="one endpoint in front of a prefill and a decode instance")
    from longserve.entrypoints.proxy import add_proxy_args, cmd_proxy
    add_proxy_args(proxy)
    proxy.set_defaults(func=cmd_proxy)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, TypeError, RuntimeError) as e:
        print(f"longserve: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
