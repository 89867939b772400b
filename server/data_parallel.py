"""`kvserve serve --data-parallel-size N` (`-dp N`): N engine replicas behind one API server.

This process loads no model. It starts N child `kvserve serve` processes on 127.0.0.1
(server/dp_replicas.py), waits for their /health, and answers the client itself: the two
generation routes and /v1/ws go to the replica chosen by server/dp_routing.py (least requests
in flight, with prompt-prefix affinity); the body and the response bytes (SSE included) pass
through unchanged. /health is 200 only while every replica runs; /metrics merges the replicas'
pages under a `replica` label and adds the front's per-replica figures; every other route
(/v1/models, /tokenize, the router routes, the chat page) goes to the first healthy replica.

A replica that exits is taken out of rotation (/health turns 503, the others keep serving);
its requests in flight end with an OpenAI error body (or a `data: {"error": ...}` event and
`data: [DONE]` when streamed). SIGTERM / Ctrl-C drain: new requests get 503, the children get
SIGTERM and drain theirs, and every child is reaped before the front exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web

from server.app import (
    auth_middleware,
    body_timeout_middleware,
    drain_middleware,
    version,
)
from server.config import MAX_HEADER_FIELD_BYTES, MAX_HEADER_LINE_BYTES, MAX_HEADERS
from server.dp_replicas import (
    WATCH_INTERVAL_S,
    Replica,
    front_metrics,
    merge_metrics,
    reap,
    start_replicas,
    terminate_all,
    wait_ready,
)
from server.dp_routing import Balancer, prefix_keys, prompt_text
from server.errors import APIError, error_middleware
from server.router_api import connect_address
from server.routes import DONE, sse_event
from server.serve import _install_signal_handlers, bind_sockets, is_loopback, start_sites
from server.state import CONFIG, STATE, ServerConfig, ServerState

logger = logging.getLogger("kvserve")

# Headers that belong to one hop, not to the request or response passed on.
_HOP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive",
                          "transfer-encoding", "upgrade", "te", "trailer", "proxy-authorization",
                          "proxy-authenticate", "content-encoding", "date", "server"})
_WS_HANDSHAKE = frozenset({"sec-websocket-key", "sec-websocket-version",
                           "sec-websocket-extensions", "sec-websocket-accept"})


@dataclass
class Front:
    """The replicas, the routing state and the client session the front forwards with."""

    replicas: list[Replica]
    balancer: Balancer
    session: aiohttp.ClientSession | None = None
    websockets: set[web.WebSocketResponse] = field(default_factory=set)

    def client(self) -> aiohttp.ClientSession:
        assert self.session is not None, "the front's session starts with the app"
        return self.session

    def first_healthy(self) -> Replica:
        for replica in self.replicas:
            if self.balancer.healthy[replica.index]:
                return replica
        raise _no_replica()

    def check_alive(self) -> None:
        """Marks every replica whose process exited as dead."""
        for replica in self.replicas:
            if self.balancer.healthy[replica.index] and replica.proc.poll() is not None:
                logger.error("data parallel: replica %d (pid %d) exited with code %s; the "
                             "others keep serving", replica.index, replica.proc.pid,
                             replica.proc.returncode)
                self.balancer.mark_dead(replica.index)


FRONT = web.AppKey("front", Front)


def _no_replica() -> APIError:
    return APIError(503, "no engine replica is running", code="service_unavailable",
                    headers={"Retry-After": "5"})


def _lost(front: Front, index: int, exc: BaseException) -> APIError:
    front.check_alive()
    return APIError(502, f"engine replica {index} failed while serving this request "
                         f"({type(exc).__name__}: {exc})", code="replica_failed")


def _forward_headers(headers: Mapping[str, str], drop: frozenset[str] = _HOP_HEADERS
                     ) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in drop}


async def generate(request: web.Request) -> web.StreamResponse:
    """The generation routes: pick a replica by load and prefix, forward, pass the answer on."""
    front = request.app[FRONT]
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None  # the replica answers the 400
    index = front.balancer.acquire(prefix_keys(prompt_text(body)))
    if index is None:
        raise _no_replica()
    try:
        return await _forward(request, front, front.replicas[index], raw)
    finally:
        front.balancer.release(index)


async def forward_any(request: web.Request) -> web.StreamResponse:
    """Every other route: sent to the first healthy replica."""
    front = request.app[FRONT]
    return await _forward(request, front, front.first_healthy(), await request.read())


async def _forward(request: web.Request, front: Front, replica: Replica,
                   raw: bytes) -> web.StreamResponse:
    try:
        async with front.client().request(request.method, replica.url + request.path_qs,
                                          data=raw or None,
                                          headers=_forward_headers(request.headers),
                                          allow_redirects=False) as upstream:
            headers = _forward_headers(upstream.headers)
            if upstream.content_type != "text/event-stream":
                return web.Response(status=upstream.status, body=await upstream.read(),
                                    headers=headers)
            response = web.StreamResponse(status=upstream.status, headers=headers)
            await response.prepare(request)
            await _pump_sse(front, replica, upstream, response)
            return response
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise _lost(front, replica.index, exc) from exc


async def _pump_sse(front: Front, replica: Replica, upstream: aiohttp.ClientResponse,
                    response: web.StreamResponse) -> None:
    while True:
        try:
            chunk = await upstream.content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # the replica went away
            error = _lost(front, replica.index, exc)
            await response.write(sse_event(error.body()) + DONE)
            break
        if not chunk:
            break
        try:
            await response.write(chunk)
        except ConnectionError:
            return  # the client went away; leaving the block closes the replica's stream
    await response.write_eof()


async def websocket(request: web.Request) -> web.StreamResponse:
    """GET /v1/ws: one replica (the least loaded) serves the whole connection; messages pass
    through both ways and a close on either side closes the other."""
    front = request.app[FRONT]
    index = front.balancer.acquire()
    if index is None:
        raise _no_replica()
    config = request.app[CONFIG]
    url = front.replicas[index].url.replace("http://", "ws://") + request.path_qs
    try:
        async with front.client().ws_connect(
                url, headers=_forward_headers(request.headers, _HOP_HEADERS | _WS_HANDSHAKE),
                max_msg_size=0, heartbeat=None) as upstream:
            client = web.WebSocketResponse(max_msg_size=config.max_body_bytes,
                                           heartbeat=config.ws_heartbeat_s)
            await client.prepare(request)
            front.websockets.add(client)
            try:
                await _pump_ws(client, upstream)
            finally:
                front.websockets.discard(client)
            return client
    except aiohttp.ClientError as exc:
        raise _lost(front, index, exc) from exc
    finally:
        front.balancer.release(index)


async def _pump_ws(client: web.WebSocketResponse,
                   upstream: aiohttp.ClientWebSocketResponse[bool]) -> None:
    async def copy(src: web.WebSocketResponse | aiohttp.ClientWebSocketResponse[bool],
                   dst: web.WebSocketResponse | aiohttp.ClientWebSocketResponse[bool]) -> None:
        async for msg in src:
            if msg.type == aiohttp.WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
            else:
                break
        code = src.close_code or aiohttp.WSCloseCode.OK
        await dst.close(code=code, message=b"")

    tasks = [asyncio.ensure_future(copy(client, upstream)),
             asyncio.ensure_future(copy(upstream, client))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await upstream.close()
        await client.close()


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 only while every replica runs and the front is not draining."""
    front = request.app[FRONT]
    front.check_alive()
    if request.app[STATE].draining or not all(front.balancer.healthy):
        down = [i for i, ok in enumerate(front.balancer.healthy) if not ok]
        return web.Response(status=503, text=f"unavailable; replicas down: {down}")
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: every replica's page under a `replica` label, plus the front's figures."""
    front = request.app[FRONT]

    async def page(replica: Replica) -> str | None:
        if not front.balancer.healthy[replica.index]:
            return None
        try:
            async with front.client().get(replica.url + "/metrics",
                                          timeout=aiohttp.ClientTimeout(total=10)) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    pages = await asyncio.gather(*(page(r) for r in front.replicas))
    b = front.balancer
    text = merge_metrics(list(pages)) + front_metrics(b.in_flight, b.healthy, b.routed,
                                                      b.affinity_hits)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def kv_event_sources(request: web.Request) -> web.Response:
    """GET /kv_event_sources: every running replica's KV event publisher, keyed by replica
    index (vLLM keys them by data-parallel rank), each with the host a router can reach."""
    front = request.app[FRONT]
    sources: dict[str, object] = {}
    for replica in front.replicas:
        if not front.balancer.healthy[replica.index]:
            continue
        try:
            async with front.client().get(replica.url + "/kv_event_sources") as resp:
                entry = orjson.loads(await resp.read()).get("0")
        except (aiohttp.ClientError, orjson.JSONDecodeError, AttributeError):
            continue
        if isinstance(entry, dict) and isinstance(entry.get("endpoint"), str):
            # a replica answers for 127.0.0.1, where the front reached it
            for key in ("endpoint", "replay_endpoint"):
                if isinstance(entry.get(key), str) and entry[key].startswith("tcp://127.0.0.1:"):
                    entry[key] = connect_address("tcp://*:" + entry[key].rsplit(":", 1)[1],
                                                 request.app[CONFIG].host, request.host)
            sources[str(replica.index)] = entry
    body = sources or {"sources": []}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def replica_argv(argv: list[str], config: ServerConfig) -> list[str]:
    """The replicas' flags: with --kv-events-config each binds its TCP publisher on a port of
    the OS's choosing (same host), since they cannot share one; the front lists them all."""
    if config.kv_events_config is None:
        return argv
    events = json.loads(config.kv_events_config)
    for key in ("endpoint", "replay_endpoint"):
        value = events.get(key, "tcp://*:5557" if key == "endpoint" else None)
        if isinstance(value, str) and value.startswith("tcp://"):
            events[key] = value.rsplit(":", 1)[0] + ":0"
    return [*argv, "--kv-events-config", json.dumps(events)]


