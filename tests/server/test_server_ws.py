"""GET /v1/ws end to end on a real `kvserve serve`: many requests multiplexed over one socket,
cancel by id, close aborts, bad messages, ping and the message size cap."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.support.metrics import MetricsPage, scrape, wait_idle
from tests.support.server_process import MAX_BODY_BYTES, ServerProcess
from tests.support.tiny_models import english_sentences
from tests.support.ws import RECEIVE_TIMEOUT_S, Socket

IDLE_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def server(capped_server: ServerProcess) -> ServerProcess:
    """The session's server with a 64 KiB body and message cap (tests/server/conftest.py)."""
    return capped_server


def completion_request(i: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": english_sentences(1, seed=100 + i)[0], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "logprobs": 0}


def chat_request(i: int, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": english_sentences(1, seed=200 + i)[0]}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": True}


def streamed_result(kind: str, chunks: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """(text, token strings) of choice 0 from streamed chunks."""
    text, tokens = "", []
    for chunk in chunks:
        for choice in chunk["choices"]:
            logprobs = choice["logprobs"]
            if kind == "chat":
                text += choice["delta"].get("content") or ""
                tokens += [t["token"] for t in (logprobs or {}).get("content", [])]
            else:
                text += choice["text"]
                tokens += (logprobs or {}).get("tokens", [])
    return text, tokens


def whole_result(kind: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    """(text, token strings) of choice 0 from a non-streamed response."""
    choice = body["choices"][0]
    if kind == "chat":
        return choice["message"]["content"], [t["token"] for t in choice["logprobs"]["content"]]
    return choice["text"], choice["logprobs"]["tokens"]


async def http_post(session: aiohttp.ClientSession, url: str, kind: str,
                    body: dict[str, Any]) -> dict[str, Any]:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    async with session.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def metrics(url: str) -> MetricsPage:
    return await asyncio.to_thread(scrape, url)


async def idle(url: str, timeout: float = IDLE_TIMEOUT_S) -> MetricsPage:
    """Waits until nothing runs or waits and the KV cache is empty."""
    return await asyncio.to_thread(wait_idle, url, timeout)


def aborted(page: MetricsPage) -> float:
    """Requests finished by abort so far."""
    return page.value("request_success_total", finished_reason="abort")


def num_runs(ids: list[Any]) -> int:
    """Maximal blocks of equal consecutive ids."""
    return sum(1 for i, x in enumerate(ids) if i == 0 or ids[i - 1] != x)


def test_twenty_requests_interleave_and_match_http(server: ServerProcess) -> None:
    requests = {}
    for i in range(20):
        kind = "chat" if i % 2 else "completion"
        max_tokens = 12 + 3 * i
        body = (chat_request if kind == "chat" else completion_request)(i, max_tokens)
        requests[f"r{i}" if i % 3 else i] = (kind, max_tokens, body)  # string and int ids

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            expected = await asyncio.gather(*(http_post(session, server.url, kind, body)
                                              for kind, _, body in requests.values()))
            async with session.ws_connect(server.url + "/v1/ws") as ws:
                sock = Socket(ws)
                for request_id, (kind, _, body) in requests.items():
                    await sock.send({"type": kind, "id": request_id, **body})
                await sock.until_finished(set(requests))
            assert sock.errors() == []
            for (request_id, (kind, max_tokens, _)), want in zip(requests.items(), expected,
                                                                 strict=True):
                done = sock.done(request_id)
                assert done["finish_reasons"] == ["length"]
                assert done["usage"] == want["usage"]
                assert done["usage"]["completion_tokens"] == max_tokens
                text, tokens = streamed_result(kind, sock.deltas(request_id))
                assert (text, tokens) == whole_result(kind, want)
                assert len(tokens) == max_tokens
            # Deltas of different requests arrive interleaved, not one request after another.
            order = [m["id"] for m in sock.messages if m["type"] == "delta"]
            assert num_runs(order) >= 5 * len(requests)
            first_done = next(i for i, m in enumerate(sock.messages) if m["type"] == "done")
            assert {m["id"] for m in sock.messages[:first_done]} == set(requests)
            await idle(server.url)

    asyncio.run(main())


def test_cancel_stops_one_request_and_the_others_go_on(server: ServerProcess) -> None:
    others = {"a": ("completion", 80), "b": ("chat", 80)}

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            before = await metrics(server.url)
            async with session.ws_connect(server.url + "/v1/ws") as ws:
                sock = Socket(ws)
                await sock.send({"type": "completion", "id": "victim",
                                 **completion_request(0, 1000)})
                for request_id, (kind, num) in others.items():
                    body = (chat_request if kind == "chat" else completion_request)(1, num)
                    await sock.send({"type": kind, "id": request_id, **body})
                await sock.until_deltas("victim", 5)
                running = await metrics(server.url)
                assert running["running"] >= 1
                assert running["kv_cache_usage"] > 0
                await sock.send({"type": "cancel", "id": "victim"})
                await sock.until_finished({"victim"})
                await sock.until_finished(set(others))
                after = await idle(server.url, timeout=2.0)
                # The socket still takes requests.
                await sock.send({"type": "completion", "id": "again",
                                 **completion_request(2, 3)})
                await sock.until_finished({"again"})
            victim = sock.done("victim")
            assert victim["finish_reasons"] == ["abort"]
            num_streamed = len(streamed_result("completion", sock.deltas("victim"))[1])
            assert 5 <= victim["usage"]["completion_tokens"] == num_streamed < 1000
            for request_id, (_, num) in others.items():
                done = sock.done(request_id)
                assert done["finish_reasons"] == ["length"]
                assert done["usage"]["completion_tokens"] == num
            assert sock.done("again")["usage"]["completion_tokens"] == 3
            assert aborted(after) - aborted(before) == 1
            assert sock.errors() == []

    asyncio.run(main())


def test_closing_the_socket_aborts_its_requests(server: ServerProcess) -> None:
    ids = ["x", "y", "z"]

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            before = await metrics(server.url)
            async with session.ws_connect(server.url + "/v1/ws") as ws:
                sock = Socket(ws)
                for i, request_id in enumerate(ids):
                    await sock.send({"type": "completion", "id": request_id,
                                     **completion_request(10 + i, 1000)})
                for request_id in ids:
                    await sock.until_deltas(request_id, 2)
                busy = await metrics(server.url)
                assert busy["running"] == len(ids)
                assert busy["kv_cache_usage"] > 0
            after = await idle(server.url)
            assert aborted(after) - aborted(before) == len(ids)
            # Aborted, not finished: far fewer tokens than 3 x 1000 were generated.
            generated = after.value("generation_tokens_total") - \
                before.value("generation_tokens_total")
            assert generated < len(ids) * 1000 // 2

    asyncio.run(main())


def test_bad_messages_get_errors_and_the_socket_keeps_working(server: ServerProcess) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(server.url + "/v1/ws") as ws:
            sock = Socket(ws)

            async def expect_error(raw: str, request_id: Any, param: str | None = None
                                   ) -> dict[str, Any]:
                await ws.send_str(raw)
                message = await sock.receive()
                assert message["type"] == "error" and message["id"] == request_id, message
                error = message["error"]
                assert error["type"] == "invalid_request_error" and error["message"], error
                if param is not None:
                    assert error["param"] == param, error
                return message

            await expect_error("{not json", None)
            await expect_error("[1, 2]", None)
            await expect_error(json.dumps({"type": "teleport", "id": "t1"}), "t1", "type")
            await expect_error(json.dumps({"type": "completion", "prompt": "hi"}), None, "id")
            await expect_error(json.dumps({"type": "completion", "id": True, "prompt": "x"}),
                               None, "id")
            await expect_error(json.dumps({"type": "completion", "id": "neg", "prompt": "hi",
                                           "temperature": -1}), "neg", "temperature")
            await expect_error(json.dumps({"type": "chat", "id": "nomsg"}), "nomsg")
            await expect_error(json.dumps({"type": "cancel", "id": "ghost"}), "ghost", "id")
            await ws.send_bytes(b'{"type": "ping"}')
            binary = await sock.receive()
            assert binary["type"] == "error" and binary["id"] is None
            # A duplicate id is refused while the first is running; the first is untouched.
            await sock.send({"type": "completion", "id": "dup", **completion_request(3, 40)})
            await sock.send({"type": "completion", "id": "dup", **completion_request(4, 5)})
            refusal = await sock.receive()
            while refusal["type"] == "delta":
                refusal = await sock.receive()
            # Reported with id null (the id still belongs to the running request), naming it.
            assert refusal["type"] == "error" and refusal["id"] is None, refusal
            assert refusal["error"]["param"] == "id" and "'dup'" in refusal["error"]["message"]
            await sock.until_finished({"dup"})  # the done of the first
            done = sock.done("dup")
            assert done["finish_reasons"] == ["length"]
            assert done["usage"]["completion_tokens"] == 40
            # Once finished, the id may be used again.
            await sock.send({"type": "completion", "id": "dup", **completion_request(5, 2)})
            await sock.send({"type": "ping"})
            replies = [await sock.receive()]
            while replies[-1]["type"] != "done":
                replies.append(await sock.receive())
            assert {"type": "pong"} in replies
            assert replies[-1]["id"] == "dup" and replies[-1]["usage"]["completion_tokens"] == 2
            await idle(server.url)

    asyncio.run(main())


def test_oversized_message_closes_with_1009(server: ServerProcess) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(server.url + "/v1/ws") as ws:
                await ws.send_str(json.dumps({"type": "completion", "id": "big",
                                              "prompt": "a" * MAX_BODY_BYTES}))
                msg = await asyncio.wait_for(ws.receive(), RECEIVE_TIMEOUT_S)
                assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), msg
                assert ws.close_code == 1009
            # The server keeps serving: health, a fresh socket, HTTP.
            async with session.get(server.url + "/health") as resp:
                assert resp.status == 200
            async with session.ws_connect(server.url + "/v1/ws") as ws:
                sock = Socket(ws)
                await sock.send({"type": "ping"})
                assert await sock.receive() == {"type": "pong"}
                # A message just under the cap is fine.
                message = {"type": "completion", "id": "ok", **completion_request(7, 2)}
                message["user"] = "u" * (MAX_BODY_BYTES - len(json.dumps(message)) - 100)
                await sock.send(message)
                await sock.until_finished({"ok"})
                assert sock.errors() == []
                assert sock.done("ok")["usage"]["completion_tokens"] == 2
            body = await http_post(session, server.url, "completion", completion_request(6, 3))
            assert body["usage"]["completion_tokens"] == 3
            await idle(server.url)
        assert server.proc.poll() is None

    asyncio.run(main())
