"""The tool-call parser interface and its registry by name (`--tool-call-parser NAME`).

A parser reads a chat completion's generated text and separates the tool calls from the
content, either from the whole text or incrementally from streamed deltas. One parser instance
follows one choice of one response: its streaming state is per choice.

Streaming and whole-text extraction agree by construction: `extract_tool_calls` feeds the whole
text through the streaming path and joins what it produced, so a response reads the same
whether it was streamed or not, whatever the chunk boundaries.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar


def make_tool_call_id() -> str:
    """A fresh tool-call id in OpenAI's form (`call_` + 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One whole function call: its name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The call as an entry of OpenAI's `message.tool_calls`."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A piece of a streamed tool call. The first piece of call `index` carries its id and
    name (and may carry the start of its arguments); later pieces append to the arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The piece in OpenAI's streamed `delta.tool_calls` shape."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamDelta:
    """What one streamed text delta turned into: content to show and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: StreamDelta) -> None:
        """Appends another delta's content and tool-call pieces to this one."""
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


@dataclass
class ExtractedToolCalls:
    """A whole text split into content (None when there is none) and tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


def join_deltas(delta: StreamDelta) -> ExtractedToolCalls:
    """Assembles streamed pieces into whole calls; empty content becomes None."""
    calls: list[ToolCall] = []
    for piece in delta.tool_calls:
        if piece.name is not None:
            calls.append(ToolCall(piece.name, piece.arguments, piece.id or make_tool_call_id()))
        else:
            calls[piece.index].arguments += piece.arguments
    return ExtractedToolCalls(delta.content or None, calls)


class ToolParser(ABC):
    """Separates tool calls from content in one choice's generated text."""

    @abstractmethod
    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        """Consumes the next piece of generated text; returns what can be told already.

        Text that may still turn out to belong to a tool call (a tag split across deltas, a
        call whose end has not arrived) is held back until it is known."""

    @abstractmethod
    def finish_streaming(self) -> StreamDelta:
        """The generation ended: returns whatever was held back, resolved."""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """Content and tool calls of a whole generated text (a fresh parser per text)."""
        delta = self.extract_tool_calls_streaming(text)
        delta.extend(self.finish_streaming())
        return join_deltas(delta)


ParserT = TypeVar("ParserT", bound=type[ToolParser])
_REGISTRY: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[ParserT], ParserT]:
    """Class decorator: makes a parser available as `--tool-call-parser NAME`."""

    def register(cls: ParserT) -> ParserT:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"a tool-call parser named {name!r} is already registered")
        _REGISTRY[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under NAME; ValueError listing the names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; available: "
                         f"{', '.join(tool_parser_names())}") from None


def tool_parser_names() -> list[str]:
    """The registered parser names, sorted."""
    return sorted(_REGISTRY)


class HeldWhitespace:
    """Holds the trailing whitespace of streamed text until it is known whether more text
    follows it (then it is released) or a tool call does (then the caller drops it)."""

    def __init__(self) -> None:
        self.pending = ""

    def push(self, text: str) -> str:
        """The part of the pending whitespace plus TEXT that can be released now."""
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body):]
        return body

    def take(self) -> str:
        """Releases and clears whatever is pending."""
        text, self.pending = self.pending, ""
        return text
