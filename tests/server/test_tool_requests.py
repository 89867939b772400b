"""Tool calls without a server, around the parsers: the request checks, the tool-call modes,
the chat rendering of tools (a template without tools, one that refuses a system turn, one that
renders them), the response shapes streamed and whole, and the flags."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, RequestOutput
from server.protocol import ChatCompletionRequest, chat_messages
from server.protocol_tools import chat_tools
from server.responses import CallSpec, ResponseBuilder
from server.tool_parsers import HermesToolParser
from server.tool_parsers.mode import ToolSettings, plan_tool_calls
from server.tool_parsers.prompt import render_with_tools, tools_system_prompt
from tests.support.tool_calls import REQUIRED, TIME, TOOLS, WEATHER

# ---- request checks and modes -----------------------------------------------------------------

def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)


def test_chat_tools_checks() -> None:
    assert chat_tools(chat()) is None
    assert chat_tools(chat(tool_choice="none")) is None
    with pytest.raises(InvalidRequestError) as err:
        chat_tools(chat(tool_choice="required"))
    assert err.value.param == "tool_choice"
    named = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(InvalidRequestError, match="nope") as err:
        chat_tools(chat(tools=TOOLS, tool_choice=named))
    assert err.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError) as err:
        chat_tools(chat(tools=[TOOLS[1], TOOLS[1]]))
    assert err.value.param == "tools"
    tools = chat_tools(chat(tools=TOOLS))
    assert tools == TOOLS  # unset fields are left out, not null
    with pytest.raises(msgspec.ValidationError, match="tools"):
        chat(tools=[{"type": "function", "function": {"name": "f"}}] * 129)


def test_modes() -> None:
    settings = ToolSettings()
    assert plan_tool_calls(None, None, None, settings) == (None, None)
    assert plan_tool_calls(TOOLS, "none", None, settings) == (None, None)
    mode, constraint = plan_tool_calls(TOOLS, None, None, settings)
    assert mode is not None and constraint is None and mode.tool_calls_finish and mode.parallel
    assert isinstance(mode.new_parser(), HermesToolParser)
    with pytest.raises(InvalidRequestError, match="enable-auto-tool-choice"):
        plan_tool_calls(TOOLS, "auto", None, ToolSettings(enable_auto_tool_choice=False))
    mode, constraint = plan_tool_calls(TOOLS, "required", False, settings)
    assert mode is not None and not mode.parallel and constraint is not None
    assert isinstance(constraint.json, dict) and constraint.json["maxItems"] == 1
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    mode, constraint = plan_tool_calls(TOOLS, named.tool_choice, None, settings)
    assert mode is not None and not mode.tool_calls_finish  # OpenAI: "stop" for a named one
    assert constraint is not None and constraint.json == {"type": "object"}


def test_chat_messages_tool_turns_and_trailing_placeholder() -> None:
    req = chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": ""}])
    messages = chat_messages(req.messages)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert messages[2]["tool_call_id"] == "call_1"


# ---- rendering --------------------------------------------------------------------------------

class FakeEngine:
    """Records what reaches render_chat; renders role: content lines (tools only if asked)."""

    def __init__(self, renders_tools: bool, refuse_system: bool = False) -> None:
        self.renders_tools = renders_tools
        self.refuse_system = refuse_system
        self.calls: list[tuple[list[dict[str, Any]], Any]] = []

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    *, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        self.calls.append((messages, tools))
        if self.refuse_system and messages[0]["role"] == "system":
            raise InvalidRequestError("roles must alternate", "messages")
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if tools and self.renders_tools:
            text = json.dumps(tools) + text
        return {"prompt": text, "prompt_token_ids": [1]}


TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]


def test_render_for_a_template_without_tools() -> None:
    engine = FakeEngine(renders_tools=False)
    prompt = render_with_tools(engine, TURNS, TOOLS, True, renders_tools=False)["prompt"]
    messages, tools = engine.calls[-1]
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant",
                                                               "user"]
    assert messages[0]["content"] == tools_system_prompt(TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0]) in prompt and "<tool_call>" in prompt
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert messages[3]["content"] == ("<tool_response>\nsunny\n</tool_response>\n"
                                      "<tool_response>\nnoon\n</tool_response>")
    # An existing system prompt keeps its text and gets the tools after it.
    render_with_tools(engine, [{"role": "system", "content": "Be brief."}, *TURNS[:1]], TOOLS,
                      True, renders_tools=False)
    assert engine.calls[-1][0][0]["content"].startswith("Be brief.\n\n# Tools")


def test_render_when_the_template_refuses_a_system_turn() -> None:
    engine = FakeEngine(renders_tools=False, refuse_system=True)
    render_with_tools(engine, TURNS[:1], TOOLS, True, renders_tools=False)
    messages, _ = engine.calls[-1]
    assert messages[0]["role"] == "user" and messages[0]["content"].endswith("\n\nweather?")
    assert messages[0]["content"].startswith("# Tools")


def test_render_for_a_template_with_tools() -> None:
    engine = FakeEngine(renders_tools=True)
    render_with_tools(engine, TURNS, TOOLS, True, renders_tools=True)
    messages, tools = engine.calls[-1]
    assert tools == TOOLS and messages[2] == TURNS[2]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


# ---- response shapes --------------------------------------------------------------------------

def build(tool_choice: Any, parallel: bool | None, pieces: list[str], finish: str = "stop"
          ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    mode, _ = plan_tool_calls(TOOLS, tool_choice, parallel, ToolSettings())
    builder = ResponseBuilder(CallSpec("chat", "m", tool_mode=mode), 1)
    chunks = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = CompletionOutput(0, piece, [i], finish_reason=finish if last else None)
        for delta in builder.update(0, RequestOutput("r", None, [1, 2], [out], last)):
            chunks.append(delta)
    return chunks, builder.final_body()


def test_response_streamed_and_whole_auto() -> None:
    text = f"Hm. <tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    chunks, body = build(None, None, [text[i:i + 5] for i in range(0, len(text), 5)])
    assert [c["finish_reason"] for c in chunks].count("tool_calls") == 1
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert "".join(c["delta"].get("content", "") for c in chunks) == "Hm."
    calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert [(t["index"], t["type"], t["function"]["name"]) for t in calls] == [
        (0, "function", "get_weather"), (1, "function", "get_time")]
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "Hm."
    assert [c["id"] for c in message["tool_calls"]] == [t["id"] for t in calls]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris", "unit": "celsius"}


def test_response_without_calls_and_cut_short() -> None:
    _, body = build(None, None, ["Just ", "words."])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Just words."}
    assert body["choices"][0]["finish_reason"] == "stop"
    _, body = build(None, None, [f"<tool_call>{TIME}</tool_call>", " and"], finish="length")
    assert body["choices"][0]["finish_reason"] == "length"


def test_response_parallel_false_keeps_the_first_call() -> None:
    text = f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>"
    chunks, body = build(None, False, [text])
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == [
        "get_weather"]
    assert body["choices"][0]["message"]["content"] is None
    assert all(t["index"] == 0 for c in chunks for t in c["delta"].get("tool_calls", []))


def test_response_named_and_required() -> None:
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    chunks, body = build(named.tool_choice, None, ['{"zone"', ': "CET"}'])
    assert body["choices"][0]["finish_reason"] == "stop"
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}
    first, second = (c["delta"]["tool_calls"][0] for c in chunks)
    assert first["id"] == call["id"] and first["function"]["name"] == "get_time"
    assert second == {"index": 0, "function": {"arguments": ': "CET"}'}}
    chunks, body = build("required", None, [REQUIRED[:50], REQUIRED[50:]])
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert len(body["choices"][0]["message"]["tool_calls"]) == 3


# ---- flags ------------------------------------------------------------------------------------

def test_flags() -> None:
    from server.cli import build_parser
    from server.config import server_config

    default = server_config(build_parser().parse_args(["serve"]))
    assert default.enable_auto_tool_choice and default.tool_call_parser == "hermes"
    vllm_style = server_config(build_parser().parse_args(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
    assert vllm_style.enable_auto_tool_choice and vllm_style.tool_call_parser == "hermes"
    off = server_config(build_parser().parse_args(["serve", "--no-enable-auto-tool-choice"]))
    assert not off.enable_auto_tool_choice
    off.validate()
    unknown = server_config(build_parser().parse_args(["serve", "--tool-call-parser", "nope"]))
    with pytest.raises(ValueError, match="hermes"):
        unknown.validate()


# A template that renders tools itself, in the way of Qwen2.5's (written for this test).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %}\n{{ tool | tojson }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% for call in message.tool_calls %}\n<tool_call>{{ {'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>tool[{{ message.tool_call_id }}]\n"
    "{{ message.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_render_through_a_hugging_face_template_with_tools() -> None:
    from engine.input_processor import InputProcessor
    from server.tool_parsers.prompt import template_renders_tools
    from tests.support.tiny_models import CHATML_TEMPLATE, train_tokenizer

    tokenizer = train_tokenizer()
    processor = InputProcessor(tokenizer, len(tokenizer), 4096, 16, 1024, frozenset())
    tokenizer.chat_template = CHATML_TEMPLATE
    assert not template_renders_tools(processor)
    tokenizer.chat_template = TOOLS_TEMPLATE
    assert template_renders_tools(processor)
    prompt = render_with_tools(processor, TURNS, TOOLS, True, renders_tools=True)["prompt"]
    assert prompt.startswith("<|im_start|>system\nTools:") and json.dumps(TOOLS[0]) in prompt
    # The earlier call's arguments reach the template as an object, not as escaped JSON text.
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<|im_start|>tool[call_2]\nnoon<|im_end|>" in prompt
    assert "# Tools" not in prompt  # nothing injected: the template shows the tools itself
