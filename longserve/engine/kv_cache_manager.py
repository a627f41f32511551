"""Block pool and per-request block allocation with prefix caching, in virtual blocks of
`tokens_per_block` = block_size * W tokens (W CP ranks). A full block is named by a hash chain
h_i = hash((h_{i-1}, its tokens)); free blocks wait in an LRU queue, cached ones keep their hash."""
from __future__ import annotations

from collections import OrderedDict

from longserve.engine.request import Request


def compute_block_hashes(request: Request, num_full: int, tokens_per_block: int) -> list[int]:
    """The hash chain of the request's first `num_full` blocks (each hash covers its block's tokens
    and its parent's hash), extending the one it has: only the new blocks' tokens are read."""
    hashes = list(request.block_hashes)
    tokens = request.token_ids_slice(len(hashes) * tokens_per_block, num_full * tokens_per_block)
    for i in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        hashes.append(hash((hashes[-1] if hashes else None, tuple(tokens[i:i + tokens_per_block]))))
    return hashes


class KVCacheManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks  # >= 1: Worker.determine_num_blocks refuses an empty cache
        self.tokens_per_block = tokens_per_block
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.newly_allocated: list[int] = []  # blocks handed out since the last drain (to zero)
        self.num_cached_tokens_hit = 0  # prompt tokens found in the prefix cache
        self.num_cached_tokens_queried = 0  # prompt tokens looked up
        self.on_evict = None  # (block id, block hash) -> None: a cached block is taken for new data

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # least recently used first
        h = self.block_hash[block_id]
        if h is not None:  # evict its cached content
            if self.cached.get(h) == block_id:
                del self.cached[h]
                if self.on_evict is not None:
                    self.on_evict(block_id, h)
            self.block_hash[block_id] = None
        self.ref_cnt[block_id] = 1
        self.newly_allocated.append(block_id)
        return block_id

    def _touch(self, block_id: int) -> None:
        if self.ref_cnt[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_cnt[block_id] += 1

    def drain_newly_allocated(self) -> list[int]:
        blocks, self.newly_allocated = self.newly_allocated, []
        return blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks at the start of the request, and its token count (at least
        one token is left to compute: its logits give the next token)."""
        if not self.enable_prefix_caching:
            return [], 0
        request.block_hashes = compute_block_hashes(
            request, request.num_tokens // self.tokens_per_block, self.tokens_per_block)
        max_blocks = (request.num_tokens - 1) // self.tokens_per_block
        hits = []
        for h in request.block_hashes[:max_blocks]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.tokens_per_block

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; False if the pool is short."""
        end = request.num_computed_tokens + num_new_tokens
        if not computed_blocks and end <= len(request.block_ids) * self.tokens_per_block:
            return True  # most decode steps: the last block has room
        computed_blocks = computed_blocks or []
        need = self.blocks_needed(end) - len(request.block_ids) - len(computed_blocks)
        reusable_free = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)
        if need > self.num_free_blocks - reusable_free:
            return False
        for b in computed_blocks:
            self._touch(b)
        request.block_ids.extend(computed_blocks)
        request.block_ids.extend(self._take_free_block() for _ in range(max(need, 0)))
        return True

    def share(self, block_ids: list[int]) -> list[int]:
        """One more reference to each block (a forked choice reads its parent's prompt blocks)."""
        for b in block_ids:
            self._touch(b)
        return list(block_ids)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks in the prefix cache."""
        next_full = (request.num_cached_blocks + 1) * self.tokens_per_block
        if not self.enable_prefix_caching or request.num_computed_tokens < next_full:
            return  # (no block filled since the last call: most decode steps)
        # computed may run ahead of the known tokens (a placeholder of asynchronous scheduling)
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.tokens_per_block
        if num_full <= request.num_cached_blocks:
            return
        if num_full > len(request.block_hashes):
            request.block_hashes = compute_block_hashes(request, num_full, self.tokens_per_block)
        for i in range(request.num_cached_blocks, num_full):
            block_id, h = request.block_ids[i], request.block_hashes[i]
            if self.block_hash[block_id] is None and h not in self.cached:
                self.block_hash[block_id] = h
                self.cached[h] = block_id
        request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Drop the request's references; tail blocks go to the queue first so they are evicted first."""
        for block_id in reversed(request.block_ids):
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None
        request.block_ids = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True
