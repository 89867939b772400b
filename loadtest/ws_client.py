"""A load client for kvserve's multiplexed WebSocket (`GET /v1/ws`): many requests, one socket.

`WSClient` opens one socket; each `stream()` call sends one chat or completion message under a
fresh id and waits for its messages, which a single reader task routes by id. Timings are kept
by the same `ChunkTimer` the SSE client uses, so TTFT, ITL and E2E mean the same thing for both
transports (the server's "delta" data is exactly the SSE chunk).

Failures never raise out of `stream()`; they come back as records with `ok=False` and:
  "ws_error:<type>"   the server's error message for that id (type of its OpenAI error object;
                      plain "ws_error" when it has none), e.g. a bad parameter
  "timeout"           no "done" within timeout_s; the client sends a cancel for the id
  "connection_error"  the socket closed or failed while the request was pending (the message
                      has the close code), or was never open / already closed
`__aenter__` raises `ConnectionError` when the socket cannot be opened. `record.status` is 101
(the WebSocket upgrade status) for every request sent over an open socket, else None.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp
import orjson

from loadtest.records import ChunkTimer, RequestRecord, error_text, fail
from loadtest.sse_client import StreamRequest, request_headers

logger = logging.getLogger("kvserve.loadtest")

MESSAGE_TYPES = {"chat": "chat", "completions": "completion"}
WS_SWITCHING_PROTOCOLS = 101


@dataclass(frozen=True)
class Closed:
    """Put in a pending request's inbox when the socket goes away: ends it as failed."""

    reason: str


Inbox = asyncio.Queue[dict[str, Any] | Closed]


def ws_url(base_url: str) -> str:
    """The socket's URL: base_url's /v1/ws with http(s) turned into ws(s)."""
    url = base_url.rstrip("/") + "/v1/ws"
    if url.startswith("https://"):
        return "wss://" + url[len("https://"):]
    if url.startswith("http://"):
        return "ws://" + url[len("http://"):]
    return url


def build_message(req: StreamRequest, request_id: str, include_usage: bool) -> dict[str, Any]:
    """The client message for one request. `stream` is implied on the socket, so it is left
    out; `stream_options` asks for the usage chunk exactly as over SSE."""
    message: dict[str, Any] = {**req.payload, "type": MESSAGE_TYPES[req.kind], "id": request_id}
    message.pop("stream", None)
    message["stream_options"] = {"include_usage": include_usage}
    return message


def apply_message(message: dict[str, Any] | Closed, timer: ChunkTimer) -> bool:
    """Applies one routed message to a request's record; True when the request is over."""
    record = timer.record
    if isinstance(message, Closed):
        fail(record, "connection_error", message.reason)
        return True
    kind = message.get("type")
    if kind == "delta":
        data = message.get("data")
        if isinstance(data, dict):
            timer.apply_chunk(data)
        return False
    if kind == "done":
        timer.apply_usage(message.get("usage"))  # the server always reports it here
        reasons = message.get("finish_reasons") or []
        if record.finish_reason is None and reasons:
            record.finish_reason = reasons[0]
        record.ok = True
        return True
    if kind == "error":
        error = message.get("error")
        etype = error.get("type") if isinstance(error, dict) else None
        fail(record, f"ws_error:{etype}" if etype else "ws_error", error_text(error))
        return True
    return False  # a type this client does not know: skip it


