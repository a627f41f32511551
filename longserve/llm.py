"""`LLM`: the offline API, in vLLM's shape."""
from __future__ import annotations

import contextlib
import os
import queue

import torch
from tqdm import tqdm

from longserve.config import (CacheConfig, EngineConfig, KVTransferConfig, ModelConfig,
                              ParallelConfig, SchedulerConfig, parse_dtype)
from longserve.engine.executor import launched_by_torchrun
from longserve.engine.llm_engine import LLMEngine
from longserve.engine.request import RequestOutput
from longserve.inputs import is_token_list
from longserve.models.builtin import DEFAULT_MODEL, model_config, resolve_model
from longserve.sampling_params import SamplingParams


def validate_parallel(p: ParallelConfig, model: ModelConfig, cache: CacheConfig, device: str) -> None:
    for name in ("tensor_parallel_size", "prefill_context_parallel_size",
                 "decode_context_parallel_size", "data_parallel_size",
                 "cp_kv_cache_interleave_size"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    tp, dcp = p.tensor_parallel_size, p.decode_context_parallel_size
    if tp % dcp:
        raise ValueError(f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp}")
    if model.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the {model.num_heads} attention heads")
    if model.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the MLP's intermediate_size="
                         f"{model.intermediate_size}")
    groups = tp // dcp  # KV head groups (see kv_head_range)
    if model.num_kv_heads % groups and groups % model.num_kv_heads:
        raise ValueError(f"{model.num_kv_heads} KV heads cannot be split over tp/dcp={groups} groups")
    if cache.block_size % p.cp_kv_cache_interleave_size:
        raise ValueError(f"cp_kv_cache_interleave_size={p.cp_kv_cache_interleave_size} must divide "
                         f"block_size={cache.block_size}")
    validate_moe_parallel(p, model)
    local = p.data_parallel_size if p.data_parallel_size_local is None else p.data_parallel_size_local
    if (device == "cuda" and local * p.replica_size > torch.cuda.device_count()
            and not launched_by_torchrun()):
        raise ValueError(f"the parallel layout (data_parallel_size x prefill_context_parallel_size x "
                         f"tensor_parallel_size) needs {local * p.replica_size} GPUs; "
                         f"{torch.cuda.device_count()} are visible")


def validate_moe_parallel(p: ParallelConfig, model: ModelConfig) -> None:
    """Expert parallelism, dual-batch overlap and how expert layers split over DP x TP."""
    moe_ranks = p.data_parallel_size * p.tensor_parallel_size
    if p.enable_expert_parallel and not model.is_moe:
        raise ValueError(f"enable_expert_parallel needs a model with expert layers; "
                         f"{model.architecture} has none")
    if p.enable_expert_parallel and model.num_experts % moe_ranks:
        raise ValueError(f"enable_expert_parallel: data_parallel_size x tensor_parallel_size = "
                         f"{moe_ranks} must divide the {model.num_experts} experts")
    if model.is_moe and not p.enable_expert_parallel and model.moe_intermediate_size % moe_ranks:
        raise ValueError(f"data_parallel_size x tensor_parallel_size = {moe_ranks} must divide the "
                         f"expert width {model.moe_intermediate_size} (or enable_expert_parallel)")
    if model.is_moe and p.data_parallel_size > 1 and p.prefill_context_parallel_size > 1:
        raise ValueError("data_parallel_size > 1 with prefill_context_parallel_size > 1 is not "
                         "supported for models with expert layers")
    if p.enable_dbo:
        why = ("the model has no expert layers" if not model.is_moe else
               "prefill_context_parallel_size > 1 splits tokens by position, not by request"
               if p.prefill_context_parallel_size > 1 else
               "sequence parallelism pads the step to a multiple of tensor_parallel_size"
               if p.enable_sequence_parallel else None)
        if why:
            raise ValueError(f"enable_dbo (micro-batching) cannot split this layout: {why}")
    for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
        if not isinstance(getattr(p, name), int) or getattr(p, name) < 2:
            raise ValueError(f"{name} must be an integer >= 2, got {getattr(p, name)!r}")


