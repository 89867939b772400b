"""Server settings and their command-line flags. Kept free of heavy imports so `kvserve --help`
and `kvserve plan` start fast."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
# aiohttp's parser limits, passed explicitly so they are documented and tested: a longer
# request line or header line, or more headers, is answered 400 before any handler runs.
MAX_HEADER_LINE_BYTES = 8190
MAX_HEADER_FIELD_BYTES = 8190
MAX_HEADERS = 128
# Shapes of GET /get_load (server/router_api.py): SGLang's router reads a list of per-rank
# loads, vLLM's router (vllm-router) reads {"load": N}; both call the same path.
GET_LOAD_FORMATS = ("sglang", "vllm-router")


@dataclass
class ServerConfig:
    """Everything the HTTP layer needs beyond the engine's own arguments."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)
    api_key: str | None = None
    max_queue_len: int | None = None
    shutdown_timeout: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S
    ws_heartbeat_s: float = 20.0
    stats_interval_s: float = 10.0
    # Tool calls (README, "Tool calls"): on by default with the Hermes parser, since chat
    # front-ends send `tools` on every request; vLLM's flags mean what they mean there.
    enable_auto_tool_choice: bool = True
    tool_call_parser: str | None = "hermes"
    # Routers in front of replicas (README, "Replicas behind a router").
    vllm_metric_names: bool = False  # also expose /metrics under vLLM's `vllm:` names
    get_load_format: str = "sglang"  # the shape of GET /get_load, one of GET_LOAD_FORMATS
    data_parallel_size: int = 1  # engine replicas behind this server (server/data_parallel.py)
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON (engine/kv_events.py)

    def validate(self) -> None:
        """Raises ValueError naming the bad setting."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_queue_len is not None and self.max_queue_len < 1:
            # Every new request waits at least until the next step, so 0 would refuse all.
            raise ValueError(f"--max-queue-len must be >= 1, got {self.max_queue_len}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.request_body_timeout_s > 0:
            raise ValueError("--request-body-timeout must be > 0, got "
                             f"{self.request_body_timeout_s}")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.get_load_format not in GET_LOAD_FORMATS:
            raise ValueError(f"--get-load-format must be one of {', '.join(GET_LOAD_FORMATS)}, "
                             f"got {self.get_load_format!r}")
        if self.tool_call_parser is not None:
            from server.tool_parsers import get_tool_parser

            get_tool_parser(self.tool_call_parser)  # ValueError naming the known parsers
        if self.kv_events_config is not None:
            from engine.kv_events import KVEventsConfig

            KVEventsConfig.from_json(self.kv_events_config)  # ValueError naming the field


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """HTTP flags, spelled as vLLM's."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use in `model` (default: the model's name)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1 routes (default: no key)")
    parser.add_argument("--max-queue-len", type=int, default=None,
                        help="waiting requests beyond this get 503 + Retry-After "
                             "(default: unbounded)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds requests in flight may take to finish after SIGTERM")
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                        help="largest request body or WebSocket message")
    parser.add_argument("--request-body-timeout", type=float,
                        default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
                        help="seconds a request body may take to arrive; slower gets 408")
    parser.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="read tool calls out of the output when tool_choice is auto (the "
                             "default when a request has tools); --no-enable-auto-tool-choice "
                             "answers such requests 400, as vLLM does without the flag "
                             "(default: on)")
    parser.add_argument("--tool-call-parser", default="hermes",
                        help="format of the model's tool calls for tool_choice auto: hermes "
                             "(<tool_call>{json}</tool_call>, Qwen2.5 and Hermes style; "
                             "default: hermes)")
    parser.add_argument("--vllm-metric-names", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="also expose every /metrics family under vLLM's prefix (vllm:"
                             "num_requests_waiting, ...), for Kubernetes' Gateway API "
                             "inference extension and llm-d (default: off)")
    parser.add_argument("--get-load-format", choices=GET_LOAD_FORMATS, default="sglang",
                        help="shape of GET /get_load: sglang = [{dp_rank, num_reqs, "
                             "num_waiting_reqs, num_tokens}] (SGLang's router), vllm-router = "
                             "{\"load\": N} (vLLM's router power_of_two policy) "
                             "(default: sglang)")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine replicas, each a child process with --num-threads / N "
                             "threads, behind this server, which routes each request to the "
                             "least loaded one with prompt-prefix affinity (default: 1)")
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="publish KV cache block events for vllm-router's kv_aware policy, "
                             "as vLLM: '{\"enable_kv_cache_events\": true, \"publisher\": "
                             "\"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": "
                             "\"kv-events\"}' (GET /kv_event_sources lists it; default: off)")


def server_config(ns: argparse.Namespace) -> ServerConfig:
    """ServerConfig from parsed flags."""
    return ServerConfig(host=ns.host, port=ns.port, served_model_names=ns.served_model_name or [],
                        api_key=ns.api_key, max_queue_len=ns.max_queue_len,
                        shutdown_timeout=ns.shutdown_timeout, max_body_bytes=ns.max_body_bytes,
                        request_body_timeout_s=ns.request_body_timeout,
                        enable_auto_tool_choice=ns.enable_auto_tool_choice,
                        tool_call_parser=ns.tool_call_parser,
                        vllm_metric_names=ns.vllm_metric_names,
                        get_load_format=ns.get_load_format,
                        data_parallel_size=ns.data_parallel_size,
                        kv_events_config=ns.kv_events_config)
