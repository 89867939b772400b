"""Tool-call parsing without a server: the Hermes parser on whole texts and on every way of
splitting a stream, the parsers of forced calls (tool_choice required and named), the parser
registry, the request checks, the chat rendering of tools, and the response shapes."""

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
from server.tool_parsers import (
    HermesToolParser,
    NamedToolParser,
    RequiredToolParser,
    StreamDelta,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)
from server.tool_parsers.forced import named_schema, required_schema
from server.tool_parsers.mode import ToolSettings, plan_tool_calls
from server.tool_parsers.prompt import render_with_tools, tools_system_prompt

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"zone": "CET"}}'
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]


def stream(parser: ToolParser, pieces: list[str]) -> tuple[list[StreamDelta], StreamDelta]:
    """Every delta the parser returned, and all of them joined (finish included)."""
    deltas = [parser.extract_tool_calls_streaming(piece) for piece in pieces]
    deltas.append(parser.finish_streaming())
    total = StreamDelta()
    for delta in deltas:
        total.extend(delta)
    return deltas, total


def calls_of(delta: StreamDelta) -> list[tuple[str, dict[str, Any]]]:
    """(name, parsed arguments) of each call in a joined stream."""
    names: list[str] = []
    args: list[str] = []
    for piece in delta.tool_calls:
        if piece.name is not None:
            assert piece.index == len(names) and piece.id and piece.id.startswith("call_")
            names.append(piece.name)
            args.append(piece.arguments)
        else:
            args[piece.index] += piece.arguments
    return [(name, json.loads(arg)) for name, arg in zip(names, args, strict=True)]


# ---- Hermes: whole texts --------------------------------------------------------------------

def test_hermes_content_then_calls() -> None:
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call>"
    result = HermesToolParser().extract_tool_calls(text)
    assert result.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in result.tool_calls}) == 2


def test_hermes_only_calls_have_no_content() -> None:
    result = HermesToolParser().extract_tool_calls(f"<tool_call>\n{WEATHER}\n</tool_call>\n")
    assert result.content is None and [c.name for c in result.tool_calls] == ["get_weather"]


def test_hermes_plain_text_is_kept_exactly() -> None:
    for text in ("Hello there!\n\n", "a < b and <tool", "  x  ", "<tool_cal", ""):
        result = HermesToolParser().extract_tool_calls(text)
        assert result.content == (text or None) and result.tool_calls == []


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"a": 1}',  # cut short
    '{"arguments": {"a": 1}}',  # no name
    '{"name": "", "arguments": {}}',
    '{"name": "f", "arguments": [1, 2]}',
    '{"name": "f", "arguments": "not json"}',
    '["f"]',
    "get_weather(city='Paris')",
])
def test_hermes_malformed_call_stays_content(body: str) -> None:
    text = f"Sure. <tool_call>{body}</tool_call> done"
    result = HermesToolParser().extract_tool_calls(text)
    assert result.tool_calls == [] and result.content == text


def test_hermes_malformed_call_beside_a_good_one() -> None:
    text = f"<tool_call>{{oops</tool_call>\n<tool_call>{TIME}</tool_call>"
    result = HermesToolParser().extract_tool_calls(text)
    assert result.content == "<tool_call>{oops</tool_call>"
    assert [c.name for c in result.tool_calls] == ["get_time"]


def test_hermes_unclosed_last_call() -> None:
    # A model may stop right after the JSON: whole JSON is a call, cut JSON stays content.
    result = HermesToolParser().extract_tool_calls(f"<tool_call>\n{WEATHER}\n")
    assert result.content is None and [c.name for c in result.tool_calls] == ["get_weather"]
    cut = f"<tool_call>\n{WEATHER[:30]}"
    assert HermesToolParser().extract_tool_calls(cut).content == cut


def test_hermes_argument_forms() -> None:
    result = HermesToolParser().extract_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
        '<tool_call>{"name": "g", "parameters": {"b": "é"}}</tool_call>'
        '<tool_call>{"name": "h"}</tool_call>')
    assert [(c.name, c.arguments) for c in result.tool_calls] == [
        ("f", '{"a": 1}'), ("g", '{"b": "é"}'), ("h", "{}")]


# ---- Hermes: streams --------------------------------------------------------------------------