def build_engine_config(model: str = DEFAULT_MODEL, *, tokenizer: str | None = None,
                        dtype: str | torch.dtype = "auto", device: str | None = None,
                        max_model_len: int | None = None, block_size: int = 16,
                        max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                        gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = True,
                        enable_chunked_prefill: bool = True, enforce_eager: bool = False,
                        seed: int = 0, tensor_parallel_size: int = 1,
                        prefill_context_parallel_size: int = 1,
                        decode_context_parallel_size: int = 1, data_parallel_size: int = 1,
                        cp_kv_cache_interleave_size: int = 1, enable_sequence_parallel: bool = False,
                        num_gpu_blocks: int | None = None, cpu_kv_cache_gb: float = 0.25,
                        attention_backend: str = "auto", load_format: str = "auto",
                        distributed_timeout_s: float = 300.0, enable_expert_parallel: bool = False,
                        enable_dbo: bool = False, dbo_decode_token_threshold: int = 32,
                        dbo_prefill_token_threshold: int = 512, kv_offload_gb: float = 0.0,
                        kv_transfer_config: dict | KVTransferConfig | None = None,
                        async_scheduling: bool | None = None,
                        data_parallel_size_local: int | None = None,
                        data_parallel_start_rank: int = 0,
                        data_parallel_address: str = "127.0.0.1",
                        data_parallel_rpc_port: int = 0,
                        kv_cache_dtype: str = "auto") -> EngineConfig:
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a folder path or 'builtin:<name>', got {type(model).__name__}")
    model = os.fspath(model)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    check_engine_args(locals())  # the arguments so far, by name
    model_cfg = model_with_tokenizer(model, seed, tokenizer)
    if dtype == "auto":
        dtype = torch.float32 if device == "cpu" else (
            torch.bfloat16 if model_cfg.checkpoint_dtype == torch.float32 else model_cfg.checkpoint_dtype)
    max_model_len = resolve_max_model_len(max_model_len, model_cfg.max_position_embeddings)
    cache = CacheConfig(block_size, gpu_memory_utilization, enable_prefix_caching,
                        int(cpu_kv_cache_gb * (1 << 30)), num_gpu_blocks, kv_cache_dtype)
    parallel = ParallelConfig(tensor_parallel_size, prefill_context_parallel_size,
                              decode_context_parallel_size, data_parallel_size,
                              cp_kv_cache_interleave_size, enable_sequence_parallel,
                              distributed_timeout_s, enable_expert_parallel, enable_dbo,
                              dbo_decode_token_threshold, dbo_prefill_token_threshold, 0,
                              data_parallel_size_local, data_parallel_start_rank,
                              data_parallel_address, data_parallel_rpc_port)
    validate_parallel(parallel, model_cfg, cache, device)
    validate_dp_hosts(parallel)
    kv_transfer = build_kv_transfer_config(kv_transfer_config, kv_offload_gb)
    sched = SchedulerConfig(max_num_seqs, max_num_batched_tokens or max(8192, max_num_seqs),
                            max_model_len, enable_chunked_prefill,
                            resolve_async_scheduling(async_scheduling, kv_transfer))
    check_kv_transfer_fits(kv_transfer, enable_prefix_caching, data_parallel_size)
    return EngineConfig(model_cfg, cache, parallel, sched, parse_dtype(dtype), device,
                        enforce_eager, seed, attention_backend, load_format, kv_transfer)


def check_kv_transfer_fits(kv_transfer: KVTransferConfig, prefix_caching: bool, dp_size: int) -> None:
    if kv_transfer.kv_offload_bytes and not prefix_caching:
        raise ValueError("kv_offload_gb needs prefix caching (drop --no-enable-prefix-caching)")
    if (kv_transfer.kv_offload_bytes or kv_transfer.kv_role) and dp_size > 1:
        raise ValueError("KV transfer and kv_offload_gb run with data_parallel_size=1 for now")


def model_with_tokenizer(model: str, seed: int, tokenizer: str | None):
    """The model's config; `tokenizer` (a folder with tokenizer.json, or a .gguf) overrides its own."""
    model_cfg = model_config(resolve_model(model, seed))
    if tokenizer is not None:
        if not (os.path.isdir(tokenizer) or (tokenizer.endswith(".gguf") and os.path.isfile(tokenizer))):
            raise FileNotFoundError(f"tokenizer {tokenizer!r} is neither a folder (with "
                                    "tokenizer.json) nor a .gguf file")
        model_cfg.tokenizer = tokenizer
    return model_cfg


def validate_dp_hosts(p: ParallelConfig) -> None:
    """Data parallelism over several hosts: this host's cores, and where the front end is."""
    local = p.data_parallel_size if p.data_parallel_size_local is None else p.data_parallel_size_local
    if isinstance(local, bool) or not isinstance(local, int) or not 0 <= local <= p.data_parallel_size:
        raise ValueError(f"data_parallel_size_local must be an integer in [0, data_parallel_size="
                         f"{p.data_parallel_size}], got {local!r}")
    start = p.data_parallel_start_rank
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= p.data_parallel_size - local:
        raise ValueError(f"data_parallel_start_rank must be an integer in [0, "
                         f"{p.data_parallel_size - local}], got {start!r}")
    port = p.data_parallel_rpc_port
    if isinstance(port, bool) or not isinstance(port, int) or not (port == 0 or 0 < port < 65534):
        raise ValueError(f"data_parallel_rpc_port must be 0 (free ports) or in [1, 65533], got {port!r}")
    if local < p.data_parallel_size and not port:
        raise ValueError("cores on other hosts (data_parallel_size_local < data_parallel_size) "
                         "need a fixed data_parallel_rpc_port to connect to")
    if p.data_parallel_size > 1 and launched_by_torchrun():
        raise ValueError("data_parallel_size > 1 runs one engine core per DP rank; across hosts "
                         "use --data-parallel-address / --data-parallel-rpc-port (and --headless on "
                         "the other hosts) instead of torchrun")


