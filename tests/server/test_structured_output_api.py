"""Structured outputs and logit_bias over HTTP and the WebSocket, against the session's real
`kvserve serve` of the tiny random Llama: OpenAI's response_format, vLLM's guided_* extras and
structured_outputs object, streamed and not; invalid constraints are 400s naming the field;
logit_bias forces a token; the fields are in GET /openapi.json."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import jsonschema_rs
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.api import assert_error, http, post_json
from tests.support.server_process import ServerProcess
from tests.support.ws import Socket

NAME = {"type": "string", "pattern": "^[a-z]{1,8}$"}  # see tests/engine/test_structured_output
PERSON = {"type": "object", "properties": {
    "name": NAME,
    "role": {"enum": ["admin", "user", "guest"]},
    "address": {"type": "object", "properties": {
        "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"]},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
               "minItems": 1, "maxItems": 3}},
    "required": ["name", "role", "address", "scores"]}
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Who are you?"}]


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    return tiny_server


def json_schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                   "strict": True}}


def test_chat_response_format_json_schema_whole_and_streamed(client: openai.OpenAI,
                                                             model_name: str) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model=model_name, messages=CHAT, max_tokens=200, temperature=1.0, seed=seed,
            response_format=json_schema_format(PERSON))
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema_rs.validate(PERSON, json.loads(choice.message.content or ""))
        stream = client.chat.completions.create(
            model=model_name, messages=CHAT, max_tokens=200, temperature=1.0, seed=seed, stream=True,
            response_format=json_schema_format(PERSON))
        parts, reasons = [], []
        for chunk in stream:
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                reasons.append(c.finish_reason)
        assert "".join(parts) == choice.message.content  # the same seed, the same text
        assert [r for r in reasons if r] == ["stop"]


def test_completions_guided_fields_and_structured_outputs(client: openai.OpenAI,
                                                          model_name: str) -> None:
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"guided_json": PERSON}, lambda t: jsonschema_rs.is_valid(PERSON, json.loads(t))),
        ({"guided_regex": r"[A-Z][a-z]{1,6} [0-9]{2}"},
         lambda t: re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{2}", t)),
        ({"guided_choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
        ({"guided_grammar": 'root ::= ("ab" | "cd")+ "!"'},
         lambda t: re.fullmatch(r"(ab|cd)+!", t)),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t)),
    ]
    for extra, check in cases:
        for stream in (False, True):
            kwargs: dict[str, Any] = dict(model=model_name, prompt="the cat", max_tokens=120,
                                          temperature=1.0, seed=5, extra_body=extra)
            if stream:
                chunks = list(client.completions.create(stream=True, **kwargs))
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                reasons = [c.choices[0].finish_reason for c in chunks
                           if c.choices and c.choices[0].finish_reason]
            else:
                reply = client.completions.create(**kwargs)
                text, reasons = reply.choices[0].text, [reply.choices[0].finish_reason]
            assert reasons == ["stop"] and check(text), (extra, stream, text)


def test_json_object_on_completions(client: openai.OpenAI, server: ServerProcess,
                                   model_name: str) -> None:
    closers = {str(t): 8 for t in _token_ids(server, '"}')}  # random model: close strings
    reply = client.completions.create(model=model_name, prompt="One two", max_tokens=120, seed=2,
                                      temperature=1.0, logit_bias=closers,
                                      extra_body={"response_format": {"type": "json_object"}})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].text), dict)
    text = client.completions.create(model=model_name, prompt="One two", max_tokens=5, temperature=0.0,
                                     extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].finish_reason in ("stop", "length")


def test_logit_bias_forces_a_token(client: openai.OpenAI, server: ServerProcess,
                                   model_name: str) -> None:
    token = _token_ids(server, " dog")[-1]
    reply = client.completions.create(model=model_name, prompt="the cat", max_tokens=4, temperature=1.0,
                                      seed=1, logit_bias={str(token): 100},
                                      extra_body={"ignore_eos": True})
    forced = post_json(server, "/detokenize", {"tokens": [token] * 4})["prompt"]
    assert reply.choices[0].text == forced


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": json_schema_format({"type": "object", "properties": {
        "a": {"type": "nosuchtype"}}})}, "response_format", "Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", None),
    ({"guided_regex": "(unclosed"}, "guided_regex", "parenthesis"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ({"guided_choice": []}, "guided_choice", None),
    ({"guided_json": "{not json"}, "guided_json", "JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex",
     "at most one"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "vocabulary"),
    ({"logit_bias": {"5": 101}}, "logit_bias", None),
    ({"logit_bias": {"x": 1}}, "logit_bias", None),
])
def test_invalid_constraints_are_400_naming_the_field(server: ServerProcess, body: dict[str, Any],
                                                      param: str, words: str | None) -> None:
    for path, base in (("/v1/chat/completions", {"messages": CHAT}),
                       ("/v1/completions", {"prompt": "the cat"})):
        error = assert_error(http(server, "POST", path, {**base, "max_tokens": 4, **body}), 400,
                             param)
        if words is not None:
            assert words in error["message"], error


def test_structured_output_over_the_websocket(server: ServerProcess) -> None:
    async def run() -> tuple[Socket, list[str]]:
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(server.url + "/v1/ws") as ws:
            sock = Socket(ws)
            await sock.send({"type": "chat", "id": "j", "messages": CHAT, "max_tokens": 200,
                             "seed": 3, "temperature": 1.0,
                             "response_format": json_schema_format(PERSON)})
            await sock.send({"type": "completion", "id": "c", "prompt": "the cat",
                             "max_tokens": 20, "guided_choice": ["x", "y"]})
            await sock.send({"type": "completion", "id": "bad", "prompt": "the cat",
                             "guided_regex": "(("})
            await sock.until_finished({"j", "c"})
            return sock, [_text(d) for d in sock.deltas("j")]

    sock, parts = asyncio.run(run())
    jsonschema_rs.validate(PERSON, json.loads("".join(parts)))
    assert "".join(_text(d) for d in sock.deltas("c")) in ("x", "y")
    assert sock.done("j")["finish_reasons"] == ["stop"]
    errors = [e for e in sock.errors() if e["id"] == "bad"]
    assert len(errors) == 1 and errors[0]["error"]["param"] == "guided_regex"


def test_openapi_describes_the_new_fields(server: ServerProcess) -> None:
    doc = http(server, "GET", "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[request]["properties"]
        for field in ("response_format", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "structured_outputs", "logit_bias"):
            assert field in props, (request, field)
        assert props["logit_bias"]["anyOf"][0]["additionalProperties"]["maximum"] == 100
    assert set(schemas["ResponseFormat"]["properties"]["type"]["enum"]) == \
        {"text", "json_object", "json_schema"}


def _token_ids(server: ServerProcess, text: str) -> list[int]:
    return list(post_json(server, "/tokenize", {"prompt": text,
                                                "add_special_tokens": False})["tokens"])


def _text(delta: dict[str, Any]) -> str:
    choices = delta["choices"]  # Socket.deltas gives each delta message's data
    if not choices:
        return ""
    choice = choices[0]
    return str(choice.get("delta", {}).get("content") or choice.get("text") or "")
