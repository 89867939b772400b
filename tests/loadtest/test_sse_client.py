"""The streaming load client against an in-process fake OpenAI server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loadtest.records import RequestRecord
from loadtest.runner import run_fixed_concurrency
from loadtest.sse_client import SSEParser, StreamRequest, stream_request
from loadtest.stats import percentile, summarize

FIRST_SLEEP, GAP_SLEEP = 0.06, 0.02
WORDS = ["Hello", ",", " world", "!"]


@dataclass
class Gauge:
    """Streams in flight on the fake server, and the most seen at once."""

    now: int = 0
    peak: int = 0


GAUGE = web.AppKey("gauge", Gauge)


def chunk(content: str | None = None, finish: str | None = None,
          usage: dict[str, int] | None = None) -> bytes:
    """One chat.completion.chunk event; no content and no finish means a usage-only chunk."""
    body: dict[str, Any] = {"object": "chat.completion.chunk", "choices": []}
    if content is not None or finish is not None:
        delta = {} if content is None else {"content": content}
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


async def chat(request: web.Request) -> web.StreamResponse:
    """Streams a scenario named by the user message: ok, no_usage, error, no_done, or http400."""
    body = await request.json()
    scenario = body["messages"][0]["content"]
    if scenario == "http400":
        return web.json_response({"error": {"message": "bad max_tokens"}}, status=400)
    gauge = request.app[GAUGE]
    gauge.now += 1
    gauge.peak = max(gauge.peak, gauge.now)
    try:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk(content=""))  # the role chunk carries no text
        await asyncio.sleep(FIRST_SLEEP)
        for i, word in enumerate(WORDS):
            if i:
                await asyncio.sleep(GAP_SLEEP)
            await resp.write(chunk(content=word))
            if scenario == "error" and i == 1:
                await resp.write(b'data: {"error": {"message": "boom", "code": 500}}\n\n')
                return resp
        await resp.write(chunk(finish="length"))
        if scenario != "no_usage":
            await resp.write(chunk(usage={"prompt_tokens": 5, "completion_tokens": 7}))
        if scenario != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        gauge.now -= 1


async def completions(request: web.Request) -> web.StreamResponse:
    """A text-completion stream: `choices[0].text`, split across TCP writes mid-line."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    event = 'data: {"choices": [{"index": 0, "text": "abc", "finish_reason": null}]}\r\n\r\n'
    await resp.write(event[:10].encode())
    await asyncio.sleep(0.01)
    await resp.write(event[10:].encode())
    await resp.write(b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}'
                     b"\n\ndata: [DONE]\n\n")
    return resp


def with_server(test: Callable[[str], Awaitable[Any]]) -> Any:
    """Runs `test(base_url)` against a fresh fake server."""
    async def main() -> Any:
        app = web.Application()
        app[GAUGE] = Gauge()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_post("/v1/completions", completions)
        async with TestServer(app, host="127.0.0.1") as server:
            result = await test(str(server.make_url("")))
            return result, app[GAUGE].peak
    return asyncio.run(main())


def one(scenario: str) -> RequestRecord:
    import aiohttp

    async def test(base: str) -> RequestRecord:
        async with aiohttp.ClientSession() as session:
            req = StreamRequest("chat", {"messages": [{"role": "user", "content": scenario}]})
            return await stream_request(session, base, req, timeout_s=10)
    return with_server(test)[0]


def test_success_records_text_usage_and_timing() -> None:
    rec = one("ok")
    assert rec.ok and rec.status == 200 and rec.error == ""
    assert rec.text == "Hello, world!"
    assert rec.output_tokens == 7 and rec.usage_reported and rec.prompt_tokens == 5
    assert rec.finish_reason == "length"
    assert rec.ttft_s is not None and rec.ttft_s >= FIRST_SLEEP * 0.95
    assert len(rec.itl_s) == len(WORDS) - 1
    assert all(gap >= GAP_SLEEP * 0.9 for gap in rec.itl_s)
    assert rec.e2e_s >= rec.ttft_s + sum(rec.itl_s) - 1e-6


def test_without_usage_counts_content_chunks() -> None:
    rec = one("no_usage")
    assert rec.ok and not rec.usage_reported and rec.output_tokens == len(WORDS)


def test_stream_closed_after_finish_reason_without_done_is_ok() -> None:
    rec = one("no_done")
    assert rec.ok and rec.output_tokens == 7


def test_in_stream_error_is_a_failure() -> None:
    rec = one("error")
    assert not rec.ok and "boom" in rec.error and rec.text == "Hello,"


