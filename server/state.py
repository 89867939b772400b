"""The typed keys under which the app holds its state."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from engine.async_engine import AsyncEngine
from server.config import ServerConfig
from server.generation import ServedModel


@dataclass
class ServerState:
    """Mutable server-wide flags (event-loop thread only)."""

    draining: bool = False


CONFIG = web.AppKey("config", ServerConfig)
ENGINE = web.AppKey("engine", AsyncEngine)
MODEL = web.AppKey("model", ServedModel)
STATE = web.AppKey("state", ServerState)
