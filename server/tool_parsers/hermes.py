"""The Hermes tool-call format (Hermes 2 Pro, Qwen2.5, SmolLM3 and the prompt kvserve injects
for templates without tools): each call is a JSON object `{"name": ..., "arguments": {...}}`
between `<tool_call>` and `</tool_call>`; text outside the tags is content.

A call is emitted whole once its closing tag arrives (or the generation ends right after its
JSON), so a call that does not parse is never half-sent: its text, tags included, stays content.
"""

from __future__ import annotations

import json

from server.tool_parsers.base import (
    HeldWhitespace,
    StreamDelta,
    ToolCallDelta,
    ToolParser,
    make_tool_call_id,
    register_tool_parser,
)

START = "<tool_call>"
END = "</tool_call>"


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call's JSON body, or None when it is not a call.

    `arguments` may be an object or its JSON text; `parameters` is accepted for it, as some
    models write; missing arguments mean `{}`."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return name, args
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of TEXT that is a proper beginning of TAG."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""

    def __init__(self) -> None:
        self._buffer = ""  # text not yet told: a partial tag, or an open call's body
        self._in_call = False
        self._searched = 0  # how much of an open call's body was searched for END already
        self._num_calls = 0
        self._space = HeldWhitespace()  # whitespace before a call is dropped, not content

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        """Content up to any possible tag; each call once its closing tag has arrived."""
        out = StreamDelta()
        self._buffer += delta_text
        while True:
            if not self._in_call:
                at = self._buffer.find(START)
                if at < 0:
                    keep = _partial_tag_length(self._buffer, START)
                    out.content += self._space.push(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out.content += self._space.push(self._buffer[:at])
                self._buffer = self._buffer[at + len(START):]
                self._in_call, self._searched = True, 0
            else:
                at = self._buffer.find(END, max(0, self._searched - len(END) + 1))
                if at < 0:
                    self._searched = len(self._buffer)
                    return out
                body = self._buffer[:at]
                self._buffer = self._buffer[at + len(END):]
                self._in_call = False
                self._close_call(body, START + body + END, out)

    def finish_streaming(self) -> StreamDelta:
        """An unclosed call counts when its JSON is whole; anything else left is content."""
        out = StreamDelta()
        if self._in_call:
            self._close_call(self._buffer, START + self._buffer, out)
        else:
            out.content += self._space.push(self._buffer)
        self._buffer, self._in_call = "", False
        if not self._num_calls:
            out.content += self._space.take()
        return out

    def _close_call(self, body: str, raw: str, out: StreamDelta) -> None:
        call = parse_call(body)
        if call is None:  # not a call after all: the text is content, tags and all
            out.content += self._space.push(raw)
            return
        self._space.take()  # the whitespace before a call is layout, not content
        name, arguments = call
        out.tool_calls.append(ToolCallDelta(self._num_calls, arguments, make_tool_call_id(),
                                            name))
        self._num_calls += 1