def create_front_app(config: ServerConfig, front: Front) -> web.Application:
    """The front's application (the replicas are already started and ready)."""
    config.validate()
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[error_middleware, drain_middleware, auth_middleware,
                                       body_timeout_middleware])
    app[CONFIG] = config
    app[STATE] = ServerState()
    app[FRONT] = front
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/ws", websocket)
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_route("*", "/{tail:.*}", forward_any)
    return app


def run_data_parallel(config: ServerConfig, size: int, argv: list[str],
                      num_threads: int | None) -> int:
    """Serves with `size` replicas until a signal; returns the exit code."""
    return asyncio.run(_serve(config, size, argv, num_threads))


async def _serve(config: ServerConfig, size: int, argv: list[str],
                 num_threads: int | None) -> int:
    config.validate()
    socks = bind_sockets(config.host, config.port)  # before the replicas take ports of their own
    replicas = start_replicas(replica_argv(argv, config), size, num_threads)
    front = Front(replicas, Balancer(size))
    stop = asyncio.Event()
    _install_signal_handlers(stop)
    runner: web.AppRunner | None = None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=10), auto_decompress=False) as session:
            front.session = session
            ready = asyncio.ensure_future(wait_ready(replicas, session))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                ready.cancel()
                return 0
            stopped.cancel()
            ready.result()  # RuntimeError when a replica failed to start
            app = create_front_app(config, front)
            runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                   handler_cancellation=True, shutdown_timeout=1.0,
                                   max_line_size=MAX_HEADER_LINE_BYTES,
                                   max_field_size=MAX_HEADER_FIELD_BYTES,
                                   max_headers=MAX_HEADERS)
            await runner.setup()
            port = await start_sites(runner, socks)
            logger.info("kvserve (data parallel, %d replicas) is listening on http://%s:%d",
                        size, config.host, port)
            if not config.api_key and not is_loopback(config.host):
                logger.warning("listening on %s, which is not a loopback address, without "
                               "--api-key", config.host)
            while not stop.is_set():
                front.check_alive()
                try:
                    await asyncio.wait_for(stop.wait(), WATCH_INTERVAL_S)
                except asyncio.TimeoutError:
                    pass
            app[STATE].draining = True
            await _drain(front, config.shutdown_timeout)
    finally:
        if runner is not None:
            await runner.cleanup()
        for sock in socks:
            sock.close()
        terminate_all(replicas)
        await reap(replicas, config.shutdown_timeout + 5.0)
    logger.info("kvserve (data parallel) stopped; every replica reaped")
    return 0


async def _drain(front: Front, timeout: float) -> None:
    """The children drain what they hold (SIGTERM); the front waits for its forwards."""
    terminate_all(front.replicas)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout + 2.0
    while sum(front.balancer.in_flight) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # let the handlers write their last bytes
