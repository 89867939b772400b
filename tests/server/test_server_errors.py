"""Every failure the HTTP server reports is an OpenAI error body with the right status, and the
server keeps serving afterwards: bad input (400), auth (401), unknown model or route (404),
oversized bodies (413), a full queue (503 + Retry-After) and real faults (500, in test_server_faults.py). Also the small
utility routes: /health, /version, /v1/models, /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.support.api import (
    PROMPT,
    assert_error,
    assert_error_body,
    assert_serves,
    http,
    openai_client,
)
from tests.support.metrics import scrape
from tests.support.server_process import MAX_BODY_BYTES, ServerProcess, kvserve

API_KEY = "test-secret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(capped_server: ServerProcess) -> ServerProcess:
    """The session's server with a 64 KiB body cap (tests/server/conftest.py)."""
    return capped_server


@pytest.fixture(scope="module")
def guarded_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServerProcess]:
    """An API key on /v1, and one running request at a time with one waiting: a third
    concurrent request must be refused."""
    with kvserve(tiny_llama_dir, "--api-key", API_KEY, "--max-num-seqs", "1",
                 "--max-queue-len", "1", log_dir=tmp_path_factory.mktemp("guarded_logs")) as proc:
        yield proc


@pytest.fixture(scope="module")
def vocab_size(tiny_llama_dir: Path) -> int:
    return int(json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"])


# ---- 400: bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1000}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "seed": 2**64, "temperature": 1.0}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "seed": -(2**63) - 1, "temperature": 1.0}, "seed"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_p": -1}, "top_p"),
])
def test_bad_fields_are_400(server: ServerProcess, path: str, body: dict[str, Any],
                            param: str) -> None:
    assert_error(http(server, "POST", path, body), 400, param)
    # Asking for a stream changes nothing: the error comes before any SSE.
    assert_error(http(server, "POST", path, {**body, "stream": True}), 400, param)
    assert_serves(server)


def test_extreme_seeds_that_fit_64_bits_work(server: ServerProcess) -> None:
    for seed in (2**63 - 1, -(2**63)):
        reply = http(server, "POST", "/v1/completions",
                     {"prompt": PROMPT, "max_tokens": 2, "temperature": 1.0, "seed": seed,
                      "n": 2, "ignore_eos": True})
        assert reply.status == 200, reply.raw
        assert [c["finish_reason"] for c in reply.json()["choices"]] == ["length"] * 2


@pytest.mark.parametrize("raw", [b'{"prompt": "hi", "max_tokens": ', b"not json", b"",
                                 b'["a list"]'])
def test_malformed_json_is_400(server: ServerProcess, raw: bytes) -> None:
    error = assert_error(http(server, "POST", "/v1/completions", raw), 400)
    assert error["type"] == "invalid_request_error"
    assert_serves(server)


def test_token_id_outside_the_vocabulary(server: ServerProcess, vocab_size: int) -> None:
    for prompt in ([1, 2, vocab_size], [[3, 4], [5, vocab_size + 7]]):
        error = assert_error(http(server, "POST", "/v1/completions",
                                  {"prompt": prompt, "max_tokens": 2}), 400)
        assert str(vocab_size) in error["message"]
    assert_error(http(server, "POST", "/v1/completions", {"prompt": [1, -2]}), 400)
    assert_serves(server)
    # A batch with one bad prompt queued nothing: the engine is idle again.
    page = scrape(server.url)
    gauges = page.find("num_requests_waiting") + page.find("num_requests_running")
    assert any("model_name" in s.labels for s in page.find("num_requests_waiting"))
    assert all(s.value == 0.0 for s in gauges)


def test_prompt_plus_max_tokens_over_max_model_len(server: ServerProcess) -> None:
    models = http(server, "GET", "/v1/models").json()
    max_model_len = models["data"][0]["max_model_len"]
    num_prompt = http(server, "POST", "/tokenize", {"prompt": PROMPT}).json()["count"]
    max_tokens = max_model_len - num_prompt + 3
    error = assert_error(http(server, "POST", "/v1/completions",
                              {"prompt": PROMPT, "max_tokens": max_tokens}), 400)
    for number in (max_model_len, max_tokens, num_prompt):
        assert str(number) in error["message"]
    chat = assert_error(http(server, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": PROMPT}],
                              "max_completion_tokens": max_model_len}), 400)
    assert str(max_model_len) in chat["message"]
    # Exactly at the limit is allowed.
    ok = http(server, "POST", "/v1/completions",
              {"prompt": PROMPT, "max_tokens": max_model_len - num_prompt, "stream": True})
    assert ok.status == 200 and ok.raw.endswith(b"data: [DONE]\n\n")


def test_openai_sdk_raises_bad_request(server: ServerProcess) -> None:
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                  temperature=-1.0)
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict) and info.value.body.get("param") == "temperature"


# ---- 401, 404, 405, 413 -----------------------------------------------------------------------

def test_api_key(guarded_server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        error = assert_error(http(guarded_server, "POST", "/v1/completions", body, headers), 401)
        assert error["type"] == "authentication_error"
    assert_error(http(guarded_server, "GET", "/v1/models"), 401)
    assert http(guarded_server, "GET", "/health").status == 200
    assert http(guarded_server, "GET", "/metrics").status == 200
    assert_serves(guarded_server, AUTH)
    with pytest.raises(openai.AuthenticationError):
        openai_client(guarded_server, api_key="wrong").models.list()
    good = openai_client(guarded_server, api_key=API_KEY)
    assert good.models.list().data


def test_unknown_model_is_404(server: ServerProcess) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]})):
        error = assert_error(http(server, "POST", path, {**body, "model": "no-such-model"}),
                             404, "model")
        assert "no-such-model" in error["message"]
    assert_serves(server)


