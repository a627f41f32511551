"""Dual-batch overlap (docs/architecture.md, 'Data parallelism, ...'): two micro-batches' forwards
as stage generators, run in turn. Same tokens as one batch; eager only, so off by default."""
from __future__ import annotations

import torch

from longserve.models.moe import FusedMoE


def forward_stages(model, input_ids, positions, meta, dp_pad: int | None):
    """The model's forward (no sequence parallelism) as a stage generator -> hidden [T, hidden]."""
    hidden, residual = model.embed_tokens(input_ids), None
    cos_sin = model.layers[0].self_attn.rotary.cos_sin(positions)
    for layer in model.layers:
        q, k, v, residual = layer.before_attention(cos_sin, hidden, residual)
        hidden, residual = layer.post_attention(layer.self_attn.attn(q, k, v, meta), residual, False)
        if isinstance(layer.mlp, FusedMoE):
            hidden = yield from layer.mlp.stages(hidden, "all", dp_pad)
        else:
            hidden = layer.mlp(hidden)
    hidden, _ = model.norm(hidden, residual)
    return hidden


def run_dual_batch(model, ubatches: list[tuple], dp_pad: int | None) -> torch.Tensor:
    """ubatches: two (input_ids, positions, meta); both padded to dp_pad tokens in expert
    layers. Returns the hidden states of both, concatenated in order."""
    running = [forward_stages(model, *ub, dp_pad) for ub in ubatches]
    outputs: list[torch.Tensor | None] = [None] * len(running)
    while any(out is None for out in outputs):
        for i, stages in enumerate(running):
            if outputs[i] is not None:
                continue
            try:
                next(stages)
            except StopIteration as done:
                outputs[i] = done.value
    return torch.cat(outputs)
