"""The tool-call fields of a chat request (README, "Tool calls"): tools, tool_choice and the
tool calls of earlier assistant messages, and OpenAI's checks on them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from server.protocol import ChatCompletionRequest

# OpenAI caps a request at 128 tools.
MAX_TOOLS = 128
MAX_TOOL_NAME_LENGTH = 256  # OpenAI allows 64; longer names only waste the prompt
MAX_TOOL_CALL_ID_LENGTH = 1024
ToolName = Annotated[str, Meta(min_length=1, max_length=MAX_TOOL_NAME_LENGTH)]


class FunctionCall(msgspec.Struct, kw_only=True):
    """The function of an earlier assistant tool call: arguments as JSON text (OpenAI) or an
    object (some clients)."""

    name: ToolName
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(msgspec.Struct, kw_only=True):
    """One tool call of an earlier assistant message."""

    id: Annotated[str, Meta(max_length=MAX_TOOL_CALL_ID_LENGTH)] | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A function the model may call: `parameters` is its arguments' JSON schema."""

    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    """The function a named tool_choice forces."""

    name: ToolName


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """tool_choice `{"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Tools as the chat template takes them (unset fields left out); None for none."""
    return [msgspec.to_builtins(tool) for tool in tools] if tools else None


def chat_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools as plain dicts (None when it has none), after OpenAI's checks: a
    tool_choice other than "none" needs tools, a named one must be among them, and names are
    unique."""
    tools = tool_dicts(req.tools)
    choice = req.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise InvalidRequestError("tool_choice is only allowed when tools are specified; "
                                  "send tools or drop tool_choice", "tool_choice")
    names = [tool["function"]["name"] for tool in tools or []]
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise InvalidRequestError(f"tools holds two functions named {duplicate!r}; function "
                                  "names must be unique", "tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequestError(f"tool_choice names the function {choice.function.name!r}, "
                                  f"which is not in tools ({', '.join(names)})", "tool_choice")
    return tools
