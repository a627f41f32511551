"""EngineArgs: every engine argument declared once (default, checks, help), as `LLM`'s keywords and
the command's engine flags; `create_engine_config` checks the rules between them."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields

import torch

from longserve.config import (KV_CACHE_DTYPES, KV_ROLES, CacheConfig, EngineConfig, KVTransferConfig,
                              ModelConfig, ParallelConfig, SchedulerConfig, parse_dtype, refuse)
from longserve.distributed.parallel_state import launched_by_torchrun
from longserve.models.builtin import DEFAULT_MODEL, model_config, resolve_model

ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
MAX_BLOCK_SIZE = 4096


# A check is (does a value pass, what a value must be): "{name} must be {what}, got {value!r}".
def require(name: str, value, check) -> None:
    refuse(not check[0](value), f"{name} must be {check[1]}, got {value!r}")


def integer(lo: int, hi: int | None = None, optional: bool = False, what: str | None = None):
    what = what or f"an integer in [{lo}, {'inf' if hi is None else hi}]{' or None' if optional else ''}"
    return (lambda v: (optional and v is None) or (isinstance(v, int) and not isinstance(v, bool)
                                                    and lo <= v and (hi is None or v <= hi))), what


def number(lo: float, hi: float | None = None):  # lo < v <= hi
    return (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > lo
            and (hi is None or v <= hi)), f"a number in ({lo}, {'inf' if hi is None else hi}]"


POSITIVE, DBO_THRESHOLD = integer(1, what="a positive integer"), integer(2, what="an integer >= 2")
BOOL_OR_NONE = (lambda v: v is None or isinstance(v, bool), "True, False or None")  # None: the default rule


def arg(default, *checks, help: str | None = None, flags: tuple[str, ...] = (), **cli):
    """An EngineArgs field. flags: aliases of its --field-name; cli: add_argument's type, choices
    or action. A bool must be one; a value with choices, one of them."""
    if isinstance(default, bool):
        checks = ((lambda v: isinstance(v, bool), "True or False"), *checks)
    if "choices" in cli:
        checks = (*checks, (lambda v: v in cli["choices"], f"one of {list(cli['choices'])}"))
    return field(default=default, metadata=dict(checks=checks, help=help, flags=flags, cli=cli))


def kv_transfer_json(text: str) -> dict:
    if f"kv_{text}" in KV_ROLES:  # shorthand: producer, consumer, both
        return {"kv_role": f"kv_{text}"}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--kv-transfer-config is neither JSON nor producer / consumer / "
                                         f"both: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--kv-transfer-config must be a JSON object")
    return value


@dataclass
class EngineArgs:
    """vLLM's engine arguments: a field's bad value is refused at construction, naming it."""
    model: str = arg(DEFAULT_MODEL, help="HF-format folder, a .gguf file, smollm2 (the default: "
                     "SmolLM2-135M-Instruct, fetched once) or builtin:<name> (random weights)")
    tokenizer: str | None = arg(None, help="a folder with tokenizer.json (or a .gguf) instead of the model's")
    dtype: str | torch.dtype = arg("auto", help="auto, float32, bfloat16, float16")
    device: str | None = arg(None, (lambda v: not v or v in ("cpu", "cuda"), "'cpu' or 'cuda'"),
                             help="cpu or cuda (default: cuda when available)")
    max_model_len: int | None = arg(None, type=int, help="default: the model's max_position_embeddings")
    block_size: int = arg(16, integer(1, MAX_BLOCK_SIZE), (lambda v: v & (v - 1) == 0, "a power of two"))
    max_num_seqs: int = arg(256, integer(1))
    max_num_batched_tokens: int | None = arg(None, integer(1, optional=True), type=int,
                                             help="tokens per step (default: max(8192, max_num_seqs))")
    gpu_memory_utilization: float = arg(0.9, number(0, 1))
    cpu_kv_cache_gb: float = arg(0.25, number(0))
    num_gpu_blocks: int | None = arg(None, integer(1, optional=True), type=int,
                                     help="KV cache blocks (default: as many as memory holds)")
    kv_cache_dtype: str = arg("auto", choices=tuple(KV_CACHE_DTYPES), help="auto (the model's dtype) or fp8")
    enable_prefix_caching: bool = arg(True)
    enable_chunked_prefill: bool = arg(True)
    long_prefill_token_threshold: int = arg(0, integer(0), help="most tokens of one prompt in a step, "
                                            "leaving the rest to the prompts behind it (0: no cap)")
    enforce_eager: bool = arg(False, help="no CUDA graphs")
    async_scheduling: bool | None = arg(
        None, BOOL_OR_NONE, action=argparse.BooleanOptionalAction,
        help="plan step N+1 while the device runs step N (default: on where supported)")
    seed: int = arg(0, integer(-(1 << 63), (1 << 63) - 1))
    load_format: str = arg("auto", choices=LOAD_FORMATS, help="dummy: seeded random weights "
                           "(benchmarks at real shapes)")
    attention_backend: str = arg("auto", choices=ATTENTION_BACKENDS)
    tensor_parallel_size: int = arg(1, POSITIVE, flags=("-tp",))
    prefill_context_parallel_size: int = arg(1, POSITIVE, flags=("-pcp",))
    decode_context_parallel_size: int = arg(1, POSITIVE, flags=("-dcp",))
    data_parallel_size: int = arg(1, POSITIVE, flags=("-dp",))
    data_parallel_size_local: int | None = arg(None, type=int, flags=("-dpl",),
                                               help="engine cores (DP ranks) on this host (default: all)")
    data_parallel_start_rank: int = arg(0, flags=("-dpr",), help="the first DP rank on this host (headless hosts)")
    data_parallel_address: str = arg("127.0.0.1", flags=("-dpa",),
                                     help="the front end's host: engine cores of other hosts connect to it")
    data_parallel_rpc_port: int = arg(
        0, integer(0, 65533, what="0 (free ports) or in [1, 65533]"), flags=("-dpp",),
        help="the front end's port for its engine cores (and the next two); 0: free ports")
    cp_kv_cache_interleave_size: int = arg(1, POSITIVE)
    enable_sequence_parallel: bool = arg(False)
    enable_expert_parallel: bool = arg(False, help="shard the experts of MoE layers over the DP x TP ranks")
    enable_dbo: bool = arg(False, help="dual-batch overlap: split large MoE steps into two micro-batches")
    dbo_decode_token_threshold: int = arg(32, DBO_THRESHOLD)
    dbo_prefill_token_threshold: int = arg(512, DBO_THRESHOLD)
    distributed_timeout_s: float = arg(300.0, number(0))
    rank0_own_process: bool | None = arg(
        None, BOOL_OR_NONE, action=argparse.BooleanOptionalAction,
        help="rank 0's worker in a process of its own, so that its launches run beside the engine "
        "core's scheduling (default: on a GPU without KV transfer or torchrun)")
    kv_offload_gb: float = arg(0.0, (lambda v: isinstance(v, (int, float)) and v >= 0, "a number >= 0"),
                               help="host pool (GiB, pinned on CUDA) for prefix-cache blocks evicted "
                               "from the device")
    kv_transfer_config: dict | KVTransferConfig | None = arg(
        None, (lambda v: v is None or isinstance(v, (dict, KVTransferConfig)), "a dict or KVTransferConfig"),
        type=kv_transfer_json, help='JSON, e.g. \'{"kv_role": "kv_producer", "kv_lease_s": 30}\'; '
        'producer / consumer / both: only that kv_role')

    def __post_init__(self):
        refuse(not isinstance(self.model, (str, os.PathLike)),
               f"model must be a folder path or 'builtin:<name>', got {type(self.model).__name__}")
        for f in fields(self):
            for check in f.metadata["checks"]:
                require(f.name, getattr(self, f.name), check)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """A flag per field: --field-name (--no-field-name for one that is on by default)."""
        for f in fields(cls):
            flag, kw = f.name.replace("_", "-"), dict(f.metadata["cli"])
            if isinstance(f.default, bool):
                flag, kw["action"] = ("no-" + flag, "store_false") if f.default else (flag, "store_true")
            elif f.default is not None and "action" not in kw:
                kw.setdefault("type", type(f.default))
            parser.add_argument("--" + flag, *f.metadata["flags"], dest=f.name, default=f.default,
                                help=f.metadata["help"], **kw)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def create_engine_config(self) -> EngineConfig:
        # device_count asks NVML: is_available would start the CUDA driver in the front end (slow)
        device = self.device or ("cuda" if torch.cuda.device_count() > 0 else "cpu")
        model = model_with_tokenizer(os.fspath(self.model), self.seed, self.tokenizer)
        dtype = self.dtype if self.dtype != "auto" else torch.float32 if device == "cpu" else (
            torch.bfloat16 if model.checkpoint_dtype == torch.float32 else model.checkpoint_dtype)
        limit = model.max_position_embeddings
        max_model_len = limit if self.max_model_len is None else self.max_model_len
        require("max_model_len", max_model_len, integer(2, limit, what=f"an integer in [2, {limit}] "
                                                         "(the model's max_position_embeddings)"))
        cache = self._config(CacheConfig, cpu_kv_cache_bytes=int(self.cpu_kv_cache_gb * (1 << 30)),
                             num_blocks=self.num_gpu_blocks)
        kv_transfer = self._kv_transfer()  # async_scheduling=True with KV transfer / offload: refused
        parallel = self._config(ParallelConfig, rank0_own_process=self._rank0_own_process(device, kv_transfer))
        validate_dp_hosts(parallel)
        validate_parallel(parallel, model, cache, device)
        scheduler = self._config(
            SchedulerConfig, max_num_batched_tokens=self.max_num_batched_tokens or max(8192, self.max_num_seqs),
            max_model_len=max_model_len, async_scheduling=self.async_scheduling is not False
            and not (kv_transfer.kv_role or kv_transfer.kv_offload_bytes))
        return self._config(EngineConfig, model=model, cache=cache, parallel=parallel, scheduler=scheduler,
                            dtype=parse_dtype(dtype), device=device, kv_transfer=kv_transfer)

    def _config(self, cls, **resolved):
        """cls by keyword: each field it shares with EngineArgs by name, the rest from `resolved`."""
        mine = {f.name for f in fields(self)}
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls) if f.name in mine} | resolved)

    def _rank0_own_process(self, device: str, kv: KVTransferConfig) -> bool:
        """Where the engine core's own paths to rank 0 run in-process, rank 0 stays there: its KV
        connector's reports and events, torchrun's rank 0."""
        why = ("KV transfer or kv_offload_gb" if kv.kv_role or kv.kv_offload_bytes else
               "torchrun (rank 0 is the core's process)" if launched_by_torchrun() else None)
        refuse(self.rank0_own_process and why, f"rank0_own_process is not supported with {why}")
        return device == "cuda" and why is None if self.rank0_own_process is None else self.rank0_own_process

    def _kv_transfer(self) -> KVTransferConfig:
        """kv_transfer_config with kv_offload_gb. Asynchronous scheduling is off with either (loads
        and saves are tied to the step that reports them), and both need one DP rank for now."""
        kv = self.kv_transfer_config
        kv = kv if isinstance(kv, KVTransferConfig) else KVTransferConfig.from_dict(dict(kv or {}))
        if self.kv_offload_gb:
            kv.kv_offload_bytes = int(self.kv_offload_gb * (1 << 30))
        kv.validate()
        used = kv.kv_role or kv.kv_offload_bytes
        refuse(used and self.async_scheduling, "async_scheduling is not supported with KV transfer or "
               "kv_offload_gb (leave it unset)")
        refuse(kv.kv_offload_bytes and not self.enable_prefix_caching,
               "kv_offload_gb needs prefix caching (drop --no-enable-prefix-caching)")
        refuse(used and self.data_parallel_size > 1,
               "KV transfer and kv_offload_gb run with data_parallel_size=1 for now")
        return kv


def model_with_tokenizer(model: str, seed: int, tokenizer: str | None) -> ModelConfig:
    """The model's config; `tokenizer` (a folder with tokenizer.json, or a .gguf) overrides its own."""
    model_cfg = model_config(resolve_model(model, seed))
    if tokenizer is not None:
        if not (os.path.isdir(tokenizer) or (tokenizer.endswith(".gguf") and os.path.isfile(tokenizer))):
            raise FileNotFoundError(f"tokenizer {tokenizer!r} is neither a folder (with "
                                    "tokenizer.json) nor a .gguf file")
        model_cfg.tokenizer = tokenizer
    return model_cfg


