"""Tool calls on chat completions: parsers that separate calls from content in generated text
(registered by name for `--tool-call-parser`), the parsers of forced calls, and the chat
rendering that shows a model its tools."""

from server.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)
from server.tool_parsers.forced import NamedToolParser, RequiredToolParser
from server.tool_parsers.hermes import HermesToolParser

__all__ = [
    "ExtractedToolCalls",
    "HermesToolParser",
    "NamedToolParser",
    "RequiredToolParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "register_tool_parser",
    "tool_parser_names",
]
