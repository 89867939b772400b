"""Tool-call parsing without a server: the Hermes parser on whole texts and on every way of
splitting a stream, the parsers of forced calls (tool_choice required and named) and the parser
registry. The request checks, rendering and response shapes are in test_tool_requests.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

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
from tests.support.tool_calls import REQUIRED, TIME, TOOLS, WEATHER


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
