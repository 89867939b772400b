"""The worker endpoints that routers in front of several kvserve replicas call: vLLM's router
(PyPI `vllm-router`) and SGLang's router (PyPI `sglang-router`).

Each answers in the shape the router reads (checked against vllm-router 0.1.17 and
sglang-router 0.3.2 by running them; README, "Replicas behind a router"):

- `GET /server_info`, `/get_server_info` (both routers): SGLang reads `served_model_name`,
  `model_path`, `tp_size`, `dp_size`, `max_total_tokens`; vllm-router's kv_aware policy reads
  `block_size` (and the model from `vllm_config`).
- `GET /model_info`, `/get_model_info` (SGLang): `model_path`, `is_generation`,
  `architectures`.
- `GET /get_load` (both routers' power_of_two policy): SGLang reads
  `[{dp_rank, num_reqs, num_waiting_reqs, num_tokens}]` and adds up `num_tokens`; vllm-router
  reads `{"load": N}`. The two cannot share one body, so --get-load-format picks one.
- `POST /v1/completions/render`, `/v1/chat/completions/render` (vllm-router's cache_aware and
  kv_aware policies, on every worker for every request, before falling back to /tokenize):
  vLLM's shapes, a list of `{request_id, model, token_ids, stream}` (one per prompt) and one
  such object; the router reads `token_ids`.
- `POST /flush_cache` (both routers fan it out): 200 when flushed, 409 while requests are in
  flight; the routers read only the status.
- `GET /kv_event_sources` (vllm-router's kv_aware policy): with --kv-events-config, the
  publisher's resolved config keyed by data-parallel rank, `{"0": {"endpoint":
  "tcp://HOST:PORT", "topic", "publisher": "zmq", "enable_kv_cache_events": true, "encoding":
  "msgpack", "schema_version": 1, ...}}` (vllm-router subscribes only to such entries, and
  rejects a wildcard host: HOST is --host, or the host the caller reached); without it
  `{"sources": []}`, which vllm-router reads as no publisher.

Everything comes from the engine through `EngineClient`; nothing here reaches inside it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import orjson
from aiohttp import web

from server.errors import APIError
from server.generation import render_chat
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_limits,
    completion_prompts,
)
from server.protocol_tools import chat_tools
from server.state import CONFIG, ENGINE, MODEL

logger = logging.getLogger("kvserve")
# The KV event publisher when --kv-events-config enables one (engine/kv_events.py).
KV_EVENTS = web.AppKey("kv_events", object)
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")

# Render bodies carry whatever the router forwards (vllm-router adds SGLang's fields such as
# no_stop_trim): they are decoded without the unknown-field warning, which the real call that
# follows logs once anyway.
_QUIET_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(kind) for kind in (CompletionRequest, ChatCompletionRequest)}


def _json(payload: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload),
                        content_type="application/json")


def _version() -> str:
    try:
        return importlib.metadata.version("kvserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _decode_quietly(kind: type[Any], body: bytes) -> Any:
    try:
        request = _QUIET_DECODERS[kind].decode(body)
    except RecursionError:  # as protocol.decode: 100k `[` must be a 400, not a crash
        raise msgspec.DecodeError("JSON is nested too deeply") from None
    check_limits(request)
    return request


async def server_info(request: web.Request) -> web.Response:
    """GET /server_info and /get_server_info: the engine's settings, under SGLang's field
    names and, in `vllm_config`, vLLM's."""
    info = request.app[ENGINE].server_info()
    model = request.app[MODEL]
    return _json({
        **info,
        "served_model_name": model.name,
        "served_model_names": model.names,
        "version": _version(),
        # SGLang's names (its router labels the worker with them).
        "tp_size": 1, "dp_size": 1,
        "max_total_tokens": info["num_kv_cache_tokens"],
        "max_running_requests": info["max_num_seqs"],
        "max_prefill_tokens": info["max_num_batched_tokens"],
        "page_size": info["block_size"],
        # vLLM's /server_info?config_format=json layout.
        "vllm_config": {
            "model_config": {"model": info["model_path"], "served_model_name": model.name,
                             "max_model_len": info["max_model_len"], "dtype": info["dtype"]},
            "cache_config": {"block_size": info["block_size"],
                             "num_gpu_blocks": info["num_gpu_blocks"],
                             "cache_dtype": info["cache_dtype"],
                             "enable_prefix_caching": info["enable_prefix_caching"]},
            "scheduler_config": {"max_num_seqs": info["max_num_seqs"],
                                 "max_num_batched_tokens": info["max_num_batched_tokens"]},
            "parallel_config": {"tensor_parallel_size": info.get("tensor_parallel_size", 1),
                                "pipeline_parallel_size": 1,
                                "data_parallel_size": 1},
        },
    })


async def model_info(request: web.Request) -> web.Response:
    """GET /model_info and /get_model_info: SGLang's model facts."""
    engine = request.app[ENGINE]
    info = engine.server_info()
    model = request.app[MODEL]
    body: dict[str, Any] = {
        "model_path": info["model_path"], "served_model_name": model.name,
        "is_generation": True, "architectures": [info["architecture"]],
        "max_model_len": info["max_model_len"], "vocab_size": info["vocab_size"],
        "has_image_understanding": False, "has_audio_understanding": False,
    }
    if Path(info["model_path"]).is_dir():  # a GGUF file carries its tokenizer inside
        body["tokenizer_path"] = info["model_path"]
    return _json(body)


