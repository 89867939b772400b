"""Storms against a real `kvserve serve` process.

Disconnects: KVSERVE_STORM_STREAMS streams (SSE and WebSocket, default 200) are cut at seeded
random points: right after sending, before the first token, mid-stream; WebSocket requests are
cancelled by message or dropped with their socket. Afterwards no request runs or waits, every
KV block is free, and greedy outputs equal the ones from before the storm.

Overload: 5x (max-num-seqs + max-queue-len) requests at once. Those past the queue get 503
with Retry-After at once, while the admitted ones run; those all finish with every token; and
the server's resident memory stays flat over repeated rounds.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest.sse_client import SSEParser, StreamRequest, build_body, stream_request
from loadtest.ws_client import WSClient
from tests.support.metrics import wait_idle
from tests.support.server_process import ServerProcess, kvserve
from tests.support.tiny_models import english_sentences

NUM_STREAMS = int(os.environ.get("KVSERVE_STORM_STREAMS", "200"))
STORM_CONCURRENCY = 16  # streams in flight at once
STORM_MAX_TOKENS = 40
SEED = 1234
CUT_POINTS = ("after_send", "before_first_token", "mid_stream", "never")
PROBES = english_sentences(3, seed=99)

MAX_NUM_SEQS = 4
MAX_QUEUE_LEN = 8
OVERLOAD_FACTOR = 5
OVERLOAD_MAX_TOKENS = 96
REJECT_WITHIN_S = 2.0
# Growth of VmRSS from after a warm-up round to after three more. The tiny model's weights and
# KV cache are allocated at startup, and a full queue refuses work instead of buffering it,
# so nothing should grow with the number of requests; 30 MB leaves room for allocator and
# aiohttp buffer noise while still catching a leak of per-request state (tens of KB each).
RSS_GROWTH_BYTES = 30 * 2**20


def greedy_texts(url: str) -> list[str]:
    """The probes' greedy completions, one at a time."""
    async def run() -> list[str]:
        async with aiohttp.ClientSession() as session:
            records = [await stream_request(session, url, StreamRequest(
                "completions", {"prompt": p, "max_tokens": 24, "temperature": 0.0,
                                "ignore_eos": True})) for p in PROBES]
        assert all(r.ok and r.output_tokens == 24 for r in records)
        return [r.text for r in records]

    return asyncio.run(run())


# ---- the disconnect storm -----------------------------------------------------------------------

