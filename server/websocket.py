"""GET /v1/ws: many concurrent requests multiplexed over one WebSocket.

Client messages (JSON text frames):
  {"type": "completion" | "chat", "id": ID, ...the HTTP body's fields...}
  {"type": "cancel", "id": ID}
  {"type": "ping"}
Server messages:
  {"type": "delta", "id": ID, "data": <the SSE chunk's JSON>}
  {"type": "done", "id": ID, "finish_reasons": [...], "usage": {...}}   (exactly one per id)
  {"type": "error", "id": ID | null, "error": {OpenAI error object}}   (ends that id; id is
      null when the message had no usable id or reused one that is still running)
  {"type": "pong"}
Closing the socket aborts every request it still carries.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from engine.engine_client import EngineClient
from server.errors import APIError, bad_request, from_exception, invalid_json
from server.generation import Call, ServedModel, start_chat, start_completion
from server.protocol import ChatCompletionRequest, CompletionRequest, convert, parse_message
from server.state import CONFIG, ENGINE, MODEL, STATE, ServerState

logger = logging.getLogger("kvserve.server")

RequestId = str | int
MAX_ID_LENGTH = 256  # an id is echoed in every message of its request


class WebSocketSession:
    """One socket: its running requests by client id and a single writer task."""

    def __init__(self, ws: web.WebSocketResponse, engine: EngineClient,
                 model: ServedModel, state: ServerState) -> None:
        self.ws = ws
        self.engine = engine
        self.model = model
        self.state = state
        self.tasks: dict[RequestId, asyncio.Task[None]] = {}
        self.closing = False  # the socket closed: requests still running are cut short
        self._outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._writer = asyncio.create_task(self._write_loop())

    def send(self, message: dict[str, Any]) -> None:
        """Queues a message; one writer task keeps frames whole and in order."""
        self._outbox.put_nowait(orjson.dumps(message))

    async def _write_loop(self) -> None:
        while (data := await self._outbox.get()) is not None:
            if self.ws.closed:
                continue
            try:
                await self.ws.send_frame(data, WSMsgType.TEXT)
            except (ConnectionError, RuntimeError):
                logger.debug("websocket closed while sending")

    def handle(self, raw: str) -> None:
        """Dispatches one client message; bad messages get an error, never a crash."""
        request_id: RequestId | None = None
        try:
            message = parse_message(raw)
            if not isinstance(message, dict):
                raise bad_request("a message must be a JSON object")
            request_id = _valid_id(message.get("id"))
            self._dispatch(message, request_id)
        except msgspec.ValidationError as exc:  # raised only by convert: the id is known
            self.error(request_id, from_exception(exc))
        except msgspec.DecodeError as exc:
            self.error(None, invalid_json(exc, "the message"))
        except Exception as exc:
            self.error(request_id, from_exception(exc))

    def _dispatch(self, message: dict[str, Any], request_id: RequestId | None) -> None:
        kind = message.get("type")
        if kind == "ping":
            self.send({"type": "pong"})
            return
        if request_id is None:
            raise bad_request("each message needs an \"id\" (a string or an integer)", "id")
        if kind == "cancel":
            self._cancel(request_id)
        elif kind in ("completion", "chat"):
            if request_id in self.tasks:  # reported without the id: that id is still running
                self.error(None, bad_request(f"id {request_id!r} is already running on this "
                                             "socket; the new request was refused", "id"))
                return
            if self.state.draining:  # as drain_middleware answers new HTTP requests
                raise APIError(503, "the server is shutting down", code="shutting_down")
            call = self._start(kind, message)
            self.tasks[request_id] = asyncio.create_task(self._run(request_id, call))
        else:
            raise bad_request(f"unknown message type {kind!r}; use completion, chat, cancel "
                              "or ping", "type")

    def _start(self, kind: str, message: dict[str, Any]) -> Call:
        try:
            if kind == "chat":
                return start_chat(self.engine, self.model,
                                  convert(ChatCompletionRequest, message))
            return start_completion(self.engine, self.model, convert(CompletionRequest, message))
        except msgspec.ValidationError as exc:
            raise from_exception(exc) from exc

    def _cancel(self, request_id: RequestId) -> None:
        task = self.tasks.get(request_id)
        if task is None:
            raise bad_request(f"no request with id {request_id!r} is running on this socket",
                              "id")
        task.cancel()

    async def _run(self, request_id: RequestId, call: Call) -> None:
        try:
            async for chunk in call.chunks():
                self.send({"type": "delta", "id": request_id, "data": chunk})
        except asyncio.CancelledError:
            # A cancel message (the done message below reports finish_reason abort), or the
            # socket went away: logged, as an HTTP client's disconnect is.
            if self.closing:
                call.log_client_gone(f"the websocket closed (id {request_id!r})")
        except Exception as exc:
            self.error(request_id, from_exception(exc))
            return
        finally:
            call.cancel()
            self.tasks.pop(request_id, None)
        reasons = [r or "abort" for r in call.builder.finish_reasons]
        self.send({"type": "done", "id": request_id, "finish_reasons": reasons,
                   "usage": call.builder.usage()})

    def error(self, request_id: RequestId | None, error: APIError) -> None:
        self.send({"type": "error", "id": request_id, **error.body()})

    async def close(self) -> None:
        """Aborts every request still running, then stops the writer."""
        self.closing = True
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._outbox.put_nowait(None)
        await asyncio.gather(self._writer, return_exceptions=True)


def _valid_id(value: Any) -> RequestId | None:
    """The message's id if it is a string of at most MAX_ID_LENGTH characters or a 64-bit
    integer (never echo back anything else)."""
    if isinstance(value, str) and len(value) <= MAX_ID_LENGTH:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63:
        return value  # orjson writes 64-bit integers only
    return None


async def websocket(request: web.Request) -> web.WebSocketResponse:
    """GET /v1/ws."""
    config = request.app[CONFIG]
    ws = web.WebSocketResponse(heartbeat=config.ws_heartbeat_s,
                               max_msg_size=config.max_body_bytes)
    await ws.prepare(request)
    state = request.app[STATE]
    session = WebSocketSession(ws, request.app[ENGINE], request.app[MODEL], state)
    state.websockets.add(ws)
    try:
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                session.handle(msg.data)
            elif msg.type == WSMsgType.BINARY:
                session.error(None, bad_request("send JSON as text frames"))
            elif msg.type == WSMsgType.ERROR:
                logger.info("websocket error: %s", ws.exception())
                break
    finally:
        state.websockets.discard(ws)
        await session.close()
    return ws


async def close_websockets(app: web.Application) -> None:
    """on_shutdown: tells every open socket the server is going away (close code 1001)."""
    for ws in list(app[STATE].websockets):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")