STREAM_TEXTS = [
    f"Checking.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call>",
    f"<tool_call>{TIME}</tool_call> and then some text < 3",
    f"a <tool_call>{{bad json</tool_call> b <tool_call>{TIME}</tool_call>",
    "no calls at all, just <tool_ words and </tool_call> stray tags",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_hermes_every_split_point_matches_the_whole_text(text: str) -> None:
    whole = HermesToolParser().extract_tool_calls(text)
    expected = [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
    for at in range(len(text) + 1):
        deltas, total = stream(HermesToolParser(), [text[:at], text[at:]])
        assert (total.content or None) == whole.content, at
        assert calls_of(total) == expected, at
        for delta in deltas:  # a tag never leaks into content, even split
            if whole.tool_calls:
                assert "<tool_call>" not in delta.content.replace("<tool_call>{bad", "")


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_hermes_one_character_at_a_time_and_in_three_pieces(text: str) -> None:
    whole = HermesToolParser().extract_tool_calls(text)
    expected = [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
    _, total = stream(HermesToolParser(), list(text))
    assert (total.content or None) == whole.content and calls_of(total) == expected
    step = 7
    for i in range(0, len(text), step):
        for j in range(i, len(text), step):
            _, total = stream(HermesToolParser(), [text[:i], text[i:j], text[j:]])
            assert (total.content or None) == whole.content and calls_of(total) == expected


def test_hermes_holds_a_split_tag_back() -> None:
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("Hi <tool").content == "Hi"
    assert parser.extract_tool_calls_streaming("_ca").content == ""
    delta = parser.extract_tool_calls_streaming(f"ll>{TIME}</tool_")
    assert delta.content == "" and delta.tool_calls == []
    delta = parser.extract_tool_calls_streaming("call>")
    assert [p.name for p in delta.tool_calls] == ["get_time"]
    assert parser.finish_streaming().content == ""


# ---- forced calls ----------------------------------------------------------------------------

REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Par\\"is}", "n": [1, {"x": 2}]}},'
            ' {"parameters": {"zone": "CET"}, "name": "get_time"}, {"name": "get_time"}]')


def test_required_whole_and_streamed() -> None:
    expected = [("get_weather", {"city": 'Par"is}', "n": [1, {"x": 2}]}),
                ("get_time", {"zone": "CET"}), ("get_time", {})]
    whole = RequiredToolParser().extract_tool_calls(REQUIRED)
    assert whole.content is None
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == expected
    for pieces in (list(REQUIRED), [REQUIRED[:40], REQUIRED[40:90], REQUIRED[90:]]):
        deltas, total = stream(RequiredToolParser(), pieces)
        assert calls_of(total) == expected and total.content == ""
    # The arguments stream as they are generated, once the name is known.
    deltas, _ = stream(RequiredToolParser(), list(REQUIRED))
    pieces_of_first = [p for d in deltas for p in d.tool_calls if p.index == 0]
    assert pieces_of_first[0].name == "get_weather" and len(pieces_of_first) > 10


def test_required_output_that_is_not_calls_is_content() -> None:
    for text in ("I will not", '[{"name": "f"'):
        result = RequiredToolParser().extract_tool_calls(text)
        assert result.tool_calls == [] and result.content == text


def test_named_parser() -> None:
    text = '  {"city": "Paris"}\n'
    result = NamedToolParser("get_weather").extract_tool_calls(text)
    assert result.content is None
    assert [(c.name, c.arguments) for c in result.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    _, total = stream(NamedToolParser("get_weather"), list(text))
    assert calls_of(total) == [("get_weather", {"city": "Paris"})]
    assert NamedToolParser("f").extract_tool_calls("").tool_calls[0].arguments == "{}"


def test_schemas() -> None:
    functions = [t["function"] for t in TOOLS]
    schema = required_schema(functions, parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    assert required_schema(functions[:1], parallel=False)["maxItems"] == 1
    assert named_schema(functions[0]) == functions[0]["parameters"]


# ---- registry ---------------------------------------------------------------------------------

def test_registry() -> None:
    assert get_tool_parser("hermes") is HermesToolParser and "hermes" in tool_parser_names()
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")

    @register_tool_parser("test_upper")
    class Upper(HermesToolParser):
        pass

    assert get_tool_parser("test_upper") is Upper
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("test_upper")(HermesToolParser)


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