def test_http_error_is_a_failure() -> None:
    rec = one("http400")
    assert not rec.ok and rec.status == 400 and "bad max_tokens" in rec.error


def test_chunk_hook_sees_every_chunk_as_it_arrives() -> None:
    import aiohttp

    seen: list[dict[str, Any]] = []

    async def test(base: str) -> RequestRecord:
        async with aiohttp.ClientSession() as session:
            req = StreamRequest("chat", {"messages": [{"role": "user", "content": "ok"}]})
            return await stream_request(session, base, req, on_chunk=seen.append)
    rec = with_server(test)[0]
    assert rec.ok and len(seen) == 7  # role, 4 words, finish, usage
    assert [c["choices"][0]["delta"].get("content") for c in seen[1:5]] == WORDS
    assert seen[-1]["usage"]["completion_tokens"] == 7  # the usage-only chunk too


def test_completions_stream_split_across_writes() -> None:
    import aiohttp

    async def test(base: str) -> RequestRecord:
        async with aiohttp.ClientSession() as session:
            return await stream_request(session, base, StreamRequest("completions", {"p": 1}))
    rec = with_server(test)[0]
    assert rec.ok and rec.text == "abc" and rec.finish_reason == "stop"


def test_unreachable_server_is_a_failure() -> None:
    import aiohttp

    async def test() -> RequestRecord:
        async with aiohttp.ClientSession() as session:
            return await stream_request(session, "http://127.0.0.1:9", StreamRequest(
                "chat", {}), timeout_s=2)
    rec = asyncio.run(test())
    assert not rec.ok and rec.error


def test_parser_joins_multiline_data_and_skips_comments() -> None:
    parser = SSEParser()
    events = [parser.feed_line(line) for line in
              [b": keep-alive\n", b"event: message\n", b"data: a\n", b"data:b\r\n", b"\r\n"]]
    assert events == [None, None, None, None, "a\nb"]
    assert parser.feed_line("data: tail") is None and parser.flush() == "tail"


def test_runner_keeps_concurrency_and_records_every_request() -> None:
    reqs = [StreamRequest("chat", {"messages": [{"role": "user", "content": s}]})
            for s in ["ok"] * 5 + ["http400"]]
    result, max_in_flight = with_server(lambda base: run_fixed_concurrency(base, reqs, 2))
    assert len(result.records) == 6 and result.not_sent == 0
    assert max_in_flight == 2
    summary = summarize(result.records, result.duration_s)
    assert summary["successful_requests"] == 5 and summary["failed_requests"] == 1
    assert summary["total_output_tokens"] == 35
    errors = list(summary["failure_examples"].values())
    assert errors and "HTTP 400" in errors[0]


def test_runner_starts_nothing_after_time_limit() -> None:
    reqs = [StreamRequest("chat", {"messages": [{"role": "user", "content": "ok"}]})] * 3
    result, _ = with_server(lambda base: run_fixed_concurrency(base, reqs, 2, time_limit_s=0))
    assert result.records == [] and result.not_sent == 3


def test_percentile_interpolates_like_numpy() -> None:
    sample = [float(x) for x in range(10, 0, -1)]  # unsorted on purpose
    assert percentile(sample, 50) == pytest.approx(5.5)
    assert percentile(sample, 99) == pytest.approx(9.91)
    assert percentile(sample, 0) == 1.0 and percentile(sample, 100) == 10.0
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0


def test_summarize_known_sample() -> None:
    records = [RequestRecord(ok=True, ttft_s=0.1 * (i + 1), itl_s=[0.01, 0.03], e2e_s=1.0 + i,
                             output_tokens=10) for i in range(4)]
    records.append(RequestRecord(ok=False, error="HTTP 500: x", ttft_s=9.0, output_tokens=99))
    s = summarize(records, duration_s=4.0)
    assert (s["successful_requests"] + s["failed_requests"], s["successful_requests"],
            s["failed_requests"], s["total_output_tokens"]) == (5, 4, 1, 40)
    assert s["output_throughput"] == pytest.approx(10.0)
    assert s["ttft_ms"]["median"] == pytest.approx(250.0)  # failures are left out of latencies
    assert s["ttft_ms"]["p99"] == pytest.approx(397.0)
    assert s["itl_ms"]["median"] == pytest.approx(20.0)
    assert s["itl_ms"]["p99"] == pytest.approx(30.0)
    assert s["e2el_ms"]["median"] == pytest.approx(2500.0)
    assert list(s["failure_examples"].values()) == ["HTTP 500: x"]
