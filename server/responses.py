"""OpenAI response shapes built from engine deltas: streamed chunks (shared by SSE and the
WebSocket) and whole responses, for completions and chat completions. A chat call with tools
reads each choice's text through its tool-call parser (server/tool_parsers): content and
`tool_calls` deltas when streamed, `message.tool_calls` when whole.

One `ResponseBuilder` serves one API call: its prompts x n choices, each choice's text,
logprobs and finish reason accumulated from the deltas it is fed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import CompletionOutput, Logprob, RequestOutput
from server.tool_parsers.base import StreamDelta, ToolParser
from server.tool_parsers.mode import ToolCallMode


@dataclass
class CallSpec:
    """What one API call asked for, beyond sampling."""

    kind: str  # "completion" or "chat"
    model: str
    n: int = 1
    echo_texts: list[str] | None = None  # per prompt, when echo is on
    top_logprobs: int | None = None  # None: no logprobs
    include_usage: bool = False
    continuous_usage: bool = False
    response_id: str = ""
    tool_mode: ToolCallMode | None = None  # chat with tools: how calls are read
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.response_id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            self.response_id = f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ChoiceState:
    """One choice's accumulated output."""

    index: int
    texts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    text_offset: int = 0
    started: bool = False
    done: bool = False
    # With a tool mode: the choice's parser and its calls so far ({"id", "type", "function"}).
    tool_parser: ToolParser | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ResponseBuilder:
    """Turns (prompt index, RequestOutput delta) pairs into OpenAI chunks and a final body."""

    def __init__(self, spec: CallSpec, num_prompts: int) -> None:
        self.spec = spec
        self.choices = [ChoiceState(i) for i in range(num_prompts * spec.n)]
        if spec.tool_mode is not None:
            for choice in self.choices:
                choice.tool_parser = spec.tool_mode.new_parser()
        self.prompt_tokens = [0] * num_prompts

    # ---- accumulation ---------------------------------------------------------------------

    def update(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """Applies one step's output; returns the chunk choices it produced."""
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        deltas = []
        choices, first, update_choice = self.choices, prompt_index * self.spec.n, \
            self._update_choice
        for completion in output.outputs:
            delta = update_choice(choices[first + completion.index], completion, prompt_index)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _update_choice(self, state: ChoiceState, out: CompletionOutput,
                       prompt_index: int) -> dict[str, Any] | None:
        if state.done:
            return None
        text = out.text  # this step's delta (the engine streams deltas only)
        spec = self.spec
        if state.started and state.tool_parser is None and spec.top_logprobs is None:
            # Most deltas (every streamed token): no echo, logprobs or tool parsing to do.
            finish = out.finish_reason
            state.num_tokens += len(out.token_ids)
            state.finish_reason, state.stop_reason = finish, out.stop_reason
            state.done = finish is not None
            state.texts.append(text)
            if not text and not out.token_ids and finish is None:
                return None
            return self._choice_delta(state, text, None)
        first = not state.started
        if first:
            if spec.echo_texts is not None:
                text = spec.echo_texts[prompt_index] + text
            state.started = True
        state.num_tokens += len(out.token_ids)
        new_logprobs = None if spec.top_logprobs is None else self._logprobs(state, out)
        state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
        state.done = out.finish_reason is not None
        if state.tool_parser is not None and spec.tool_mode is not None:
            return self._tool_choice_delta(state, state.tool_parser, spec.tool_mode, text,
                                           new_logprobs)
        state.texts.append(text)
        if not text and not out.token_ids and not state.done and not first:
            return None
        return self._choice_delta(state, text, new_logprobs)

    def _tool_choice_delta(self, state: ChoiceState, parser: ToolParser, mode: ToolCallMode,
                           text: str, logprobs: list[dict[str, Any]] | None
                           ) -> dict[str, Any] | None:
        """A chat delta of a choice read for tool calls: content and tool-call pieces, in
        OpenAI's streamed shape; None while the parser holds everything back. A choice that
        called tools under auto or required finishes with "tool_calls" (unless cut short by
        length, which stays "length")."""
        parsed = parser.extract_tool_calls_streaming(text)
        if state.done:
            parsed.extend(parser.finish_streaming())
        pieces = self._keep_calls(state, parsed, mode.parallel)
        state.texts.append(parsed.content)
        if state.done and state.tool_calls and mode.tool_calls_finish and \
                state.finish_reason == "stop":
            state.finish_reason = "tool_calls"
        if not parsed.content and not pieces and not logprobs and not state.done:
            return None
        delta: dict[str, Any] = {}
        if parsed.content:
            delta["content"] = parsed.content
        if pieces:
            delta["tool_calls"] = pieces
        return {"index": state.index, "delta": delta, "logprobs": _chat_logprobs(logprobs),
                "finish_reason": state.finish_reason if state.done else None}

    @staticmethod
    def _keep_calls(state: ChoiceState, parsed: StreamDelta, parallel: bool
                    ) -> list[dict[str, Any]]:
        """Records the tool-call pieces (only the first call without parallel_tool_calls);
        returns them in OpenAI's shape."""
        pieces = []
        for piece in parsed.tool_calls:
            if piece.index > 0 and not parallel:
                continue
            if piece.name is not None:
                state.tool_calls.append({"id": piece.id, "type": "function", "function": {
                    "name": piece.name, "arguments": piece.arguments}})
            else:
                state.tool_calls[piece.index]["function"]["arguments"] += piece.arguments
            pieces.append(piece.to_openai())
        return pieces

    def _logprobs(self, state: ChoiceState,
                  out: CompletionOutput) -> list[dict[str, Any]] | None:
        if self.spec.top_logprobs is None or out.logprobs is None:
            return None
        entries = [self._logprob_entry(state, token_id, table)
                   for token_id, table in zip(out.token_ids, out.logprobs, strict=True)]
        state.logprobs.extend(entries)
        return entries

    def _logprob_entry(self, state: ChoiceState, token_id: int,
                       table: dict[int, Logprob]) -> dict[str, Any]:
        chosen = table[token_id]
        text = chosen.decoded_token or ""
        top = sorted((lp for lp in table.values() if lp.rank is not None),
                     key=lambda lp: lp.rank or 0)[: self.spec.top_logprobs]
        entry = {"token": text, "logprob": _finite(chosen.logprob), "offset": state.text_offset,
                 "top": [(lp.decoded_token or "", _finite(lp.logprob)) for lp in top]}
        state.text_offset += len(text)
        return entry

    # ---- shapes ---------------------------------------------------------------------------

    def _choice_delta(self, state: ChoiceState, text: str,
                      logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
        finish = state.finish_reason if state.done else None
        if self.spec.kind == "chat":
            return {"index": state.index, "delta": {"content": text},
                    "logprobs": None if logprobs is None else _chat_logprobs(logprobs),
                    "finish_reason": finish}
        return {"index": state.index, "text": text,
                "logprobs": None if logprobs is None else _completion_logprobs(logprobs),
                "finish_reason": finish, "stop_reason": state.stop_reason if finish else None}

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role and empty content for every choice."""
        return self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None} for c in self.choices])

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """One streamed chunk carrying these choice deltas."""
        spec = self.spec
        obj = "chat.completion.chunk" if spec.kind == "chat" else "text_completion"
        chunk = {"id": spec.response_id, "object": obj, "created": spec.created,
                 "model": spec.model, "choices": choices}
        if spec.include_usage:
            chunk["usage"] = self.usage() if spec.continuous_usage else None
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        """The final chunk of an include_usage stream: no choices, the totals."""
        chunk = self.chunk([])
        chunk["usage"] = self.usage()
        return chunk

    def usage(self) -> dict[str, int]:
        """Token counts: each prompt once, every choice's output."""
        prompt = sum(self.prompt_tokens)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    @property
    def finish_reasons(self) -> list[str | None]:
        """Each choice's finish reason (None while running)."""
        return [c.finish_reason for c in self.choices]

    def final_body(self) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        if self.spec.kind == "chat":
            choices = [{"index": c.index, "message": _chat_message(c),
                        "logprobs": _chat_logprobs(c.logprobs if self._wants_logprobs else None),
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                       for c in self.choices]
            obj = "chat.completion"
        else:
            choices = [{"index": c.index, "text": "".join(c.texts),
                        "logprobs": _completion_logprobs(
                            c.logprobs if self._wants_logprobs else None),
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                       for c in self.choices]
            obj = "text_completion"
        return {"id": self.spec.response_id, "object": obj, "created": self.spec.created,
                "model": self.spec.model, "choices": choices, "usage": self.usage()}

    @property
    def _wants_logprobs(self) -> bool:
        return self.spec.top_logprobs is not None


def _chat_message(choice: ChoiceState) -> dict[str, Any]:
    """A whole chat choice's message: content is null when the choice only called tools."""
    content = "".join(choice.texts)
    if not choice.tool_calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None, "tool_calls": choice.tool_calls}


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number, so clamp as vLLM does.
    return max(value, -9999.0)


def _chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [
        {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                          for t, lp in e["top"]]}
        for e in entries]}


def _completion_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_top_with_chosen(e) for e in entries],
            "text_offset": [e["offset"] for e in entries]}


def _top_with_chosen(entry: dict[str, Any]) -> dict[str, float]:
    # OpenAI: "always returns the logprob of the sampled token, so there may be up to
    # logprobs+1 elements". Distinct ids can decode to the same text (byte tokens all read
    # "\ufffd"); the dict keeps the best-ranked one.
    top: dict[str, float] = {}
    for text, logprob in entry["top"]:
        top.setdefault(text, logprob)
    top.setdefault(entry["token"], entry["logprob"])
    return top
