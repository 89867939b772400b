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
import json
import re
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.server_process import ServerProcess, kvserve
from tests.support.tiny_models import random_prompts

MAX_NUM_BATCHED_TOKENS = 32
NUM_CHUNKS = 24  # the long prompt needs at least this many steps to prefill
LONG_PROMPT_LEN = NUM_CHUNKS * MAX_NUM_BATCHED_TOKENS
MAX_MODEL_LEN = 1024
VOCAB = 512
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    with kvserve(tiny_llama_dir, "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                 "--max-model-len", str(MAX_MODEL_LEN),
                 log_dir=tmp_path_factory.mktemp("interleave")) as srv:
        yield srv


async def iteration_histogram(session: aiohttp.ClientSession, url: str) -> dict[float, float]:
    """Bucket upper bound -> steps of kvserve:iteration_tokens_total (and -1.0 -> count)."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    buckets = {float(le): float(v) for le, v in re.findall(
        r'^kvserve:iteration_tokens_total_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$', text, re.M)}
    count = re.search(r"^kvserve:iteration_tokens_total_count\{[^}]*\} (\S+)$", text, re.M)
    assert count is not None and buckets, text
    buckets[-1.0] = float(count.group(1))
    return buckets


def test_decode_keeps_streaming_while_a_long_prompt_prefills(server: ServerProcess) -> None:
    short_prompt = random_prompts(VOCAB, 1, 16, 16, seed=21)[0]
    long_prompt = random_prompts(VOCAB, 1, LONG_PROMPT_LEN, LONG_PROMPT_LEN, seed=22)[0]

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            before = await iteration_histogram(session, server.url)
            async with session.ws_connect(server.url + "/v1/ws") as ws:
                loop = asyncio.get_running_loop()
                received: list[tuple[float, dict[str, Any]]] = []

                async def receive() -> dict[str, Any]:
                    msg = await asyncio.wait_for(ws.receive(), TIMEOUT_S)
                    assert msg.type == aiohttp.WSMsgType.TEXT, msg
                    message = dict(json.loads(msg.data))
                    received.append((loop.time(), message))
                    assert message["type"] != "error", message
                    return message

                await ws.send_str(json.dumps({
                    "type": "completion", "id": "stream", "prompt": short_prompt,
                    "max_tokens": MAX_MODEL_LEN - len(short_prompt), "temperature": 0,
                    "ignore_eos": True}))
                while sum(m.get("id") == "stream" for _, m in received) < 3:
                    await receive()  # streaming
                await ws.send_str(json.dumps({
                    "type": "completion", "id": "long", "prompt": long_prompt,
                    "max_tokens": 4, "temperature": 0, "ignore_eos": True}))
                await ws.send_str(json.dumps({"type": "ping"}))
                while not any(m.get("id") == "long" and m["type"] == "done"
                              for _, m in received):
                    await receive()
                await ws.send_str(json.dumps({"type": "cancel", "id": "stream"}))
                while not any(m.get("id") == "stream" and m["type"] == "done"
                              for _, m in received):
                    await receive()
            after = await iteration_histogram(session, server.url)

        messages = [m for _, m in received]
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
        t_pong, t_first = received[pong][0], received[first_long][0]
        times = [t for t, m in received if m.get("id") == "stream" and m["type"] == "delta"]
        spanning = [(a, b) for a, b in pairwise(times) if a <= t_pong and b >= t_first]
        assert spanning == []
        # Every step stayed within the token budget, and the prefill took many steps.
        num_steps = after[-1.0] - before[-1.0]
        assert num_steps >= NUM_CHUNKS
        bound = min(le for le in after if le >= MAX_NUM_BATCHED_TOKENS)
        assert after[bound] - before[bound] == num_steps

    asyncio.run(main())
