"""KV cache events: which prefixes this engine holds, published for cache-aware routers.

`--kv-events-config` takes vLLM's JSON (field names as vLLM's `KVEventsConfig`). When enabled,
the prefix cache's changes are published on a ZeroMQ PUB socket in vLLM's wire format, which
vLLM's router (`vllm-router --policy kv_aware`) subscribes to after reading
`GET /kv_event_sources`:

- three frames per batch: the topic (UTF-8), a sequence number (8-byte big-endian, from 0, +1
  per batch) and a msgpack `KVEventBatch` `[ts, [event, ...], data_parallel_rank]`;
- each event a map whose `type` is `BlockStored` (`block_hashes`, `parent_block_hash`,
  `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`, and `extra_keys` when a
  cache_salt keys the first block), `BlockRemoved` (`block_hashes`, `medium`) or
  `AllBlocksCleared`;
- a hash is the last 8 bytes of kvserve's sha256 block key read big-endian (as vLLM's integer
  hashes). The router keys its index by hashes it computes itself from `token_ids`; the
  published hashes only link a block to its parent and to its later removal.
- with `replay_endpoint`, a ROUTER socket answers `[b"", seq(8 bytes)]` with the retained
  batches from `seq` on (the last `buffer_steps`), then an end marker (seq -1, empty payload).

The engine never waits for the network: the event-loop thread appends to a bounded deque
(dropping, and counting, when it is full) and a background thread batches, encodes and sends.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from engine.core.block_pool import BlockHash

logger = logging.getLogger("kvserve")

_POLL_S = 0.01  # how long the sender sleeps when nothing is queued
_END_OF_REPLAY = struct.pack(">q", -1)


@dataclass
class KVEventsConfig:
    """vLLM's `--kv-events-config` fields (vllm/config/kv_events.py), same names and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" to publish; "null" publishes nothing
    endpoint: str = "tcp://*:5557"  # bound by this server
    replay_endpoint: str | None = None  # bound too when set
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ send high-water mark, in messages
    max_queue_size: int = 100_000  # events queued for the sender before new ones are dropped
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parses the flag's JSON; ValueError names what is wrong."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        config = cls(**raw)
        config.validate()
        return config

    def validate(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be zmq or null, "
                             f"got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--kv-events-config: {name} must be an integer >= 1")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(
                    ("tcp://", "ipc://", "inproc://"))):
                raise ValueError(f"--kv-events-config: {name} must be tcp://HOST:PORT, "
                                 f"ipc://PATH or inproc://NAME, got {value!r}")

    def resolved(self, endpoint: str, replay_endpoint: str | None) -> dict[str, Any]:
        """This config with the addresses actually bound, as `/kv_event_sources` lists it."""
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                "replay_endpoint": replay_endpoint, "buffer_steps": self.buffer_steps,
                "hwm": self.hwm, "max_queue_size": self.max_queue_size, "topic": self.topic,
                "encoding": "msgpack", "schema_version": 1}


def external_hash(block_hash: BlockHash) -> int:
    """The published form of a block key: its last 8 bytes, big-endian (vLLM's int hashes)."""
    return int.from_bytes(block_hash[-8:], "big")


