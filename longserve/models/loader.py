"""Build a model and fill it from a HF-format folder (safetensors), each rank taking its slices.

`load_format="dummy"` fills the parameters with seeded random values instead (benchmarks
at real shapes, where no weights can be downloaded).
"""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from longserve.config import ModelConfig
from longserve.distributed.parallel_state import ParallelState
from longserve.models.llama import LlamaForCausalLM, checkpoint_to_param_name

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(cfg: ModelConfig, ps: ParallelState, dtype: torch.dtype, device: str,
                load_format: str = "auto", seed: int = 0) -> LlamaForCausalLM:
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, ps)
    finally:
        torch.set_default_dtype(old_dtype)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    else:
        load_weights(model, cfg)
    return model.eval()


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} lists missing weight files: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {path!r}")
    return files


def load_weights(model: LlamaForCausalLM, cfg: ModelConfig) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in safetensors_files(cfg.path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # some tied checkpoints still carry a copy
                load_one(params, name, f.get_tensor(name), file, loaded)
    missing = [n for n in params if n not in loaded
               and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise ValueError(f"weights missing from {cfg.path!r}: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")


def load_one(params: dict, name: str, tensor: torch.Tensor, file: str, loaded: set) -> None:
    param_name, shard = checkpoint_to_param_name(name)
    param = params.get(param_name)
    if param is None:
        raise ValueError(f"unexpected tensor {name!r} in {file}")
    try:
        param.weight_loader(param, tensor.to(param.dtype), shard)
    except ValueError as e:
        raise ValueError(f"tensor {name!r} in {file}: {e}") from None
    loaded.add(param_name)


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights: N(0, 0.02) for matrices and biases, ~1 for norm weights."""
    for i, (name, p) in enumerate(sorted(model.named_parameters())):
        gen = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
        p.normal_(0.0, 0.02, generator=gen)
        if "norm" in name:
            p.add_(1.0)
