"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask of the engine and
of the response, decided as vLLM does:

- no tools, or `tool_choice` "none": no parsing, the output is content;
- "auto" (the default when tools are given): the server's `--tool-call-parser` reads calls out
  of the output; refused with 400 under `--no-enable-auto-tool-choice`, as vLLM refuses it
  without `--enable-auto-tool-choice`;
- "required" and a named function: the output is constrained to a JSON schema (structured
  outputs), so the call always parses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output.constraints import validate as validate_constraint
from server.tool_parsers.base import ToolParser, get_tool_parser
from server.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    named_schema,
    required_schema,
)


@dataclass(frozen=True)
class ToolCallMode:
    """How the response reads a chat call's output for tool calls."""

    new_parser: Callable[[], ToolParser]  # one fresh parser per choice
    # Whether a choice that produced calls ends with finish_reason "tool_calls" (auto and
    # required); a named tool_choice keeps "stop", as OpenAI answers it.
    tool_calls_finish: bool = True
    parallel: bool = True  # false: only a choice's first call is kept


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool-call flags."""

    enable_auto_tool_choice: bool = True
    tool_call_parser: str | None = "hermes"


def plan_tool_calls(tools: list[dict[str, Any]] | None, tool_choice: Any,
                    parallel_tool_calls: bool | None, settings: ToolSettings
                    ) -> tuple[ToolCallMode | None, StructuredOutputsParams | None]:
    """The response's tool-call mode and the output constraint for a validated request
    (`tool_choice` as decoded: None, a string, or a struct with `.function.name`)."""
    if not tools:
        return None, None
    choice = "auto" if tool_choice is None else tool_choice
    parallel = parallel_tool_calls is not False
    if choice == "none":
        return None, None
    if choice == "auto":
        if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
            raise InvalidRequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set; send tool_choice "none", "required" or a named function instead',
                "tool_choice")
        parser = get_tool_parser(settings.tool_call_parser)
        return ToolCallMode(parser, True, parallel), None
    functions = [tool["function"] for tool in tools]
    if choice == "required":
        mode = ToolCallMode(RequiredToolParser, True, parallel)
        constraint = StructuredOutputsParams(json=required_schema(functions, parallel))
    else:
        name = tool_choice.function.name
        function = next(f for f in functions if f["name"] == name)
        mode = ToolCallMode(partial(NamedToolParser, name), False, False)
        constraint = StructuredOutputsParams(json=named_schema(function))
    # A function's parameters schema that cannot be compiled is the tools' fault: name them.
    validate_constraint(constraint, "tools")
    return mode, constraint
