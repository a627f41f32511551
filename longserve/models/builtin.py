"""Model names: `smollm2` (the default real model) and `builtin:<name>`, real architectures with
seeded random weights written once as HF folders under LONGSERVE_CACHE (default
~/.cache/longserve); `*-shape` entries carry only a config (use load_format="dummy")."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from longserve.config import ModelConfig, read_json
from longserve.models.gguf_loader import gguf_hf_config, is_gguf
from longserve.models.loader import checkpoint_shapes
from longserve.models.smollm2 import smollm2_path
from longserve.startup import cache_dir

DEFAULT_MODEL = "smollm2"  # SmolLM2-135M-Instruct, a real trained model (GGUF)

TINY_COMMON = dict(vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6,
                   bos_token_id=1, eos_token_id=2, torch_dtype="float32")
TINY_LLAMA = dict(TINY_COMMON, architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                  num_hidden_layers=2, num_attention_heads=4, tie_word_embeddings=False)
# real shapes; bos / eos: the built-in tokenizer's <s> and </s> (structured outputs mask past its 485 ids)
SHAPE_COMMON = dict(bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
QWEN3_SHAPE = dict(SHAPE_COMMON, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   max_position_embeddings=40960, head_dim=128)
LLAMA3_8B_SHAPE = dict(
    SHAPE_COMMON, architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
    max_position_embeddings=1048576, tie_word_embeddings=False)

BUILTIN_CONFIGS: dict[str, dict] = {
    "llama-tiny": dict(
        TINY_LLAMA, intermediate_size=160, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=256)),
    "qwen2-tiny": dict(
        TINY_COMMON, architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
        intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3-tiny": dict(
        TINY_COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=96,
        intermediate_size=224, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True),
    # one KV head: more TP ranks than KV heads replicate it (or shard tokens with DCP)
    "llama-tiny-mqa": dict(TINY_LLAMA, intermediate_size=128, num_key_value_heads=1, rope_theta=10000.0),
    # cross-layer KV sharing: layers 2 and 3 read the KV of layers 0 and 1
    "llama-tiny-kvshare": dict(TINY_LLAMA, intermediate_size=160, num_hidden_layers=4, num_key_value_heads=2,
                               rope_theta=10000.0, longserve_kv_sharing={"2": 0, "3": 1}),
    # mixture of experts: 8 experts, top-2; Qwen3-MoE's layer 1 is a dense MLP
    "qwen3-moe-tiny": dict(
        TINY_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
        rope_theta=1000000.0, tie_word_embeddings=False),
    "mixtral-tiny": dict(
        TINY_LLAMA, architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=32,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0),
    "qwen3-0.6b-shape": dict(
        QWEN3_SHAPE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        tie_word_embeddings=True),
    "llama3-8b-shape": LLAMA3_8B_SHAPE,
    # the Llama-3-8B shape with one KV head: tp=2 replicates it on both ranks (each holds
    # the whole KV), tp=2 x dcp=2 shards its tokens (each holds half): the layout guide's case
    "llama3-8b-1kv-shape": dict(LLAMA3_8B_SHAPE, num_key_value_heads=1),
    "qwen3-30b-a3b-shape": dict(
        QWEN3_SHAPE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False),
}

CORPUS = """LongServe serves long prompts on many GPUs. The quick brown fox jumps over the lazy dog.
Context parallelism splits a prompt across ranks; each rank keeps a shard of the KV cache.
Tensor parallelism splits the heads and the matrices; data parallelism splits the requests.
Once upon a time there was a small engine that could read a million tokens and answer.
def add(a, b):\n    return a + b\nprint(add(2, 3))\n0123456789 !?.,;:'"()[]{}<>-_=+*/%&|^~#@$
"""


def model_config(path: str) -> ModelConfig:
    """The ModelConfig of an HF folder or of a GGUF file (from its metadata)."""
    if not is_gguf(path):
        return ModelConfig.from_pretrained(path)
    return ModelConfig.from_hf_dict(path, gguf_hf_config(path))


def resolve_model(model: str, seed: int = 0) -> str:
    """A model argument -> a folder with an HF config, or a .gguf file (`smollm2`: fetched once)."""
    if model == DEFAULT_MODEL:
        return smollm2_path(cache_dir())
    if is_gguf(model):
        if not os.path.isfile(model):
            raise FileNotFoundError(f"GGUF file {model!r} does not exist")
        return model
    if not model.startswith("builtin:"):
        if not os.path.isdir(model):
            raise FileNotFoundError(f"model folder {model!r} does not exist (or use "
                                    f"{DEFAULT_MODEL!r}, a .gguf file, or builtin:<name>, one of "
                                    f"{sorted(BUILTIN_CONFIGS)})")
        return model
    name = model.removeprefix("builtin:")
    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {sorted(BUILTIN_CONFIGS)}")
    path = os.path.join(cache_dir(), f"{name}-seed{seed}")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        write_builtin(name, path, seed)
    elif name.endswith("-shape") and read_json(os.path.join(path, "config.json")) != BUILTIN_CONFIGS[name]:
        with open(os.path.join(path, "config.json"), "w") as f:  # a config only: refreshed
            json.dump(BUILTIN_CONFIGS[name], f, indent=2)
    return path


def write_builtin(name: str, path: str, seed: int) -> None:
    cfg = BUILTIN_CONFIGS[name]
    tmp = f"{path}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if not name.endswith("-shape"):
        save_file(random_hf_state_dict(cfg, seed), os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
    write_tokenizer(tmp, min(cfg["vocab_size"], 512))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.rename(tmp, path)  # atomic: concurrent writers of the same model both succeed
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


def random_hf_state_dict(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = checkpoint_shapes(ModelConfig.from_hf_dict("builtin", cfg))
    # norms around 1; std 0.1 on tiny matrices gives peaked, stable next-token distributions
    return {name: (1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(shape, generator=gen)
            for name, shape in sorted(shapes.items())}


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained on a fixed corpus (deterministic): <s> is 1, </s> 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    assert tok.token_to_id("<s>") == 1 and tok.token_to_id("</s>") == 2