def resolve_async_scheduling(requested, kv: KVTransferConfig) -> bool:
    """On by default; off (and refused when asked for) with KV transfer / offload (loads and
    saves are tied to the step that reports them)."""
    why = "KV transfer or kv_offload_gb" if kv.kv_role or kv.kv_offload_bytes else None
    if requested is None:
        return why is None
    if not isinstance(requested, bool):
        raise ValueError(f"async_scheduling must be True, False or None, got {requested!r}")
    if requested and why:
        raise ValueError(f"async_scheduling is not supported with {why} (leave it unset)")
    return requested


def build_kv_transfer_config(kv_transfer_config, kv_offload_gb: float) -> KVTransferConfig:
    if not isinstance(kv_offload_gb, (int, float)) or kv_offload_gb < 0:
        raise ValueError(f"kv_offload_gb must be a number >= 0, got {kv_offload_gb!r}")
    if isinstance(kv_transfer_config, KVTransferConfig):
        cfg = kv_transfer_config
    elif isinstance(kv_transfer_config, dict) or kv_transfer_config is None:
        cfg = KVTransferConfig.from_dict(dict(kv_transfer_config or {}))
    else:
        raise TypeError("kv_transfer_config must be a dict or KVTransferConfig, "
                        f"got {type(kv_transfer_config).__name__}")
    if kv_offload_gb:
        cfg.kv_offload_bytes = int(kv_offload_gb * (1 << 30))
    cfg.validate()
    return cfg


def resolve_max_model_len(max_model_len, limit: int) -> int:
    """The model's own limit by default; else an integer in [2, limit]."""
    if max_model_len is None:
        return limit
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) \
            or not 2 <= max_model_len <= limit:
        raise ValueError(f"max_model_len must be an integer in [2, {limit}] (the model's "
                         f"max_position_embeddings), got {max_model_len!r}")
    return max_model_len


ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
MAX_BLOCK_SIZE = 4096


def check_engine_args(args: dict) -> None:
    """Types and ranges of the engine's scalar arguments; the message names the field."""
    def integer(name, lo, hi=None, optional=False):
        v = args[name]
        if optional and v is None:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise ValueError(f"{name} must be an integer in [{lo}, {hi if hi else 'inf'}]"
                             f"{' or None' if optional else ''}, got {v!r}")

    def number(name, lo, hi=None):  # lo < v <= hi
        v = args[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > lo \
                or (hi is not None and not v <= hi):
            raise ValueError(f"{name} must be a number in ({lo}, {hi if hi else 'inf'}], got {v!r}")

    integer("block_size", 1, MAX_BLOCK_SIZE)
    if args["block_size"] & (args["block_size"] - 1):
        raise ValueError(f"block_size must be a power of two, got {args['block_size']}")
    integer("max_num_seqs", 1)
    integer("max_num_batched_tokens", 1, optional=True)
    integer("num_gpu_blocks", 1, optional=True)
    integer("seed", -(1 << 63), (1 << 63) - 1)
    number("gpu_memory_utilization", 0, 1)
    number("cpu_kv_cache_gb", 0)
    number("distributed_timeout_s", 0)
    for name, allowed in (("attention_backend", ATTENTION_BACKENDS), ("load_format", LOAD_FORMATS)):
        if args[name] not in allowed:
            raise ValueError(f"{name} must be one of {list(allowed)}, got {args[name]!r}")
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager",
                 "enable_sequence_parallel"):
        if not isinstance(args[name], bool):
            raise ValueError(f"{name} must be True or False, got {args[name]!r}")


def _next_output(done: queue.SimpleQueue) -> RequestOutput:
    """The next finished request (a bounded wait, so Ctrl-C gets through at once)."""
    while True:
        try:
            item = done.get(timeout=0.1)
        except queue.Empty:
            continue
        if isinstance(item, BaseException):  # its engine core died
            raise item
        return item


class LLM:
    """Offline generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        self.config = build_engine_config(model, **kwargs)
        self.engine = LLMEngine(self.config)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, data_parallel_rank: int | None = None) -> list[RequestOutput]:
        """data_parallel_rank: run every prompt on that DP rank (default: balanced)."""
        if isinstance(prompts, (str, dict)) or is_token_list(prompts):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        requests = [self.engine.make_request(p, sp, data_parallel_rank)
                    for p, sp in zip(prompts, params)]
        done: queue.SimpleQueue = queue.SimpleQueue()
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(requests), desc="generate", disable=not use_tqdm or len(requests) < 2)
        try:
            for req in requests:  # all validated before any is queued
                self.engine.add_request(req, sink=done)
            while len(outputs) < len(requests):
                out = _next_output(done)
                outputs[out.request_id] = out
                bar.update(1)
        except BaseException:
            for req in requests:  # leave nothing behind for the next call
                self.engine.abort(req.request_id)
            raise
        finally:
            bar.close()
        return [outputs[r.request_id] for r in requests]  # n choices each: .outputs[i]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """vLLM's chat: one conversation (a list of {"role": ..., "content": ...}) or a list of
        conversations, each rendered with the model's chat template and generated from."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts "
                             "(one conversation) or of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.engine.encode_chat(c, chat_template, add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.shutdown()