def test_unknown_route_is_404_and_wrong_method_405(server: ServerProcess) -> None:
    assert_error(http(server, "GET", "/v1/no-such-route"), 404)
    assert_error(http(server, "POST", "/v2/completions", {"prompt": PROMPT}), 404)
    assert_error(http(server, "GET", "/v1/completions"), 405)
    assert_serves(server)


def test_body_over_the_cap_is_413(server: ServerProcess) -> None:
    too_big = {"prompt": "x" * (MAX_BODY_BYTES + 100)}
    error = assert_error(http(server, "POST", "/v1/completions", too_big), 413)
    assert error["type"] == "invalid_request_error"
    # Just under the cap the body is read: the prompt is then too long for the model (400).
    under = {"prompt": "x " * ((MAX_BODY_BYTES - 100) // 2)}
    assert len(json.dumps(under)) < MAX_BODY_BYTES
    assert_error(http(server, "POST", "/v1/completions", under), 400)
    assert_serves(server)


# ---- 503: full queue --------------------------------------------------------------------------

def test_full_queue_is_503_with_retry_after(guarded_server: ServerProcess) -> None:
    asyncio.run(_fill_the_queue(guarded_server))
    assert_serves(guarded_server, AUTH)


async def _busy(url: str) -> tuple[float | None, float | None]:
    """(running, waiting) requests, from /metrics."""
    page = await asyncio.to_thread(scrape, url)
    return page["running"], page["waiting"]


async def _fill_the_queue(server: ServerProcess) -> None:
    url = server.url
    models = http(server, "GET", "/v1/models", headers=AUTH).json()
    max_model_len = int(models["data"][0]["max_model_len"])
    num_prompt = http(server, "POST", "/tokenize", {"prompt": PROMPT}).json()["count"]
    # As long as the model allows, so it is still running when the third request arrives.
    long = {"prompt": PROMPT, "max_tokens": max_model_len - num_prompt, "ignore_eos": True}
    async with aiohttp.ClientSession(headers=AUTH) as session:
        running = await session.post(url + "/v1/completions", json={**long, "stream": True})
        assert running.status == 200
        await running.content.readline()  # its first chunk: it is running
        queued = asyncio.create_task(session.post(url + "/v1/completions", json=long))
        deadline = time.monotonic() + 10
        while await _busy(url) != (1, 1):
            assert time.monotonic() < deadline, "the second request never queued"
            await asyncio.sleep(0.01)
        async with session.post(url + "/v1/completions", json=long) as refused:
            assert refused.status == 503
            retry_after = refused.headers["Retry-After"]
            assert retry_after.isdigit() and int(retry_after) >= 1
            error = assert_error_body(await refused.json())
        assert error["type"] == "server_error" and error["code"] == "queue_full"
        assert await _busy(url) == (1, 1)  # the refused request left no trace
        assert not queued.done()  # still waiting for its whole (non-streamed) body
        running.close()  # both clients hang up: both requests are aborted
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        while await _busy(url) != (0, 0):
            assert time.monotonic() < deadline + 10, "the requests were never aborted"
            await asyncio.sleep(0.01)


# ---- unknown fields, utility routes -----------------------------------------------------------

def test_unknown_fields_are_ignored_and_logged(server: ServerProcess) -> None:
    reply = http(server, "POST", "/v1/completions",
                 {"prompt": PROMPT, "max_tokens": 2, "frobnicate_level": 3,
                  "another_unknown_knob": {"a": 1}})
    assert reply.status == 200
    assert len(reply.json()["choices"]) == 1
    deadline = time.monotonic() + 5
    while "frobnicate_level" not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    line = next(x for x in server.log().splitlines() if "frobnicate_level" in x)
    assert line.startswith("WARNING") and "another_unknown_knob" in line


def test_models_version_health(server: ServerProcess, tiny_llama_dir: Path) -> None:
    models = http(server, "GET", "/v1/models").json()
    assert models["object"] == "list"
    (entry,) = models["data"]
    assert entry["object"] == "model" and entry["id"]
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert entry["max_model_len"] == config["max_position_embeddings"]
    version = http(server, "GET", "/version")
    assert version.status == 200 and isinstance(version.json()["version"], str)
    health = http(server, "GET", "/health")
    assert health.status == 200


def test_tokenize_detokenize_round_trip(server: ServerProcess, vocab_size: int) -> None:
    text = "The old snow model sleeps, 42 times!"
    tokens = http(server, "POST", "/tokenize", {"prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert all(0 <= t < vocab_size for t in tokens["tokens"])
    back = http(server, "POST", "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    usage = http(server, "POST", "/v1/completions",
                 {"prompt": text, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == tokens["count"]
    chat = http(server, "POST", "/tokenize",
                {"messages": [{"role": "user", "content": text}]}).json()
    assert chat["count"] > tokens["count"]  # the template adds role markers
    assert_error(http(server, "POST", "/detokenize", {"tokens": [vocab_size]}), 400, "tokens")
    assert_error(http(server, "POST", "/tokenize", {}), 400)