async def get_load(request: web.Request) -> web.Response:
    """GET /get_load in the shape --get-load-format names: SGLang's per-rank list (its router
    adds up `num_tokens`) or vllm-router's `{"load": requests waiting or running}`."""
    load = request.app[ENGINE].load()
    if request.app[CONFIG].get_load_format == "vllm-router":
        return _json({"load": load.num_running + load.num_waiting})
    return _json([{"dp_rank": 0, "num_reqs": load.num_running + load.num_waiting,
                   "num_waiting_reqs": load.num_waiting, "num_tokens": load.num_used_tokens}])


async def render_completion(request: web.Request) -> web.Response:
    """POST /v1/completions/render: the token ids each prompt would be computed with, as
    vLLM answers (a list, one entry per prompt), without generating anything."""
    body = _decode_quietly(CompletionRequest, await request.read())
    model = request.app[MODEL]
    model.check(body.model)
    engine = request.app[ENGINE]
    rendered = []
    for prompt in completion_prompts(body.prompt):
        ids = engine.tokenize(prompt) if isinstance(prompt, str) else prompt
        rendered.append({"request_id": f"cmpl-{uuid.uuid4().hex}", "model": model.name,
                         "token_ids": ids, "stream": bool(body.stream),
                         "token_offsets": None})
    return _json(rendered)


async def render_chat_completion(request: web.Request) -> web.Response:
    """POST /v1/chat/completions/render: the chat-templated prompt's token ids (tools
    included), as vLLM answers, without generating anything."""
    body = _decode_quietly(ChatCompletionRequest, await request.read())
    model = request.app[MODEL]
    model.check(body.model)
    add_prompt = True if body.add_generation_prompt is None else body.add_generation_prompt
    prompt = render_chat(request.app[ENGINE], model, body.messages, chat_tools(body),
                         add_prompt)
    return _json({"request_id": f"chatcmpl-{uuid.uuid4().hex}", "model": model.name,
                  "token_ids": prompt["prompt_token_ids"], "stream": bool(body.stream),
                  "token_offsets": None})


async def flush_cache(request: web.Request) -> web.Response:
    """POST /flush_cache: forgets every cached prefix. Refused with 409 while any
    request is waiting or running, as SGLang refuses it; the routers fan it out to every
    worker and report a failure when one refuses."""
    engine = request.app[ENGINE]
    if not engine.reset_prefix_cache():
        load = engine.load()
        raise APIError(409, f"the prefix cache was not flushed: {load.num_running} request(s) "
                            f"running and {load.num_waiting} waiting; retry when idle",
                       code="requests_in_flight", headers={"Retry-After": "1"})
    return web.Response(text="Cache flushed.\n")


async def kv_event_sources(request: web.Request) -> web.Response:
    """GET /kv_event_sources: where vllm-router's kv_aware policy subscribes to KV block
    events, keyed by data-parallel rank as vLLM answers; `{"sources": []}` when kvserve
    publishes none (vllm-router then scores replicas by load alone)."""
    publisher: Any = request.app.get(KV_EVENTS)
    if publisher is None:
        return _json({"sources": []})
    endpoint = connect_address(publisher.endpoint, request.app[CONFIG].host, request.host)
    replay = publisher.replay_endpoint
    if replay is not None:
        replay = connect_address(replay, request.app[CONFIG].host, request.host)
    return _json({str(publisher.rank): publisher.config.resolved(endpoint, replay)})


def connect_address(bound: str, server_host: str, request_host: str) -> str:
    """The bound ZeroMQ address as a subscriber elsewhere connects to it: a wildcard host
    becomes --host when that is specific, else the host the caller reached this server by."""
    if not bound.startswith("tcp://"):
        return bound
    parts = urlsplit(bound)
    if parts.hostname not in _WILDCARD_HOSTS and parts.hostname is not None:
        return bound
    host = server_host if server_host not in _WILDCARD_HOSTS else \
        (urlsplit(f"http://{request_host}").hostname or "127.0.0.1")
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{parts.port}"


async def kv_events_context(app: web.Application) -> AsyncIterator[None]:
    """Starts the KV event publisher on the engine's prefix cache (--kv-events-config) after
    the engine starts; stops it before the engine stops."""
    text = app[CONFIG].kv_events_config
    publisher = None
    if text is not None:
        from engine.kv_events import KVEventsConfig, KVEventSink, ZmqEventPublisher, attach

        config = KVEventsConfig.from_json(text)
        kv: Any = getattr(getattr(app[ENGINE], "engine", None), "kv", None)
        if config.enabled and kv is None:
            logger.warning("--kv-events-config: this engine has no prefix cache to publish")
        elif config.enabled:
            if not kv.enable_caching:
                raise ValueError("--kv-events-config needs prefix caching, which is off")
            sink = KVEventSink(kv.block_size, config.max_queue_size)
            publisher = ZmqEventPublisher(config, sink)
            detach = attach(kv, sink)
            app[KV_EVENTS] = publisher
    yield
    if publisher is not None:
        detach()
        publisher.shutdown()


def register(app: web.Application) -> None:
    """Adds the router-facing routes to the app."""
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/get_load", get_load)
    app.router.add_post("/v1/completions/render", render_completion)
    app.router.add_post("/v1/chat/completions/render", render_chat_completion)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/kv_event_sources", kv_event_sources)
