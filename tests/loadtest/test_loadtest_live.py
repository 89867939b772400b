"""`python -m loadtest run` against a live kvserve (tiny model) over SSE and the WebSocket,
and against servers that fail: every failure is counted by kind, none crashes the run."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loadtest.__main__ import main as loadtest_main
from loadtest.datasets import Prompt
from loadtest.runner import LoadConfig, run_load
from loadtest.sse_client import StreamRequest
from tests.support.server_process import ServerProcess, kvserve

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {"successful_requests", "failed_requests", "not_sent", "failures_by_kind",
                "failure_examples", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "ttft_ms",
                "tpot_ms", "itl_ms", "e2el_ms", "goodput", "server"}
STATS = {"mean", "median", "p90", "p99", "std"}
SAMPLE_KEYS = {"t", "running", "waiting", "kv_cache_usage", "preemptions",
               "prefix_cache_hit_rate"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    with kvserve(tiny_llama_dir, "--max-model-len", "512",
                 log_dir=tmp_path_factory.mktemp("loadtest")) as srv:
        yield srv


def run_cli(server: ServerProcess, tmp_path: Path, *flags: str,
            scrape_interval: str = "0.2") -> tuple[int, dict[str, Any]]:
    out = tmp_path / "result.json"
    code = loadtest_main(["run", "--url", server.url, "--no-progress", "--scrape-interval",
                          scrape_interval, "--result-json", str(out), *flags])
    return code, orjson.loads(out.read_bytes())


def check_complete_result(result: dict[str, Any], num_requests: int) -> None:
    assert result["kind"] == "kvserve-loadtest" and result["version"] == 1
    summary = result["summary"]
    assert SUMMARY_KEYS <= set(summary)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(summary[key]) == STATS and all(v is not None for v in summary[key].values())
    assert len(result["requests"]) == num_requests
    assert result["server_metrics"] and all(SAMPLE_KEYS <= set(s)
                                            for s in result["server_metrics"])
    assert summary["server"]["max_running"] >= 1


@pytest.mark.parametrize("transport,endpoint", [("sse", "completions"), ("ws", "chat")])
def test_run_writes_every_field_and_a_png(server: ServerProcess, tmp_path: Path,
                                          transport: str, endpoint: str) -> None:
    png = tmp_path / "run.png"
    code, result = run_cli(server, tmp_path, "--transport", transport, "--endpoint", endpoint,
                           "--num-prompts", "12", "--request-rate", "30", "--input-len", "24",
                           "--output-len", "6", "--ignore-eos", "--goodput", "ttft:600000",
                           "e2el:600000", "--plot", str(png),
                           # the run lasts ~0.4 s: scrape often enough to see requests running
                           scrape_interval="0.03")
    assert code == 0
    check_complete_result(result, 12)
    summary = result["summary"]
    assert summary["successful_requests"] == 12 and summary["failed_requests"] == 0
    assert summary["total_output_tokens"] == 12 * 6  # EOS ignored: exactly max_tokens each
    assert all(r["usage_reported"] and r["output_tokens"] == 6 for r in result["requests"])
    # generous SLOs: every request is good, so goodput equals the request throughput
    assert summary["goodput"]["good_requests"] == 12
    assert summary["goodput"]["request_throughput"] == pytest.approx(
        summary["request_throughput"])
    assert summary["output_throughput"] == pytest.approx(72 / summary["duration_s"])
    starts = [r["start_s"] for r in result["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0.05  # paced, not all at t=0
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


def test_duration_bounds_a_run(server: ServerProcess, tmp_path: Path) -> None:
    code, result = run_cli(server, tmp_path, "--num-prompts", "1000", "--request-rate", "10",
                           "--duration", "1", "--input-len", "8", "--output-len", "2")
    assert code == 0
    sent = len(result["requests"])
    assert 1 <= sent < 60 and result["summary"]["not_sent"] == 1000 - sent


def test_rejected_requests_are_counted_with_their_error_body(server: ServerProcess,
                                                             tmp_path: Path) -> None:
    # max_tokens past --max-model-len: every request gets an OpenAI 400
    code, result = run_cli(server, tmp_path, "--num-prompts", "5", "--output-len", "4096",
                           "--input-len", "8")
    assert code == 1  # nothing succeeded
    summary = result["summary"]
    assert summary["failures_by_kind"] == {"http_400:invalid_request_error": 5}
    assert "max_tokens" in summary["failure_examples"]["http_400:invalid_request_error"]
    assert summary["successful_requests"] == 0 and summary["ttft_ms"]["median"] is None


def test_ws_per_request_errors_are_counted(server: ServerProcess, tmp_path: Path) -> None:
    code, result = run_cli(server, tmp_path, "--transport", "ws", "--num-prompts", "3",
                           "--output-len", "4096", "--input-len", "8")
    assert code == 1
    assert result["summary"]["failures_by_kind"] == {"ws_error:invalid_request_error": 3}


async def dropping_server() -> TestServer:
    """A fake server that starts each SSE stream, sends one chunk, then cuts the connection."""

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        assert request.transport is not None
        request.transport.close()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


def test_dropped_connections_are_counted_not_crashed() -> None:
    async def scenario() -> Any:
        server = await dropping_server()
        try:
            prompts = [Prompt(2, 4, text=f"p{i}") for i in range(6)]
            requests = [StreamRequest("completions", {"prompt": p.text, "max_tokens": 4})
                        for p in prompts]
            cfg = LoadConfig(url=str(server.make_url("")), max_concurrency=3, progress=False,
                             request_timeout_s=10, scrape_interval_s=0.1)
            return await run_load(cfg, prompts, requests)
        finally:
            await server.close()

    run = asyncio.run(scenario())
    assert len(run.records) == 6 and not any(r.ok for r in run.records)
    # the first chunk arrived before the cut: TTFT was measured, the request still failed
    assert all(r.ttft_s is not None for r in run.records)
    assert {r.error_kind for r in run.records} <= {"connection_error", "incomplete_stream"}
    assert run.server_metrics == [] and run.server_summary is None  # no /metrics there
