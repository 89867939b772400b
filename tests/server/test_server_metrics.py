"""/metrics of a real `kvserve serve` process: vLLM's metric names under `kvserve:`, counters
that move by exactly what a request did, prefix-cache hits on a repeated prompt, and nothing
left running, waiting or holding KV blocks after 50 clients hang up mid-stream."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import urllib.request
from typing import Any

import aiohttp
import pytest

from tests.support.api import post_json
from tests.support.metrics import PREFIX, MetricsPage, scrape, wait_idle
from tests.support.server_process import ServerProcess

NUM_CLIENTS = 50
CHUNKS_BEFORE_HANGING_UP = 3
IDLE_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    """The session's default server (tests/conftest.py)."""
    return tiny_server


def complete(server: ServerProcess, **body: Any) -> dict[str, Any]:
    result: dict[str, Any] = post_json(server, "/v1/completions", body)
    return result


def idle(server: ServerProcess) -> MetricsPage:
    return wait_idle(server.url, IDLE_TIMEOUT_S)


def fresh_prompt_ids(seed: int, length: int) -> list[int]:
    """Random token ids no other test sends, so no prefix-cache block matches them."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


# ---- names --------------------------------------------------------------------------------------

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
            "generation_tokens", "request_success")
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds",
              "iteration_tokens_total")


def test_every_metric_name_is_exposed(server: ServerProcess) -> None:
    complete(server, prompt="Hello there", max_tokens=3, ignore_eos=True)
    page = scrape(server.url)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", page.text, flags=re.M))
    assert all(name.startswith(PREFIX) for name in types), sorted(types)
    for name in GAUGES:
        assert types[PREFIX + name] == "gauge"
        assert 0.0 <= page.value(name)
    for name in COUNTERS:
        # The text format names counters with their _total sample, as vLLM's page does.
        assert types[PREFIX + name + "_total"] == "counter", name
        assert re.search(rf"^{re.escape(PREFIX + name)}_total\{{", page.text, flags=re.M), name
    for name in HISTOGRAMS:
        assert types[PREFIX + name] == "histogram", name
        assert page.value(f"{name}_count") >= 1, name
        assert page.value(f"{name}_bucket", le="+Inf") == page.value(f"{name}_count")
    assert page.value("request_success_total", finished_reason="length") >= 1
    for line in page.text.splitlines():
        if line.startswith(PREFIX + "request_success_total"):
            assert 'finished_reason="' in line
    assert types[PREFIX + "cache_config_info"] == "gauge"


def test_cache_config_info_matches_the_startup_log(server: ServerProcess) -> None:
    info = scrape(server.url).labels_of("cache_config_info")
    assert {"block_size", "num_gpu_blocks", "num_kv_cache_tokens", "max_concurrency"} <= \
        set(info)
    block_size, num_blocks = int(info["block_size"]), int(info["num_gpu_blocks"])
    num_tokens = int(info["num_kv_cache_tokens"])
    assert block_size >= 1 and num_blocks >= 1
    assert num_tokens == num_blocks * block_size
    log = server.log()
    logged_tokens = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert logged_tokens is not None and int(logged_tokens.group(1).replace(",", "")) == \
        num_tokens
    with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as resp:
        max_model_len = json.load(resp)["data"][0]["max_model_len"]
    logged = re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", log)
    assert logged is not None
    assert int(logged.group(1).replace(",", "")) == max_model_len
    assert float(info["max_concurrency"]) == pytest.approx(float(logged.group(2)), abs=0.01)
    assert float(info["max_concurrency"]) <= num_tokens / max_model_len + 0.01


# ---- counters move by what a request did --------------------------------------------------------

def test_counters_move_by_one_requests_tokens(server: ServerProcess) -> None:
    before = idle(server)
    prompt = fresh_prompt_ids(seed=1, length=37)
    body = complete(server, prompt=prompt, max_tokens=9, ignore_eos=True, temperature=0.0)
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), 9)
    after = idle(server)

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    assert delta("generation_tokens_total") == usage["completion_tokens"]
    assert delta("prompt_tokens_total") == usage["prompt_tokens"]  # nothing of it was cached
    assert delta("prefix_cache_queries_total") == usage["prompt_tokens"]
    assert delta("prefix_cache_hits_total") == 0
    assert delta("request_success_total", finished_reason="length") == 1
    assert delta("e2e_request_latency_seconds_count") == 1
    assert delta("time_to_first_token_seconds_count") == 1
    assert delta("request_queue_time_seconds_count") == 1
    # One gap between each two consecutive tokens.
    assert delta("inter_token_latency_seconds_count") == usage["completion_tokens"] - 1
    # Steps compute the prompt, then feed back every sampled token but the last.
    assert delta("iteration_tokens_total_sum") == \
        usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert delta("e2e_request_latency_seconds_sum") >= delta("time_to_first_token_seconds_sum")


def test_prefix_cache_hits_on_a_repeated_prompt(server: ServerProcess) -> None:
    block_size = int(scrape(server.url).labels_of("cache_config_info")["block_size"])
    prompt = fresh_prompt_ids(seed=2, length=5 * block_size + 3)
    before = idle(server)
    complete(server, prompt=prompt, max_tokens=2)
    middle = idle(server)
    complete(server, prompt=prompt, max_tokens=2)
    after = idle(server)
    hits_first = middle.value("prefix_cache_hits_total") - before.value("prefix_cache_hits_total")
    hits_second = after.value("prefix_cache_hits_total") - \
        middle.value("prefix_cache_hits_total")
    assert hits_first == 0
    # Every full block of the prompt is found again (at least one token is always computed).
    full_blocks = (len(prompt) - 1) // block_size
    assert hits_second == full_blocks * block_size
    queries = after.value("prefix_cache_queries_total") - \
        middle.value("prefix_cache_queries_total")
    assert queries == len(prompt)


# ---- clients that hang up ------------------------------------------------------------------------

async def _hang_up_after_a_few_chunks(session: aiohttp.ClientSession, url: str,
                                      index: int) -> int:
    body = {"prompt": f"Client {index} asks about the green cache block",
            "max_tokens": 200, "ignore_eos": True, "temperature": 0.0, "stream": True}
    resp = await session.post(url + "/v1/completions", json=body)
    assert resp.status == 200
    num_chunks = 0
    while num_chunks < CHUNKS_BEFORE_HANGING_UP:
        line = await resp.content.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: {"):
            num_chunks += 1
    resp.close()  # drops the connection mid-stream
    return num_chunks


async def _many_clients_hang_up(url: str) -> list[int]:
    connector = aiohttp.TCPConnector(limit=NUM_CLIENTS, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        return list(await asyncio.gather(
            *(_hang_up_after_a_few_chunks(session, url, i) for i in range(NUM_CLIENTS))))


def test_clients_hanging_up_free_everything(server: ServerProcess) -> None:
    before = idle(server)
    counts = asyncio.run(_many_clients_hang_up(server.url))
    assert counts == [CHUNKS_BEFORE_HANGING_UP] * NUM_CLIENTS
    after = idle(server)
    aborted = after.value("request_success_total", finished_reason="abort") - \
        before.value("request_success_total", finished_reason="abort")
    assert aborted == NUM_CLIENTS
    generated = after.value("generation_tokens_total") - before.value("generation_tokens_total")
    assert NUM_CLIENTS * CHUNKS_BEFORE_HANGING_UP <= generated < NUM_CLIENTS * 200
    time.sleep(0.3)  # nothing keeps generating for the clients that left
    assert scrape(server.url).value("generation_tokens_total") == after.value(
        "generation_tokens_total")
    body = complete(server, prompt="Hello there", max_tokens=4, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 4
    idle(server)


async def _give_up_while_waiting(url: str, num_clients: int) -> None:
    body = {"prompt": "Hello there", "max_tokens": 200, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        posts = [asyncio.create_task(session.post(url + "/v1/completions", json=body))
                 for _ in range(num_clients)]
        deadline = time.monotonic() + 10
        while True:  # every request has reached the engine
            async with session.get(url + "/metrics") as resp:
                page = MetricsPage(await resp.text())
            if page["running"] + page["waiting"] == \
                    num_clients:
                break
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        for post in posts:
            post.cancel()  # the client gives up before any byte of the response
        await asyncio.gather(*posts, return_exceptions=True)


def test_non_streamed_clients_giving_up_are_aborted(server: ServerProcess) -> None:
    num_clients = 20
    before = idle(server)
    asyncio.run(_give_up_while_waiting(server.url, num_clients))
    after = idle(server)
    aborted = after.value("request_success_total", finished_reason="abort") - \
        before.value("request_success_total", finished_reason="abort")
    assert aborted == num_clients
    assert after.value("request_success_total", finished_reason="length") == \
        before.value("request_success_total", finished_reason="length")