def validate_parallel(p: ParallelConfig, model: ModelConfig, cache: CacheConfig, device: str) -> None:
    tp, dcp = p.tensor_parallel_size, p.decode_context_parallel_size
    refuse(tp % dcp, f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp}")
    refuse(model.num_heads % tp, f"tensor_parallel_size={tp} must divide the {model.num_heads} attention heads")
    refuse(model.intermediate_size % tp, f"tensor_parallel_size={tp} must divide the MLP's "
           f"intermediate_size={model.intermediate_size}")
    groups = tp // dcp  # KV head groups (see kv_heads_of_rank)
    refuse(model.num_kv_heads % groups and groups % model.num_kv_heads,
           f"{model.num_kv_heads} KV heads cannot be split over tp/dcp={groups} groups")
    refuse(cache.block_size % p.cp_kv_cache_interleave_size, f"cp_kv_cache_interleave_size="
           f"{p.cp_kv_cache_interleave_size} must divide block_size={cache.block_size}")
    validate_moe_parallel(p, model)
    local = p.data_parallel_size if p.data_parallel_size_local is None else p.data_parallel_size_local
    if device == "cuda" and local * p.replica_size > torch.cuda.device_count() and not launched_by_torchrun():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ValueError(f"the parallel layout (data_parallel_size x prefill_context_parallel_size x "
                         f"tensor_parallel_size) needs {local * p.replica_size} GPUs; "
                         f"{torch.cuda.device_count()} are visible (CUDA_VISIBLE_DEVICES={visible})")


