"""The generation routes: POST /v1/completions and /v1/chat/completions, streamed over SSE
with OpenAI's framing or returned whole."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import web

from server.errors import APIError, from_exception
from server.generation import Call, start_chat, start_completion
from server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, decode
from server.state import ENGINE, MODEL

logger = logging.getLogger("kvserve.server")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying a JSON payload."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    body = decode(CompletionRequest, await request.read())
    _check_stream_options(body)
    call = start_completion(request.app[ENGINE], request.app[MODEL], body)
    return await respond(request, call)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    body = decode(ChatCompletionRequest, await request.read())
    _check_stream_options(body)
    call = start_chat(request.app[ENGINE], request.app[MODEL], body)
    return await respond(request, call)


def _check_stream_options(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")


async def respond(request: web.Request, call: Call) -> web.StreamResponse:
    """Streams the call over SSE or returns its whole body; always aborts leftovers."""
    try:
        if call.stream:
            return await _stream_sse(request, call)
        body = await call.collect()
        return web.Response(body=orjson.dumps(body), content_type="application/json")
    except asyncio.CancelledError:  # handler_cancellation: the client closed the connection
        call.log_client_gone("the client disconnected")
        raise
    finally:
        call.cancel()



async def _stream_sse(request: web.Request, call: Call) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        async for chunk in call.chunks():
            await response.write(sse_event(chunk))
    except (ConnectionResetError, ConnectionError):
        call.log_client_gone("the client went away mid-stream")
        return response
    except Exception as exc:  # headers are sent: report the error in-stream
        await response.write(sse_event(from_exception(exc).body()))
    await response.write(DONE)
    await response.write_eof()
    return response