def storm_request(rng: random.Random) -> StreamRequest:
    kind = rng.choice(("completions", "chat"))
    text = english_sentences(1, seed=rng.randrange(10**6))[0]
    payload = {"max_tokens": STORM_MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
    if kind == "chat":
        return StreamRequest(kind, {**payload, "messages": [{"role": "user", "content": text}]})
    return StreamRequest(kind, {**payload, "prompt": text})


async def sse_cut(session: aiohttp.ClientSession, url: str, req: StreamRequest, cut: str,
                  after_chunks: int) -> None:
    """One SSE stream, dropped at its cut point (or read to the end for "never")."""
    path = "/v1/chat/completions" if req.kind == "chat" else "/v1/completions"
    post = asyncio.ensure_future(session.post(url + path, json=build_body(req, True)))
    if cut == "after_send":
        await asyncio.sleep(0.002)
        post.cancel()
        await asyncio.gather(post, return_exceptions=True)
        return
    resp = await post
    assert resp.status == 200, await resp.text()
    if cut == "before_first_token":
        resp.close()  # the headers are out; no token read yet
        return
    parser, chunks = SSEParser(), 0
    async for line in resp.content:
        data = parser.feed_line(line)
        if data is None:
            continue
        if data == "[DONE]":
            break
        chunks += 1
        if cut == "mid_stream" and chunks >= after_chunks:
            break
    resp.close()


async def ws_batch(url: str, reqs: list[StreamRequest], delays: list[float | None],
                   close_after: float) -> None:
    """Several requests on one socket: each cancelled by message after its delay (None: left
    running), and the socket closed after `close_after` s with whatever is still in flight."""
    async with WSClient(url) as ws:
        tasks = [asyncio.create_task(ws.stream(r, timeout_s=60)) for r in reqs]

        async def cancel_later(task: asyncio.Task[object], delay: float) -> None:
            await asyncio.sleep(delay)
            task.cancel()

        cancels = [asyncio.create_task(cancel_later(t, d))
                   for t, d in zip(tasks, delays, strict=True) if d is not None]
        await asyncio.wait(tasks, timeout=close_after)
        await asyncio.gather(*cancels, return_exceptions=True)
    await asyncio.gather(*tasks, return_exceptions=True)


async def storm(url: str, num_streams: int) -> dict[str, int]:
    """Runs the storm; returns how many streams were cut at each point."""
    rng = random.Random(SEED)
    limit = asyncio.Semaphore(STORM_CONCURRENCY)
    counts = dict.fromkeys((*CUT_POINTS, "ws"), 0)
    jobs = []
    connector = aiohttp.TCPConnector(limit=STORM_CONCURRENCY, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def guarded(job: Coroutine[Any, Any, None]) -> None:
            async with limit:
                await job

        sent = 0
        while sent < num_streams:
            if rng.random() < 0.3:  # a socket with 1-6 requests
                size = min(rng.randint(1, 6), num_streams - sent)
                reqs = [storm_request(rng) for _ in range(size)]
                delays = [rng.choice((None, 0.0, rng.uniform(0.0, 0.5))) for _ in reqs]
                jobs.append(guarded(ws_batch(url, reqs, delays, rng.uniform(0.0, 0.6))))
                counts["ws"] += size
                sent += size
            else:
                cut = rng.choice(CUT_POINTS)
                counts[cut] += 1
                jobs.append(guarded(sse_cut(session, url, storm_request(rng), cut,
                                            rng.randint(1, STORM_MAX_TOKENS - 1))))
                sent += 1
        await asyncio.gather(*jobs)
    return counts


@pytest.mark.slow
def test_disconnect_storm_leaves_nothing_behind(tiny_server: ServerProcess) -> None:
    """On the session's default server (tests/conftest.py): the storm must leave it as it
    found it, for whichever test comes next."""
    server = tiny_server
    before = greedy_texts(server.url)
    wait_idle(server.url)
    counts = asyncio.run(storm(server.url, NUM_STREAMS))
    assert sum(counts.values()) == NUM_STREAMS and all(counts.values()), counts
    page = wait_idle(server.url)
    assert page["kv_cache_usage"] == 0.0
    assert greedy_texts(server.url) == before
    wait_idle(server.url)
    assert server.proc.poll() is None


# ---- overload -----------------------------------------------------------------------------------

def rss_bytes(pid: int) -> int:
    """The process's resident set size (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


async def overload_round(url: str, num_requests: int) -> list[tuple[int, float, str, int]]:
    """Fires every request at once; returns (status, seconds, Retry-After, tokens) for each."""
    connector = aiohttp.TCPConnector(limit=num_requests)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(i: int) -> tuple[int, float, str, int]:
            body = {"prompt": f"Request {i} of the overload round", "ignore_eos": True,
                    "max_tokens": OVERLOAD_MAX_TOKENS, "temperature": 0.0}
            started = time.monotonic()
            async with session.post(url + "/v1/completions", json=body) as resp:
                payload = await resp.json()
                tokens = payload["usage"]["completion_tokens"] if resp.status == 200 else 0
                return (resp.status, time.monotonic() - started,
                        resp.headers.get("Retry-After", ""), tokens)

        return list(await asyncio.gather(*(one(i) for i in range(num_requests))))


def check_round(results: list[tuple[int, float, str, int]]) -> None:
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(ok) + len(refused) == len(results), sorted({r[0] for r in results})
    # All arrive before the first step can move more than max-num-seqs out of the queue.
    assert MAX_QUEUE_LEN <= len(ok) <= MAX_QUEUE_LEN + MAX_NUM_SEQS, len(ok)
    assert all(r[3] == OVERLOAD_MAX_TOKENS for r in ok)
    assert all(r[2] and int(r[2]) > 0 for r in refused)
    slowest_refusal = max(r[1] for r in refused)
    assert slowest_refusal < REJECT_WITHIN_S
    assert slowest_refusal < max(r[1] for r in ok) / 2, "refused only once the work was done"


@pytest.mark.slow
def test_overload_refuses_past_the_queue_and_memory_stays_flat(tiny_llama_dir: Path,
                                                               tmp_path: Path) -> None:
    num_requests = OVERLOAD_FACTOR * (MAX_NUM_SEQS + MAX_QUEUE_LEN)
    with kvserve(tiny_llama_dir, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue-len",
                 str(MAX_QUEUE_LEN), log_dir=tmp_path) as server:
        check_round(asyncio.run(overload_round(server.url, num_requests)))  # warm-up
        wait_idle(server.url)
        warm = rss_bytes(server.proc.pid)
        for _ in range(3):
            check_round(asyncio.run(overload_round(server.url, num_requests)))
            wait_idle(server.url)
        grown = rss_bytes(server.proc.pid) - warm
        assert grown < RSS_GROWTH_BYTES, f"RSS grew by {grown / 2**20:.1f} MiB"
