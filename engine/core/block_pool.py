"""The KV block pool: the one owner of every KV cache block.

Free blocks wait in an LRU queue (a doubly linked list, so a block that gets a prefix-cache hit
leaves the middle of the queue in O(1)). A full block may carry a chained hash (sha256 of its
parent's hash and its own token ids); a freed block keeps that hash until the pool hands it out
again (lazy eviction), so a later request with the same prefix can pick it back up.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Protocol

# A block's prefix-cache key: sha256 over its parent's key and its own token ids (and, for the
# first block, the request's cache_salt). Chaining a cryptographic digest makes the key stand
# for the whole prefix: no crafted prompt can collide with another request's blocks and read
# its KV, which a non-cryptographic hash such as Python's hash() would allow.
BlockHash = bytes
ROOT_HASH = hashlib.sha256(b"kvserve prefix cache v1").digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      cache_salt: str | None = None) -> BlockHash:
    """Chains one full block's token ids onto its parent's key (None for the first block)."""
    digest = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    if cache_salt is not None:
        salt = cache_salt.encode()
        digest.update(len(salt).to_bytes(8, "little") + salt)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVEventSink(Protocol):
    """Told when a prefix enters or leaves the cache (engine/kv_events.py publishes it)."""

    def block_stored(self, block_hash: BlockHash) -> None: ...

    def block_removed(self, block_hash: BlockHash) -> None: ...

    def all_cleared(self) -> None: ...


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's K and V tensors."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Free blocks, least recently freed first; O(1) append, pop and removal from the middle."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Takes the least recently freed block."""
        block = self._head.next_free
        if block is None or block is self._tail:
            raise ValueError("no free KV cache blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlinks a block from wherever it sits in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Puts a block at the most-recently-freed end."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        ids, block = [], self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Allocates, shares, caches and frees KV blocks; counts prefix-cache queries and hits."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        # Optional listener for KV cache events (--kv-events-config); None costs one check.
        self.event_sink: KVEventSink | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached or not)."""
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Share of blocks held by live requests, 0.0 to 1.0 (vLLM's kv_cache_usage)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding exactly this prefix, if it is still cached."""
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on cache hits, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hands out fresh blocks, evicting their old cached contents only now."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Registers a full, computed block under its chained hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        # If an identical block is already cached, keep the older entry; this one is then
        # simply not findable, which is harmless (and announced to no event sink).
        if self.cached.setdefault(block_hash, block) is block and self.event_sink is not None:
            self.event_sink.block_stored(block_hash)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference per block; a block reaching zero joins the free queue's tail.

        Callers pass a request's blocks in reverse, so its tail blocks (least likely to be
        shared by another prompt) are evicted before its head blocks.
        """
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed more often than taken"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def uncache(self, block: KVCacheBlock) -> None:
        """Removes a block's hash entry (its contents are not to be trusted)."""
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (SGLang's /flush_cache, vLLM's reset_prefix_cache).

        Only when no request holds a block: a held block's hash may be about to be shared by
        a request admitted in the same step, so, as vLLM does, the reset is refused (False,
        nothing changed) until every block is free. The blocks stay in the free queue in their
        order; only their hashes go, so the next identical prompt computes its KV again.
        """
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.event_sink is not None:
            self.event_sink.all_cleared()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.event_sink is not None:
                self.event_sink.block_removed(block.block_hash)
        block.block_hash = None
