"""Worker utilities. A layer's cache: [2, num_kernel_blocks, kernel_block_size, Hkv, D]; manager
block b is kernel blocks b*k .. b*k+k-1, so its K and its V are two contiguous byte ranges."""
from __future__ import annotations

import importlib.util
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from longserve.attention.kv_cache_spec import AttentionGroup, KVCacheConfig, KVCacheGroupSpec, MultipleOf
from longserve.config import CacheConfig, ParallelConfig, parse_dtype

# Triton is optional (CPU-only installs zero blocks with torch ops) and imported only where it runs:
# ~0.3 s of every CPU process's start
HAS_TRITON = importlib.util.find_spec("triton") is not None

GiB = 1 << 30
_ALIGN = 16  # bytes; lets the kernel use 128-bit stores


def _manager_block_view(name: str, cache: torch.Tensor, manager_block_size: int,
                        kernel_block_size: int, dtype: torch.dtype | None) -> torch.Tensor:
    """The cache as [2, num_manager_blocks, elements per manager block], checked."""
    if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[2] != kernel_block_size:
        raise ValueError(f"layer {name!r}: expected a KV cache [2, num_blocks, {kernel_block_size},"
                         f" heads, head_dim], got {tuple(cache.shape)}")
    if dtype is not None and cache.dtype != dtype:
        raise ValueError(f"layer {name!r}: cache dtype {cache.dtype} is not the configured {dtype}")
    if not (cache[0].is_contiguous() and cache[1].is_contiguous()):
        raise ValueError(f"layer {name!r}: K and V planes of the cache must each be contiguous")
    if manager_block_size % kernel_block_size or cache.shape[1] % (manager_block_size // kernel_block_size):
        raise ValueError(f"layer {name!r}: {cache.shape[1]} kernel blocks of {kernel_block_size} tokens"
                         f" do not form whole manager blocks of {manager_block_size} tokens")
    k = manager_block_size // kernel_block_size
    return cache.view(2, cache.shape[1] // k, -1)


class KVBlockZeroer:
    """Zeroes newly allocated KV blocks of every layer, in one Triton launch on CUDA."""

    def __init__(self, device: torch.device | str, use_triton: bool | None = None):
        self.device = torch.device(device)
        # None: Triton on CUDA, torch elsewhere. True also works on CPU under TRITON_INTERPRET=1.
        if use_triton is None:
            use_triton = self.device.type == "cuda" and HAS_TRITON
        if use_triton and not HAS_TRITON:
            raise RuntimeError("KVBlockZeroer(use_triton=True) needs triton installed")
        self.use_triton = use_triton
        self.views: list[torch.Tensor] = []  # [2, num_manager_blocks, -1] per distinct buffer
        self.num_blocks = 0  # manager blocks every buffer has (bound for host-side id checks)
        self.seg_table: torch.Tensor | None = None  # int64 [num_segments, 2], on device
        self.chunk_bytes = 0
        self.num_chunks = 0  # chunks of the largest page
        self.kernel = None  # zero_kv_kernel's, imported once the Triton path is set up

    def init_meta(self, attn_groups_iter: Iterable[AttentionGroup], kernel_block_sizes: list[int],
                  cache_dtype: str | torch.dtype, runner_only_attn_layers: set[str],
                  static_forward_context: dict[str, Any]) -> None:
        """Collect every distinct cache buffer (by address; runner_only_attn_layers skipped) and
        precompute the kernel's segment table. cache_dtype: "auto" or the dtype every cache must have."""
        dtype = None if cache_dtype == "auto" else parse_dtype(cache_dtype)
        seen: set[int] = set()
        self.views = []
        for group in attn_groups_iter:
            kernel_block_size = kernel_block_sizes[group.kv_cache_group_id]
            for name in group.layer_names:
                if name in runner_only_attn_layers:
                    continue
                if name not in static_forward_context:
                    raise ValueError(f"layer {name!r} of an attention group has no module in the forward context")
                cache = static_forward_context[name].kv_cache
                if cache.data_ptr() in seen:
                    continue
                seen.add(cache.data_ptr())
                self.views.append(_manager_block_view(
                    name, cache, group.kv_cache_spec.block_size, kernel_block_size, dtype))
        self.num_blocks = min((v.shape[1] for v in self.views), default=0)
        if self.use_triton and self.views:
            self._build_segment_table()
            self.zero_block_ids([0])  # compiles the kernel now, not in a request's first step

    def _build_segment_table(self) -> None:
        """(address, page bytes) of K and V of block 0 of each buffer; chunking that fits all."""
        from longserve.worker.zero_kv_kernel import MAX_CHUNK_BYTES, zero_kv_blocks_kernel
        self.kernel = zero_kv_blocks_kernel
        rows = [(v[plane].data_ptr(), v.stride(1) * v.element_size()) for v in self.views for plane in (0, 1)]
        if any(addr % _ALIGN or page % _ALIGN for addr, page in rows):
            self.use_triton = False  # never for real caches; the torch path handles any layout
            return
        if len(rows) > 65535:
            raise ValueError(f"{len(rows)} KV segments exceed the CUDA grid limit of 65535")
        page_gcd = math.gcd(*(page for _, page in rows))
        self.chunk_bytes = min(MAX_CHUNK_BYTES, page_gcd & -page_gcd)  # a power of two >= 16
        self.num_chunks = max(page for _, page in rows) // self.chunk_bytes
        self.seg_table = torch.tensor(rows, dtype=torch.int64, device=self.device)

    def zero_block_ids(self, block_ids: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Zero manager blocks `block_ids` (K and V) in every distinct layer cache."""
        ids = self._ids_on_device(block_ids)
        if ids is None or not self.views:
            return
        if self.use_triton:
            grid = (ids.numel(), self.seg_table.shape[0], self.num_chunks)
            self.kernel[grid](self.seg_table, ids, CHUNK_BYTES=self.chunk_bytes, num_warps=4)
        else:  # as bytes: any cache dtype (float8 has no index_fill on CPU), all-zero bits = 0.0
            for view in self.views:
                view.view(torch.uint8).index_fill_(1, ids, 0)

    def _ids_on_device(self, block_ids) -> torch.Tensor | None:
        """int64 ids on the cache device, or None when empty. Host ids are bounds-checked;
        device ids are not (that would sync)."""
        if not isinstance(block_ids, torch.Tensor):
            block_ids = torch.from_numpy(np.asarray(block_ids, dtype=np.int64))
        ids = block_ids.reshape(-1)
        if ids.numel() == 0:
            return None
        if ids.device.type == "cpu" and self.views:
            host = ids.numpy()  # a view; numpy's min/max cost far less than torch's here
            lo, hi = int(host.min()), int(host.max())
            if lo < 0 or hi >= self.num_blocks:
                raise ValueError(f"block ids span [{lo}, {hi}] but the KV caches have {self.num_blocks} blocks")
        # pageable host memory is staged before the call returns: safe, and no stream sync
        return ids.to(device=self.device, dtype=torch.int64, non_blocking=True)


def _layer_index(layer_name: str) -> int:
    """'model.layers.7.self_attn.attn' -> 7: the single integer component of the name."""
    ints = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(ints) != 1:
        raise ValueError(f"layer name {layer_name!r} must hold exactly one layer index, found {ints}")
    return ints[0]


def bind_kv_cache(kv_caches: dict[str, torch.Tensor], forward_context: dict[str, Any],
                  runner_kv_caches: list[torch.Tensor], num_attn_module: int = 1) -> None:
    """Give each attention module its cache and refill `runner_kv_caches` in layer order
    (up to `num_attn_module` modules may share a layer index, in their order in `kv_caches`)."""
    by_index: dict[int, list[str]] = defaultdict(list)
    for name in kv_caches:
        by_index[_layer_index(name)].append(name)
    for index, names in by_index.items():
        if len(names) > num_attn_module:
            raise ValueError(f"layer index {index} has {len(names)} attention modules {names};"
                             f" num_attn_module={num_attn_module}")
    missing = [name for name in kv_caches if name not in forward_context]
    if missing:
        raise ValueError(f"KV caches for layers missing from the forward context: {missing}")
    runner_kv_caches.clear()
    for index in sorted(by_index):
        runner_kv_caches.extend(kv_caches[name] for name in by_index[index])
    for name, cache in kv_caches.items():
        forward_context[name].kv_cache = cache


def add_kv_sharing_layers_to_kv_cache_groups(shared_kv_cache_layers: dict[str, str],
                                             kv_cache_groups: list[KVCacheGroupSpec],
                                             runner_only_attn_layers: set[str] | None = None) -> None:
    """Put each layer that reads another layer's KV (layer -> target) into the target's group,
    so it gets the target's block table and attention metadata. Calling twice is harmless."""
    owner_group = {name: group for group in kv_cache_groups for name in group.layer_names
                   if name not in shared_kv_cache_layers}
    for layer, target in shared_kv_cache_layers.items():
        if target not in owner_group:
            raise ValueError(f"layer {layer!r} shares the KV cache of {target!r},"
                             f" which is in no KV-cache group (it owns no cache)")
    for layer, target in shared_kv_cache_layers.items():
        group = owner_group[target]
        if layer not in group.layer_names:
            group.layer_names.append(layer)
        if runner_only_attn_layers is not None:
            runner_only_attn_layers.add(layer)


def _supports(backend: type, block_size: int) -> bool:
    return any(block_size % s.base == 0 if isinstance(s, MultipleOf) else block_size == s
               for s in backend.get_supported_kernel_block_sizes())


def select_common_block_size(kv_manager_block_size: int, backends: list[type]) -> int:
    """The manager's block size if every backend supports it, else the largest size that
    every backend supports and that divides it (manager block = k kernel blocks)."""
    m = kv_manager_block_size
    for size in range(m, 0, -1):  # descending, so the first hit is the largest
        if m % size == 0 and all(_supports(b, size) for b in backends):
            return size
    supported = "; ".join(f"{b.__name__}: {b.get_supported_kernel_block_sizes()}" for b in backends)
    raise ValueError(f"no kernel block size divides the KV manager block size {m} and is"
                     f" supported by every attention backend ({supported})")


def prepare_kernel_block_sizes(kv_cache_config: KVCacheConfig,
                               attn_groups: list[list[AttentionGroup]]) -> list[int]:
    """One kernel block size per KV-cache group; attn_groups[i] are group i's backends."""
    groups = kv_cache_config.kv_cache_groups
    if len(attn_groups) != len(groups):
        raise ValueError(f"{len(attn_groups)} lists of attention groups for {len(groups)} KV-cache groups")
    return [select_common_block_size(g.kv_cache_spec.block_size, [a.backend for a in ags])
            for g, ags in zip(groups, attn_groups)]


@dataclass
class MemorySnapshot:
    """Device memory at one moment, in bytes."""
    total: int
    free: int

    @property
    def used(self) -> int:
        return self.total - self.free

    @classmethod
    def measure(cls, device: torch.device | str = "cuda") -> "MemorySnapshot":
        """CUDA: the driver's numbers (all processes). CPU: MemTotal / MemAvailable."""
        device = torch.device(device)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return cls(total=total, free=free)
        if not os.path.exists("/proc/meminfo"):
            raise RuntimeError("no /proc/meminfo to measure CPU memory; build MemorySnapshot(total, free)")
        with open("/proc/meminfo") as f:  # "MemTotal:  16318540 kB"
            kib = {key: int(value.split()[0]) for key, value in (line.split(":", 1) for line in f)}
        return cls(total=kib["MemTotal"] << 10, free=kib.get("MemAvailable", kib["MemFree"]) << 10)


def request_memory(init_snapshot: MemorySnapshot, cache_config: CacheConfig) -> int:
    """Bytes the engine may take, free now: total * gpu_memory_utilization (checked at the door)."""
    util = cache_config.gpu_memory_utilization
    requested = int(init_snapshot.total * util)
    if init_snapshot.free < requested:
        raise ValueError(f"free memory on device ({init_snapshot.free / GiB:.2f} GiB) is less than the"
                         f" requested {requested / GiB:.2f} GiB (gpu_memory_utilization={util} of"
                         f" {init_snapshot.total / GiB:.2f} GiB); lower gpu_memory_utilization"
                         f" or free memory held by other processes")
    return requested


def is_residual_scattered_for_sp(config: Any, num_input_tokens: int) -> bool:
    """Whether sequence parallelism splits the residual over the TP ranks at this size (an uneven
    count stays replicated); config: an EngineConfig or a ParallelConfig."""
    parallel: ParallelConfig = getattr(config, "parallel", config)
    tp = parallel.tensor_parallel_size
    return parallel.enable_sequence_parallel and tp > 1 and num_input_tokens % tp == 0
