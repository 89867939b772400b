"""One API call end to end, independent of transport: validate the body, queue one engine
request per prompt, and yield chunk payloads as the engine produces deltas.

SSE, the WebSocket and non-streamed responses all drive a `Call`; each call's requests are
aborted when its consumer stops early (client gone, cancel message, socket closed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

from engine.engine_client import EngineClient, RequestHandle
from engine.input_processor import PromptInput
from engine.outputs import RequestOutput
from server.errors import APIError
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    chat_messages,
    completion_prompts,
    sampling_params,
)
from server.protocol_tools import chat_tools
from server.responses import CallSpec, ResponseBuilder
from server.tool_parsers.mode import ToolSettings, plan_tool_calls
from server.tool_parsers.prompt import render_with_tools, template_renders_tools

logger = logging.getLogger("kvserve.server")


@dataclass
class ServedModel:
    """The names a model is served under and its limits."""

    names: list[str]
    root: str
    max_model_len: int
    # --enable-auto-tool-choice and --tool-call-parser.
    tools: ToolSettings = field(default_factory=ToolSettings)
    # Whether the chat template renders `tools` itself; probed on the first request with tools.
    renders_tools: bool | None = None

    @property
    def name(self) -> str:
        """The primary served name."""
        return self.names[0]

    def check(self, requested: str | None) -> None:
        """404 for a model this server does not serve; a missing model means the default."""
        if requested is not None and requested not in self.names:
            raise APIError(404, f"The model `{requested}` does not exist; this server serves "
                                f"{', '.join(self.names)}", param="model",
                           code="model_not_found")


class Call:
    """A validated API call: its streams (one per prompt) and its response builder."""

    def __init__(self, builder: ResponseBuilder, streams: list[RequestHandle],
                 stream: bool) -> None:
        self.builder = builder
        self.streams = streams
        self.stream = stream  # whether the client asked for a streamed response

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Chunk payloads in order, then the usage chunk when asked for. An engine-side error
        raises APIError; leaving early aborts what is still running."""
        try:
            if self.builder.spec.kind == "chat":
                yield self.builder.role_chunk()
            if len(self.streams) == 1:  # most calls: read the one stream with no relay
                builder = self.builder
                async for output in self.streams[0]:
                    _raise_if_failed(output)
                    if deltas := builder.update(0, output):
                        yield builder.chunk(deltas)
            else:
                async for prompt_index, output in self._outputs():
                    if (chunk := self._chunk(prompt_index, output)) is not None:
                        yield chunk
            if self.builder.spec.include_usage:
                yield self.builder.usage_chunk()
        finally:
            self.cancel()

    async def collect(self) -> dict[str, Any]:
        """Runs the call to the end and returns the whole response body."""
        async for _ in self.chunks():
            pass
        return self.builder.final_body()

    def log_client_gone(self, why: str) -> None:
        """One INFO line when the client cuts this call short (the metrics only count it)."""
        if all(reason is not None for reason in self.builder.finish_reasons):
            return  # it had already finished
        logger.info("%s: request %s aborted after %d completion tokens", why,
                    self.builder.spec.response_id, self.builder.usage()["completion_tokens"])

    def cancel(self) -> None:
        """Aborts every request of this call that is still running."""
        for stream in self.streams:
            stream.cancel()

    def _chunk(self, prompt_index: int, output: RequestOutput) -> dict[str, Any] | None:
        _raise_if_failed(output)
        deltas = self.builder.update(prompt_index, output)
        return self.builder.chunk(deltas) if deltas else None

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = \
            asyncio.Queue()
        tasks = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()


async def _pump(index: int, stream: RequestHandle,
                queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]]) -> None:
    try:
        async for output in stream:
            queue.put_nowait((index, output))
    except Exception as exc:  # surfaces in the consumer
        queue.put_nowait((index, exc))
    queue.put_nowait((index, None))


