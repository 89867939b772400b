"""A request's scheduler-side state: its tokens and one progress counter."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import SampleLogprobs
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def __init__(self, value: int) -> None:
        # Whether the request will never be scheduled again: a plain attribute, read for every
        # request every step (an enum property costs several times more).
        self.finished = value >= 4


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence to generate. `n > 1` requests become n of these, one per choice.

    Progress is the single counter `num_computed_tokens`: tokens whose KV is in the cache.
    Prefill chunks, decodes and recomputation after preemption all advance it the same way.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16
    arrival_time: float = field(default_factory=time.monotonic)
    # For choice i > 0 of an n > 1 request: the sibling whose prompt blocks it shares.
    parent: Request | None = None
    choice_index: int = 0
    # Mixed into the first block's prefix-cache key: only requests with the same salt share KV.
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Async scheduling: tokens scheduled to be sampled whose value the engine does not know
    # yet (the step that samples them is in flight); the worker fills them in.
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until then
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs = field(default_factory=list)
    first_scheduled_time: float | None = None  # monotonic; for the queue-time metric
    # Structured outputs: the grammar being compiled for this request (an
    # xgrammar.CompiledGrammar once done); the scheduler admits the request only then.
    grammar: Future[Any] | None = None
    # Whether sampling reads the output history (penalties): the scheduler's per-step fast
    # path reads this flag instead of the params' property.
    needs_history: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.needs_history = self.sampling_params.needs_penalties

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """Whether the request is done for any reason."""
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: stop, length, abort or error."""
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        """Records one sampled token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
