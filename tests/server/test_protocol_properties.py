"""Property tests of the request decode path, in-process: any JSON either decodes to a valid
Struct or maps to a 4xx APIError, never another exception; requests built within the
documented bounds always decode."""

from __future__ import annotations

from typing import Any, get_args

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from server import protocol
from server.errors import APIError, from_exception
from server.protocol import ChatCompletionRequest, CompletionRequest, decode

KINDS = (CompletionRequest, ChatCompletionRequest)
SETTINGS = settings(max_examples=200, deadline=None)

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=20)
# Objects whose keys are mostly real field names, so values reach the field validators.
field_names = st.sampled_from(sorted(protocol.KNOWN_PARAMS)) | st.text(max_size=8)
request_like = st.dictionaries(field_names, json_values, max_size=8)


def decode_or_4xx(kind: type[Any], body: bytes) -> None:
    """Decodes; any failure must map to a 4xx APIError."""
    try:
        request = decode(kind, body)
    except Exception as exc:
        error = from_exception(exc)
        assert isinstance(error, APIError) and 400 <= error.status < 500, (exc, body)
        return
    assert isinstance(request, kind)


@SETTINGS
@given(value=json_values | request_like, kind=st.sampled_from(KINDS))
def test_any_json_decodes_or_is_4xx(value: Any, kind: type[Any]) -> None:
    decode_or_4xx(kind, msgspec.json.encode(value))


@SETTINGS
@given(body=st.binary(max_size=64), kind=st.sampled_from(KINDS))
def test_any_bytes_decode_or_are_4xx(body: bytes, kind: type[Any]) -> None:
    decode_or_4xx(kind, body)


@settings(max_examples=20, deadline=None)
@given(depth=st.integers(1, 50_000), kind=st.sampled_from(KINDS))
def test_deep_nesting_is_4xx(depth: int, kind: type[Any]) -> None:
    decode_or_4xx(kind, b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}")


stop_strings = st.text(min_size=1, max_size=protocol.MAX_STOP_LENGTH // 8)
sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, protocol.MAX_INT),
    "temperature": st.floats(0, protocol.MAX_TEMPERATURE),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, protocol.MAX_INT),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "n": st.integers(1, protocol.MAX_N),
    "stop": stop_strings | st.lists(stop_strings, max_size=protocol.MAX_STOP),
    "stop_token_ids": st.lists(st.integers(0, protocol.MAX_INT), max_size=20),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0, protocol.MAX_REPETITION_PENALTY, exclude_min=True),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "user": st.text(max_size=20),
})
token_ids = st.lists(st.integers(0, protocol.MAX_INT), min_size=1, max_size=8)
prompts = (st.text(min_size=1, max_size=20) | st.lists(st.text(min_size=1), min_size=1, max_size=4)
           | token_ids | st.lists(token_ids, min_size=1, max_size=4))
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(get_args(protocol.Role)),
                                           "content": st.text(max_size=20) | st.none()}),
                    min_size=1, max_size=5)


@SETTINGS
@given(fields=sampling, prompt=prompts, logprobs=st.integers(0, protocol.MAX_LOGPROBS))
def test_valid_completion_requests_decode(fields: dict[str, Any], prompt: Any,
                                          logprobs: int) -> None:
    body = {**fields, "prompt": prompt, "logprobs": logprobs}
    if isinstance(prompt, list) and not isinstance(prompt[0], int):
        body["n"] = min(body.get("n", 1), protocol.MAX_CHOICES // len(prompt))
    request = decode(CompletionRequest, msgspec.json.encode(body))
    assert request.prompt == prompt and request.logprobs == logprobs
    assert protocol.completion_prompts(request.prompt)


@SETTINGS
@given(fields=sampling, chat=messages, top=st.integers(0, protocol.MAX_LOGPROBS))
def test_valid_chat_requests_decode(fields: dict[str, Any], chat: list[dict[str, Any]],
                                    top: int) -> None:
    body = {**fields, "messages": chat, "logprobs": True, "top_logprobs": top}
    request = decode(ChatCompletionRequest, msgspec.json.encode(body))
    assert len(request.messages) == len(chat)
    assert protocol.chat_messages(request.messages)
