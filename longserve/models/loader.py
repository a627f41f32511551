"""Build a model and fill it from a HF-format folder (safetensors) or a GGUF file, each rank
taking its slices; `load_format="dummy"`: seeded random values (benchmarks at real shapes)."""
from __future__ import annotations

import glob
import os
import sys

import torch
from safetensors import safe_open

from longserve.config import ModelConfig, read_json
from longserve.distributed.parallel_state import ParallelState
from longserve.models.gguf_loader import gguf_hf_config, gguf_tensors, is_gguf
from longserve.models.kv_scales import checkpoint_scale_key, set_kv_scales
from longserve.models.llama import STACKED_PARAMS, LlamaForCausalLM, checkpoint_to_param_name

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, device: str,
                load_format: str = "auto", seed: int = 0, expert_parallel: bool = False,
                fp8_kv: bool = False) -> LlamaForCausalLM:
    """fp8_kv: give the attention layers the scales of an FP8 KV cache (models/kv_scales.py)."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, ps, expert_parallel)
    finally:
        torch.set_default_dtype(old_dtype)
    kv_scales = {}
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    else:
        kv_scales = load_weights(model, cfg)
    if fp8_kv:
        set_kv_scales(model, kv_scales)
    return model.eval()


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            names = sorted(set(read_json(index)["weight_map"].values()))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a valid weight index: {e!r}") from None
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} lists missing weight files: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {path!r}")
    return files


def load_weights(model: LlamaForCausalLM, cfg: ModelConfig) -> dict[tuple[int, str], torch.Tensor]:
    """Fill the parameters; returns the checkpoint's KV cache scales, (layer, "k"/"v"/"kv")
    -> tensor (vLLM's names; used by an FP8 KV cache, ignored otherwise)."""
    params = dict(model.named_parameters())
    shapes = checkpoint_shapes(cfg) | fused_expert_shapes(cfg)
    loaded: set[tuple] = set()
    kv_scales: dict[tuple[int, str], torch.Tensor] = {}
    bar = progress_bar(len(shapes))
    if is_gguf(cfg.path):  # one file, dequantized tensor by tensor
        for name, tensor in gguf_tensors(cfg.path, gguf_hf_config(cfg.path)):
            load_named(params, name, tensor, cfg.path, cfg, loaded, shapes, kv_scales)
            bar.update()
    for file in [] if is_gguf(cfg.path) else safetensors_files(cfg.path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    load_named(params, name, f.get_tensor(name), file, cfg, loaded, shapes, kv_scales)
                    bar.update()
        except ValueError:
            raise  # ours: names the tensor and the file
        except Exception as e:  # a truncated or corrupt file (SafetensorError, OSError, ...)
            raise ValueError(f"cannot read weights from {file}: {e}") from None
    missing = [f"{n} ({shard})" if shard is not None else n
               for n in params for shard in expected_shards(n, cfg) if (n, shard) not in loaded
               and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    bar.close()
    if missing:
        raise ValueError(f"weights missing from {cfg.path!r}: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    return kv_scales


def progress_bar(total: int):
    """A tqdm bar while weights load: on a terminal, on the first rank, not under pytest."""
    import torch.distributed as dist
    from tqdm import tqdm
    quiet = (not sys.stderr.isatty() or "PYTEST_CURRENT_TEST" in os.environ
             or (dist.is_initialized() and dist.get_rank() > 0))
    return tqdm(total=total, desc="loading weights", unit="tensor", disable=quiet, leave=False)


def load_named(params: dict, name: str, tensor, file: str, cfg: ModelConfig, loaded: set,
               shapes: dict, kv_scales: dict) -> None:
    if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
        return  # (some tied checkpoints still carry a copy of the embedding)
    scale_key = checkpoint_scale_key(name)
    if scale_key is not None:
        if tensor.numel() not in (1, cfg.num_kv_heads) or not bool((tensor.float() > 0).all()):
            raise ValueError(f"KV cache scale {name!r} in {file} must be one positive number or one "
                             f"per KV head ({cfg.num_kv_heads}), got shape {tuple(tensor.shape)}")
        kv_scales[scale_key] = tensor.float()
        return
    param_name, shard = checkpoint_to_param_name(name)
    param = params.get(param_name)
    if param is None or name not in shapes:
        raise ValueError(f"unexpected tensor {name!r} in {file}")
    if tuple(tensor.shape) != shapes[name]:
        raise ValueError(f"tensor {name!r} in {file} has shape {tuple(tensor.shape)}; "
                         f"the config asks for {shapes[name]}")
    try:
        param.weight_loader(param, tensor.to(param.dtype), shard)
    except ValueError as e:
        raise ValueError(f"tensor {name!r} in {file}: {e}") from None
    expand = getattr(param, "expand_shard", None)
    loaded.update((param_name, s) for s in (expand(shard) if expand else [shard]))


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name and full shape of every tensor a HF checkpoint of this architecture holds."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_heads, cfg.num_kv_heads
    qkv_heads = (("q", nh), ("k", nkv), ("v", nkv))
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       **{p + f"self_attn.{x}_proj.weight": (n * d, h) for x, n in qkv_heads},
                       p + "self_attn.o_proj.weight": (h, nh * d)})
        if i in cfg.moe_layers:
            shapes.update(expert_shapes(cfg, p))
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
        if cfg.attention_bias:
            shapes.update({p + f"self_attn.{x}_proj.bias": (n * d,) for x, n in qkv_heads})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


def expert_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """One expert layer as transformers' save_pretrained writes it: one tensor per expert."""
    h, w = cfg.hidden_size, cfg.moe_intermediate_size
    mixtral = cfg.architecture == "MixtralForCausalLM"
    block = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes = {block + "gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        shapes.update({f"{block}experts.{e}.{n}.weight": s for n, s in zip(names, ((w, h), (w, h), (h, w)))})
    return shapes


def fused_expert_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The 3-D expert tensors of transformers 5's modules (also accepted by the loader)."""
    e, h, w = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {"gate.weight": (e, h), "experts.gate_up_proj": (e, 2 * w, h), "experts.down_proj": (e, h, w)}
    return {f"model.layers.{i}.mlp.{name}": s for i in cfg.moe_layers for name, s in shapes.items()}


def expected_shards(param_name: str, cfg: ModelConfig | None = None) -> list:
    """The checkpoint pieces a (possibly fused) parameter is made of."""
    if param_name.endswith((".mlp.w13", ".mlp.w2")):  # one or two per expert
        kinds = ("gate", "up") if param_name.endswith("w13") else ("down",)
        return [(k, e) for e in range(cfg.num_experts) for k in kinds]
    return [shard for _, ours, shard in STACKED_PARAMS if ours in param_name] or [None]


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights: N(0, 0.02) for matrices and biases, ~1 for norm weights."""
    for i, (name, p) in enumerate(sorted(model.named_parameters())):
        gen = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
        p.normal_(0.0, 0.02, generator=gen)
        if "norm" in name:
            p.add_(1.0)
