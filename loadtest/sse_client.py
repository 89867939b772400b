"""An async streaming client for OpenAI-compatible servers, with per-request latency records.

`stream_request` sends one `stream: true` chat or text completion and times it: TTFT (to the
first non-empty content chunk), the gaps between later content chunks (ITL), and end to end.
`loadtest.runner` drives many of them; `loadtest.stats.summarize` turns records into
throughput and latency percentiles.

Server errors never raise: an HTTP error status, an in-stream `{"error": ...}` object, a
dropped connection or a timeout each come back as a record with `ok=False`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from loadtest.records import (
    ChunkTimer,
    RequestRecord,
    error_text,
    fail,
    http_error_kind,
)

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
DONE = "[DONE]"


@dataclass(frozen=True)
class StreamRequest:
    """One request: `kind` is "chat" (payload has `messages`) or "completions" (`prompt`).
    The client adds `stream` and `stream_options` itself."""

    kind: str
    payload: dict[str, Any]


# ---- SSE framing --------------------------------------------------------------------------


class SSEParser:
    """Incremental server-sent-events parser: feed it lines, get back each event's data.

    Per the SSE spec an event is its `data:` lines joined by newlines, ended by a blank line;
    comment lines (starting ':') and other fields (event:, id:, retry:) are skipped.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed_line(self, raw: bytes | str) -> str | None:
        """Takes one line (with or without its line ending); returns an event's data when
        this line completes one, else None."""
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """Ends the pending event (at a blank line, or at end of stream for servers that
        close without one); returns its data, or None when nothing was pending."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


# ---- one request --------------------------------------------------------------------------


def build_body(req: StreamRequest, include_usage: bool) -> dict[str, Any]:
    """The JSON body actually sent: the payload plus the streaming switches."""
    body = dict(req.payload)
    body["stream"] = True
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def request_headers(api_key: str | None) -> dict[str, str]:
    """JSON content type, plus a bearer token when an API key is given."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


ChunkHook = Callable[[dict[str, Any]], None]


async def stream_request(session: aiohttp.ClientSession, base_url: str, req: StreamRequest,
                         include_usage: bool = True, timeout_s: float = 600.0,
                         api_key: str | None = None, on_chunk: ChunkHook | None = None
                         ) -> RequestRecord:
    """Sends one streaming request and times it; never raises for server-side failures.
    `on_chunk`, when given, sees every parsed chunk as it arrives (live observers)."""
    record = RequestRecord()
    timer = ChunkTimer(record)
    url = base_url.rstrip("/") + ENDPOINTS[req.kind]
    try:
        async with session.post(url, data=orjson.dumps(build_body(req, include_usage)),
                                headers=request_headers(api_key),
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            record.status = resp.status
            if resp.status != 200:
                body = (await resp.text())[:2000]
                fail(record, http_error_kind(resp.status, body), f"HTTP {resp.status}: {body}")
                return timer.finish()
            await _read_stream(resp, timer, on_chunk)
    except asyncio.TimeoutError:
        fail(record, "timeout", f"no complete response within {timeout_s:g} s")
    except (aiohttp.ClientError, ValueError) as exc:
        fail(record, "connection_error", f"{type(exc).__name__}: {exc}")
    return timer.finish()


async def _read_stream(resp: aiohttp.ClientResponse, timer: ChunkTimer,
                       on_chunk: ChunkHook | None = None) -> None:
    """Reads SSE events until [DONE], an error event, or the end of the body. A stream that
    ends without [DONE] still counts as ok (some servers never send it) when it produced
    a finish_reason."""
    parser, record = SSEParser(), timer.record
    async for line in resp.content:
        data = parser.feed_line(line)
        if data is not None and _handle_event(data, timer, on_chunk):
            return
    data = parser.flush()
    if data is not None and _handle_event(data, timer, on_chunk):
        return
    record.ok = record.finish_reason is not None
    if not record.ok:
        fail(record, "incomplete_stream", "stream ended without [DONE] or a finish_reason")


def _handle_event(data: str, timer: ChunkTimer, on_chunk: ChunkHook | None = None) -> bool:
    """Applies one event to the record; True when the stream is over (done or failed)."""
    record = timer.record
    if data.strip() == DONE:
        record.ok = True
        return True
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        fail(record, "bad_stream", f"bad SSE data: {data[:200]!r}")
        return True
    if not isinstance(chunk, dict):
        fail(record, "bad_stream", f"unexpected SSE data: {data[:200]!r}")
        return True
    if "error" in chunk:
        fail(record, "stream_error", "in-stream error: " + error_text(chunk["error"]))
        return True
    timer.apply_chunk(chunk)
    if on_chunk is not None:
        on_chunk(chunk)
    return False
