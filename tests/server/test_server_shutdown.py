"""`kvserve serve` shutdown: SIGTERM drains requests in flight (503 for new work, /health 503)
and exits 0; a second SIGTERM exits at once; --shutdown-timeout bounds the drain."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.server_process import ServerProcess, kvserve
from tests.support.tiny_models import english_sentences
from tests.support.waiting import wait_until
from tests.support.ws import Socket

NUM_STREAMS = 4
TIMEOUT_S = 60.0


@dataclass
class Stream:
    """What one streamed completion delivered."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]
    error: BaseException | None = None

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for chunk in self.chunks for c in chunk.get("choices", [])
                if c["finish_reason"] is not None]

    @property
    def num_token_chunks(self) -> int:
        return sum(len(chunk.get("choices", [])) for chunk in self.chunks)

    @property
    def usage(self) -> dict[str, int] | None:
        return self.chunks[-1].get("usage") if self.chunks else None


async def stream_completion(session: aiohttp.ClientSession, url: str, prompt: str,
                            max_tokens: int, stream: Stream) -> Stream:
    """Streams one completion over SSE into `stream`; a dropped connection is recorded."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):].strip()
                if data == b"[DONE]":
                    stream.done = True
                    break
                stream.chunks.append(json.loads(data))
    except aiohttp.ClientError as exc:
        stream.error = exc
    return stream


async def start_streams(session: aiohttp.ClientSession, url: str, max_tokens: int
                        ) -> tuple[list[Stream], list[asyncio.Task[Stream]]]:
    """Starts NUM_STREAMS streamed completions and waits until each has a token."""
    streams = [Stream() for _ in range(NUM_STREAMS)]
    tasks = [asyncio.create_task(stream_completion(session, url, english_sentences(1, seed=i)[0],
                                                   max_tokens, s))
             for i, s in enumerate(streams)]
    await wait_until(lambda: all(len(s.chunks) >= 2 for s in streams), "streams to start",
                     timeout=20.0)
    return streams, tasks


async def wait_health(session: aiohttp.ClientSession, url: str, status: int,
                      timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        async with session.get(url + "/health") as resp:
            if resp.status == status:
                return
        assert loop.time() < deadline, f"/health did not turn {status}"
        await asyncio.sleep(0.01)


def wait_exit(server: ServerProcess, timeout: float) -> tuple[int | None, float]:
    """Waits for the process to exit; returns (exit code or None, seconds waited)."""
    started = time.monotonic()
    deadline = started + timeout
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.proc.poll(), time.monotonic() - started


def test_sigterm_drains_requests_in_flight(tiny_llama_dir: Path,
                                           tmp_path: Path) -> None:
    max_tokens = 200

    async def main(server: ServerProcess) -> tuple[list[Stream], list[dict[str, Any]]]:
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(server.url + "/v1/ws") as ws:
            socket = Socket(ws)
            await socket.send({"type": "completion", "id": "old", "prompt": "hello there",
                               "max_tokens": max_tokens, "temperature": 0,
                               "ignore_eos": True})
            await socket.until(lambda m: m["type"] == "delta")
            streams, tasks = await start_streams(session, server.url, max_tokens)
            server.proc.send_signal(signal.SIGTERM)
            await wait_health(session, server.url, 503)
            # Still draining: the streams are not done yet, and new work is refused.
            assert not all(s.done for s in streams)
            async with session.post(server.url + "/v1/completions",
                                    json={"prompt": "hello", "max_tokens": 2}) as resp:
                assert resp.status == 503
                assert resp.headers.get("Retry-After")
                error = (await resp.json())["error"]
                assert error["type"] == "server_error" and error["message"]
                assert error["code"] == "shutting_down"
            async with session.post(server.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}]}) as resp:
                assert resp.status == 503
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                await session.ws_connect(server.url + "/v1/ws")
            assert info.value.status == 503
            # A socket opened before the signal takes no new work either.
            await socket.send({"type": "completion", "id": "new", "prompt": "hi",
                               "max_tokens": 2})
            async with session.get(server.url + "/metrics") as resp:
                assert resp.status == 200  # operators can watch the drain
            assert not all(s.done for s in streams)
            await socket.until(lambda m: m["type"] == "done" and m["id"] == "old")
            done = list(await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S))
            # Once drained, a socket still open is told the server is going away.
            closing = await asyncio.wait_for(ws.receive(), TIMEOUT_S)
            while closing.type == aiohttp.WSMsgType.TEXT:
                closing = await asyncio.wait_for(ws.receive(), TIMEOUT_S)
            assert closing.type == aiohttp.WSMsgType.CLOSE, closing
            assert closing.data == aiohttp.WSCloseCode.GOING_AWAY, closing
            return done, socket.messages

    with kvserve(tiny_llama_dir, log_dir=tmp_path) as server:
        streams, messages = asyncio.run(main(server))
        code, _ = wait_exit(server, TIMEOUT_S)
        assert code == 0, server.log()
    for stream in streams:
        assert stream.error is None and stream.done
        assert stream.finish_reasons == ["length"]
        assert stream.usage is not None and stream.usage["completion_tokens"] == max_tokens
        assert stream.num_token_chunks >= max_tokens // 2
    new = [m for m in messages if m.get("id") == "new"]
    assert len(new) == 1 and new[0]["type"] == "error", new
    assert new[0]["error"]["code"] == "shutting_down"
    old = [m for m in messages if m.get("id") == "old" and m["type"] == "done"]
    assert len(old) == 1 and old[0]["finish_reasons"] == ["length"]
    assert old[0]["usage"]["completion_tokens"] == max_tokens
    assert "draining" in server.log() and "kvserve stopped" in server.log()


def test_second_sigterm_exits_at_once(tiny_llama_dir: Path, tmp_path: Path) -> None:
    max_tokens = 1000

    async def main(server: ServerProcess) -> tuple[list[Stream], int | None, float]:
        async with aiohttp.ClientSession() as session:
            streams, tasks = await start_streams(session, server.url, max_tokens)
            server.proc.send_signal(signal.SIGTERM)
            await wait_health(session, server.url, 503)
            server.proc.send_signal(signal.SIGTERM)
            code, waited = await asyncio.to_thread(wait_exit, server, 10.0)
            done = list(await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S))
            return done, code, waited

    with kvserve(tiny_llama_dir, "--max-model-len", "1024", log_dir=tmp_path) as server:
        streams, code, waited = asyncio.run(main(server))
        assert code is not None and waited < 2.0, server.log()
        assert code != 0
    # It did not wait for the requests: they were cut off.
    assert not any(s.done for s in streams)
    assert all(s.usage is None for s in streams)


def test_shutdown_timeout_bounds_the_drain(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shutdown_timeout = 0.5
    max_tokens = 1000

    async def main(server: ServerProcess) -> tuple[list[Stream], int | None, float]:
        async with aiohttp.ClientSession() as session:
            streams, tasks = await start_streams(session, server.url, max_tokens)
            server.proc.send_signal(signal.SIGTERM)
            code, waited = await asyncio.to_thread(wait_exit, server, 20.0)
            done = list(await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S))
            return done, code, waited

    with kvserve(tiny_llama_dir, "--shutdown-timeout", str(shutdown_timeout),
                 log_dir=tmp_path) as server:
        streams, code, waited = asyncio.run(main(server))
        assert code == 0, server.log()
        assert waited < shutdown_timeout + 3.0, server.log()
        assert "shutdown timeout" in server.log()
    # The requests were stopped early, not run to the end, and told why in-stream.
    for stream in streams:
        assert stream.error is None and stream.done
        assert 2 <= stream.num_token_chunks < max_tokens
        assert stream.finish_reasons == []
        error = stream.chunks[-1]["error"]
        assert error["type"] == "server_error" and "shutting down" in error["message"]

