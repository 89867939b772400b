"""Per-request sampling parameters, validated up front so bad input fails before it is queued."""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each logit_bias value


class RequestOutputKind(enum.Enum):
    """What a request's outputs carry, as vLLM's: DELTA streams each step's new tokens and text
    (the server); FINAL_ONLY hands out one cumulative output when the request ends (`LLM`)."""

    DELTA = enum.auto()
    FINAL_ONLY = enum.auto()


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate, as vLLM's `StructuredOutputsParams`
    (formerly `GuidedDecodingParams`): exactly one of the fields is set.

    json: a JSON schema (dict or its JSON text); json_object: any JSON object; regex: a
    regular expression; choice: one of these strings; grammar: an EBNF grammar (xgrammar's
    dialect, which also reads GBNF).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):  # a list is accepted and kept as a tuple
            object.__setattr__(self, "choice", tuple(self.choice))


@dataclass
class SamplingParams:
    """What to sample and when to stop, with vLLM's names and defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    # Grammar-constrained decoding (engine/structured_output); None costs nothing.
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> bias in [-100, 100], added to the logits before sampling.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:  # OpenAI clients send 0 for "no top-k"
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the parameter and the accepted range."""
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n}", "n")
        _check(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63),
               f"seed must be a 64-bit integer, got {self.seed}", "seed")
        _check(_finite(self.temperature) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature}", "temperature")
        # the sampler computes in float32: a top_p that rounds to 0 there keeps no token
        _check(_finite(self.top_p) and 0 < self.top_p <= 1 and _float32(self.top_p) > 0,
               f"top_p must be in (0, 1] (at least {MIN_FLOAT32:g}), got {self.top_p}", "top_p")
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
               f"top_k must be -1 (disabled) or >= 1, got {self.top_k}", "top_k")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value}", name)
        # logits are divided or multiplied by it in float32: past these bounds a logit becomes
        # inf or 0 and a masked one (-inf) NaN, which then wins the argmax (a fuzzed request
        # with 5e-324 sampled a token its guided_choice refused, and the step failed)
        _check(_finite(self.repetition_penalty)
               and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
               f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}",
               "repetition_penalty")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                   f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
               f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens,
                   f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                   "min_tokens")
        _check(self.logprobs is None or (isinstance(self.logprobs, int)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}", "logprobs")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop must be a list of non-empty strings", "stop")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers", "stop_token_ids")
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams),
                   "structured_outputs must be a StructuredOutputsParams", "structured_outputs")
            from engine.structured_output.constraints import check_shape

            check_shape(self.structured_outputs)
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or top_k 1) means argmax."""
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        """Whether any output-history penalty applies."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)

    @property
    def needs_filtering(self) -> bool:
        """Whether top-k / top-p / min-p truncation applies."""
        return self.top_k > 1 or self.top_p < 1.0 or self.min_p > 0.0


def _check_logit_bias(bias: Any) -> None:
    _check(isinstance(bias, dict), "logit_bias must map token ids to numbers", "logit_bias")
    for token, value in bias.items():
        _check(isinstance(token, int) and not isinstance(token, bool) and token >= 0,
               f"logit_bias keys must be token ids (integers >= 0), got {token!r}", "logit_bias")
        _check(_finite(value) and not isinstance(value, bool)
               and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS,
               f"logit_bias values must be in [-100, 100], got {value!r} for token {token}",
               "logit_bias")


MIN_FLOAT32 = 1.1754943508222875e-38  # the smallest normal float32
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-4, 1e4


def _float32(value: float) -> float:
    """value as the sampler's float32 holds it (subnormals kept; below them, 0)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)
