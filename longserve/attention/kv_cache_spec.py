"""What the worker needs to know about the KV cache, as plain data. A manager block of
`AttentionSpec.block_size` tokens may be split into kernel blocks (prepare_kernel_block_sizes)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MultipleOf:
    """A backend's kernel block size may be any positive multiple of `base`."""
    base: int

    def __post_init__(self):
        if self.base <= 0:
            raise ValueError(f"MultipleOf needs a positive base, got {self.base}")


@dataclass
class AttentionSpec:
    """One attention layer's cache: [2, num_blocks, block_size, num_kv_heads, head_size]."""
    block_size: int  # tokens per manager block
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one manager block of one layer, K and V together."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table (same spec, same block ids)."""
    layer_names: list[str]
    kv_cache_spec: AttentionSpec


@dataclass
class KVCacheConfig:
    num_blocks: int  # manager blocks per layer
    kv_cache_groups: list[KVCacheGroupSpec]


@dataclass
class AttentionGroup:
    """Layers of one KV-cache group that run on the same attention backend."""
    backend: type  # has get_supported_kernel_block_sizes() -> list[int | MultipleOf]
    layer_names: list[str]
    kv_cache_spec: AttentionSpec
    kv_cache_group_id: int = 0  # index into KVCacheConfig.kv_cache_groups