def _raise_if_failed(output: RequestOutput) -> None:
    for completion in output.outputs:  # a plain loop: run for every delta of every stream
        if completion.finish_reason == "error":
            raise APIError(500, "the model step for this request failed; see the server log",
                           code="internal_error")


def start_completion(engine: EngineClient, model: ServedModel, req: CompletionRequest) -> Call:
    """Validates a completions request and queues its prompts."""
    model.check(req.model)
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs (prompt logprobs) is not supported",
                       param="echo")
    prompts: list[PromptInput] = list(completion_prompts(req.prompt))
    params = sampling_params(req, req.max_tokens, req.logprobs, default_max_tokens=16,
                             defaults=engine.model_info.default_sampling_params)
    echo = [_prompt_text(engine, p) for p in prompts] if req.echo else None
    spec = CallSpec("completion", model.name, params.n, echo, req.logprobs,
                    req.include_usage, req.continuous_usage)
    return _start(engine, spec, prompts, params, req)


def start_chat(engine: EngineClient, model: ServedModel, req: ChatCompletionRequest) -> Call:
    """Validates a chat request, applies the chat template and queues it."""
    model.check(req.model)
    add_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
    tools = chat_tools(req)
    mode, constraint = plan_tool_calls(tools, req.tool_choice, req.parallel_tool_calls,
                                       model.tools)
    prompt = render_chat(engine, model, req.messages, tools, add_prompt)
    top = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = sampling_params(req, max_tokens, top, default_max_tokens=None,
                             defaults=engine.model_info.default_sampling_params)
    if constraint is not None:  # tool_choice required or named: the call must parse
        if params.structured_outputs is not None:
            raise APIError(400, "a response_format or guided decoding constraint cannot be "
                                "combined with a required or named tool_choice",
                           param="tool_choice")
        params = replace(params, structured_outputs=constraint)
    spec = CallSpec("chat", model.name, params.n, None, top, req.include_usage,
                    req.continuous_usage, tool_mode=mode)
    return _start(engine, spec, [prompt], params, req)


def render_chat(engine: EngineClient, model: ServedModel, messages: list[ChatMessage],
                tools: list[dict[str, Any]] | None, add_generation_prompt: bool
                ) -> dict[str, Any]:
    """The prompt of a conversation: the chat template, with the tools and tool turns shown
    to the model when there are any (server/tool_parsers/prompt.py)."""
    plain = chat_messages(messages)
    if not tools and not any(m["role"] == "tool" or "tool_calls" in m for m in plain):
        return engine.render_chat(plain, add_generation_prompt)
    if model.renders_tools is None:
        model.renders_tools = template_renders_tools(engine)
    return render_with_tools(engine, plain, tools, add_generation_prompt, model.renders_tools)


def _start(engine: EngineClient, spec: CallSpec, prompts: list[PromptInput], params: Any,
           req: CompletionRequest | ChatCompletionRequest) -> Call:
    streams: list[RequestHandle] = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(engine.add_request(_salted(prompt, req.cache_salt), params,
                                              f"{spec.response_id}-{i}"))
    except BaseException:
        for stream in streams:  # a later prompt was bad: drop the ones already queued
            stream.cancel()
        raise
    builder = ResponseBuilder(spec, len(prompts))
    # Known before any output, so the first chunk's continuous usage counts the prompt.
    builder.prompt_tokens = [s.num_prompt_tokens for s in streams]
    return Call(builder, streams, bool(req.stream))


def _salted(prompt: PromptInput, cache_salt: str | None) -> PromptInput:
    """The prompt as a dict carrying the request's cache_salt, when it has one."""
    if cache_salt is None:
        return prompt
    if isinstance(prompt, dict):
        return {**prompt, "cache_salt": cache_salt}
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt, "cache_salt": cache_salt}


def _prompt_text(engine: EngineClient, prompt: PromptInput) -> str:
    if isinstance(prompt, str):
        return prompt
    # echo decodes the ids before the engine queues them: detokenize checks them (a 400)
    return engine.detokenize(list(cast(list[int], prompt)), "prompt")
