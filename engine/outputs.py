"""Results handed to callers, shaped as vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability, its rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One generated position: token id -> Logprob, the sampled token plus the top N. The sampler
# builds it (decoded_token None), the output processor fills in the text once, and the same
# objects reach the caller and the server's response builder.
PositionLogprobs = dict[int, Logprob]
SampleLogprobs = list[PositionLogprobs]


@dataclass(slots=True)  # slots: built for every streaming request every step
class CompletionOutput:
    """One choice of a request. With RequestOutputKind.DELTA (streaming) `text`, `token_ids`
    and `logprobs` hold only what this step added; with FINAL_ONLY they are the whole output."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        """Whether this choice is done."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: its prompt and each choice so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
