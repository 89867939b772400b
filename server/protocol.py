"""Request bodies as msgspec Structs with bounds as constraints, decoded by module-level
decoders, and their translation into engine prompts and SamplingParams.

`null` means unset everywhere. Unknown fields are ignored with a warning, as vLLM does.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from engine.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger("kvserve.server")

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
LogprobCount = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
# A 64-bit seed, as vLLM accepts; a larger one would fail inside the model step (torch's
# generator), taking the whole batch down with it.
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class StreamOptions(msgspec.Struct, kw_only=True):
    """OpenAI's stream_options (plus vLLM's continuous_usage_stats)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    n: PositiveInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    ignore_eos: bool | None = None
    min_tokens: NonNegativeInt | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions."""

    prompt: Any = None  # string, list of strings, token ids, or a list of token-id lists
    logprobs: LogprobCount | None = None
    echo: bool | None = None


class TextPart(msgspec.Struct, kw_only=True):
    """One part of a chat message's content list; only text parts are understood."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    """One chat message."""

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None
    add_generation_prompt: bool | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize."""

    tokens: list[NonNegativeInt]
    model: str | None = None


def _decoders(kind: type[msgspec.Struct]) -> tuple[msgspec.json.Decoder[Any], frozenset[str]]:
    return msgspec.json.Decoder(kind), frozenset(kind.__struct_fields__)


_DECODERS = {kind: _decoders(kind) for kind in
             (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)}
# Reads only the top-level keys (values stay raw bytes) to name ignored fields in the log.
_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])
KNOWN_PARAMS = frozenset().union(*(fields for _, fields in _DECODERS.values()))


def decode(kind: type[Any], body: bytes) -> Any:
    """Decodes and validates a request body; raises msgspec errors that map to 400."""
    decoder, fields = _DECODERS[kind]
    request = decoder.decode(body)
    unknown = sorted(set(_KEYS.decode(body)) - fields)
    if unknown:
        logger.warning("The following fields were present in the request but ignored: %s",
                       unknown)
    return request


def convert(kind: type[Any], obj: dict[str, Any]) -> Any:
    """Validates an already-parsed object (a WebSocket message) as a request Struct."""
    fields = _DECODERS[kind][1]
    unknown = sorted(set(obj) - fields - {"type", "id"})
    if unknown:
        logger.warning("The following fields were present in the request but ignored: %s",
                       unknown)
    return msgspec.convert({k: v for k, v in obj.items() if k in fields}, kind)


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    default_max_tokens: int | None) -> SamplingParams:
    """SamplingParams from request fields; unset fields take vLLM's defaults."""
    values: dict[str, Any] = {
        "n": req.n, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "seed": req.seed, "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "min_tokens": req.min_tokens,
        "stop": [req.stop] if isinstance(req.stop, str) else req.stop,
        "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "logprobs": logprobs,
    }
    values = {k: v for k, v in values.items() if v is not None}
    values["max_tokens"] = max_tokens if max_tokens is not None else default_max_tokens
    return SamplingParams(**values)


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions request: a string, strings, token ids or id lists."""
    if isinstance(prompt, str):
        return [_non_empty(prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a non-empty string, list of strings, list of token "
                         "ids or list of token-id lists")
    if all(isinstance(p, str) for p in prompt):
        return [_non_empty(p) for p in prompt]
    if all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a "
                     "list of non-empty token-id lists (not a mix)")


def _non_empty(text: str) -> str:
    if not text:
        raise ValueError("prompt is empty; give at least one token of text")
    return text


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template expects them: content flattened to text."""
    if not messages:
        raise ValueError("messages must contain at least one message")
    return [{"role": m.role, "content": _message_text(m)} for m in messages]


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ValueError(f"messages content part of type {part.type!r} is not supported; "
                             "only text parts are")
        texts.append(part.text)
    return "\n".join(texts)