class WSClient:
    """One WebSocket to a kvserve server carrying any number of concurrent `stream()` calls.

    Use as `async with WSClient(url) as ws: await ws.stream(req)`. A reader task routes the
    server's messages by id into per-request inboxes; a writer task sends client messages in
    order (so a cancel can be queued without awaiting, even from a cancelled task).
    """

    def __init__(self, base_url: str, api_key: str | None = None,
                 connect_timeout_s: float = 30.0, max_msg_size: int = 64 * 2**20) -> None:
        self.url = ws_url(base_url)
        self.api_key = api_key
        self.connect_timeout_s = connect_timeout_s
        self.max_msg_size = max_msg_size
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse[Any] | None = None
        self._pending: dict[str, Inbox] = {}
        self._outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed: str | None = "the socket is not open"
        self._ids = itertools.count(1)

    async def __aenter__(self) -> WSClient:
        """Opens the session and the socket; raises ConnectionError if that fails."""
        self._session = aiohttp.ClientSession()
        headers = request_headers(self.api_key)
        headers.pop("Content-Type")
        try:
            ws = await asyncio.wait_for(
                self._session.ws_connect(self.url, headers=headers,
                                         max_msg_size=self.max_msg_size),
                self.connect_timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            await self._session.close()
            raise ConnectionError(f"could not open {self.url}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        self._ws, self._closed = ws, None
        self._tasks = [asyncio.create_task(self._read_loop(ws)),
                       asyncio.create_task(self._write_loop(ws))]
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        """Fails whatever is still pending, then closes the socket and the session."""
        self._close_all("the client closed the socket")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()

    async def stream(self, req: StreamRequest, include_usage: bool = True,
                     timeout_s: float = 600.0) -> RequestRecord:
        """Sends one request over the socket and times it until its "done" or "error"; never
        raises for server-side failures. Cancelling the caller cancels the request too."""
        record = RequestRecord()
        timer = ChunkTimer(record)
        if self._closed is not None:
            fail(record, "connection_error", self._closed)
            return timer.finish()
        record.status = WS_SWITCHING_PROTOCOLS
        request_id = f"r{next(self._ids)}"
        inbox: Inbox = asyncio.Queue()
        self._pending[request_id] = inbox
        self._send(build_message(req, request_id, include_usage))
        try:
            await asyncio.wait_for(self._consume(inbox, timer), timeout_s)
        except asyncio.TimeoutError:
            self._send({"type": "cancel", "id": request_id})
            fail(record, "timeout", f"no complete response within {timeout_s:g} s")
        except asyncio.CancelledError:
            self._send({"type": "cancel", "id": request_id})
            raise
        finally:
            self._pending.pop(request_id, None)
        return timer.finish()

    @property
    def pending(self) -> int:
        """Requests sent and not yet finished."""
        return len(self._pending)

    @staticmethod
    async def _consume(inbox: Inbox, timer: ChunkTimer) -> None:
        while not apply_message(await inbox.get(), timer):
            pass

    def _send(self, message: dict[str, Any]) -> None:
        """Queues a message for the writer; dropped once the socket is gone."""
        if self._closed is None:
            self._outbox.put_nowait(orjson.dumps(message).decode())

    def _close_all(self, reason: str) -> None:
        """Marks the socket gone (first reason wins) and ends every pending request."""
        if self._closed is not None:
            return
        self._closed = reason
        for inbox in self._pending.values():
            inbox.put_nowait(Closed(reason))
        self._outbox.put_nowait(None)

    async def _write_loop(self, ws: aiohttp.ClientWebSocketResponse[Any]) -> None:
        while (data := await self._outbox.get()) is not None:
            try:
                await ws.send_str(data)
            except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
                self._close_all(f"sending failed: {type(exc).__name__}: {exc} "
                                f"(close code {ws.close_code})")
                return

    async def _read_loop(self, ws: aiohttp.ClientWebSocketResponse[Any]) -> None:
        """Routes messages until the socket closes or fails, then fails what is pending."""
        reason = "the socket closed"
        try:
            while True:
                msg = await ws.receive()
                if msg.type == aiohttp.WSMsgType.TEXT:
                    self._route(msg.data)
                elif msg.type == aiohttp.WSMsgType.ERROR:
                    reason = f"socket error: {ws.exception() or msg.data}"
                    break
                elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING,
                                  aiohttp.WSMsgType.CLOSED):
                    reason += f": {msg.extra}" if msg.extra else ""
                    break
        except (aiohttp.ClientError, ConnectionError, RuntimeError, ValueError) as exc:
            reason = f"reading failed: {type(exc).__name__}: {exc}"
        self._close_all(f"{reason} (close code {ws.close_code})")

    def _route(self, raw: str) -> None:
        """Hands a message to its request's inbox. Messages for ids no longer pending (a
        cancelled request's final "done") are dropped; an error with no usable id is logged,
        since this client's ids are unique and valid it cannot be about one of them."""
        try:
            message = orjson.loads(raw)
        except orjson.JSONDecodeError:
            logger.warning("websocket: not JSON: %.200r", raw)
            return
        if not isinstance(message, dict):
            return
        request_id = message.get("id")
        inbox = self._pending.get(request_id) if isinstance(request_id, str) else None
        if inbox is not None:
            inbox.put_nowait(message)
        elif message.get("type") == "error" and request_id is None:
            logger.warning("websocket error for no request: %s", error_text(message.get("error")))
