"""A recording client for GET /v1/ws: every message received, in order, with its arrival time,
and the questions tests ask of them (deltas of an id, its one done message, errors)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp

RECEIVE_TIMEOUT_S = 60.0


class Socket:
    """A client WebSocket that records every message it receives, in order."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse[bool],
                 timeout_s: float = RECEIVE_TIMEOUT_S) -> None:
        self.ws = ws
        self.timeout_s = timeout_s
        self.messages: list[dict[str, Any]] = []
        self.times: list[float] = []  # the event loop's clock when each message arrived

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(message))

    async def receive(self) -> dict[str, Any]:
        """The next message, which must be a JSON text frame within the timeout."""
        msg = await asyncio.wait_for(self.ws.receive(), self.timeout_s)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        message = dict(json.loads(msg.data))
        self.times.append(asyncio.get_running_loop().time())
        self.messages.append(message)
        return message

    async def until(self, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Reads until a message satisfies `condition`; returns it."""
        while not condition(message := await self.receive()):
            pass
        return message

    async def until_finished(self, ids: set[Any]) -> None:
        """Reads until every id in `ids` got its done (or error) message."""
        pending = set(ids)
        while pending:
            message = await self.receive()
            if message["type"] in ("done", "error") and message.get("id") in pending:
                pending.discard(message["id"])

    async def until_deltas(self, request_id: Any, count: int) -> None:
        while len(self.deltas(request_id)) < count:
            await self.receive()

    def deltas(self, request_id: Any) -> list[dict[str, Any]]:
        return [m["data"] for m in self.messages
                if m["type"] == "delta" and m["id"] == request_id]

    def done(self, request_id: Any) -> dict[str, Any]:
        """The one done message of an id; no delta of it may follow."""
        indices = [i for i, m in enumerate(self.messages)
                   if m["type"] == "done" and m["id"] == request_id]
        assert len(indices) == 1, f"{request_id}: {len(indices)} done messages"
        later = [m for m in self.messages[indices[0] + 1:] if m.get("id") == request_id]
        assert later == [], f"{request_id}: messages after done: {later}"
        return self.messages[indices[0]]

    def errors(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["type"] == "error"]
