"""Tool calls on chat completions end to end, against the session's tiny-Llama server (default
flags: auto tool choice with the Hermes parser) through the official `openai` SDK, raw SSE and
the WebSocket.

The tiny model has random weights and a ChatML template without tools, so: required and named
calls rely on structured outputs (the JSON always parses); an auto call is produced by
constraining the output with guided_regex to Hermes text, which the parser then reads; and the
rendered prompt shows the injected tools block.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import openai
import pytest

from tests.support.api import assert_error, http, post_json
from tests.support.server_process import ServerProcess, kvserve

UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"unit": UNIT}, "required": ["unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time now.",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                       "required": ["zone"]}}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_ANSWER = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                 '{"unit": "celsius"}}\n</tool_call>')


def regex_for(text: str) -> str:
    """A regex matching exactly TEXT (xgrammar's dialect)."""
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\/" else ("\\n" if c == "\n" else c)
                   for c in text)


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    return tiny_server


def body(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": USER, "tools": TOOLS, "temperature": 0.0,
            "max_tokens": 48, **fields}


def sse_chunks(server: ServerProcess, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed request, checking the [DONE] framing."""
    reply = http(server, "POST", "/v1/chat/completions", {**payload, "stream": True},
                 timeout=60)
    assert reply.status == 200, reply.raw
    events = [line[6:] for line in reply.raw.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def assemble(chunks: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], list[str]]:
    """(content, calls, finish reasons) of a streamed choice 0, with OpenAI's stream rules:
    role first, a call's first piece carries id, type and name, later pieces only arguments."""
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content, reasons = "", []
    calls: list[dict[str, Any]] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls", []):
                if "id" in piece:
                    assert piece["index"] == len(calls) and piece["type"] == "function"
                    assert piece["id"].startswith("call_")
                    calls.append({"id": piece["id"], "name": piece["function"]["name"],
                                  "arguments": piece["function"]["arguments"]})
                else:
                    assert set(piece) == {"index", "function"}
                    calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
            if choice["finish_reason"] is not None:
                reasons.append(choice["finish_reason"])
    return content, calls, reasons


# ---- required and named: structured outputs ---------------------------------------------------

def test_named_function_non_streamed_through_the_sdk(client: openai.OpenAI,
                                                      model_name: str) -> None:
    reply = client.chat.completions.create(
        model=model_name, messages=cast(Any, USER), tools=cast(Any, TOOLS),
        tool_choice=cast(Any, NAMED), temperature=0.0, max_tokens=48)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's answer for a named tool_choice
    assert choice.message.content is None and choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["unit"] in UNIT["enum"]  # type: ignore[union-attr]


def test_required_streamed_through_the_sdk(client: openai.OpenAI, model_name: str) -> None:
    stream = client.chat.completions.create(
        model=model_name, messages=cast(Any, USER), tools=cast(Any, TOOLS),
        tool_choice="required", temperature=0.0, max_tokens=64, stream=True,
        parallel_tool_calls=False)
    names, arguments, reasons = [], "", []
    for chunk in stream:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                assert piece.index == 0  # parallel_tool_calls false: one call
                if piece.function and piece.function.name:
                    assert piece.id and piece.type == "function"
                    names.append(piece.function.name)
                arguments += (piece.function.arguments or "") if piece.function else ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"] and len(names) == 1
    tool = next(t["function"] for t in TOOLS if t["function"]["name"] == names[0])
    args = json.loads(arguments)
    assert set(args) == set(tool["parameters"]["properties"])


def test_required_whole_equals_streamed(server: ServerProcess, model_name: str) -> None:
    payload = body(model_name, tool_choice="required", max_tokens=64, seed=3, temperature=1.0)
    whole = post_json(server, "/v1/chat/completions", payload)
    choice = whole["choices"][0]
    content, calls, reasons = assemble(sse_chunks(server, payload))
    assert reasons == [choice["finish_reason"]] == ["tool_calls"]
    assert choice["message"]["content"] is None and content == ""
    expected = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in choice["message"]["tool_calls"]]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected


# ---- auto: the Hermes parser ------------------------------------------------------------------

def test_auto_reads_hermes_calls_whole_sse_and_websocket(server: ServerProcess,
                                                          model_name: str) -> None:
    payload = body(model_name, guided_regex=regex_for(HERMES_ANSWER), max_tokens=160)
    whole = post_json(server, "/v1/chat/completions", payload)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"unit": "celsius"}

    content, calls, reasons = assemble(sse_chunks(server, payload))
    assert (content, reasons) == ("Let me look.", ["tool_calls"])
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"unit": "celsius"})]

    async def over_websocket() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        chunks = []
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(server.url + "/v1/ws") as ws:
            await ws.send_json({"type": "chat", "id": "t1", **payload})
            async for msg in ws:
                message = json.loads(msg.data)
                if message["type"] == "delta":
                    chunks.append(message["data"])
                else:
                    return chunks, message
        raise AssertionError("the socket closed early")

    chunks, done = asyncio.run(over_websocket())
    assert done["type"] == "done" and done["finish_reasons"] == ["tool_calls"]
    content, calls, reasons = assemble(chunks)
    assert (content, reasons) == ("Let me look.", ["tool_calls"]) and len(calls) == 1


