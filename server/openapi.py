"""GET /openapi.json: an OpenAPI 3.1 document whose request schemas are generated from the
protocol Structs (msgspec.json.schema_components), so it can never drift from what the
server decodes, and whose Meta bounds (minimum, maximum, maxLength, maxItems) let fuzzers
such as schemathesis aim at the edges."""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import orjson

from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

_REF = "#/components/schemas/{name}"


class ErrorObject(msgspec.Struct, kw_only=True):
    """OpenAI's error fields."""

    message: str
    type: str
    param: str | None
    code: str | None


class Error(msgspec.Struct, kw_only=True):
    """Every 4xx and 5xx body: `{"error": {...}}`."""

    error: ErrorObject


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: int) -> dict[str, Any]:
    """Error responses, each with the Error schema."""
    return {str(s): {"description": "an OpenAI error body", "content": _json(_ref("Error"))}
            for s in statuses}


def _generation(summary: str, request: str) -> dict[str, Any]:
    """A POST that returns JSON, or SSE when `stream` is true."""
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(_ref(request))},
        "responses": {
            "200": {"description": "the response, or an SSE stream with `stream: true`",
                    "content": {**_json({"type": "object"}),
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 408, 413, 503),
        },
    }}


def _post(summary: str, request: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(_ref(request))},
        "responses": {"200": {"description": "the result", "content": _json({"type": "object"})},
                      **_errors(400, 404, 408, 413, 503)},
    }}


def _get(summary: str, content: dict[str, Any] | None, *errors: int) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "success"}
    if content is not None:
        ok["content"] = content
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(*errors)}}}


def build_openapi() -> dict[str, Any]:
    """The whole document as a dict."""
    _, components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, Error],
        ref_template=_REF)
    paths = {
        "/v1/completions": _generation("OpenAI completions", "CompletionRequest"),
        "/v1/chat/completions": _generation("OpenAI chat completions", "ChatCompletionRequest"),
        "/tokenize": _post("a prompt or chat messages to token ids", "TokenizeRequest"),
        "/detokenize": _post("token ids to text", "DetokenizeRequest"),
        "/v1/models": _get("the served models", _json({"type": "object"}), 401),
        "/health": {"get": {"summary": "200 when ready", "responses": {
            "200": {"description": "ready"},
            "503": {"description": "draining, or the engine failed",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/version": _get("the kvserve version", _json({"type": "object"})),
    }
    return {"openapi": "3.1.0",
            "info": {"title": "kvserve", "version": "0.1.0",
                     "description": "OpenAI-compatible LLM serving; limits in README.md"},
            "paths": paths, "components": {"schemas": components}}


@functools.cache
def openapi_document() -> bytes:
    """The document as JSON bytes, built once."""
    return orjson.dumps(build_openapi())
