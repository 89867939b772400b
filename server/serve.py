"""`kvserve serve`: runs the app on uvloop with a graceful drain on SIGTERM / SIGINT.

First signal: /health turns 503, new requests get 503, requests in flight run to the end for
up to --shutdown-timeout seconds, then the process exits 0. A second signal exits at once.
An engine that dies (a tensor-parallel rank exited) turns /health 503 and stops the server
the same way, with exit code 3.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
import sys
import time

from aiohttp import web

from engine.config import EngineArgs
from server.app import create_app
from server.config import (
    MAX_HEADER_FIELD_BYTES,
    MAX_HEADER_LINE_BYTES,
    MAX_HEADERS,
    ServerConfig,
)
from server.state import ENGINE, STATE

logger = logging.getLogger("kvserve")

EXIT_FORCED = 1
EXIT_ENGINE_DEAD = 3  # the engine died (a tensor-parallel rank exited, the step loop crashed)
ENGINE_WATCH_INTERVAL_S = 0.5


def run_serve(config: ServerConfig, engine_args: EngineArgs) -> int:
    """Serves until a signal; returns the exit code."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(serve(config, engine_args))
    return uvloop.run(serve(config, engine_args))


async def serve(config: ServerConfig, engine_args: EngineArgs) -> int:
    """Starts the app, waits for a signal, drains, and cleans up."""
    # The address is bound before the engine starts: tensor-parallel ranks open TCP sockets of
    # their own, and one could otherwise take a --port in the ephemeral range first.
    socks = bind_sockets(config.host, config.port)
    try:
        return await _serve_on(socks, config, engine_args)
    finally:
        for sock in socks:  # closed already when the server ran; not when the engine failed
            sock.close()


async def _serve_on(socks: list[socket.socket], config: ServerConfig,
                    engine_args: EngineArgs) -> int:
    app = create_app(config, engine_args)
    runner = web.AppRunner(app, handle_signals=False, access_log=None,
                           handler_cancellation=True, shutdown_timeout=1.0,
                           max_line_size=MAX_HEADER_LINE_BYTES,
                           max_field_size=MAX_HEADER_FIELD_BYTES, max_headers=MAX_HEADERS)
    await runner.setup()  # builds the engine: loads weights, logs the capacity lines
    port = await start_sites(runner, socks)
    logger.info("kvserve is listening on http://%s:%d", config.host, port)
    if not config.api_key and not is_loopback(config.host):
        logger.warning("listening on %s, which is not a loopback address, without --api-key: "
                       "anyone who can reach this port can use the model", config.host)
    stop = asyncio.Event()
    _install_signal_handlers(stop)
    watcher = asyncio.get_running_loop().create_task(_watch_engine(app, stop))
    await stop.wait()
    watcher.cancel()
    app[STATE].draining = True
    await _drain(app, config.shutdown_timeout)
    dead = app[ENGINE].is_dead
    await runner.cleanup()
    logger.info("kvserve stopped%s", " (the engine had died)" if dead else "")
    return EXIT_ENGINE_DEAD if dead else 0


async def _watch_engine(app: web.Application, stop: asyncio.Event) -> None:
    """Stops the server once the engine is dead (/health already answers 503): a supervisor
    sees the process exit non-zero and restarts it, as with vLLM."""
    while not app[ENGINE].is_dead:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    logger.error("the engine is dead: stopping the server")
    stop.set()


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts local connections (a hostname other than localhost is
    treated as reachable from elsewhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Binds every address `host` resolves to, without listening yet: the port is ours, and a
    client that connects before the server starts is refused rather than left waiting. Port 0
    takes the port the OS gives the first address for the others too. A ValueError says which
    address could not be bound (the command line prints it and exits 2)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} does not resolve: {exc}") from None
    socks: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # "::" and "0.0.0.0" side by side, as aiohttp does
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:
                address = (address[0], socks[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as exc:
                raise ValueError(f"cannot listen on {address[0]!s} port {address[1]!s}: "
                                 f"{exc.strerror or exc}") from None
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


async def start_sites(runner: web.AppRunner, socks: list[socket.socket]) -> int:
    """Serves `runner` on the sockets bind_sockets returned; returns the bound port."""
    for sock in socks:
        await web.SockSite(runner, sock).start()
    return int(socks[0].getsockname()[1])


def _install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            logger.warning("second signal: exiting now")
            sys.stderr.flush()
            os._exit(EXIT_FORCED)
        logger.info("%s received: draining (send it again to exit at once)",
                    signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


async def _drain(app: web.Application, timeout: float) -> None:
    engine = app[ENGINE]
    deadline = time.monotonic() + timeout
    while engine.num_unfinished and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if engine.num_unfinished:
        logger.warning("shutdown timeout: aborting %d unfinished request(s)",
                       engine.num_unfinished)
        engine.abort_all(f"the server is shutting down: --shutdown-timeout ({timeout} s) "
                         "expired before this request finished")
    # Let the handlers write their last chunks before the sockets close.
    await asyncio.sleep(0.1)