def test_open_webui_shape_tools_on_every_request(server: ServerProcess, model_name: str) -> None:
    # Open WebUI sends its tools with no tool_choice and a trailing empty assistant message;
    # a plain answer comes back as content with the usual finish reason.
    payload = {"model": model_name, "stream": False, "max_tokens": 8, "temperature": 0.0,
               "tools": TOOLS, "messages": [*USER, {"role": "assistant", "content": ""}]}
    reply = post_json(server, "/v1/chat/completions", payload)
    choice = reply["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert isinstance(choice["message"]["content"], str)
    assert "tool_calls" not in choice["message"]
    # The placeholder was dropped and the tools were shown to the model.
    with_tools = post_json(server, "/tokenize", {"messages": USER, "tools": TOOLS})
    assert reply["usage"]["prompt_tokens"] == with_tools["count"]
    plain = post_json(server, "/tokenize", {"messages": USER})
    assert with_tools["count"] > plain["count"] + 50
    content, calls, reasons = assemble(sse_chunks(server, payload))
    assert calls == [] and len(reasons) == 1 and content == choice["message"]["content"]


def test_tool_choice_none_does_not_parse(server: ServerProcess, model_name: str) -> None:
    payload = body(model_name, tool_choice="none", guided_regex=regex_for(HERMES_ANSWER),
                   max_tokens=160)
    choice = post_json(server, "/v1/chat/completions", payload)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == HERMES_ANSWER


# ---- the next turn and the prompt -------------------------------------------------------------

SECOND_TURN: list[dict[str, Any]] = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees, sunny"},
]


def rendered(server: ServerProcess, model_name: str, **fields: Any) -> str:
    ids = post_json(server, "/tokenize", {"model": model_name, **fields})["tokens"]
    return str(post_json(server, "/detokenize", {"tokens": ids})["prompt"])


def test_second_turn_with_tool_results(client: openai.OpenAI, server: ServerProcess,
                                       model_name: str) -> None:
    reply = client.chat.completions.create(
        model=model_name, messages=cast(Any, SECOND_TURN), tools=cast(Any, TOOLS),
        temperature=0.0, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = rendered(server, model_name, messages=SECOND_TURN, tools=TOOLS)
    # The template has no tools: kvserve wrote them in a system prompt, the earlier call as
    # Hermes text and the result in a tool_response.
    assert prompt.index("<|im_start|>system\n# Tools") < prompt.index("<|im_start|>user")
    assert json.dumps(TOOLS[0]) in prompt and "<tool_call>" in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"unit": "celsius"}}\n</tool_call><|im_end|>') in prompt
    assert ("<|im_start|>user\n<tool_response>\n18 degrees, sunny\n</tool_response><|im_end|>"
            in prompt)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_prompt_without_tools_is_unchanged(server: ServerProcess, model_name: str) -> None:
    prompt = rendered(server, model_name, messages=USER)
    assert prompt == "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n" \
                     "<|im_start|>assistant\n"
    # A trailing empty assistant message (front-ends' placeholder) is dropped.
    assert rendered(server, model_name,
                    messages=[*USER, {"role": "assistant", "content": ""}]) == prompt


# ---- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": None, "tool_choice": NAMED}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 129}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object",
                                    "properties": {"a": {"type": "nonsense"}}}}}]}, "tools"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "messages"),
])
def test_invalid_tool_requests_get_400(server: ServerProcess, model_name: str,
                                       fields: dict[str, Any], param: str) -> None:
    reply = http(server, "POST", "/v1/chat/completions", body(model_name, **fields))
    assert_error(reply, 400, param)


def test_invalid_named_choice_over_the_websocket(server: ServerProcess, model_name: str) -> None:
    async def main() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(server.url + "/v1/ws") as ws:
            await ws.send_json({"type": "chat", "id": 7, **body(
                model_name, tool_choice={"type": "function", "function": {"name": "nope"}})})
            return dict(json.loads((await ws.receive()).data))

    message = asyncio.run(main())
    assert message["type"] == "error" and message["id"] == 7
    assert message["error"]["param"] == "tool_choice"


@pytest.fixture(scope="module")
def no_auto_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerProcess]:
    with kvserve(tiny_llama_dir, "--no-enable-auto-tool-choice",
                 log_dir=tmp_path_factory.mktemp("no_auto_tools")) as server:
        yield server


def test_no_enable_auto_tool_choice_restores_vllms_400(no_auto_server: ServerProcess) -> None:
    model = post_json(no_auto_server, "/v1/chat/completions",
                      {"messages": USER, "max_tokens": 2})["model"]
    for fields in ({}, {"tool_choice": "auto"}):
        reply = http(no_auto_server, "POST", "/v1/chat/completions", body(model, **fields))
        error = assert_error(reply, 400, "tool_choice")
        assert "--enable-auto-tool-choice" in error["message"]
    # Without auto parsing, none, required and named still work.
    for choice in ("none", "required", NAMED):
        reply = http(no_auto_server, "POST", "/v1/chat/completions",
                     body(model, tool_choice=choice, max_tokens=4))
        assert reply.status == 200, reply.raw
