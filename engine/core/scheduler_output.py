"""What crosses between the scheduler and the worker: the immutable batch of one step
(`SchedulerOutput` of `ScheduledRequest`s) and what the step produced (`StepResult`).

Kept apart from the scheduler so the worker side imports these types and never the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from engine.outputs import PositionLogprobs
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar

# A token id the scheduler does not know yet (async scheduling: it is being sampled by the step
# in flight); the worker replaces it with that step's sampled token before the forward.
PLACEHOLDER_TOKEN_ID = -1


class ScheduledRequest(NamedTuple):
    """One request's share of a step, immutable so the worker thread can read it safely (a
    NamedTuple: built for every running request every step, several times cheaper than a
    frozen dataclass)."""

    request_id: str
    token_ids: tuple[int, ...]  # the tokens computed this step
    start_pos: int  # position of token_ids[0]
    block_ids: tuple[int, ...]
    sample: bool  # whether this step reaches the end of the known tokens
    sampling_params: SamplingParams
    # Set only when sampling needs history (penalties): prompt and output token ids.
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    # Token ids that must not be sampled yet (min_tokens): EOS and stop ids.
    banned_token_ids: tuple[int, ...] = ()
    # The compiled grammar of a structured-output request (engine/structured_output), or None.
    grammar: xgrammar.CompiledGrammar | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    """An immutable batch for the worker."""

    requests: tuple[ScheduledRequest, ...]
    finished_request_ids: frozenset[str] = field(default_factory=frozenset)

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return sum(len(r.token_ids) for r in self.requests)


@dataclass
class StepResult:
    """What one step produced: a token (and maybe logprobs) per sampling request."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    # Structured outputs: requests whose grammar ended with this token (they stop, even with
    # ignore_eos) and requests whose token the grammar refused (they end with an error).
    grammar_terminated: set[str] = field(default_factory=set)
    grammar_rejected: set[str] = field(default_factory=set)
    # The step's forward seconds as the worker timed it (0.0: not timed); the adaptive step
    # budget learns step costs from it.
    forward_seconds: float = 0.0
