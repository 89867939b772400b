"""What real chat front-ends and client libraries send, replayed against a real server: Open
WebUI's and LibreChat's request shapes (no max_tokens, nulls for optional fields, content parts,
a trailing empty assistant message, side requests for titles and tags), the official `openai`
SDK and `langchain-openai`. Each answer must have OpenAI's shape and stream order (role first,
content deltas, one finish_reason per choice, usage only when asked, `[DONE]` last).

The server runs the tiny Llama with a generation_config.json recommending greedy sampling and
`--override-generation-config '{"max_new_tokens": 6}'`, so a request without max_tokens (every
Open WebUI chat) stops after 6 tokens instead of running to max_model_len.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_openai import ChatOpenAI

from tests.support.api import openai_client, post_json
from tests.support.metrics import scrape, wait_idle
from tests.support.server_process import ServerProcess, kvserve

DEFAULT_CAP = 6  # --override-generation-config's max_new_tokens
SYSTEM = "You are a helpful assistant."


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("frontend") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    config_path = folder / "generation_config.json"
    config = json.loads(config_path.read_text())
    config.update({"temperature": 0.0, "max_new_tokens": 50})
    config_path.write_text(json.dumps(config))
    with kvserve(folder, "--served-model-name", "tiny", "--override-generation-config",
                 json.dumps({"max_new_tokens": DEFAULT_CAP}),
                 log_dir=tmp_path_factory.mktemp("frontend_logs")) as server:
        yield server


def sse_events(server: ServerProcess, body: dict[str, Any]) -> list[Any]:
    """POSTs a streamed request; returns every SSE data payload in order (JSON, or the
    literal "[DONE]")."""
    request = urllib.request.Request(server.url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    events: list[Any] = []
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: "):
                data = line[6:].decode()
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def check_stream_order(events: list[Any], n: int, usage: bool) -> dict[int, str]:
    """OpenAI's stream order for a chat; returns each choice's text."""
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    texts: dict[int, str] = {i: "" for i in range(n)}
    finished: dict[int, str] = {}
    seen_role: set[int] = set()
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        if not chunk["choices"]:  # only the usage chunk has none, and it is last
            assert usage and chunk is chunks[-1]
            continue
        if not usage:
            assert chunk.get("usage") is None
        for choice in chunk["choices"]:
            index, delta = choice["index"], choice["delta"]
            if index not in seen_role:  # the role comes first, before any content
                assert delta.get("role") == "assistant" and not delta.get("content")
                seen_role.add(index)
            else:
                assert "role" not in delta or delta["role"] is None
            assert index not in finished, "content after this choice's finish_reason"
            texts[index] += delta.get("content") or ""
            if choice["finish_reason"] is not None:
                finished[index] = choice["finish_reason"]
    assert sorted(finished) == list(range(n)), "exactly one finish_reason per choice"
    if usage:
        totals = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and totals["completion_tokens"] >= 1
        assert totals["total_tokens"] == totals["prompt_tokens"] + totals["completion_tokens"]
    return texts


def chat_text(server: ServerProcess, messages: list[dict[str, Any]], **fields: Any) -> str:
    body = post_json(server, "/v1/chat/completions", {"messages": messages, **fields})
    return str(body["choices"][0]["message"]["content"])


OPEN_WEBUI_CHAT: dict[str, Any] = {
    # Open WebUI: streamed, no max_tokens, its own fields beside OpenAI's.
    "model": "tiny", "stream": True, "stream_options": {"include_usage": True},
    "messages": [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": [{"type": "text", "text": "Hello there!"}]}],
    "metadata": {"chat_id": "abc", "message_id": "def"}, "features": {"web_search": False},
    "params": {}, "background_tasks": {"title_generation": True},
}
LIBRECHAT_CHAT: dict[str, Any] = {
    # LibreChat: nulls for what it leaves unset, a user id, penalties at 0, n.
    "model": "tiny", "stream": True, "temperature": 0, "top_p": 1, "presence_penalty": 0,
    "frequency_penalty": 0, "stop": None, "max_tokens": None, "user": "user-1234", "n": 2,
    "logit_bias": None, "messages": [{"role": "user", "content": "Hello there!"}],
}


def test_open_webui_chat_without_max_tokens_stops_at_the_server_default(
        server: ServerProcess) -> None:
    events = sse_events(server, OPEN_WEBUI_CHAT)
    texts = check_stream_order(events, n=1, usage=True)
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] <= DEFAULT_CAP
    # The generation config made it greedy: the same as an explicit temperature-0 request.
    messages = [OPEN_WEBUI_CHAT["messages"][0], {"role": "user", "content": "Hello there!"}]
    assert texts[0] == chat_text(server, messages, max_tokens=DEFAULT_CAP, temperature=0)
    # A request's own max_tokens still wins over the default.
    longer = post_json(server, "/v1/chat/completions", {
        "messages": messages, "max_completion_tokens": DEFAULT_CAP + 4, "ignore_eos": True})
    assert longer["usage"]["completion_tokens"] == DEFAULT_CAP + 4


def test_librechat_nulls_user_and_n(server: ServerProcess) -> None:
    events = sse_events(server, LIBRECHAT_CHAT)
    texts = check_stream_order(events, n=2, usage=False)
    assert texts[0] == texts[1]  # temperature 0: both choices greedy


def test_stop_as_string_or_list_and_content_parts(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Tell me about the snow."}]
    full = chat_text(server, messages, max_tokens=DEFAULT_CAP, ignore_eos=True)
    stop = full.strip()[:2]
    assert stop
    for value in (stop, [stop, "zzzz"]):
        cut = chat_text(server, messages, max_tokens=DEFAULT_CAP, ignore_eos=True, stop=value)
        assert stop not in cut and full.startswith(cut)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me about"},
                                          {"type": "text", "text": "the snow."}]}]
    assert chat_text(server, parts, max_tokens=3) == chat_text(
        server, [{"role": "user", "content": "Tell me about\nthe snow."}], max_tokens=3)


def test_trailing_empty_assistant_message_is_dropped(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Hello there!"}]
    with_empty = [*messages, {"role": "assistant", "content": ""}]
    assert chat_text(server, with_empty, ignore_eos=True) == chat_text(server, messages,
                                                                       ignore_eos=True)


def test_openai_sdk_streams_in_order_with_usage_only_when_asked(server: ServerProcess) -> None:
    client = openai_client(server)
    messages: Any = [{"role": "user", "content": "Hello there!"}]
    for include_usage in (False, True):
        stream = client.chat.completions.create(
            model="tiny", messages=messages, stream=True, max_completion_tokens=5,
            stream_options={"include_usage": True} if include_usage else None)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] is not None and all(f is None for f in finishes[:-1])
        usage_chunks = [c for c in chunks if c.usage is not None]
        assert len(usage_chunks) == (1 if include_usage else 0)
        if include_usage:
            assert usage_chunks[0] is chunks[-1] and not chunks[-1].choices
    whole = client.chat.completions.create(model="tiny", messages=messages,
                                           max_completion_tokens=5, user="u1", n=1)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens <= 5


def test_langchain_openai_invoke_and_stream(server: ServerProcess) -> None:
    llm = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key="x",  # type: ignore[arg-type]
                     temperature=0, max_tokens=5, max_retries=0, timeout=60)
    conversation = [("system", SYSTEM), ("human", "Hello there!")]
    expected = chat_text(server, [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "Hello there!"}],
                         max_tokens=5, temperature=0)
    assert llm.invoke(conversation).content == expected
    streamed = "".join(str(chunk.content) for chunk in llm.stream(conversation))
    assert streamed == expected


def test_side_requests_do_not_stall_a_streaming_chat(server: ServerProcess) -> None:
    """Title, tag and follow-up requests (non-streamed, as Open WebUI sends them) run while a
    chat streams; the chat keeps producing tokens during them and finishes whole."""
    arrivals: list[float] = []
    side_spans: list[tuple[float, float]] = []
    started = threading.Event()

    def side_request(task: str) -> None:
        started.wait(30)
        begin = time.monotonic()
        chat_text(server, [{"role": "user", "content": f"### Task:\n{task}\n### Chat: hi"}],
                  max_tokens=12, ignore_eos=True, stream=False)
        side_spans.append((begin, time.monotonic()))

    threads = [threading.Thread(target=side_request, args=(task,)) for task in
               ("Generate a concise title", "Generate 1-3 tags", "Suggest 3 follow-ups")]
    for thread in threads:
        thread.start()
    body = {"model": "tiny", "stream": True, "max_tokens": 48, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Hello there!"}]}
    request = urllib.request.Request(server.url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                arrivals.append(time.monotonic())
                if len(arrivals) == 3:
                    started.set()
    for thread in threads:
        thread.join(60)
    assert len(side_spans) == 3
    first_begin = min(b for b, _ in side_spans)
    last_end = max(e for _, e in side_spans)
    during = [t for t in arrivals if first_begin < t < last_end]
    assert during, "the chat produced nothing while the side requests ran"
    assert len(arrivals) == 48 + 1  # the role chunk, then one chunk per token


def _open_stream(server: ServerProcess, body: dict[str, Any]) -> socket.socket:
    """Sends a chat request over a raw socket (so the test can drop the connection)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def _wait_for_log(server: ServerProcess, text: str, after: int) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = server.log()[after:]
        if text in log:
            return log
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in the server log")


@pytest.mark.parametrize("stream", [True, False])
def test_client_gone_mid_request_is_logged_and_aborted(server: ServerProcess,
                                                       stream: bool) -> None:
    wait_idle(server.url)
    before = len(server.log())
    sock = _open_stream(server, {"messages": [{"role": "user", "content": "Hello"}],
                                 "max_tokens": 900, "ignore_eos": True, "stream": stream})
    if stream:
        received = b""
        while received.count(b"data: ") < 4:
            received += sock.recv(65536)
            assert b" 200 OK" in received, received
    else:
        deadline = time.monotonic() + 30
        while scrape(server.url)["running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    sock.close()
    log = _wait_for_log(server, "completion tokens", before)
    line = next(x for x in log.splitlines() if "aborted after" in x)
    assert "INFO" in line and "chatcmpl-" in line and "client" in line
    assert wait_idle(server.url).is_idle()
