"""Which replica serves a request under `--data-parallel-size N` (server/data_parallel.py).

Pure bookkeeping, no I/O: the front counts each replica's requests in flight (running plus
waiting, as far as the front can see them) and remembers, in a bounded LRU table, which replica
first served each prompt prefix. Prefixes are taken at doubling lengths (64, 128, ... 16,384
characters: the levels of a coarse radix tree over the prompt text), so a request matches the
longest prefix any earlier one had: a conversation's own history before a system prompt that
every conversation shares. It goes to the replica that owns that prefix (its KV blocks are
likely still in that replica's prefix cache) unless that replica is unhealthy or carries more
than `max_extra_load` requests beyond the least-loaded one; otherwise to the least loaded
healthy replica (ties go round-robin). A spilled request does not move the prefix: its owner
keeps it, so the next request sharing it goes home again once the load allows (moving it would
spread every busy prefix over every replica's cache), while the longer prefixes only the spilled
request has are recorded for the replica that now holds them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

# Prefix lengths (characters) that make up a prompt's affinity keys; a prompt shorter than the
# first carries too little cacheable prefix to pin.
PREFIX_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
AFFINITY_ENTRIES = 32768  # prefixes remembered (least recently used dropped first)
# Affinity yields when its replica has this many more in flight than the least loaded (or half
# the least loaded's count, if more): a miss re-prefills a whole shared prefix, while one more
# sequence in a batch costs a replica little. Measured with 8 documents over 2 replicas at
# concurrency 16 (benchmark 13): 4 gave a 67% hit rate, 8 gave 70% (the best possible: 73%).
MAX_EXTRA_LOAD = 8


def prompt_text(body: Any) -> str:
    """The text a request's prompt starts with: chat messages as `role: content` lines (text
    parts of multi-part contents joined), a completion's prompt (the first, if a list), or ''."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        lines = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(str(part.get("text", "")) for part in content
                                  if isinstance(part, dict))
            lines.append(f"{message.get('role', '')}: {content or ''}")
        return "\n".join(lines)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, list):  # token ids
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def prefix_keys(text: str) -> tuple[str, ...]:
    """The affinity keys of a prompt, shortest first: a hash of its first L characters for each
    L in PREFIX_LENGTHS that the prompt reaches (none for a prompt under 64 characters)."""
    data = text.encode()
    keys, hasher, done = [], hashlib.blake2b(digest_size=16), 0
    for length in PREFIX_LENGTHS:
        if len(text) < length:
            break
        end = len(text[:length].encode())
        hasher.update(data[done:end])
        done = end
        keys.append(hasher.copy().hexdigest())
    return tuple(keys)


def choose_replica(loads: Sequence[int], healthy: Sequence[bool], affinity: int | None,
                   max_extra_load: int = MAX_EXTRA_LOAD, start: int = 0) -> int | None:
    """The replica for one request, or None when none is healthy.

    `affinity` (the replica that owns this prefix) wins unless it is unhealthy or its load
    exceeds the least-loaded healthy replica's by more than `max_extra_load` (or by more than
    half the least loaded's own load, when that is larger). Otherwise
    the least loaded healthy replica; among equals, the first at or after `start` (cyclically).
    """
    candidates = [i for i in range(len(loads)) if healthy[i]]
    if not candidates:
        return None
    least = min(loads[i] for i in candidates)
    if affinity is not None and 0 <= affinity < len(loads) and healthy[affinity] \
            and loads[affinity] - least <= max(max_extra_load, least // 2):
        return affinity
    n = len(loads)
    return min(candidates, key=lambda i: (loads[i], (i - start) % n))


class Balancer:
    """The front's routing state: in-flight counts, health, and the prefix table."""

    def __init__(self, num_replicas: int, max_extra_load: int = MAX_EXTRA_LOAD,
                 capacity: int = AFFINITY_ENTRIES) -> None:
        self.in_flight = [0] * num_replicas
        self.healthy = [True] * num_replicas
        self.routed = [0] * num_replicas  # requests sent to each replica, ever
        self.affinity_hits = 0
        self.max_extra_load = max_extra_load
        self.capacity = capacity
        self._prefixes: OrderedDict[str, int] = OrderedDict()
        self._next = 0

    def acquire(self, keys: Sequence[str] = ()) -> int | None:
        """Picks a replica for a request with affinity `keys` (prefix_keys, shortest first) and
        counts it in flight there; None when no replica is healthy. Pair with `release`."""
        table = self._prefixes
        affinity = None
        for key in keys:  # the longest prefix with a live owner
            owner = table.get(key)
            if owner is not None and self.healthy[owner]:
                affinity = owner
        chosen = choose_replica(self.in_flight, self.healthy, affinity, self.max_extra_load,
                                self._next)
        if chosen is None:
            return None
        if chosen == affinity:
            self.affinity_hits += 1
        self._next = (chosen + 1) % len(self.in_flight)
        for key in keys:  # known prefixes keep their owner; new ones are the chosen replica's
            table.setdefault(key, chosen)
            table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)
        self.in_flight[chosen] += 1
        self.routed[chosen] += 1
        return chosen

    def release(self, replica: int) -> None:
        """The request sent to `replica` finished (or failed)."""
        self.in_flight[replica] -= 1

    def mark_dead(self, replica: int) -> None:
        """Takes a replica out of rotation and forgets the prefixes it owned."""
        self.healthy[replica] = False
        for key in [k for k, v in self._prefixes.items() if v == replica]:
            del self._prefixes[key]