def validate_moe_parallel(p: ParallelConfig, model: ModelConfig) -> None:
    """Expert parallelism, dual-batch overlap and how expert layers split over DP x TP."""
    ranks, ep = p.data_parallel_size * p.tensor_parallel_size, p.enable_expert_parallel
    refuse(ep and not model.is_moe, f"enable_expert_parallel needs a model with expert layers; "
           f"{model.architecture} has none")
    refuse(ep and model.num_experts % ranks, f"enable_expert_parallel: data_parallel_size x "
           f"tensor_parallel_size = {ranks} must divide the {model.num_experts} experts")
    refuse(model.is_moe and not ep and model.moe_intermediate_size % ranks, f"data_parallel_size x "
           f"tensor_parallel_size = {ranks} must divide the expert width {model.moe_intermediate_size} "
           "(or enable_expert_parallel)")
    refuse(model.is_moe and p.data_parallel_size > 1 and p.prefill_context_parallel_size > 1,
           "data_parallel_size > 1 with prefill_context_parallel_size > 1 is not supported for "
           "models with expert layers")
    why = ("the model has no expert layers" if not model.is_moe else
           "prefill_context_parallel_size > 1 splits tokens by position, not by request"
           if p.prefill_context_parallel_size > 1 else
           "sequence parallelism pads the step to a multiple of tensor_parallel_size"
           if p.enable_sequence_parallel else None)
    refuse(p.enable_dbo and why, f"enable_dbo (micro-batching) cannot split this layout: {why}")


def validate_dp_hosts(p: ParallelConfig) -> None:
    """Data parallelism over several hosts: this host's cores, and where the front end is."""
    dp = p.data_parallel_size
    local = dp if p.data_parallel_size_local is None else p.data_parallel_size_local
    require("data_parallel_size_local", local,
            integer(0, dp, what=f"an integer in [0, data_parallel_size={dp}]"))
    require("data_parallel_start_rank", p.data_parallel_start_rank, integer(0, dp - local))
    refuse(local < dp and not p.data_parallel_rpc_port, "cores on other hosts (data_parallel_size_local "
           "< data_parallel_size) need a fixed data_parallel_rpc_port to connect to")
    refuse(dp > 1 and launched_by_torchrun(), "data_parallel_size > 1 runs one engine core per DP rank; "
           "across hosts use --data-parallel-address / --data-parallel-rpc-port (and --headless on "
           "the other hosts) instead of torchrun")
