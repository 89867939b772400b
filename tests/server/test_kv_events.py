"""KV cache events (--kv-events-config, engine/kv_events.py) read by a real ZeroMQ subscriber
from a real `kvserve serve`: BlockStored with the prompt's token ids and chained hashes,
BlockRemoved when a cached block is reused, AllBlocksCleared after POST /flush_cache, the
frames vLLM sends; /kv_event_sources listing the bound endpoint; and vllm-router's kv_aware
policy sending a shared prefix to the replica that announced it."""

from __future__ import annotations

import json
import random
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine.core.block_pool import hash_block_tokens
from engine.kv_events import external_hash
from loadtest.serve_process import free_port
from tests.support.api import http, post_json
from tests.support.metrics import wait_idle
from tests.support.server_process import ServerProcess, kvserve

zmq = pytest.importorskip("zmq", reason="pyzmq publishes KV events (a kvserve dependency)")

BLOCK_SIZE = 16
TOPIC = "kv-events"
RECV_TIMEOUT_S = 20.0


def events_flag(port: int, **extra: Any) -> list[str]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{port}", "topic": TOPIC, **extra}
    return ["--kv-events-config", json.dumps(config)]


class Subscriber:
    """A SUB socket on a server's publisher, decoding each message's three frames."""

    def __init__(self, endpoint: str, topic: str = TOPIC) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        self.seqs: list[int] = []
        time.sleep(0.5)  # ZeroMQ's slow joiner: what is published before this is not seen

    def events(self, until: Any, timeout_s: float = RECV_TIMEOUT_S) -> list[dict[str, Any]]:
        """Every event received until one satisfies `until` (returned last)."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.socket.poll(100):
                continue
            topic, seq, payload = self.socket.recv_multipart()
            assert topic == TOPIC.encode()
            self.seqs.append(struct.unpack(">Q", seq)[0])
            ts, batch, rank = msgspec.msgpack.decode(payload)
            assert isinstance(ts, float) and rank == 0
            for event in batch:
                got.append(event)
                if until(event):
                    return got
        raise AssertionError(f"no matching event in {timeout_s} s; got {got}")

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def publishing(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[ServerProcess, int]]:
    """The tiny Llama publishing KV events, with a KV cache of a few dozen blocks."""
    port = free_port()
    with kvserve(tiny_llama_dir, *events_flag(port), "--kv-cache-memory-bytes", str(2**19),
                 "--max-model-len", "256",
                 log_dir=tmp_path_factory.mktemp("kv_events")) as server:
        yield server, port


@pytest.fixture
def subscriber(publishing: tuple[ServerProcess, int]) -> Iterator[Subscriber]:
    sub = Subscriber(f"tcp://127.0.0.1:{publishing[1]}")
    yield sub
    sub.close()


def get_json(server: ServerProcess, path: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(server.url + path, timeout=10) as resp:
        return json.loads(resp.read())


def prompt_ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def chain(tokens: list[int], salt: str | None = None) -> list[int]:
    """The published hashes of each full block of `tokens` (kvserve's keys, last 8 bytes)."""
    hashes, parent = [], None
    for i in range(len(tokens) // BLOCK_SIZE):
        parent = hash_block_tokens(parent, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE],
                                   salt if i == 0 else None)
        hashes.append(external_hash(parent))
    return hashes


def complete(server: ServerProcess, prompt: list[int], **extra: Any) -> None:
    post_json(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                          "temperature": 0.0, **extra})


def stored_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "BlockStored"]


# ---- /kv_event_sources ----------------------------------------------------------------------

def test_sources_list_the_bound_endpoint(publishing: tuple[ServerProcess, int]) -> None:
    server, port = publishing
    source = get_json(server, "/kv_event_sources")["0"]
    # the wildcard bind becomes the host the caller reached, which vllm-router can connect to
    assert source["endpoint"] == f"tcp://127.0.0.1:{port}"
    assert (source["topic"], source["publisher"], source["enable_kv_cache_events"],
            source["encoding"], source["schema_version"], source["replay_endpoint"]) == \
        (TOPIC, "zmq", True, "msgpack", 1, None)


# ---- the events -----------------------------------------------------------------------------

def test_a_request_publishes_its_blocks_with_token_ids_and_chained_hashes(
        publishing: tuple[ServerProcess, int], subscriber: Subscriber) -> None:
    server = publishing[0]
    prompt = prompt_ids(seed=1, length=3 * BLOCK_SIZE + 5)
    complete(server, prompt)
    events = subscriber.events(lambda e: e["type"] == "BlockStored"
                               and e["token_ids"][:BLOCK_SIZE] == prompt[:BLOCK_SIZE])
    stored = stored_of(events)[-1]
    assert stored["token_ids"] == prompt[:3 * BLOCK_SIZE]  # full blocks only
    assert stored["block_hashes"] == chain(prompt)
    assert (stored["parent_block_hash"], stored["block_size"], stored["medium"],
            stored["lora_id"], stored["lora_name"]) == (None, BLOCK_SIZE, "GPU", None, None)
    assert "extra_keys" not in stored
    # the same prompt again hits the cache: nothing new is stored
    wait_idle(server.url)
    complete(server, prompt + [7] * BLOCK_SIZE)  # one more full block, chained on the rest
    events = subscriber.events(lambda e: e["type"] == "BlockStored")
    more = stored_of(events)[-1]
    assert more["parent_block_hash"] == chain(prompt)[-1]
    assert more["block_hashes"] == chain(prompt + [7] * BLOCK_SIZE)[3:4]
    assert more["token_ids"] == (prompt + [7] * BLOCK_SIZE)[3 * BLOCK_SIZE:4 * BLOCK_SIZE]
    assert subscriber.seqs == sorted(subscriber.seqs)
    assert subscriber.seqs[-1] - subscriber.seqs[0] == len(subscriber.seqs) - 1  # no gap


