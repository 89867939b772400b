"""Per-request block tables on top of the block pool, and the prefix-cache lookups.

The scheduler asks only three things: which blocks of a new request are already computed,
room for n more tokens (or no), and to free a request.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from engine.core.parallel_sampling import shared_prompt_blocks
from engine.core.request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Maps requests to blocks; computes chained block hashes; counts prefix-cache hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Each request's block table as a tuple, rebuilt only when it grows: the scheduler
        # reads it for every running request every step.
        self._tables: dict[str, tuple[int, ...]] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds."""
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Share of blocks held by requests."""
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's block table, as the immutable tuple a step's batch carries."""
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = tuple(self.get_block_ids(request_id))
        return table

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of already-computed full blocks for a request being admitted.

        A hit never covers the last prompt token: that token must be computed to get logits.
        Choices 2..n of one request share their sibling's prompt blocks even without caching.
        """
        max_blocks = (request.num_tokens - 1) // self.block_size
        parent_blocks = self.req_blocks.get(request.parent.request_id, []) if request.parent \
            else []
        shared = shared_prompt_blocks(request, parent_blocks, self.block_size, max_blocks)
        if shared:
            return shared, len(shared) * self.block_size
        if not self.enable_caching:
            return [], 0
        hits: list[KVCacheBlock] = []
        for block_hash in self._block_hashes(request)[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if request.num_cached_tokens < 0:  # count each request once, not per retry
            self.stats.queries += request.num_tokens
            self.stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Grows the request's block table to hold `num_new_tokens` more tokens.

        `new_computed_blocks` (prefix hits, on admission) are shared, not allocated.
        Returns False and changes nothing when the pool cannot cover it.
        """
        if not new_computed_blocks:  # most calls: a running request's held blocks suffice
            held = self.req_blocks.get(request.request_id)
            if held is not None and len(held) * self.block_size >= \
                    request.num_computed_tokens + num_new_tokens:
                return True
        computed = new_computed_blocks or []
        # Hits sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        needed = self._num_blocks_needed(request, num_new_tokens, len(computed) * self.block_size)
        if needed > self.num_free_blocks - num_free_hits:
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if computed or needed > 0:
            self._tables.pop(request.request_id, None)
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            self.num_cached_blocks[request.request_id] = len(blocks)
        if needed > 0:
            blocks.extend(self.pool.get_new_blocks(needed))
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the blocks that `num_tokens` tokens fill, under their chained hashes.

        Called when a step is scheduled, before its KV is written: a request admitted in the
        same step may already share them, because every layer writes the step's K/V before
        it reads the cache. If that step fails, `discard_uncomputed` takes the entries back.
        """
        if not self.enable_caching:
            return
        rid = request.request_id
        # Only known tokens can be keyed: a token still being sampled (async scheduling) waits
        # for the next call, once the step in flight has returned it.
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:  # most calls: no block filled since the last
            return
        blocks = self.req_blocks.get(rid, [])
        num_full = min(num_full, len(blocks))
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[rid] = num_full

    def discard_uncomputed(self, request: Request) -> None:
        """Uncaches blocks whose KV a failed step never wrote, so no one hits garbage."""
        for block in self.req_blocks.get(request.request_id, [])[
                request.num_computed_tokens // self.block_size:]:
            self.pool.uncache(block)

    def reset_prefix_cache(self) -> bool:
        """Drops every cached prefix when no request holds a block; False (and no change)
        otherwise. The hit counters are cumulative and keep counting."""
        return self.pool.reset_prefix_cache()

    def free(self, request: Request) -> None:
        """Returns the request's blocks, tail first, so head blocks stay cached longest."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._tables.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request.request_id, None)
        if request.is_finished:
            self.req_hashes.pop(request.request_id, None)

    def _num_blocks_needed(self, request: Request, num_new_tokens: int,
                           num_new_computed: int) -> int:
        held = len(self.req_blocks.get(request.request_id, ()))
        total_tokens = request.num_computed_tokens + num_new_computed + num_new_tokens
        return max(0, -(-total_tokens // self.block_size) - held - num_new_computed //
                   self.block_size)

    def _block_hashes(self, request: Request, num_blocks: int | None = None) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended incrementally and memoised."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        limit = request.num_tokens // self.block_size
        if num_blocks is not None:
            limit = min(limit, num_blocks)
        tokens, size = request.all_token_ids, self.block_size
        while len(hashes) < limit:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            salt = request.cache_salt if i == 0 else None
            hashes.append(hash_block_tokens(parent, tokens[i * size:(i + 1) * size], salt))
        return hashes

