"""Request bodies as msgspec Structs with bounds as constraints, decoded by module-level
decoders, and their translation into engine prompts and SamplingParams.

`null` means unset everywhere. Unknown fields are ignored with a warning, as vLLM does. Every
field is bounded (README, "Limits"), so hostile input fails while decoding with a 400 that names
the field; the bounds are Meta constraints, so they also appear in GET /openapi.json. The
structured-output fields live in server/protocol_structured.py, the tool-call fields in
server/protocol_tools.py.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from server.protocol_structured import (
    Choices,
    JsonSchema,
    LogitBias,
    ResponseFormat,
    StructuredOutputsField,
    logit_bias_of,
    structured_outputs_of,
)
from server.protocol_tools import (
    MAX_TOOL_CALL_ID_LENGTH,
    MAX_TOOLS,
    MessageToolCall,
    Tool,
    ToolChoice,
)

logger = logging.getLogger("kvserve.server")

# Caps on what one request may ask for (README, "Limits"). vLLM has none of these except
# max_logprobs; they keep one request from queueing a million sequences or looping over a
# thousand stop strings per token.
MAX_INT = 2**31 - 1  # token counts, top_k and token ids: a larger value is never meaningful
MAX_N = 128  # OpenAI's cap on n
MAX_CHOICES = 1024  # prompts x n in one completions request
MAX_STOP = 64  # stop strings (OpenAI allows 4, vLLM has no cap)
MAX_STOP_LENGTH = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]

PositiveInt = Annotated[int, Meta(ge=1, le=MAX_INT)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=MAX_INT)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_LENGTH)]
LogprobCount = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
# A 64-bit seed, as vLLM accepts; a larger one would fail inside the model step (torch's
# generator), taking the whole batch down with it.
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


_TOKEN_IDS = {"type": "array", "minItems": 1,
              "items": {"type": "integer", "minimum": 0, "maximum": MAX_INT}}
PROMPT_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    _TOKEN_IDS,
    {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
]}


class StreamOptions(msgspec.Struct, kw_only=True):
    """OpenAI's stream_options (plus vLLM's continuous_usage_stats)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=MAX_INT)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[NonNegativeInt],
                              Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=MAX_REPETITION_PENALTY)] | None = None
    ignore_eos: bool | None = None
    min_tokens: NonNegativeInt | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: only requests with the same salt share prefix-cache blocks (tenant isolation).
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_STOP_LENGTH)] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's guided_* extras and the newer
    # structured_outputs object; at most one constraint per request.
    response_format: ResponseFormat | None = None
    guided_json: JsonSchema | None = None
    guided_regex: str | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    logit_bias: LogitBias | None = None

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

    # A string, strings, token ids or token-id lists: msgspec cannot express that union (two
    # array types), so it is checked by completion_prompts and only described in the schema.
    prompt: Annotated[Any, Meta(extra_json_schema=PROMPT_SCHEMA)] = None
    logprobs: LogprobCount | None = None
    echo: bool | None = None


