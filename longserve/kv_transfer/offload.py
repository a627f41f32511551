"""CPU offload: evicted prefix-cache blocks <-> a host pool (docs/architecture.md, 'KV transfer').
Host pool per layer: [2, num_host_blocks, block_size, H, D * itemsize] bytes, pinned on CUDA."""
from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from longserve.kv_transfer.utils import copy_kv_blocks


@dataclass
class OffloadMeta:
    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    @property
    def filled_block_ids(self) -> list[int]:
        return [d for _, d in self.loads]


class OffloadConnectorScheduler:
    def __init__(self, num_host_blocks: int, tokens_per_block: int):
        if num_host_blocks < 1:
            raise ValueError("kv_offload_gb is too small to hold one KV block")
        self.tokens_per_block = tokens_per_block
        self.host: OrderedDict[int, int] = OrderedDict()  # block hash -> host block, LRU first
        self.free_host = list(range(num_host_blocks))  # a heap: low ids first, so runs stay long
        self.pinned: set[int] = set()  # host blocks this step reads: not to be overwritten
        self.meta = OffloadMeta()
        self.num_loaded_tokens = self.num_saved_blocks = 0

    def on_evict(self, block_id: int, block_hash: int) -> None:  # called by the KV manager
        if block_hash in self.host:
            self.host.move_to_end(block_hash)
            return
        host_block = self._take_host_block()
        if host_block is None:
            return  # every host block is read this step: the block is dropped
        self.host[block_hash] = host_block
        self.meta.saves.append((block_id, host_block))
        self.num_saved_blocks += 1

    def _take_host_block(self) -> int | None:
        if self.free_host:
            return heapq.heappop(self.free_host)
        for h, host_block in self.host.items():
            if host_block not in self.pinned:
                del self.host[h]
                return host_block
        return None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        first = num_computed_tokens // self.tokens_per_block
        last = (request.num_tokens - 1) // self.tokens_per_block  # keep one token to compute
        n = 0
        for h in request.block_hashes[first:last]:
            if h not in self.host:
                break
            self.host.move_to_end(h)
            self.pinned.add(self.host[h])  # evictions while allocating must not take it
            n += 1
        return n * self.tokens_per_block, False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        first = (request.num_computed_tokens - num_external_tokens) // self.tokens_per_block
        for i in range(first, first + num_external_tokens // self.tokens_per_block):
            self.meta.loads.append((self.host[request.block_hashes[i]], block_ids[i]))
        self.num_loaded_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output) -> OffloadMeta | None:
        meta, self.meta = self.meta, OffloadMeta()
        self.pinned.clear()
        return meta if meta.saves or meta.loads else None

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None

    def update_connector_output(self, kv_connector_output) -> None:
        pass

    def has_pending(self) -> bool:
        return False


class OffloadConnectorWorker:
    def __init__(self, config, device: torch.device):
        self.config, self.device = config, device
        self.block_size = config.cache.block_size
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device_caches: dict[str, torch.Tensor] = {}
        self.host_caches: dict[str, torch.Tensor] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_scales=None) -> None:
        """The host pool holds the caches' bytes (an FP8 cache's scales stay with the layers)."""
        seen = set()
        for name, cache in kv_caches.items():
            if cache.data_ptr() in seen:  # a layer that reads another layer's cache
                continue
            seen.add(cache.data_ptr())
            data = cache.view(torch.uint8)  # float8 has no index_copy on CPU; bytes copy alike
            self.device_caches[name] = data.view(2, -1, self.block_size, *data.shape[-2:])
        bytes_per_block = sum(c[:, 0].numel() * c.element_size() for c in self.device_caches.values())
        n = self.config.kv_transfer.kv_offload_bytes // bytes_per_block
        pin = self.device.type == "cuda"
        self.host_caches = {name: torch.zeros(2, n, *c.shape[2:], dtype=c.dtype, pin_memory=pin)
                            for name, c in self.device_caches.items()}

    def start_load_kv(self, meta: OffloadMeta | None) -> None:
        if meta is None:
            return
        if self.stream is None:
            self._copy(meta)
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # the blocks to save hold the last steps' writes
        with torch.cuda.stream(self.stream):
            self._copy(meta)
        main.wait_stream(self.stream)  # the step reads the loaded blocks and rewrites the saved

    def _copy(self, meta: OffloadMeta) -> None:
        if meta.saves:  # first: an evicted block may be a load target of the same step
            copy_kv_blocks(self.device_caches, self.host_caches, [d for d, _ in meta.saves],
                           [h for _, h in meta.saves], "d2h")
        if meta.loads:
            copy_kv_blocks(self.host_caches, self.device_caches, [h for h, _ in meta.loads],
                           [d for _, d in meta.loads], "h2d")

    def wait_for_save(self) -> None:
        pass  # saves finish before the step's forward pass (the main stream waits for them)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()
