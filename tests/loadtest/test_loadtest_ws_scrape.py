"""The load harness's WebSocket client (against a live tiny kvserve and a fake socket that
drops) and its /metrics scraper (against hand-written Prometheus text and a fake server)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loadtest.scrape import MetricsScraper, parse_metrics, server_summary
from loadtest.sse_client import StreamRequest, stream_request
from loadtest.ws_client import WSClient
from tests.support.metrics import scrape, wait_idle
from tests.support.server_process import ServerProcess
from tests.support.tiny_models import english_sentences

# ---- live kvserve -------------------------------------------------------------------------


def make_request(i: int, max_tokens: int) -> StreamRequest:
    """Greedy requests, alternating chat and text completions."""
    text = english_sentences(1, seed=300 + i)[0]
    common = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if i % 2:
        return StreamRequest("chat", {"messages": [{"role": "user", "content": text}], **common})
    return StreamRequest("completions", {"prompt": text, **common})


async def aborted(url: str) -> float:
    """Requests the server counted as finished by abort (a cancel reached it)."""
    page = await asyncio.to_thread(scrape, url)
    return page.value("request_success_total", finished_reason="abort")


def test_concurrent_streams_match_sse_and_a_bad_one_fails_alone(
        tiny_server: ServerProcess) -> None:
    server = tiny_server
    requests = [make_request(i, 8 + 3 * i) for i in range(4)]
    bad = StreamRequest("completions", {"prompt": "hello", "max_tokens": -1})

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            expected = [await stream_request(session, server.url, r) for r in requests]
            async with WSClient(server.url) as ws:
                *records, failed = await asyncio.gather(*(ws.stream(r) for r in requests),
                                                        ws.stream(bad))
                assert ws.pending == 0
        for req, got, want in zip(requests, records, expected, strict=True):
            assert want.ok and got.ok, (got.error, want.error)
            assert got.status == 101
            assert got.text == want.text and got.text
            assert got.output_tokens == want.output_tokens == req.payload["max_tokens"]
            assert got.usage_reported and got.prompt_tokens == want.prompt_tokens
            assert got.finish_reason == "length"
            assert got.ttft_s is not None and 0 < got.ttft_s <= got.e2e_s
            assert len(got.itl_s) >= 1
        assert not failed.ok
        assert failed.error_kind == "ws_error:invalid_request_error", failed.error_kind
        assert "max_tokens" in failed.error

    asyncio.run(main())


def test_timeout_and_caller_cancel_abort_on_the_server(tiny_server: ServerProcess) -> None:
    server = tiny_server
    long = make_request(0, 1000)

    async def main() -> None:
        async with WSClient(server.url) as ws:
            aborts = await aborted(server.url)
            record = await ws.stream(long, timeout_s=0.3)
            assert not record.ok and record.error_kind == "timeout", record.error
            await asyncio.to_thread(wait_idle, server.url)

            task = asyncio.create_task(ws.stream(long))
            for _ in range(250):  # until the server runs it (at most ~5 s)
                if (await asyncio.to_thread(scrape, server.url))["running"]:
                    break
                await asyncio.sleep(0.02)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.to_thread(wait_idle, server.url)
            assert ws.pending == 0
            assert await aborted(server.url) == aborts + 2
            # The socket still carries new requests after both cancels.
            after = await ws.stream(make_request(1, 4))
            assert after.ok and after.output_tokens == 4

    asyncio.run(main())


# ---- a fake socket that drops --------------------------------------------------------------


async def dropping_ws(request: web.Request) -> web.WebSocketResponse:
    """Answers each request with one delta; closes with 1011 after the third request."""
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    seen = 0
    async for msg in ws:
        message = msg.json()
        seen += 1
        data = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
        await ws.send_json({"type": "delta", "id": message["id"], "data": data})
        await ws.send_json({"type": "error", "id": None, "error": {"message": "unrelated"}})
        if seen == 3:
            await ws.close(code=aiohttp.WSCloseCode.INTERNAL_ERROR, message=b"fake crash")
    return ws


def test_socket_drop_fails_pending_requests_with_connection_error() -> None:
    async def main() -> None:
        app = web.Application()
        app.router.add_get("/v1/ws", dropping_ws)
        async with TestServer(app, host="127.0.0.1") as fake:
            url = str(fake.make_url("")).rstrip("/")
            async with WSClient(url) as ws:
                req = StreamRequest("completions", {"prompt": "x", "max_tokens": 5})
                records = await asyncio.gather(*(ws.stream(req, timeout_s=10) for _ in range(3)))
                later = await ws.stream(req)
            for record in (*records, later):
                assert not record.ok and record.error_kind == "connection_error"
                assert "1011" in record.error, record.error
            assert all(r.ttft_s is not None and r.text == "hi" for r in records)
            with pytest.raises(ConnectionError):
                async with WSClient(url + "/nowhere"):
                    pass

    asyncio.run(main())


# ---- parse_metrics -------------------------------------------------------------------------

KVSERVE_TEXT = """\
# HELP kvserve:num_requests_running Requests being computed.
# TYPE kvserve:num_requests_running gauge
kvserve:num_requests_running{model_name="a"} 3.0
kvserve:num_requests_running{model_name="b"} 2.0
# TYPE kvserve:num_requests_waiting gauge
kvserve:num_requests_waiting{model_name="a"} 7.0
# TYPE kvserve:kv_cache_usage_perc gauge
kvserve:kv_cache_usage_perc{model_name="a"} 0.25
# TYPE kvserve:prefix_cache_queries counter
kvserve:prefix_cache_queries_total{model_name="a"} 1000.0
# TYPE kvserve:prefix_cache_hits counter
kvserve:prefix_cache_hits_total{model_name="a"} 400.0
# TYPE kvserve:num_preemptions counter
kvserve:num_preemptions_total{model_name="a"} 4.0
kvserve:num_preemptions_total{model_name="b"} 1.0
# TYPE kvserve:generation_tokens counter
kvserve:generation_tokens_total{model_name="a"} 99.0
"""

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 6.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.0
"""


