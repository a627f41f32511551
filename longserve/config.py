"""Flat configuration dataclasses: `EngineConfig` is what `LLM(...)` and the `longserve` command
build; every worker receives a copy, so everything in here is plain (picklable) data."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def refuse(broken, message: str) -> None:
    if broken:
        raise ValueError(message)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    refuse(not isinstance(dtype, str) or dtype not in _DTYPES,
           f"unknown dtype {dtype!r}; choose one of {sorted(set(_DTYPES))}")
    return _DTYPES[dtype]


HF_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads")


ROPE_SCALING_KEYS = {"default": (), "linear": ("factor",),  # see models/layers.py rope_inv_freq
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                "original_max_position_embeddings")}


def read_json(path: str):
    """A JSON file's value; a file that is not JSON: ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def check_hf_sizes(hf: dict, source: str) -> None:
    for key in HF_REQUIRED_FIELDS + ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        required = key in HF_REQUIRED_FIELDS
        refuse(required and key not in hf, f"{source}: missing field {key!r}")
        v = hf.get(key)
        refuse((required or v is not None) and (isinstance(v, bool) or not isinstance(v, int) or v < 1),
               f"{source}: {key} must be a positive integer, got {v!r}")


@dataclass
class ModelConfig:
    """The architecture, read from a HF config.json or a GGUF file's metadata."""
    path: str  # a HF folder or a .gguf file
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q, k, v
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k
    eos_token_ids: list[int]
    bos_token_id: int | None
    checkpoint_dtype: torch.dtype
    # layer index -> index of an earlier layer whose KV cache it reads (cross-layer KV sharing)
    kv_sharing: dict[int, int] = field(default_factory=dict)
    # mixture of experts (Qwen3-MoE, Mixtral): `moe_layers` route each token to top-k of `num_experts`
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[int] = field(default_factory=list)

    tokenizer: str | None = None  # a folder with tokenizer.json that overrides the model's

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """An HF folder's config.json (a GGUF file: models.builtin.model_config)."""
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(f"no config.json in model folder {path!r}")
        hf = read_json(config_file)
        refuse(not isinstance(hf, dict), f"{config_file} must hold a JSON object, got {type(hf).__name__}")
        try:
            return cls.from_hf_dict(path, hf)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{config_file}: missing or malformed field {e}") from None

    def check(self, source: str) -> None:
        rs = self.rope_scaling
        refuse(rs is not None and not isinstance(rs, dict),
               f"{source}: rope_scaling must be an object or null, got {rs!r}")
        kind = (rs or {}).get("rope_type", (rs or {}).get("type", "default"))
        refuse(kind not in ROPE_SCALING_KEYS, f"{source}: unsupported rope_scaling type {kind!r} "
               f"(supported: {', '.join(ROPE_SCALING_KEYS)})")
        for key in ROPE_SCALING_KEYS[kind]:
            v = rs.get(key)
            refuse(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0,
                   f"{source}: rope_scaling {kind} needs a positive number {key!r}, got {v!r}")
        refuse(not all(isinstance(t, int) and not isinstance(t, bool) for t in self.eos_token_ids),
               f"{source}: eos_token_id must be an integer or a list of them, got {self.eos_token_ids!r}")
        refuse(self.num_heads % self.num_kv_heads, f"{source}: num_key_value_heads={self.num_kv_heads} "
               f"must divide num_attention_heads={self.num_heads}")

    @classmethod
    def from_hf_dict(cls, path: str, hf: dict) -> "ModelConfig":
        """Checked (`check`), naming `path` (a GGUF file, else the folder's config.json)."""
        archs = hf.get("architectures") or []
        archs = [archs] if isinstance(archs, str) else archs
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        refuse(arch is None, f"unsupported architecture {archs} in {path!r}; "
               f"LongServe runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        source = path if path.endswith(".gguf") else os.path.join(path, "config.json")
        check_hf_sizes(hf, source)  # before any arithmetic on them
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling, rope_theta = hf.get("rope_scaling"), hf.get("rope_theta")
        rope_params = hf.get("rope_parameters")  # transformers >= 5 folds theta and scaling here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        cfg = cls(
            **moe_fields(arch, hf), path=path, architecture=arch, vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"], num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            eos_token_ids=eos_ids, bos_token_id=hf.get("bos_token_id"),
            checkpoint_dtype=parse_dtype(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            kv_sharing={int(k): int(v) for k, v in (hf.get("longserve_kv_sharing") or {}).items()})
        cfg.check(source)
        return cfg


def moe_fields(arch: str, hf: dict) -> dict:
    """The expert-layer fields, as transformers reads them (Qwen3-MoE: sparse every
    `decoder_sparse_step` layers except `mlp_only_layers`; Mixtral: every layer, top-k
    always renormalised). transformers 5 writes Qwen3-MoE's expert count as num_local_experts."""
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if arch == "MixtralForCausalLM":
        return dict(num_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                    moe_layers=list(range(hf["num_hidden_layers"])))
    if arch != "Qwen3MoeForCausalLM" or num_experts == 0:
        return {}
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    layers = [i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0]
    return dict(num_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), moe_layers=layers)


