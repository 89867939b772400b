"""The aiohttp application factory: middlewares, routes, and the engine's lifetime in the
app's cleanup context."""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.engine_client import EngineClient
from server import router_api, routes, websocket
from server.errors import APIError, Handler, error_middleware
from server.generation import ServedModel, render_chat
from server.openapi import openapi_document
from server.protocol import DetokenizeRequest, TokenizeRequest, decode
from server.protocol_tools import tool_dicts
from server.state import CONFIG, ENGINE, MODEL, STATE, ServerConfig, ServerState
from server.tool_parsers.mode import ToolSettings

# The chat page's files, shipped as package data (pyproject.toml: server = ["static/*"]).
STATIC_DIR = Path(__file__).resolve().parent / "static"

# Paths still answered while draining, so orchestrators can watch the shutdown.
_OPEN_WHILE_DRAINING = frozenset({"/health", "/metrics", "/version"})


def json_response(payload: object, status: int = 200) -> web.Response:
    """A JSON response encoded with orjson."""
    return web.Response(status=status, body=orjson.dumps(payload),
                        content_type="application/json")


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With --api-key, every /v1 route needs `Authorization: Bearer KEY` (browsers opening
    the WebSocket may pass `?api_key=KEY` instead)."""
    key = request.app[CONFIG].api_key
    if key and request.path.startswith("/v1"):
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else request.query.get("api_key", "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "Incorrect or missing API key; send `Authorization: Bearer "
                                "<key>`", code="invalid_api_key")
    return await handler(request)


@web.middleware
async def body_timeout_middleware(request: web.Request, handler: Handler
                                  ) -> web.StreamResponse:
    """Reads a request's whole body within --request-body-timeout seconds, so a client that
    sends headers and then stalls gets 408 instead of holding a handler forever. The handler's
    own read() then returns the cached bytes; the size cap (413) applies here already."""
    if request.body_exists:
        timeout = request.app[CONFIG].request_body_timeout_s
        try:
            await asyncio.wait_for(request.read(), timeout)
        except asyncio.TimeoutError:
            error = APIError(408, f"the request body did not arrive within {timeout:g} s "
                                  "(--request-body-timeout)", code="request_timeout")
            response = error.response()
            response.force_close()  # the rest of the body may never come: drop the connection
            return response
    return await handler(request)


@web.middleware
async def drain_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """While shutting down, new work gets 503."""
    if request.app[STATE].draining and request.path not in _OPEN_WHILE_DRAINING:
        raise APIError(503, "the server is shutting down", code="shutting_down",
                       headers={"Retry-After": "5"})
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 ready, 503 while draining or after an engine failure."""
    if request.app[STATE].draining or request.app[ENGINE].is_dead:
        return web.Response(status=503, text="unavailable")
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text format."""
    body = request.app[ENGINE].metrics_text()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def version(request: web.Request) -> web.Response:
    """GET /version."""
    try:
        number = importlib.metadata.version("kvserve")
    except importlib.metadata.PackageNotFoundError:
        number = "unknown"
    return json_response({"version": number})


async def models(request: web.Request) -> web.Response:
    """GET /v1/models."""
    model = request.app[MODEL]
    created = int(time.time())
    data = [{"id": name, "object": "model", "created": created, "owned_by": "kvserve",
             "root": model.root, "parent": None, "max_model_len": model.max_model_len}
            for name in model.names]
    return json_response({"object": "list", "data": data})


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize: a prompt or chat messages to token ids."""
    body = decode(TokenizeRequest, await request.read())
    request.app[MODEL].check(body.model)
    engine = request.app[ENGINE]
    if body.messages is not None:
        add_prompt = True if body.add_generation_prompt is None else body.add_generation_prompt
        ids = render_chat(engine, request.app[MODEL], body.messages, tool_dicts(body.tools),
                          add_prompt)["prompt_token_ids"]
    elif body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = engine.tokenize(body.prompt, add_special)
    else:
        raise APIError(400, "give either prompt or messages", param="prompt")
    return json_response({"count": len(ids), "max_model_len": engine.model_info.max_model_len,
                          "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize: token ids to text."""
    body = decode(DetokenizeRequest, await request.read())
    request.app[MODEL].check(body.model)
    return json_response({"prompt": request.app[ENGINE].detokenize(body.tokens, "tokens")})


async def chat_page(request: web.Request) -> web.FileResponse:
    """GET /: the built-in chat page. Public even with --api-key (it asks for the key and
    sends it to the /v1 routes, which stay guarded)."""
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def openapi_json(request: web.Request) -> web.Response:
    """GET /openapi.json: the request schemas, generated from the protocol Structs."""
    return web.Response(body=openapi_document(), content_type="application/json")


EngineFactory = Callable[[], EngineClient]


def create_app(config: ServerConfig, engine_args: EngineArgs | None = None,
               engine_factory: EngineFactory | None = None) -> web.Application:
    """Builds the application; the engine is created on startup and stopped on cleanup."""
    config.validate()
    # vLLM turns off the *_created series; dashboards built for it expect them absent.
    disable_created_metrics()
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[error_middleware, drain_middleware, auth_middleware,
                                       body_timeout_middleware])
    app[CONFIG] = config
    app[STATE] = ServerState()
    names = config.served_model_names
    factory = engine_factory or (lambda: AsyncEngine.from_args(
        engine_args or EngineArgs(), model_name=names[0] if names else None,
        max_queue_len=config.max_queue_len, stats_interval_s=config.stats_interval_s,
        vllm_metric_names=config.vllm_metric_names))
    app.cleanup_ctx.append(_engine_context(factory))
    app.cleanup_ctx.append(router_api.kv_events_context)  # --kv-events-config
    app.on_shutdown.append(websocket.close_websockets)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_get("/v1/ws", websocket.websocket)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/openapi.json", openapi_json)
    router_api.register(app)  # what vllm-router and SGLang's router call on their workers
    app.router.add_get("/", chat_page)
    app.router.add_static("/static", STATIC_DIR, show_index=False)  # no listing
    return app


def _engine_context(factory: EngineFactory) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(app: web.Application) -> AsyncIterator[None]:
        # Loading weights blocks for seconds; nothing else is being served yet.
        engine = factory()
        engine.start()
        app[ENGINE] = engine
        info = engine.model_info
        config = app[CONFIG]
        app[MODEL] = ServedModel(config.served_model_names or [info.name], info.root,
                                 info.max_model_len,
                                 ToolSettings(config.enable_auto_tool_choice,
                                              config.tool_call_parser))
        yield
        await engine.stop()

    return context
