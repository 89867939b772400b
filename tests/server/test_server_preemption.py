"""A real `kvserve serve` whose KV cache holds about two full-length requests.

32 concurrent greedy requests force preemption by recompute: every one completes with its full
token count and the same text it gets alone on the idle server, and /metrics counts the
preemptions. A request that could never fit (prompt + max_tokens, or the prompt alone, over
max_model_len, which startup guarantees the whole cache holds) is refused up front with a 400
naming both numbers, over HTTP and over the WebSocket, even while the cache is full."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest.records import RequestRecord
from loadtest.sse_client import StreamRequest, stream_request
from tests.support.api import assert_error_body
from tests.support.metrics import wait_idle
from tests.support.server_process import ServerProcess, kvserve
from tests.support.tiny_models import random_prompts

MAX_MODEL_LEN = 128
FULL_REQUESTS_IN_CACHE = 2  # the KV cache holds this many max_model_len requests
NUM_REQUESTS = 32
MAX_TOKENS = 72  # with 16-32 prompt tokens: 6-7 blocks of 16 each, ~2.3 requests in 16 blocks
TIMEOUT_S = 120.0


def kv_bytes_per_token(model_dir: Path) -> int:
    """2 (K and V) x layers x kv heads x head dim x 4 bytes (float32 on CPU)."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    kv_bytes = FULL_REQUESTS_IN_CACHE * MAX_MODEL_LEN * kv_bytes_per_token(tiny_llama_dir)
    with kvserve(tiny_llama_dir, "--max-model-len", str(MAX_MODEL_LEN),
                 "--kv-cache-memory-bytes", str(kv_bytes),
                 log_dir=tmp_path_factory.mktemp("preemption_logs")) as proc:
        yield proc


def greedy(prompt: list[int]) -> StreamRequest:
    return StreamRequest("completions", {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                         "temperature": 0.0, "ignore_eos": True})


async def send_all(url: str, requests: list[StreamRequest], concurrent: bool
                   ) -> list[RequestRecord]:
    """Streams every request over SSE, all at once or one after the other."""
    connector = aiohttp.TCPConnector(limit=len(requests))
    async with aiohttp.ClientSession(connector=connector) as session:
        if concurrent:
            return list(await asyncio.gather(
                *(stream_request(session, url, r, timeout_s=TIMEOUT_S) for r in requests)))
        return [await stream_request(session, url, r, timeout_s=TIMEOUT_S) for r in requests]


@pytest.mark.slow
def test_preemption_storm_completes_every_request_with_unpressured_output(
        server: ServerProcess) -> None:
    prompts = random_prompts(512, NUM_REQUESTS, 16, 32, seed=7)
    requests = [greedy(p) for p in prompts]
    before = wait_idle(server.url)
    storm = asyncio.run(send_all(server.url, requests, concurrent=True))
    after_storm = wait_idle(server.url)
    # One at a time nothing is preempted: the reference output of each request.
    alone = asyncio.run(send_all(server.url, requests, concurrent=False))
    after_alone = wait_idle(server.url)
    assert all(r.ok for r in storm), [r.error for r in storm if not r.ok]
    assert all(r.ok for r in alone), [r.error for r in alone if not r.ok]
    assert [r.output_tokens for r in storm] == [MAX_TOKENS] * NUM_REQUESTS
    assert [r.finish_reason for r in storm] == ["length"] * NUM_REQUESTS
    for i, (pressured, reference) in enumerate(zip(storm, alone, strict=True)):
        assert pressured.text == reference.text, f"request {i} differs after preemption"
    preempted = (after_storm["preemptions"] or 0) - (before["preemptions"] or 0)
    assert preempted > 0, "the storm never ran out of KV blocks"
    assert after_alone["preemptions"] == after_storm["preemptions"]


# ---- requests that could never fit ------------------------------------------------------------

TOO_LONG = [
    # (prompt tokens, max_tokens, numbers the message must name)
    (100, 64, ("100", "64", str(MAX_MODEL_LEN))),  # prompt + max_tokens over the limit
    (MAX_MODEL_LEN + 40, 1, (str(MAX_MODEL_LEN + 40), str(MAX_MODEL_LEN))),  # the prompt alone
]


async def _refusals_while_full(url: str) -> list[tuple[int, dict[str, Any], float]]:
    """Fills the cache with long requests, then sends each too-long request over HTTP and the
    WebSocket; returns (status, error object, seconds to answer) for each."""
    filler = [greedy(p) for p in random_prompts(512, 8, 16, 32, seed=11)]
    results: list[tuple[int, dict[str, Any], float]] = []
    async with aiohttp.ClientSession() as session:
        fill = asyncio.gather(*(stream_request(session, url, r, timeout_s=TIMEOUT_S)
                                for r in filler))
        await asyncio.sleep(0.3)
        async with session.ws_connect(url + "/v1/ws") as ws:
            for i, (num_prompt, max_tokens, _) in enumerate(TOO_LONG):
                body = {"prompt": list(range(3, 3 + num_prompt)), "max_tokens": max_tokens}
                started = time.monotonic()
                async with session.post(url + "/v1/completions", json=body) as resp:
                    results.append((resp.status, await resp.json(),
                                    time.monotonic() - started))
                started = time.monotonic()
                await ws.send_json({"type": "completion", "id": i, **body})
                message = await asyncio.wait_for(ws.receive_json(), TIMEOUT_S)
                assert message["type"] == "error" and message["id"] == i, message
                results.append((400, {"error": message["error"]}, time.monotonic() - started))
        records = await fill
    assert all(r.ok and r.output_tokens == MAX_TOKENS for r in records)
    return results


def test_a_request_that_can_never_fit_is_refused_up_front(server: ServerProcess) -> None:
    wait_idle(server.url)
    results = asyncio.run(_refusals_while_full(server.url))
    assert len(results) == 2 * len(TOO_LONG)
    for (status, body, seconds), (_, _, numbers) in zip(
            results, [case for case in TOO_LONG for _ in (0, 1)], strict=True):
        assert status == 400
        error = assert_error_body(body)
        assert error["type"] == "invalid_request_error"
        for number in numbers:
            assert number in error["message"], (number, error["message"])
        assert seconds < 2.0, "refused only after waiting"
    wait_idle(server.url)


def test_the_engine_refuses_what_its_cache_could_never_hold(tiny_llama_dir: Path) -> None:
    """The engine's own guard, behind the max_model_len check: with a cache of 4 blocks (as if
    startup had not bounded max_model_len by the cache), nothing needing 5 gets queued."""
    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), max_model_len=MAX_MODEL_LEN,
                                  kv_cache_memory_bytes=2**20))
    try:
        engine.input_processor.num_blocks = 4  # 64 tokens of 16
        for num_prompt, max_tokens in ((20, 60), (70, 1)):
            with pytest.raises(ValueError) as info:
                engine.add_request(None, list(range(3, 3 + num_prompt)),
                                   SamplingParams(max_tokens=max_tokens))
            message = str(info.value)
            assert f"({num_prompt} tokens)" in message and f"({max_tokens})" in message
            assert "5 KV blocks" in message and "holds 4 blocks (64 tokens)" in message
        assert not engine.has_unfinished_requests()
        engine.add_request(None, list(range(3, 23)), SamplingParams(max_tokens=44))  # 4 blocks
        assert engine.has_unfinished_requests()
    finally:
        engine.shutdown()
