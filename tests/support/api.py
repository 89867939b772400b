"""Plain HTTP against a test server: one request helper that returns 4xx and 5xx instead of
raising, OpenAI's error shape, and "a normal request still completes"."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai

from tests.support.server_process import ServerProcess

PROMPT = "Hello there"


class Reply:
    """A finished HTTP exchange."""

    def __init__(self, status: int, headers: Any, raw: bytes) -> None:
        self.status = status
        self.headers = headers
        self.raw = raw

    def json(self) -> Any:
        return json.loads(self.raw)


def http(server: ServerProcess, method: str, path: str, body: Any = None,
         headers: dict[str, str] | None = None, timeout: float = 30.0) -> Reply:
    """One request; 4xx and 5xx come back as a Reply, not an exception. A body that is not
    bytes is sent as JSON."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return Reply(resp.status, resp.headers, resp.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, err.headers, err.read())


def post_json(server: ServerProcess, path: str, body: Any, timeout: float = 60.0) -> Any:
    """POSTs `body` as JSON; the reply must be 200, and its JSON is returned."""
    reply = http(server, "POST", path, body, timeout=timeout)
    assert reply.status == 200, reply.raw
    return reply.json()


def assert_error_body(body: Any, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: exactly message, type, param and code under "error"."""
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param
    return dict(error)


def assert_error(reply: Reply, status: int, param: str | None = None) -> dict[str, Any]:
    """The reply is `status` with a JSON OpenAI error body (naming `param` if given)."""
    assert reply.status == status, reply.raw
    assert reply.headers["Content-Type"].startswith("application/json")
    return assert_error_body(reply.json(), param)


def assert_serves(server: ServerProcess, headers: dict[str, str] | None = None) -> None:
    """A normal request still completes."""
    reply = http(server, "POST", "/v1/completions",
                 {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True},
                 headers)
    assert reply.status == 200, reply.raw
    body = reply.json()
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"


def openai_client(server: ServerProcess, api_key: str = "x") -> openai.OpenAI:
    """The official SDK pointed at the server, without retries (a retry would hide a 5xx)."""
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)