def test_parse_metrics_kvserve_names_sum_label_sets() -> None:
    assert parse_metrics(KVSERVE_TEXT) == {
        "running": 5.0, "waiting": 7.0, "kv_cache_usage": 0.25, "preemptions": 5.0,
        "prefix_cache_queries": 1000.0, "prefix_cache_hits": 400.0}


def test_parse_metrics_vllm_names_and_missing_ones() -> None:
    assert parse_metrics(VLLM_TEXT) == {
        "running": 1.0, "waiting": 0.0, "kv_cache_usage": 0.5, "preemptions": 6.0,
        "prefix_cache_queries": None, "prefix_cache_hits": None}
    assert set(parse_metrics("").values()) == {None}


# ---- MetricsScraper ------------------------------------------------------------------------

COUNTS = web.AppKey("counts", dict)


async def fake_metrics(request: web.Request) -> web.Response:
    c = request.app[COUNTS]
    text = (f'vllm:num_requests_running{{model_name="m"}} {c["running"]}\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {c["waiting"]}\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {c["kv"]}\n'
            f'vllm:num_preemptions_total{{model_name="m"}} {c["preempt"]}\n'
            f'vllm:prefix_cache_queries_total{{model_name="m"}} {c["queries"]}\n'
            f'vllm:prefix_cache_hits_total{{model_name="m"}} {c["hits"]}\n')
    return web.Response(text=text)


def test_scraper_counts_from_the_first_sample_and_rates_per_interval() -> None:
    counts: dict[str, Any] = {"running": 1, "waiting": 0, "kv": 0.1, "preempt": 10,
                              "queries": 100, "hits": 50}

    async def main() -> list[dict[str, Any]]:
        app = web.Application()
        app[COUNTS] = counts
        app.router.add_get("/metrics", fake_metrics)
        async with TestServer(app, host="127.0.0.1") as fake, aiohttp.ClientSession() as s:
            scraper = MetricsScraper(s, str(fake.make_url("")), interval_s=60.0)
            t0 = time.perf_counter()
            scraper.start(t0)
            while not scraper.samples:
                await asyncio.sleep(0.01)
            counts.update(running=4, waiting=3, kv=0.7, preempt=12, queries=300, hits=200)
            await scraper.scrape_once()
            counts.update(running=2, waiting=0, kv=0.3, preempt=13)  # no new queries
            samples = await scraper.stop()
            assert scraper.available
            return samples

    samples = asyncio.run(main())
    assert [s["preemptions"] for s in samples] == [0, 2, 3]
    assert [s["prefix_cache_hit_rate"] for s in samples] == [None, 0.75, None]
    assert [s["running"] for s in samples] == [1, 4, 2]
    assert 0 <= samples[0]["t"] <= samples[1]["t"] <= samples[2]["t"] < 30
    assert server_summary(samples) == {
        "max_running": 4, "max_waiting": 3, "max_kv_cache_usage": 0.7, "preemptions": 3,
        "prefix_cache_hit_rate": 150 / 200}
    assert server_summary([]) is None


def test_scraper_without_metrics_or_server_stays_quiet() -> None:
    async def main() -> None:
        app = web.Application()  # no /metrics route: 404
        async with TestServer(app, host="127.0.0.1") as fake, aiohttp.ClientSession() as s:
            scraper = MetricsScraper(s, str(fake.make_url("")), interval_s=0.05)
            scraper.start(0.0)
            await asyncio.sleep(0.2)
            assert not scraper.available
            assert await scraper.stop() == []
            port = fake.port
        async with aiohttp.ClientSession() as s:  # nothing listens there any more
            down = MetricsScraper(s, f"http://127.0.0.1:{port}", interval_s=0.05)
            down.start(0.0)
            await asyncio.sleep(0.15)
            assert await down.stop() == [] and down.available  # failures are skipped

    asyncio.run(main())