def test_a_cache_salt_is_published_as_the_first_blocks_extra_key(
        publishing: tuple[ServerProcess, int], subscriber: Subscriber) -> None:
    prompt = prompt_ids(seed=2, length=2 * BLOCK_SIZE)
    complete(publishing[0], prompt, cache_salt="tenant-a")
    stored = stored_of(subscriber.events(lambda e: e["type"] == "BlockStored"))[-1]
    assert stored["block_hashes"] == chain(prompt, salt="tenant-a")
    assert stored["extra_keys"] == ["tenant-a", None]


def test_reusing_a_cached_block_publishes_block_removed(
        publishing: tuple[ServerProcess, int], subscriber: Subscriber) -> None:
    server = publishing[0]
    num_blocks = get_json(server, "/server_info")["num_gpu_blocks"]
    first = prompt_ids(seed=3, length=4 * BLOCK_SIZE)
    complete(server, first)
    announced = set(chain(first))
    subscriber.events(lambda e: e["type"] == "BlockStored")
    # distinct prompts until every block has been handed out again
    for seed in range(100, 100 + num_blocks // 4 + 2):
        wait_idle(server.url)
        complete(server, prompt_ids(seed=seed, length=4 * BLOCK_SIZE))
    removed = [e for e in subscriber.events(
        lambda e: e["type"] == "BlockRemoved" and e["block_hashes"][0] in announced)
        if e["type"] == "BlockRemoved"]
    assert removed[-1]["medium"] == "GPU" and len(removed[-1]["block_hashes"]) == 1


def test_flush_cache_publishes_all_blocks_cleared(
        publishing: tuple[ServerProcess, int], subscriber: Subscriber) -> None:
    server = publishing[0]
    complete(server, prompt_ids(seed=4, length=2 * BLOCK_SIZE))
    wait_idle(server.url)
    assert http(server, "POST", "/flush_cache").status == 200
    events = subscriber.events(lambda e: e["type"] == "AllBlocksCleared")
    assert events[-1] == {"type": "AllBlocksCleared"}


# ---- vllm-router's kv_aware policy in front of two publishing replicas -----------------------

def test_vllm_router_kv_aware_routes_a_prefix_to_the_replica_that_cached_it(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    from tests.server.test_routers import Replicas, client, router, served_name

    flags = ("--get-load-format", "vllm-router")
    with kvserve(tiny_llama_dir, *flags, *events_flag(free_port()), log_dir=tmp_path) as first, \
            kvserve(tiny_llama_dir, *flags, *events_flag(free_port()),
                    log_dir=tmp_path) as second, \
            router("vllm-router", Replicas(first, second), tmp_path, policy="kv_aware") as front:
        deadline = time.monotonic() + 30
        while front.log().count("spawned subscriber") < 2:
            assert time.monotonic() < deadline, front.log()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # the subscriptions take effect
        api, model = client(front), served_name(Replicas(first, second))
        # each replica caches its own prefix, sent to it directly
        prefixes = {first.url: prompt_ids(seed=11, length=6 * BLOCK_SIZE),
                    second.url: prompt_ids(seed=12, length=6 * BLOCK_SIZE)}
        for replica in (first, second):
            complete(replica, prefixes[replica.url])
        time.sleep(1.0)  # the events reach the router
        for owner in (second, first, second, first):
            before = {r.url: wait_idle(r.url)["prefix_cache_queries"] for r in (first, second)}
            suffix = prompt_ids(seed=int(time.monotonic_ns() % 10**6), length=5)
            api.completions.create(model=model, prompt=prefixes[owner.url] + suffix,
                                   max_tokens=1)
            after = {r.url: wait_idle(r.url)["prefix_cache_queries"] for r in (first, second)}
            served = [url for url in after if after[url] > before[url]]
            assert served == [owner.url], (owner.url, before, after)


def test_data_parallel_replicas_each_publish_on_their_own_port(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    with kvserve(tiny_llama_dir, "-dp", "2", *events_flag(free_port()),
                 log_dir=tmp_path) as server:
        sources = get_json(server, "/kv_event_sources")
        assert sorted(sources) == ["0", "1"]
        endpoints = {sources[k]["endpoint"] for k in sources}
        assert len(endpoints) == 2 and all(e.startswith("tcp://127.0.0.1:") for e in endpoints)
        subscribers = [Subscriber(e) for e in endpoints]
        try:
            prompt = prompt_ids(seed=21, length=2 * BLOCK_SIZE)
            complete(server, prompt)
            found = []
            for sub in subscribers:
                try:
                    found += stored_of(sub.events(lambda e: e["type"] == "BlockStored",
                                                  timeout_s=3.0))
                except AssertionError:
                    pass
            assert [e["token_ids"] for e in found] == [prompt]  # one replica served it
        finally:
            for sub in subscribers:
                sub.close()
