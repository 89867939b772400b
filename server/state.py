"""The typed keys under which the app holds its state."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from engine.engine_client import EngineClient
from server.config import ServerConfig
from server.generation import ServedModel


@dataclass
class ServerState:
    """Mutable server-wide flags (event-loop thread only)."""

    draining: bool = False
    # Open WebSockets, closed with 1001 (going away) when the server shuts down.
    websockets: set[web.WebSocketResponse] = field(default_factory=set)


CONFIG = web.AppKey("config", ServerConfig)
ENGINE = web.AppKey("engine", EngineClient)
MODEL = web.AppKey("model", ServedModel)
STATE = web.AppKey("state", ServerState)
