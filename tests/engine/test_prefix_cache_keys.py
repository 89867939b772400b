"""Prefix-cache block keys: a sha256 chain over the whole prefix, with an optional per-request
cache_salt mixed into the first block, so requests share KV only when their prefixes (and
salts) are equal."""

from __future__ import annotations

import hashlib
from array import array

from engine.core.block_pool import ROOT_HASH, hash_block_tokens
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


def admit(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> int:
    """Admits a request whose prompt is `tokens` and computes it; returns its prefix hits."""
    request = Request(rid, tokens, SamplingParams(), cache_salt=salt)
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, len(tokens) - num_hit_tokens, hits)
    request.num_computed_tokens = len(tokens)
    request.status = RequestStatus.RUNNING
    kv.cache_blocks(request, len(tokens))
    return num_hit_tokens


def test_key_is_sha256_of_parent_key_and_token_ids() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hashlib.sha256(ROOT_HASH + array("q", [1, 2, 3, 4]).tobytes()).digest()
    second = hash_block_tokens(first, [5, 6, 7, 8])
    assert second == hashlib.sha256(first + array("q", [5, 6, 7, 8]).tobytes()).digest()
    assert len(second) == 32


def test_key_depends_on_the_whole_prefix_and_the_salt() -> None:
    a, b = hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(b, [3, 4])
    assert hash_block_tokens(None, [1, 2], "alice") != hash_block_tokens(None, [1, 2], "bob")
    assert hash_block_tokens(None, [1, 2], "alice") == hash_block_tokens(None, [1, 2], "alice")
    assert hash_block_tokens(None, [1, 2], "alice") != a
    # Token ids are fixed-width: [1, 2] can never encode like [258] or [1, 2, 0].
    assert hash_block_tokens(None, [258]) != a != hash_block_tokens(None, [1, 2, 0])


def test_requests_share_blocks_only_with_the_same_salt() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks can hit
    assert admit(kv, "plain", prompt) == 0
    assert admit(kv, "plain-again", prompt) == 12
    assert admit(kv, "alice", prompt, "alice") == 0
    assert admit(kv, "alice-again", prompt, "alice") == 12
    assert admit(kv, "bob", prompt, "bob") == 0
