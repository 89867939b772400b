"""Chunked prefill on a real server: a long prompt is prefilled in budget-sized chunks while a
running request keeps streaming a token every step.

Both requests share one WebSocket, so the order of their messages is the order the server
produced them; a ping sent right after the long prompt marks the moment the server had queued
it. That makes the test independent of how late this process reads its socket on a loaded
machine: request 1's deltas between the pong and the long prompt's first token were produced
while the long prompt was being prefilled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.metrics import scrape
from tests.support.server_process import ServerProcess, kvserve
from tests.support.tiny_models import random_prompts
from tests.support.ws import Socket

MAX_NUM_BATCHED_TOKENS = 32
NUM_CHUNKS = 24  # the long prompt needs at least this many steps to prefill
LONG_PROMPT_LEN = NUM_CHUNKS * MAX_NUM_BATCHED_TOKENS
MAX_MODEL_LEN = 1024
VOCAB = 512


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    with kvserve(tiny_llama_dir, "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                 "--max-model-len", str(MAX_MODEL_LEN),
                 log_dir=tmp_path_factory.mktemp("interleave")) as srv:
        yield srv


async def iteration_histogram(url: str) -> dict[float, float]:
    """Bucket upper bound -> steps of kvserve:iteration_tokens_total (and -1.0 -> count)."""
    page = await asyncio.to_thread(scrape, url)
    buckets = page.buckets("iteration_tokens_total")
    (count,) = page.find("iteration_tokens_total_count")
    assert buckets, page.text
    buckets[-1.0] = float(count.value)
    return buckets


def test_decode_keeps_streaming_while_a_long_prompt_prefills(server: ServerProcess) -> None:
    short_prompt = random_prompts(VOCAB, 1, 16, 16, seed=21)[0]
    long_prompt = random_prompts(VOCAB, 1, LONG_PROMPT_LEN, LONG_PROMPT_LEN, seed=22)[0]

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            before = await iteration_histogram(server.url)
            async with session.ws_connect(server.url + "/v1/ws") as ws:
                sock = Socket(ws)

                async def receive() -> dict[str, Any]:
                    message = await sock.receive()
                    assert message["type"] != "error", message
                    return message

                await sock.send({
                    "type": "completion", "id": "stream", "prompt": short_prompt,
                    "max_tokens": MAX_MODEL_LEN - len(short_prompt), "temperature": 0,
                    "ignore_eos": True})
                while sum(m.get("id") == "stream" for m in sock.messages) < 3:
                    await receive()  # streaming
                await sock.send({
                    "type": "completion", "id": "long", "prompt": long_prompt,
                    "max_tokens": 4, "temperature": 0, "ignore_eos": True})
                await sock.send({"type": "ping"})
                while not any(m.get("id") == "long" and m["type"] == "done"
                              for m in sock.messages):
                    await receive()
                await sock.send({"type": "cancel", "id": "stream"})
                while not any(m.get("id") == "stream" and m["type"] == "done"
                              for m in sock.messages):
                    await receive()
            after = await iteration_histogram(server.url)

        messages, times = sock.messages, sock.times
        pong = messages.index({"type": "pong"})
        first_long = next(i for i, m in enumerate(messages)
                          if m.get("id") == "long" and m["type"] == "delta")
        long_done = next(m for m in messages if m.get("id") == "long" and m["type"] == "done")
        assert long_done["usage"] == {"prompt_tokens": LONG_PROMPT_LEN, "completion_tokens": 4,
                                      "total_tokens": LONG_PROMPT_LEN + 4}
        # Produced after the long prompt was queued and before its first token: one per
        # prefill chunk. Without chunked prefill (or with prefill stalling decodes) there
        # would be at most the one from the step already in flight.
        during = [i for i in range(pong + 1, first_long)
                  if messages[i].get("id") == "stream" and messages[i]["type"] == "delta"]
        assert len(during) >= NUM_CHUNKS // 3, (len(during), first_long - pong)
        # In time: no gap between consecutive tokens of the stream spans the whole prefill.
        t_pong, t_first = times[pong], times[first_long]
        stream_times = [t for t, m in zip(times, messages, strict=True)
                        if m.get("id") == "stream" and m["type"] == "delta"]
        spanning = [(a, b) for a, b in pairwise(stream_times) if a <= t_pong and b >= t_first]
        assert spanning == []
        # Every step stayed within the token budget, and the prefill took many steps.
        num_steps = after[-1.0] - before[-1.0]
        assert num_steps >= NUM_CHUNKS
        bound = min(le for le in after if le >= MAX_NUM_BATCHED_TOKENS)
        assert after[bound] - before[bound] == num_steps

    asyncio.run(main())
