"""Showing a model its tools: the chat messages and tool list handed to the chat template.

A template that renders tools itself (Qwen2.5, Hermes 2 Pro, Llama 3.1 and others take a
`tools` variable) gets them as Hugging Face expects: the tool list, assistant messages with
`tool_calls` whose arguments are objects, and `tool` messages. A template that does not (plain
ChatML, the tiny test models, the embedded SmolLM2) would drop them silently; for it the tools
are written into a system prompt in the Hermes format, as Qwen2.5's template does, earlier
calls become `<tool_call>` text and tool results `<tool_response>` text in a user turn, so the
model sees the whole exchange and answers in the format the Hermes parser reads.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from engine.errors import InvalidRequestError


class ChatRenderer(Protocol):
    """The part of the engine client this module uses (EngineClient.render_chat)."""

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    *, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]: ...


# A tool with this name is rendered once per server to learn whether the template shows tools.
PROBE_TOOL = {"type": "function", "function": {
    "name": "kvserve_template_probe", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_renders_tools(engine: ChatRenderer) -> bool:
    """Whether the model's chat template writes the `tools` it is given into the prompt."""
    probe = [{"role": "user", "content": "hi"}]
    try:
        prompt = engine.render_chat(probe, True, tools=[PROBE_TOOL])
    except InvalidRequestError:
        return False
    return "kvserve_template_probe" in str(prompt.get("prompt", ""))


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The Hermes tools block: every tool's definition, one JSON object a line."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_PROMPT.format(tools=lines)


def render_with_tools(engine: ChatRenderer, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                      renders_tools: bool) -> dict[str, Any]:
    """The prompt of a conversation that has tools or tool turns (see the module's doc)."""
    if renders_tools:
        return engine.render_chat(_for_template(messages), add_generation_prompt,
                                  tools=tools or None)
    plain = _as_text(messages)
    if not tools:
        return engine.render_chat(plain, add_generation_prompt)
    block = tools_system_prompt(tools)
    if plain and plain[0]["role"] in ("system", "developer"):
        first = plain[0]
        system = {"role": first["role"], "content": f"{first['content']}\n\n{block}"}
        with_system = [system, *plain[1:]]
    else:
        with_system = [{"role": "system", "content": block}, *plain]
    try:
        return engine.render_chat(with_system, add_generation_prompt)
    except InvalidRequestError:
        # Some templates (Mistral's) refuse a system turn: put the tools in the first user turn.
        if with_system[0]["role"] != "system" or plain[0]["role"] == "system":
            raise
        first_user = next((i for i, m in enumerate(plain) if m["role"] == "user"), None)
        if first_user is None:
            raise
        merged = list(plain)
        merged[first_user] = {"role": "user",
                              "content": f"{block}\n\n{plain[first_user]['content']}"}
        return engine.render_chat(merged, add_generation_prompt)


def _for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as Hugging Face templates expect them: tool-call arguments as objects."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**call, "function": {**call["function"],
                                      "arguments": _arguments_object(call["function"])}}
                for call in calls]}
        out.append(message)
    return out


def _arguments_object(function: dict[str, Any]) -> Any:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}


def _as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with tool calls and results written out in the Hermes format, for templates
    that only know role and content. Consecutive tool results share one user turn."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{response}"}
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = [_call_text(call["function"]) for call in message["tool_calls"]]
            content = "\n".join([content, *calls] if content else calls)
        out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _call_text(function: dict[str, Any]) -> str:
    call = {"name": function.get("name"), "arguments": _arguments_object(function)}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
