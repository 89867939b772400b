"""The narrow interface the server uses to reach an engine, and nothing else: model facts,
chat rendering, tokenizing, adding a request and iterating its deltas, aborting, stats.

`AsyncEngine` implements it in-process. The server never imports the scheduler, the tokenizer
or any engine internals, so another implementation (an engine in another process, a router
over replicas) can stand behind the same routes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.input_processor import Message, PromptInput
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelInfo:
    """What clients are told about the served model."""

    name: str  # the model's own name (folder or file stem)
    root: str  # where it was loaded from
    max_model_len: int
    vocab_size: int
    # Defaults for the sampling fields a request leaves unset (SamplingParams names), from
    # --generation-config and --override-generation-config.
    default_sampling_params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is right now, for routers that pick the least loaded replica."""

    num_running: int  # requests being computed
    num_waiting: int  # requests queued, not yet scheduled
    num_used_tokens: int  # KV token slots held by requests (blocks x block_size)
    max_total_tokens: int  # KV token slots in all
    kv_cache_usage: float  # share of KV blocks held by requests, 0.0 to 1.0


class RequestHandle(Protocol):
    """One queued request: iterate it for its outputs (each step's delta); cancel() aborts."""

    num_prompt_tokens: int

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def cancel(self) -> None: ...


class EngineClient(Protocol):
    """What the server may ask of an engine. Bad input raises InvalidRequestError (with the
    offending parameter); a full queue QueueFullError; a stopped engine EngineDeadError."""

    model_info: ModelInfo

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    @property
    def is_dead(self) -> bool: ...

    @property
    def num_unfinished(self) -> int: ...

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> dict[str, Any]: ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def detokenize(self, token_ids: list[int], param: str = "tokens") -> str: ...

    def add_request(self, prompt: PromptInput, params: SamplingParams,
                    request_id: str) -> RequestHandle: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self, reason: str) -> None: ...

    def metrics_text(self) -> bytes: ...

    def load(self) -> EngineLoad: ...

    def server_info(self) -> dict[str, Any]:
        """The engine's settings as plain JSON values: model, KV cache and scheduler."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False (nothing changed) while requests are in flight."""
        ...
