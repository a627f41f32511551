"""Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral decoder with tensor parallelism: Qwen2's q/k/v bias,
Qwen3's per-head q/k RMSNorm before RoPE, expert MLPs where `cfg.moe_layers` says (models/moe.py).
Token tensors are flat [T, ...]: every scheduled request's tokens concatenated."""
from __future__ import annotations

import re

from torch import nn

from longserve.attention.backends import Attention
from longserve.config import ModelConfig
from longserve.distributed.parallel_state import ParallelState
from longserve.models.fused_ops import linear_silu_and_mul
from longserve.models.moe import FusedMoE
from longserve.models.layers import (MergedColumnParallelLinear, ParallelLMHead,
                                     QKVParallelLinear, RMSNorm, RotaryEmbedding,
                                     RowParallelLinear, VocabParallelEmbedding)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, layer_idx: int):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.attention_bias, ps.tp, ps.dcp.world_size)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, False, ps.tp)
        self.rotary = RotaryEmbedding(d, cfg.rope_theta, cfg.rope_scaling)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, d, d ** -0.5,
                              kv_sharing_target=cfg.kv_sharing.get(layer_idx),
                              kv_shared=layer_idx in cfg.kv_sharing.values())

    def qkv(self, cos_sin, hidden, out=None, store=None):
        """hidden [T, hidden] -> q [T, Hq, D], k, v [T, Hkv, D], with RoPE (q, k into `out`; K and V
        into the cache too with store = Attention.rope_store's)."""
        q, k, v = self.qkv_proj(hidden)
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        q, k = self.rotary(cos_sin, q, k, self.q_norm, self.k_norm, out,  # Qwen3: q/k norm first
                           store and (v, *store))
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, False, ps.tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, ps.tp)

    def forward(self, x, reduce="all", dp_pad=None):
        return self.down_proj(linear_silu_and_mul(x, self.gate_up_proj.weight), reduce)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, layer_idx: int, expert_parallel: bool = False):
        super().__init__()
        self.tp = ps.tp
        self.self_attn = LlamaAttention(cfg, ps, layer_idx)
        self.mlp = FusedMoE(cfg, ps, expert_parallel) if layer_idx in cfg.moe_layers else LlamaMLP(cfg, ps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, cos_sin, hidden, residual, meta, sp: bool, dp_pad: int | None = None):
        """With sequence parallelism (`sp`) hidden and residual hold this TP rank's slice of the tokens
        between layers; dp_pad: tokens per DP rank in expert layers."""
        store = self.self_attn.attn.rope_store(meta)
        q, k, v, residual = self.before_attention(cos_sin, hidden, residual, sp, store=store)
        attn_out = self.self_attn.attn(q, k, v, meta, kv_stored=store is not None)
        return self.after_attention(attn_out, residual, sp, dp_pad)

    def before_attention(self, cos_sin, hidden, residual, sp: bool = False, out=None, store=None):
        """Input norm (+ residual add), QKV, q/k norm and RoPE -> q, k, v, residual (out: see qkv)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if sp:
            hidden = self.tp.all_gather(hidden, 0)
        q, k, v = self.self_attn.qkv(cos_sin, hidden, out, store)
        return q, k, v, residual

    def after_attention(self, attn_out, residual, sp: bool = False, dp_pad: int | None = None):
        """attn_out [T, Hq, D] -> the layer's output and residual (o_proj, norm, MLP)."""
        hidden, residual = self.post_attention(attn_out, residual, sp)
        return self.mlp(hidden, "scatter" if sp else "all", dp_pad), residual

    def post_attention(self, attn_out, residual, sp: bool):
        """o_proj (all-reduce, or reduce-scatter with sp) and the post-attention norm."""
        hidden = self.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1), "scatter" if sp else "all")
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if sp:
            hidden = self.tp.all_gather(hidden, 0)
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, expert_parallel: bool = False):
        super().__init__()
        self.cfg, self.ps = cfg, ps
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ps.tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, ps, i, expert_parallel)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ps.tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, positions, meta, sp: bool = False, dp_pad: int | None = None):
        """input_ids, positions [T] -> final hidden states [T, hidden] (this TP rank's T/tp
        rows when `sp`; the caller pads T to a multiple of tp). dp_pad: see FusedMoE."""
        hidden, residual = self.embed_tokens(input_ids), None
        if sp:
            hidden = hidden.chunk(self.ps.tp.world_size)[self.ps.tp.rank_in_group].contiguous()
        cos_sin = self.layers[0].self_attn.rotary.cos_sin(positions)
        for layer in self.layers:
            hidden, residual = layer(cos_sin, hidden, residual, meta, sp, dp_pad)
        hidden, _ = self.norm(hidden, residual)
        return self.ps.tp.all_gather(hidden, 0) if sp else hidden

    def compute_logits(self, hidden):
        """[N, hidden] -> [N, vocab] float32 on the first TP rank, None on the others."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]


# HF checkpoint name -> (our parameter name, shard) for fused parameters.
STACKED_PARAMS = [(".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"),
                  (".v_proj.", ".qkv_proj.", "v"), (".gate_proj.", ".gate_up_proj.", 0),
                  (".up_proj.", ".gate_up_proj.", 1)]


# expert tensors: per expert (Qwen3-MoE: gate/up/down_proj; Mixtral: w1/w3/w2) or fused
# 3-D (transformers 5's in-memory names); shard = (kind, expert or None for all experts)
EXPERT_TENSOR = re.compile(r"\.mlp\.experts\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj|w1|w2|w3|"
                           r"gate_up_proj)(?:\.weight)?$")
EXPERT_KINDS = {"gate_proj": ("w13", "gate"), "w1": ("w13", "gate"), "up_proj": ("w13", "up"),
                "w3": ("w13", "up"), "gate_up_proj": ("w13", "gate_up"),
                "down_proj": ("w2", "down"), "w2": ("w2", "down")}


def checkpoint_to_param_name(name: str) -> tuple[str, object]:
    """Map a HF tensor name onto this module's parameter name and shard id."""
    name = name.removeprefix("model.").replace(".self_attn.attn.", ".self_attn.")
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral
    expert = EXPERT_TENSOR.search(name)
    if expert is not None:
        param, kind = EXPERT_KINDS[expert.group(2)]
        index = None if expert.group(1) is None else int(expert.group(1))
        return name[:expert.start()] + f".mlp.{param}", (kind, index)
    for hf, ours, shard in STACKED_PARAMS:
        if hf in name:
            return name.replace(hf, ours), shard
    return name, None
