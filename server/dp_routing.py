"""Which replica serves a request under `--data-parallel-size N` (server/data_parallel.py).

Pure bookkeeping, no I/O: the front counts each replica's requests in flight (running plus
waiting, as far as the front can see them) and remembers, in a bounded LRU table, which replica
last served each prompt prefix. A request goes to the replica that served its prefix (its KV
blocks are likely still in that replica's prefix cache) unless that replica is unhealthy or
carries more than `max_extra_load` requests beyond the least-loaded one; otherwise to the least
loaded healthy replica (ties go round-robin), which then owns the prefix.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

PREFIX_CHARS = 256  # characters of the prompt that make up its affinity key
MIN_PREFIX_CHARS = 32  # shorter prompts carry too little cacheable prefix to pin
AFFINITY_ENTRIES = 4096  # prefixes remembered (least recently used dropped first)
MAX_EXTRA_LOAD = 4  # affinity yields when its replica has this many more in flight than the least


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


def prefix_key(text: str) -> str | None:
    """The affinity key of a prompt: a hash of its first PREFIX_CHARS characters, or None
    when the prompt is shorter than MIN_PREFIX_CHARS."""
    if len(text) < MIN_PREFIX_CHARS:
        return None
    return hashlib.blake2b(text[:PREFIX_CHARS].encode(), digest_size=16).hexdigest()


def choose_replica(loads: Sequence[int], healthy: Sequence[bool], affinity: int | None,
                   max_extra_load: int = MAX_EXTRA_LOAD, start: int = 0) -> int | None:
    """The replica for one request, or None when none is healthy.

    `affinity` (the replica that last served this prefix) wins unless it is unhealthy or its
    load exceeds the least-loaded healthy replica's by more than `max_extra_load`. Otherwise
    the least loaded healthy replica; among equals, the first at or after `start` (cyclically).
    """
    candidates = [i for i in range(len(loads)) if healthy[i]]
    if not candidates:
        return None
    least = min(loads[i] for i in candidates)
    if affinity is not None and 0 <= affinity < len(loads) and healthy[affinity] \
            and loads[affinity] - least <= max_extra_load:
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

    def acquire(self, key: str | None) -> int | None:
        """Picks a replica for a request with affinity `key` and counts it in flight there;
        None when no replica is healthy. Pair with `release`."""
        affinity = self._prefixes.get(key) if key is not None else None
        chosen = choose_replica(self.in_flight, self.healthy, affinity, self.max_extra_load,
                                self._next)
        if chosen is None:
            return None
        if chosen == affinity:
            self.affinity_hits += 1
        self._next = (chosen + 1) % len(self.in_flight)
        if key is not None:
            self._prefixes[key] = chosen
            self._prefixes.move_to_end(key)
            while len(self._prefixes) > self.capacity:
                self._prefixes.popitem(last=False)
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
