"""Tool calls the request forces (`tool_choice` "required" or a named function), which the
engine generates under a JSON schema (structured outputs), as vLLM does:

- a named function: the output is the function's arguments object itself;
- "required": the output is a JSON array of `{"name": ..., "parameters": {...}}`, one item per
  call (at most one when `parallel_tool_calls` is false).

Both parsers stream the arguments as they are generated; the output parses by construction, so
nothing has to be held back for validation.
"""

from __future__ import annotations

import json
from typing import Any

from server.tool_parsers.base import (
    HeldWhitespace,
    StreamDelta,
    ToolCallDelta,
    ToolParser,
    make_tool_call_id,
)

# The schema a function without `parameters` takes: any object (OpenAI: "omitting parameters
# defines a function with an empty parameter list").
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one function's arguments."""
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else ANY_OBJECT


def named_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The output schema of a named tool_choice: the function's arguments object."""
    return parameters_schema(function)


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The output schema of tool_choice "required": an array of calls to these functions."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f["name"]]},
                             "parameters": parameters_schema(f)},
              "required": ["name", "parameters"]}
             for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedToolParser(ToolParser):
    """The whole output is the arguments of one call to a known function."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False
        self._space = HeldWhitespace()

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        """Arguments text as it comes; the first piece names the function."""
        text = self._space.push(delta_text if self._started else delta_text.lstrip())
        return StreamDelta(tool_calls=self._pieces(text)) if text else StreamDelta()

    def finish_streaming(self) -> StreamDelta:
        """A call with no arguments at all still is a call, with `{}`."""
        self._space.take()
        return StreamDelta() if self._started else StreamDelta(tool_calls=self._pieces("{}"))

    def _pieces(self, text: str) -> list[ToolCallDelta]:
        if self._started:
            return [ToolCallDelta(0, text)]
        self._started = True
        return [ToolCallDelta(0, text, make_tool_call_id(), self.name)]


class RequiredToolParser(ToolParser):
    """A JSON array of `{"name": ..., "parameters": {...}}`, scanned one character at a time.

    Each call is announced once its name has been read; its `parameters` value is streamed as
    the arguments (held until the name is known if it comes first). Output that is not such an
    array (a request cut short before any call) is returned as content at the end.
    """

    def __init__(self) -> None:
        self._raw: list[str] = []  # everything seen, for the no-call fallback
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._num_calls = 0
        self._new_item()

    def _new_item(self) -> None:
        self._expect_key = True
        self._token: list[str] = []  # the key or top-level value being read in the item
        self._key: str | None = None
        self._name: str | None = None
        self._args: list[str] = []  # parameters text read but not yet sent
        self._args_seen = False
        self._in_args = False
        self._announced = False
        self._args_started = False
        self._space = HeldWhitespace()

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        """Call announcements and arguments pieces from this piece of the array."""
        out = StreamDelta()
        self._raw.append(delta_text)
        for char in delta_text:
            self._step(char, out)
        if self._in_args:
            self._send_args(out)
        return out

    def finish_streaming(self) -> StreamDelta:
        """With no call read, the output is content (so nothing generated is lost)."""
        if self._num_calls:
            return StreamDelta()
        return StreamDelta(content="".join(self._raw))

    def _step(self, char: str, out: StreamDelta) -> None:
        depth = self._depth
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
            self._collect(char, depth)
            return
        if char == '"':
            self._in_string = True
            self._collect(char, depth)
        elif char in "[{":
            self._depth += 1
            if depth == 1 and char == "{":
                self._new_item()
            elif depth >= 2:
                self._collect(char, depth)
        elif char in "]}":
            self._depth -= 1
            if depth >= 3:
                self._collect(char, depth)
            elif depth == 2:  # the item's closing brace
                self._end_value(out)
                self._end_item(out)
        elif depth == 2 and char == ":":
            self._key = _loads_str("".join(self._token))
            self._token, self._expect_key = [], False
            self._in_args = self._key == "parameters"
            self._args_seen = self._args_seen or self._in_args
        elif depth == 2 and char == ",":
            self._end_value(out)
            self._expect_key = True
        else:
            self._collect(char, depth)

    def _collect(self, char: str, depth: int) -> None:
        """Appends to the current key or value (inside an item only)."""
        if depth < 2:
            return
        if self._in_args:
            self._args.append(char)
        else:
            self._token.append(char)

    def _end_value(self, out: StreamDelta) -> None:
        if self._in_args:
            self._send_args(out)
            self._in_args = False
        elif self._key == "name" and not self._expect_key:
            self._name = _loads_str("".join(self._token).strip())
            self._announce(out)
        self._token, self._key = [], None

    def _announce(self, out: StreamDelta) -> None:
        if self._name is None or self._announced:
            return
        self._announced = True
        out.tool_calls.append(ToolCallDelta(self._num_calls, "", make_tool_call_id(),
                                            self._name))
        self._num_calls += 1
        self._send_args(out)

    def _send_args(self, out: StreamDelta) -> None:
        if not self._announced or not self._args:
            return
        text = "".join(self._args)
        self._args = []
        if not self._args_started:
            text = text.lstrip()  # the whitespace after the colon is no part of the value
        text = self._space.push(text)
        if text:
            self._args_started = True
            self._append(out, text)

    def _append(self, out: StreamDelta, text: str) -> None:
        index = self._num_calls - 1
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last.index == index:
            last.arguments += text
        else:
            out.tool_calls.append(ToolCallDelta(index, text))

    def _end_item(self, out: StreamDelta) -> None:
        if self._name is not None and not self._args_seen:
            self._append(out, "{}")  # no parameters in the item: an empty arguments object
        self._new_item()


def _loads_str(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