class KVEventSink:
    """Collects the block pool's events on the engine's thread and queues them for sending.

    The pool reports a stored block by hash only; the token ids it holds come from the
    request being cached (`cache_blocks`), which `attach` wraps to resolve them.
    """

    def __init__(self, block_size: int, max_queue_size: int) -> None:
        self.block_size = block_size
        self.max_queue_size = max_queue_size
        self.queue: deque[dict[str, Any]] = deque()
        self.num_dropped = 0  # events not queued because the sender fell behind
        self.num_unresolved = 0  # stored blocks cached outside cache_blocks (no token ids)
        self._pending: list[BlockHash] = []

    def _put(self, event: dict[str, Any]) -> None:
        if len(self.queue) >= self.max_queue_size:
            self.num_dropped += 1
            return
        self.queue.append(event)  # deque.append is atomic: no lock on the engine's thread

    # -- the block pool's hook (engine.core.block_pool.KVEventSink) --------------------------

    def block_stored(self, block_hash: BlockHash) -> None:
        self._pending.append(block_hash)

    def block_removed(self, block_hash: BlockHash) -> None:
        self._put({"type": "BlockRemoved", "block_hashes": [external_hash(block_hash)],
                   "medium": "GPU"})

    def all_cleared(self) -> None:
        self._pending.clear()
        self._put({"type": "AllBlocksCleared"})

    # -- resolving stored blocks to their tokens --------------------------------------------

    def resolve(self, hashes: list[BlockHash], start: int, end: int,
                token_ids: list[int], cache_salt: str | None) -> None:
        """Turns the blocks the pool just cached (within hashes[start:end]) into BlockStored
        events, one per run of consecutive blocks."""
        if not self._pending:
            return
        pending, self._pending = set(self._pending), []
        size, run_start = self.block_size, -1
        for i in range(start, end + 1):
            if i < end and hashes[i] in pending:
                pending.discard(hashes[i])
                if run_start < 0:
                    run_start = i
                continue
            if run_start >= 0:
                event: dict[str, Any] = {
                    "type": "BlockStored",
                    "block_hashes": [external_hash(h) for h in hashes[run_start:i]],
                    "parent_block_hash": (external_hash(hashes[run_start - 1])
                                          if run_start > 0 else None),
                    "token_ids": token_ids[run_start * size:i * size],
                    "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None}
                if run_start == 0 and cache_salt is not None:
                    event["extra_keys"] = [cache_salt] + [None] * (i - 1)
                self._put(event)
                run_start = -1
        self.num_unresolved += len(pending)


def attach(kv: Any, sink: KVEventSink) -> Callable[[], None]:
    """Hooks `sink` into an engine's KVCacheManager; returns the undo."""
    original = kv.cache_blocks

    def cache_blocks(request: Any, num_tokens: int) -> None:
        start = kv.num_cached_blocks.get(request.request_id, 0)
        original(request, num_tokens)
        if sink._pending:
            end = kv.num_cached_blocks.get(request.request_id, 0)
            hashes = kv.req_hashes.get(request.request_id, [])
            sink.resolve(hashes, start, min(end, len(hashes)), request.all_token_ids,
                         request.cache_salt)

    kv.cache_blocks = cache_blocks
    kv.pool.event_sink = sink

    def detach() -> None:
        kv.pool.event_sink = None
        if kv.__dict__.get("cache_blocks") is cache_blocks:
            del kv.cache_blocks

    return detach


class ZmqEventPublisher:
    """Binds the PUB (and replay ROUTER) sockets at once, then sends from its own thread."""

    def __init__(self, config: KVEventsConfig, sink: KVEventSink,
                 data_parallel_rank: int = 0) -> None:
        import zmq  # pyzmq; imported only when events are on

        self.config = config
        self.sink = sink
        self.rank = data_parallel_rank
        self.num_sent = 0  # batches sent
        self.num_unsent = 0  # batches ZeroMQ refused at the high-water mark
        self._zmq = zmq
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: Any = None
        try:
            self._pub.bind(config.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot bind {config.endpoint}"
                             f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}"
                             f": {exc}") from None
        self._retained: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._stop = threading.Event()
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV cache events: publishing on %s%s, topic %r", self.endpoint,
                    f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "",
                    config.topic)

    def _run(self) -> None:
        queue, topic = self.sink.queue, self.config.topic.encode()
        while not self._stop.is_set():
            if self._replay is not None:
                self._serve_replays(topic)
            if not queue:
                self._stop.wait(_POLL_S)
                continue
            events: list[dict[str, Any]] = []
            while queue and len(events) < 1024:
                events.append(queue.popleft())
            payload = self._encoder.encode([time.time(), events, self.rank])
            seq = self._seq
            self._seq += 1
            if self._replay is not None:
                self._retained.append((seq, payload))
            try:
                self._pub.send_multipart([topic, struct.pack(">Q", seq), payload],
                                         flags=self._zmq.NOBLOCK)
                self.num_sent += 1
            except self._zmq.Again:  # at the high-water mark: subscribers see a gap
                self.num_unsent += 1
        self._close_sockets()

    def _serve_replays(self, topic: bytes) -> None:
        zmq = self._zmq
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) < 3 or len(frames[-1]) != 8:
                continue  # not [identity, b"", seq]
            identity, start = frames[0], struct.unpack(">Q", frames[-1])[0]
            try:
                for seq, payload in list(self._retained):
                    if seq >= start:
                        self._replay.send_multipart(
                            [identity, b"", topic, struct.pack(">Q", seq), payload],
                            flags=zmq.NOBLOCK)
                self._replay.send_multipart([identity, b"", b"", _END_OF_REPLAY, b""],
                                            flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the requester went away

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Sends what is queued (within `timeout_s`), then closes the sockets."""
        deadline = time.monotonic() + timeout_s
        while self.sink.queue and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(_POLL_S)
        self._stop.set()
        self._thread.join(timeout=timeout_s)