# kv_cache_dtype -> the cache's element type ("auto": the model's dtype)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    cpu_kv_cache_bytes: int = 256 << 20  # the CPU's KV cache: no free-memory probe worth trusting
    num_blocks: int | None = None  # set by the worker after sizing (or by the user: a small pool)
    # "fp8" (= "fp8_e4m3"): float8 e4m3 K and V with per-head scales (models/kv_scales.py)
    kv_cache_dtype: str = "auto"  # (one of KV_CACHE_DTYPES: EngineArgs checks it)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    enable_sequence_parallel: bool = False
    distributed_timeout_s: float = 300.0
    enable_expert_parallel: bool = False  # whole experts over DP x TP (else each width is split)
    enable_dbo: bool = False  # dual-batch overlap: two micro-batches for a step of at least:
    dbo_decode_token_threshold: int = 32  # decode-only steps
    dbo_prefill_token_threshold: int = 512  # steps with a prefill
    rank0_own_process: bool = False  # rank 0's launches beside the core's scheduling
    # data parallelism runs one engine-core process per DP rank (engine/core_proc.py)
    data_parallel_rank: int = 0  # the core's own rank (each core's copy of the config)
    data_parallel_size_local: int | None = None  # cores on this host (None: all)
    data_parallel_start_rank: int = 0  # the first DP rank on this host (a headless host)
    data_parallel_address: str = "127.0.0.1"  # the front end's host; cores connect to it
    data_parallel_rpc_port: int = 0  # its handshake port and the next two (0: free ports)

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.prefill_context_parallel_size * self.tensor_parallel_size

    @property
    def replica_size(self) -> int:
        """Ranks of one model replica (one DP rank): what one engine core drives."""
        return self.prefill_context_parallel_size * self.tensor_parallel_size

    @property
    def cp_world_size(self) -> int:
        """Number of KV shards: the context-parallel ranks of a request."""
        return self.prefill_context_parallel_size * self.decode_context_parallel_size


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    # a prompt's most tokens in a step (0: no cap): the prompts behind a long one start beside it
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = False  # plan step N+1 while the device runs N (see engine_args.py)

    def __post_init__(self):  # (each limit alone is checked at the door: EngineArgs)
        refuse(not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len,
               "without chunked prefill, max_num_batched_tokens must be >= max_model_len")


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """KV transfer between instances and CPU offload: vLLM's `--kv-transfer-config` JSON keys."""
    kv_role: str | None = None  # kv_producer, kv_consumer, kv_both; None: no transfer
    engine_id: str | None = None  # this instance's name in transfer params (default: random)
    kv_ip: str = "127.0.0.1"  # a producer hosts its TCP store (control messages) here
    kv_port: int = 0  # 0: a free port
    kv_lease_s: float = 30.0  # a producer keeps a finished request's blocks at most this long
    kv_transfer_timeout_s: float = 10.0  # a consumer gives a pull up after this long
    kv_load_failure_policy: str = "recompute"  # or "fail": the request ends with an error
    kv_buffer_layout: str = "NHD"  # block layout on the wire: NHD or HND
    kv_offload_bytes: int = 0  # host pool for blocks evicted from the device cache (0: off)
    # producers ("host:port" of kv_ip/kv_port) whose pair groups a consumer builds at its start
    kv_connect: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> "KVTransferConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        refuse(unknown, f"unknown kv_transfer_config keys {sorted(unknown)}; "
               f"allowed: {sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    def validate(self) -> None:
        refuse(self.kv_role is not None and self.kv_role not in KV_ROLES,
               f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        refuse(self.kv_load_failure_policy not in ("recompute", "fail"),
               f"kv_load_failure_policy must be 'recompute' or 'fail', got {self.kv_load_failure_policy!r}")
        refuse(self.kv_buffer_layout not in ("NHD", "HND"),
               f"kv_buffer_layout must be 'NHD' or 'HND', got {self.kv_buffer_layout!r}")
        for name in ("kv_lease_s", "kv_transfer_timeout_s"):
            refuse(not getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)!r}")
        refuse(self.kv_offload_bytes < 0,
               f"kv_offload_gb must be >= 0, got {self.kv_offload_bytes / (1 << 30)}")
        refuse(self.kv_role is not None and self.kv_offload_bytes,
               "CPU offload and kv_role cannot be combined yet: use one of them")
        refuse(not 0 <= self.kv_port < 65536, f"kv_port must be in [0, 65536), got {self.kv_port}")
        refuse(not isinstance(self.kv_connect, list),
               f"kv_connect must be a list of 'host:port', got {self.kv_connect!r}")
        refuse(self.kv_connect and self.kv_role not in ("kv_consumer", "kv_both"),
               f"kv_connect needs kv_role kv_consumer or kv_both, got {self.kv_role!r}")
        for addr in self.kv_connect:
            host, _, port = str(addr).rpartition(":")
            refuse(not host or not port.isdigit() or not 0 < int(port) < 65536,
                   f"kv_connect entries must be 'host:port' with a port in [1, 65536), got {addr!r}")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    parallel: ParallelConfig
    scheduler: SchedulerConfig
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    enforce_eager: bool = False
    seed: int = 0
    attention_backend: str = "auto"  # "auto", "torch", "triton"
    load_format: str = "auto"  # "auto": safetensors from the folder; "dummy": seeded random
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    @property
    def dp_lockstep(self) -> bool:
        """Expert layers span the DP ranks: the cores step together (waves, dummy steps)."""
        return self.model.is_moe and self.parallel.data_parallel_size > 1

    @property
    def kv_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.cache.kv_cache_dtype] or self.dtype
