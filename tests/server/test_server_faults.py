"""A real fault inside the server (a model step that raises, a bug in a handler) gives a 500
with OpenAI's error body, or an in-stream error then [DONE] once streaming began, and the server
keeps serving. Run in-process so faults can be injected."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from server.app import create_app
from server.config import ServerConfig
from server.state import ENGINE
from tests.support.api import PROMPT, assert_error_body
from tests.support.waiting import wait_until


def _in_process(tiny_llama_dir: Path,
                body: Callable[[TestClient[Any, Any], AsyncEngine], Any],
                **engine_args: Any) -> None:
    args = EngineArgs(model=str(tiny_llama_dir), kv_cache_memory_bytes=4 * 2**20,
                      **engine_args)
    engines: list[AsyncEngine] = []

    def factory() -> AsyncEngine:
        engines.append(AsyncEngine.from_args(args))
        return engines[-1]

    app = create_app(ServerConfig(), engine_factory=factory)

    async def main() -> None:
        async with TestClient(TestServer(app)) as client:
            assert app[ENGINE] is engines[0]
            await body(client, engines[0])

    asyncio.run(main())


def _fail_next_steps(engine: AsyncEngine, count: int) -> list[int]:
    """Makes the next `count` model steps raise; returns a one-item list of steps failed."""
    runner = engine.engine.runner
    execute = runner.execute
    failed = [0]

    def flaky(batch: Any) -> Any:
        if failed[0] < count:
            failed[0] += 1
            raise RuntimeError("injected fault in the model step")
        return execute(batch)

    runner.execute = flaky  # type: ignore[method-assign]
    return failed


async def _normal_request(client: TestClient[Any, Any]) -> None:
    resp = await client.post("/v1/completions",
                             json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    assert resp.status == 200
    assert (await resp.json())["usage"]["completion_tokens"] == 3


def test_a_failed_step_is_500_and_the_server_keeps_serving(tiny_llama_dir: Path) -> None:
    async def body(client: TestClient[Any, Any], engine: AsyncEngine) -> None:
        await _normal_request(client)
        failed = _fail_next_steps(engine, 1)
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        assert resp.status == 500
        error = assert_error_body(await resp.json())
        assert error["type"] == "server_error"
        assert failed == [1]
        await _normal_request(client)

        failed = _fail_next_steps(engine, 1)
        for path, request in (("/v1/completions", {"prompt": PROMPT}),
                              ("/v1/chat/completions",
                               {"messages": [{"role": "user", "content": PROMPT}]})):
            # A step scheduled ahead for the last request may still be running: it must not
            # take this request's injected fault (a race seen under load).
            await wait_until(lambda: engine.num_unfinished == 0 and not engine._step_in_flight,
                             "the engine to go idle")
            failed[0] = 0
            resp = await client.post(path, json={**request, "max_tokens": 3, "stream": True})
            assert resp.status == 200  # the headers went out before the step failed
            raw = (await resp.read()).decode()
            events = [e for e in raw.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert_error_body(json.loads(events[-2][len("data: "):]))
            assert failed == [1]
        await _normal_request(client)
        assert not engine.is_dead and engine.num_unfinished == 0
        assert engine.engine.kv.usage() == 0.0

    _in_process(tiny_llama_dir, body)


def test_a_handler_bug_is_500_and_the_server_keeps_serving(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from server.responses import ResponseBuilder

    final_body = ResponseBuilder.final_body
    calls = [0]

    def broken_once(self: ResponseBuilder) -> dict[str, Any]:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyError("injected bug")
        return final_body(self)

    monkeypatch.setattr(ResponseBuilder, "final_body", broken_once)

    async def body(client: TestClient[Any, Any], engine: AsyncEngine) -> None:
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert resp.status == 500
        error = assert_error_body(await resp.json())
        assert error["type"] == "server_error"
        await _normal_request(client)
        assert engine.num_unfinished == 0

    _in_process(tiny_llama_dir, body)


# ---- only the requests of the failed step -------------------------------------------------------

LONG = 300  # tokens: the first request is surely still running when the fault is armed


async def _sse_events(resp: Any) -> list[str]:
    return [e for e in (await resp.read()).decode().split("\n\n") if e]


def test_a_failed_step_fails_only_its_requests_over_sse(tiny_llama_dir: Path) -> None:
    """With one sequence running, a queued request is not in the failed step: it succeeds."""
    async def body(client: TestClient[Any, Any], engine: AsyncEngine) -> None:
        request = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
        running = await client.post("/v1/completions", json=request)
        assert running.status == 200
        first = await running.content.readline()  # a token: it is running
        assert first.startswith(b"data: {")
        queued = asyncio.ensure_future(client.post("/v1/completions", json=request))
        await wait_until(lambda: len(engine.engine.scheduler.waiting) == 1)
        failed = _fail_next_steps(engine, 1)
        events = await _sse_events(running)
        assert events[-1] == "data: [DONE]"
        error = assert_error_body(json.loads(events[-2][len("data: "):]))
        assert error["type"] == "server_error" and failed == [1]
        resp = await queued
        assert resp.status == 200
        events = await _sse_events(resp)
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert all("error" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        await _normal_request(client)
        assert not engine.is_dead and engine.num_unfinished == 0
        assert engine.engine.kv.usage() == 0.0

    _in_process(tiny_llama_dir, body, max_num_seqs=1)


def test_a_failed_step_fails_only_its_requests_over_the_websocket(tiny_llama_dir: Path) -> None:
    """The running id ends with an error message; the queued id on the same socket is done."""
    async def body(client: TestClient[Any, Any], engine: AsyncEngine) -> None:
        request = {"type": "completion", "prompt": PROMPT, "max_tokens": LONG,
                   "ignore_eos": True}
        async with client.ws_connect("/v1/ws") as ws:
            await ws.send_json({**request, "id": "running"})
            message = await ws.receive_json(timeout=30)
            assert message["type"] == "delta" and message["id"] == "running", message
            await ws.send_json({**request, "id": "queued"})
            await wait_until(lambda: len(engine.engine.scheduler.waiting) == 1)
            failed = _fail_next_steps(engine, 1)
            ends: dict[str, dict[str, Any]] = {}
            while len(ends) < 2:
                message = await ws.receive_json(timeout=30)
                if message["type"] in ("done", "error"):
                    ends[message["id"]] = message
        assert failed == [1]
        assert ends["running"]["type"] == "error"
        assert assert_error_body({"error": ends["running"]["error"]})["type"] == "server_error"
        assert ends["queued"]["type"] == "done"
        assert ends["queued"]["finish_reasons"] == ["length"]
        assert ends["queued"]["usage"]["completion_tokens"] == LONG
        await _normal_request(client)
        assert not engine.is_dead and engine.num_unfinished == 0
        assert engine.engine.kv.usage() == 0.0

    _in_process(tiny_llama_dir, body, max_num_seqs=1)


def test_an_internal_value_error_is_500_not_400(tiny_llama_dir: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Only the engine's typed InvalidRequestError means bad input: a plain ValueError from an
    internal invariant is a server fault, answered 500 with its traceback in the log."""
    async def body(client: TestClient[Any, Any], engine: AsyncEngine) -> None:
        render = engine.render_chat

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise ValueError("prompt invariant broken")  # reads like bad input, is not

        engine.render_chat = broken  # type: ignore[method-assign]
        chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
        resp = await client.post("/v1/chat/completions", json=chat)
        assert resp.status == 500
        error = assert_error_body(await resp.json())
        assert error["type"] == "server_error" and error["param"] is None
        assert any(r.exc_info and "prompt invariant broken" in str(r.exc_info[1])
                   for r in caplog.records)
        engine.render_chat = render  # type: ignore[method-assign]
        resp = await client.post("/v1/chat/completions", json={**chat, "max_tokens": 10**6})
        assert resp.status == 400  # the engine's typed error (past max_model_len) is a 400
        assert assert_error_body(await resp.json(), "max_tokens")
        await _normal_request(client)

    _in_process(tiny_llama_dir, body)