class TextPart(msgspec.Struct, kw_only=True):
    """One part of a chat message's content list; only text parts are understood."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    """One chat message: an assistant message may carry tool_calls (content then may be
    null), a tool message the tool_call_id it answers."""

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Meta(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[str, Meta(max_length=MAX_TOOL_CALL_ID_LENGTH)] | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None
    add_generation_prompt: bool | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage],
                        Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None


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
# Every field name any request body understands.
KNOWN_PARAMS = frozenset().union(*(fields for _, fields in _DECODERS.values()))


def decode(kind: type[Any], body: bytes) -> Any:
    """Decodes and validates a request body; raises msgspec errors or InvalidRequestError
    (all 400)."""
    decoder, fields = _DECODERS[kind]
    try:
        request = decoder.decode(body)
        keys = _KEYS.decode(body)
    except msgspec.ValidationError:
        raise
    except RecursionError:  # msgspec recurses per nesting level, e.g. 100k `[` in a prompt
        raise msgspec.DecodeError("JSON is nested too deeply") from None
    except msgspec.DecodeError as exc:
        raise msgspec.DecodeError(_explain(exc, body)) from None
    _warn_unknown(sorted(set(keys) - fields))
    check_limits(request)
    return request


def parse_message(raw: str | bytes) -> Any:
    """Parses one WebSocket message: JSON of any shape (big integers kept, so the field that
    holds one is named by convert), with the same errors as decode."""
    try:
        return msgspec.json.decode(raw)
    except RecursionError:
        raise msgspec.DecodeError("JSON is nested too deeply") from None
    except msgspec.DecodeError as exc:
        data = raw.encode(errors="replace") if isinstance(raw, str) else raw
        raise msgspec.DecodeError(_explain(exc, data)) from None


def convert(kind: type[Any], obj: dict[str, Any]) -> Any:
    """Validates an already-parsed object (a WebSocket message) as a request Struct."""
    fields = _DECODERS[kind][1]
    _warn_unknown(sorted(set(obj) - fields - {"type", "id"}))
    request = msgspec.convert({k: v for k, v in obj.items() if k in fields}, kind)
    check_limits(request)
    return request


def _warn_unknown(unknown: list[str]) -> None:
    if unknown:
        logger.warning("The following fields were present in the request but ignored: %s",
                       unknown[:50])


_BYTE = re.compile(r"\(byte (\d+)\)")
_LAST_KEY = re.compile(rb'"([A-Za-z_]+)"\s*:\s*$')


def _explain(exc: msgspec.DecodeError, body: bytes) -> str:
    """msgspec's message, plus a hint when the bad byte starts NaN or Infinity (Python's json
    writes them, but they are not JSON)."""
    match = _BYTE.search(str(exc))
    if match:
        at = int(match.group(1))
        if body[at:].lstrip(b"-").startswith((b"NaN", b"Infinity")):
            key = _LAST_KEY.search(body[max(0, at - 100):at].rstrip(b"-"))
            where = f" - at `$.{key.group(1).decode()}`" if key else ""
            return (f"{exc}: NaN and Infinity are not JSON numbers; send a finite number or "
                    f"null{where}")
    return str(exc)


def check_limits(request: Any) -> None:
    """Caps that span fields, which Meta constraints cannot express."""
    if isinstance(request, CompletionRequest) and isinstance(request.prompt, list):
        prompts = len(request.prompt) if request.prompt and all(
            isinstance(p, (str, list)) for p in request.prompt) else 1
        choices = prompts * (request.n or 1)
        if choices > MAX_CHOICES:
            raise InvalidRequestError(
                f"prompt holds {prompts} prompts and n is {request.n or 1}: {choices} choices "
                f"exceed the cap of {MAX_CHOICES} per request", "prompt")


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    default_max_tokens: int | None,
                    defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """SamplingParams from request fields. An unset field takes the server's default from the
    generation config (`defaults`, SamplingParams names: --generation-config and
    --override-generation-config), else vLLM's default; `default_max_tokens` is the API's own
    default (16 for completions, none for chat) under the generation config's."""
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
        "structured_outputs": structured_outputs_of(req), "logit_bias": logit_bias_of(req),
    }
    values = {k: v for k, v in values.items() if v is not None}
    defaults = dict(defaults or {})
    default_max_tokens = defaults.pop("max_tokens", default_max_tokens)
    for key, value in defaults.items():
        values.setdefault(key, value)
    values["max_tokens"] = max_tokens if max_tokens is not None else default_max_tokens
    return SamplingParams(**values)


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions request: a string, strings, token ids or id lists."""
    if isinstance(prompt, str):
        return [_non_empty(prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError("prompt must be a non-empty string, list of strings, list of "
                                  "token ids or list of token-id lists", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [_non_empty(p) for p in prompt]
    if all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids "
                              "or a list of non-empty token-id lists (not a mix)", "prompt")


def _non_empty(text: str) -> str:
    if not text:
        raise InvalidRequestError("prompt is empty; give at least one token of text", "prompt")
    return text


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: content flattened to text, tool calls and
    tool_call_id kept in OpenAI's shape. A trailing assistant message with no content and no
    tool calls is dropped (Open WebUI and LibreChat send one as the answer's placeholder)."""
    if not messages:
        raise InvalidRequestError("messages must contain at least one message", "messages")
    out = [_message_dict(m) for m in messages]
    if len(out) > 1 and out[-1]["role"] == "assistant" and not out[-1]["content"] and \
            "tool_calls" not in out[-1]:
        out.pop()
    return out


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": _message_text(message)}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}
            for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise InvalidRequestError(f"messages content part of type {part.type!r} is not "
                                      "supported; only text parts are", "messages")
        texts.append(part.text)
    return "\n".join(texts)
