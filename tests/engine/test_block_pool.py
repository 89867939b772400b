"""Block pool and KV cache manager: ref counts, LRU eviction, hash chains, reverse free, leaks."""

from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool, hash_block_tokens
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4)


def test_new_blocks_come_out_in_lru_order_and_take_a_reference() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    pool.free_blocks(reversed(blocks))
    # freed in reverse, so the tail block (2) is evicted first, after the never-used block 3
    assert pool.free_queue.block_ids() == [3, 2, 1, 0]


def test_touch_removes_a_free_block_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks(blocks)
    pool.touch([blocks[2]])
    assert pool.free_queue.block_ids() == [0, 1, 3, 4]
    assert blocks[2].ref_cnt == 1
    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 2
    pool.free_blocks([blocks[2]])
    assert pool.num_free_blocks == 4  # still held once
    pool.free_blocks([blocks[2]])
    assert pool.free_queue.block_ids() == [0, 1, 3, 4, 2]


def test_asking_for_more_blocks_than_free_raises() -> None:
    pool = BlockPool(2)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_cached_free_block_is_evicted_lazily_only_when_reused() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(block, h)
    pool.free_blocks([block])
    assert pool.get_cached_block(h) is block  # still findable while free
    pool.get_new_blocks(1)  # takes the never-cached block 1 first (LRU)
    assert pool.get_cached_block(h) is block
    pool.get_new_blocks(1)  # now block 0 is reused and its hash dropped
    assert pool.get_cached_block(h) is None
    assert block.block_hash is None


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    a1 = hash_block_tokens(None, [1, 2])
    b1 = hash_block_tokens(None, [9, 9])
    assert hash_block_tokens(a1, [3, 4]) != hash_block_tokens(b1, [3, 4])
    assert hash_block_tokens(a1, [3, 4]) == hash_block_tokens(hash_block_tokens(None, [1, 2]),
                                                              [3, 4])


def test_prefix_hits_misses_and_never_the_last_prompt_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(12)))
    hits, n = kv.get_computed_blocks(first)
    assert (hits, n) == ([], 0)
    assert kv.allocate_slots(first, 12)
    kv.cache_blocks(first, 12)
    # same 12 tokens: the last block holds the last prompt token, so only 2 blocks hit
    same = make_request("b", list(range(12)))
    hits, n = kv.get_computed_blocks(same)
    assert n == 8 and [b.block_id for b in hits] == kv.get_block_ids("a")[:2]
    # a prompt diverging in the second block hits only the first
    diverging = make_request("c", list(range(4)) + [99] * 8)
    assert kv.get_computed_blocks(diverging)[1] == 4
    # a prompt diverging in the first block misses entirely
    assert kv.get_computed_blocks(make_request("d", [99] + list(range(1, 12))))[1] == 0
    assert kv.stats.queries == 12 * 4 and kv.stats.hits == 8 + 4


def test_shared_blocks_are_ref_counted_and_everything_is_free_at_the_end() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    assert kv.allocate_slots(a, 9)
    kv.cache_blocks(a, 9)
    hits, n = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 9 - n, hits)
    shared = kv.req_blocks["a"][:2]
    assert all(blk.ref_cnt == 2 for blk in shared)
    assert kv.num_free_blocks == 8 - 3 - 1
    for req in (a, b):
        req.status = RequestStatus.FINISHED_STOPPED
        kv.free(req)
    assert kv.num_free_blocks == 8
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_allocate_fails_without_side_effects_when_the_pool_is_short() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    big = make_request("big", list(range(13)))  # needs 4 blocks
    assert not kv.allocate_slots(big, 13)
    assert kv.num_free_blocks == 3 and "big" not in kv.req_blocks or not kv.req_blocks["big"]


def test_free_returns_blocks_in_reverse_so_the_head_stays_cached_longest() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    req = make_request("a", list(range(8)))
    assert kv.allocate_slots(req, 8)
    ids = kv.get_block_ids("a")
    req.status = RequestStatus.FINISHED_STOPPED
    kv.free(req)
    assert kv.pool.free_queue.block_ids() == list(reversed(ids))


def test_discard_uncomputed_drops_hashes_of_blocks_a_failed_step_never_wrote() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    req = make_request("a", list(range(6)))
    assert kv.allocate_slots(req, 6)
    kv.cache_blocks(req, 6)
    req.num_computed_tokens = 2  # only the first block was really written
    kv.discard_uncomputed(req)
    probe = make_request("b", list(range(6)) + [1])
    assert kv.get_computed_blocks(probe)[1] == 2
