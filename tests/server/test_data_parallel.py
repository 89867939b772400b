"""`kvserve serve --data-parallel-size 2` end to end: two child replicas behind one front give
a single server's greedy outputs, streamed and not, spread the load, keep serving when a
replica dies (whose stream in flight ends with an error event) and are all reaped on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.api import assert_serves, http, post_json
from tests.support.metrics import scrape
from tests.support.server_process import ServerProcess, kvserve
from tests.support.ws import Socket

CHAT = [{"role": "user", "content": "Tell me about caches."}]
PROMPTS = ["The quick brown fox", "Once upon a time", "A KV cache stores", "In the morning"]


@pytest.fixture(scope="module")
def dp_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[ServerProcess]:
    with kvserve(tiny_llama_dir, "-dp", "2", log_dir=tmp_path_factory.mktemp("dp")) as server:
        yield server


def _replica_pids(server: ServerProcess) -> dict[int, int]:
    """Replica index -> pid, from the front's log."""
    found = re.findall(r"replica (\d+) is pid (\d+)", server.log())
    return {int(i): int(pid) for i, pid in found}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z")


def _stream(server: ServerProcess, body: dict[str, Any]) -> list[Any]:
    """The SSE events of one streamed request: JSON payloads and the final 'DONE'."""
    request = urllib.request.Request(server.url + "/v1/" + body.pop("_path"),
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    events: list[Any] = []
    with urllib.request.urlopen(request, timeout=60) as resp:  # noqa: S310 (loopback)
        for line in resp:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                events.append("DONE" if data == b"[DONE]" else json.loads(data))
    return events


def _text(events: list[Any]) -> str:
    out = []
    for event in events[:-1]:
        for choice in event.get("choices", []):
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def test_outputs_equal_one_server(dp_server: ServerProcess, tiny_server: ServerProcess) -> None:
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        one = post_json(tiny_server, "/v1/completions", body)["choices"][0]["text"]
        assert post_json(dp_server, "/v1/completions", body)["choices"][0]["text"] == one
        events = _stream(dp_server, {**body, "_path": "completions"})
        assert events[-1] == "DONE" and _text(events) == one
    chat = {"messages": CHAT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    one = post_json(tiny_server, "/v1/chat/completions", chat)["choices"][0]["message"]
    got = post_json(dp_server, "/v1/chat/completions", chat)["choices"][0]["message"]
    assert got["content"] == one["content"]
    events = _stream(dp_server, {**chat, "_path": "chat/completions"})
    assert events[-1] == "DONE" and _text(events) == one["content"]


def test_load_spreads_and_prefix_sticks(dp_server: ServerProcess) -> None:
    before = scrape(dp_server.url)
    results: list[int] = []

    def one(prompt: str) -> None:
        body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True}
        results.append(http(dp_server, "POST", "/v1/completions", body).status)

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [200] * len(PROMPTS)
    after = scrape(dp_server.url)

    def routed(page: Any, replica: str) -> float:
        return sum(s.value for s in page.samples
                   if s.name == "kvserve_dp_routed_requests_total"
                   and s.labels["replica"] == replica)

    for replica in ("0", "1"):  # concurrent requests went to both replicas
        assert routed(after, replica) - routed(before, replica) >= 1
    # Both replicas' own counters show up under the replica label.
    assert {s.labels["replica"] for s in after.find("request_success_total")} == {"0", "1"}
    long_prompt = "System: you answer questions about caching. " * 8
    for question in ("What is LRU?", "What is FIFO?", "What is a hit?"):
        post_json(dp_server, "/v1/completions", {"prompt": long_prompt + question,
                                                 "max_tokens": 2})
    hits = [s.value for s in scrape(dp_server.url).samples
            if s.name == "kvserve_dp_affinity_hits_total"]
    assert hits and hits[0] - sum(s.value for s in after.samples
                                  if s.name == "kvserve_dp_affinity_hits_total") >= 2
    assert http(dp_server, "GET", "/health").status == 200
    assert http(dp_server, "GET", "/v1/models").json()["data"]


def test_dead_replica_and_sigterm(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with kvserve(tiny_llama_dir, "-dp", "2", "--max-num-seqs", "4", log_dir=tmp_path) as server:
        pids = _replica_pids(server)
        assert sorted(pids) == [0, 1] and all(_alive(p) for p in pids.values())
        # The first request of a fresh front goes to replica 0; kill it mid-stream.
        body = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        request = urllib.request.Request(server.url + "/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        lines: list[bytes] = []
        with urllib.request.urlopen(request, timeout=60) as resp:  # noqa: S310 (loopback)
            lines.append(resp.readline())
            os.kill(pids[0], signal.SIGKILL)
            lines.extend(resp.readlines())
        events = [ln[6:].strip() for ln in lines if ln.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        error = json.loads(events[-2])["error"]
        assert "replica 0" in error["message"] and error["code"] == "replica_failed"
        deadline = time.monotonic() + 10
        while http(server, "GET", "/health").status != 503:
            assert time.monotonic() < deadline, "/health never turned 503"
            time.sleep(0.1)
        for _ in range(3):
            assert_serves(server)  # replica 1 keeps serving
        page = scrape(server.url)
        healthy = {s.labels["replica"]: s.value for s in page.samples
                   if s.name == "kvserve_dp_replica_healthy"}
        assert healthy == {"0": 0.0, "1": 1.0}
        assert server.stop() == 0
        assert not _alive(pids[1]), "SIGTERM left a replica running"
        assert "every replica reaped" in server.log()


def test_websocket_passes_through(dp_server: ServerProcess) -> None:
    async def main() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(dp_server.url + "/v1/ws") as ws:
            sock = Socket(ws)
            await sock.send({"type": "completion", "id": "a", "prompt": "Hello",
                             "max_tokens": 4, "ignore_eos": True})
            await sock.until(lambda m: m.get("type") == "done")
            return sock.messages

    messages = asyncio.run(main())
    assert any(m.get("type") == "delta" and m.get("id") == "a" for m in messages)
    assert messages[-1]["type"] == "done"


@pytest.mark.timeout(180)
def test_replicas_with_tensor_parallel_inside(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`-dp 2 -tp 2`: each replica runs TP=2 (its own rank process), the outputs equal one
    server's, and SIGTERM drains all of it: exit 0, both replicas and both ranks gone."""
    import psutil

    body = {"prompt": "The tiny model says", "max_tokens": 8, "temperature": 0}
    with kvserve(tiny_llama_dir, log_dir=tmp_path) as single:
        expected = post_json(single, "/v1/completions", body)["choices"][0]["text"]
    with kvserve(tiny_llama_dir, "-dp", "2", "-tp", "2", log_dir=tmp_path) as server:
        pids = _replica_pids(server)
        ranks = [child for pid in pids.values() for child in psutil.Process(pid).children()
                 if "spawn_main" in " ".join(child.cmdline())]
        assert len(pids) == 2 and len(ranks) == 2
        for _ in range(4):  # both replicas serve (load spreads) with the same greedy text
            assert post_json(server, "/v1/completions", body)["choices"][0]["text"] == expected
        assert "tensor parallel size 2" in server.log()
        assert server.stop() == 0
    assert not any(_alive(pid) for pid in pids.values())
    assert not any(_alive(rank.pid) for rank in ranks)
