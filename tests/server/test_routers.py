"""Two real kvserve replicas behind each of the routers people put in front of vLLM and SGLang:
vLLM's router (PyPI `vllm-router`) and SGLang's router (PyPI `sglang-router`), both Rust
binaries. The OpenAI SDK talks to the router: completions and chat, streamed and whole. Each
router reads its own /get_load shape, fans /flush_cache out, and vllm-router's cache_aware and
kv_aware policies read /render and /get_server_info instead of falling back.

The routers are test-only dependencies (`pip install vllm-router sglang-router`, in the `dev`
extra); a test whose router is not installed is skipped, naming the package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from loadtest.serve_process import free_port
from tests.support.metrics import wait_idle
from tests.support.server_process import ServerProcess, kvserve

ROUTER_START_TIMEOUT_S = 60.0
MAX_TOKENS = 4
# Both routers check worker health every 60 s by default; tests do not wait for that.
HEALTH_CHECK_INTERVAL_S = "5"


@dataclass
class Replicas:
    """Two replicas of the tiny Llama: `sglang` answers /get_load in SGLang's shape (the
    default), `vllm` in vllm-router's (--get-load-format vllm-router)."""

    sglang: ServerProcess
    vllm: ServerProcess

    @property
    def both(self) -> tuple[ServerProcess, ServerProcess]:
        return self.sglang, self.vllm


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Replicas]:
    log_dir = tmp_path_factory.mktemp("replicas")
    with kvserve(tiny_llama_dir, log_dir=log_dir) as first, \
            kvserve(tiny_llama_dir, "--get-load-format", "vllm-router",
                    log_dir=log_dir) as second:
        yield Replicas(first, second)


class RouterProcess:
    """A router started on free ports in its own process group, logging to a file."""

    def __init__(self, kind: str, replicas: Replicas, log_path: Path, policy: str) -> None:
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{free_port()}"  # the router's own Prometheus
        self.log_path = log_path
        module = {"vllm-router": "vllm_router.launch_router",
                  "sglang-router": "sglang_router.launch_router"}[kind]
        command = [sys.executable, "-m", module, "--host", "127.0.0.1",
                   "--port", str(self.port),
                   "--prometheus-port", self.metrics_url.rsplit(":", 1)[1],
                   "--worker-urls", *(r.url for r in replicas.both), "--policy", policy,
                   "--health-check-interval-secs", HEALTH_CHECK_INTERVAL_S,
                   "--log-level", "debug"]
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        """Everything the router wrote so far, without terminal colours."""
        text = self.log_path.read_text(errors="replace")
        return "".join(part.split("m", 1)[-1] if i else part
                       for i, part in enumerate(text.split("\x1b[")))

    def wait_ready(self, num_workers: int) -> None:
        """Until the router lists `num_workers` workers in /get_loads (SGLang's registers them
        in the background after it starts listening)."""
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.kind} exited:\n{self.log()[-3000:]}"
            try:
                if len(get_json(self.url, "/get_loads")["workers"]) == num_workers \
                        and get_json(self.url, "/v1/models")["data"]:
                    return
            except (OSError, KeyError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.kind} not ready in {ROUTER_START_TIMEOUT_S} s:\n"
                           f"{self.log()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM to the group, then SIGKILL."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@contextmanager
def router(kind: str, replicas: Replicas, log_dir: Path,
           policy: str = "cache_aware") -> Iterator[RouterProcess]:
    """`kind` in front of both replicas, ready; skipped when the package is not installed."""
    package = kind.replace("-", "_")
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{kind} is not installed (pip install {kind}; it is in the dev extra)")
    started = RouterProcess(kind, replicas, log_dir / f"{kind}-{policy}.log", policy)
    try:
        started.wait_ready(num_workers=2)
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module", params=["vllm-router", "sglang-router"])
def front(request: pytest.FixtureRequest, replicas: Replicas,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """Each router, with its default cache_aware policy, in front of the two replicas."""
    with router(str(request.param), replicas, tmp_path_factory.mktemp("router")) as started:
        yield started


def get_json(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=10) as resp:
        return json.loads(resp.read())


def post(url: str, path: str, body: Any = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url + path, method="POST",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def client(front: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.url + "/v1", api_key="x", max_retries=0)


def served_name(replicas: Replicas) -> str:
    return str(get_json(replicas.sglang.url, "/v1/models")["data"][0]["id"])


def fresh_prompt(seed: int) -> str:
    """Words no other test sends, long enough to fill several KV blocks."""
    rng = random.Random(seed)
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(30))


def routing_inputs(front: RouterProcess) -> dict[str, float]:
    """vllm-router's count of prompts it tokenized for routing, by where the ids came from:
    `render` (/v1/.../render) or its fallback to /tokenize."""
    with urllib.request.urlopen(front.metrics_url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    found = {}
    for line in lines:
        if line.startswith("vllm_router_kv_routing_inputs_total{"):
            labels, value = line.rsplit(" ", 1)
            found[labels.split('result="')[1].split('"')[0]] = float(value)
    return found


@contextmanager
def routed_as_a_replica_expects(front: RouterProcess, replicas: Replicas,
                                num_requests: int) -> Iterator[None]:
    """Around `num_requests` requests: vllm-router routed each on the token ids /render gave
    it, on each replica (no fallback to /tokenize); SGLang's router serves the model under the replicas' name
    (from /server_info; without it the model is "unknown")."""
    before = routing_inputs(front) if front.kind == "vllm-router" else {}
    yield
    if front.kind == "vllm-router":
        after = routing_inputs(front)
        # each request is rendered on every worker, to score each one's cached prefix
        assert {k: after[k] - before.get(k, 0.0) for k in after} == \
            {"render": num_requests * len(replicas.both)}
    else:
        models = get_json(front.url, "/v1/models")["data"]
        assert [m["id"] for m in models] == [served_name(replicas)]


# ---- the OpenAI API through the router ------------------------------------------------------------

def test_completions_whole_and_streamed(front: RouterProcess, replicas: Replicas) -> None:
    api, model = client(front), served_name(replicas)
    with routed_as_a_replica_expects(front, replicas, num_requests=2):
        whole, chunks = _completions(api, model)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == MAX_TOKENS
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text  # greedy: the same on either replica
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS


def _completions(api: openai.OpenAI, model: str) -> tuple[Any, list[Any]]:
    whole = api.completions.create(model=model, prompt="Once upon a time", max_tokens=MAX_TOKENS,
                                   temperature=0.0, extra_body={"ignore_eos": True})
    chunks = list(api.completions.create(model=model, prompt="Once upon a time",
                                         max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    return whole, chunks


def test_chat_whole_and_streamed(front: RouterProcess, replicas: Replicas) -> None:
    api, model = client(front), served_name(replicas)
    messages: Any = [{"role": "user", "content": "Name three colours."}]
    with routed_as_a_replica_expects(front, replicas, num_requests=2):
        whole = api.chat.completions.create(model=model, messages=messages,
                                            max_tokens=MAX_TOKENS, temperature=0.0,
                                            extra_body={"ignore_eos": True})
        chunks = list(api.chat.completions.create(model=model, messages=messages,
                                                  max_tokens=MAX_TOKENS, temperature=0.0,
                                                  stream=True, extra_body={"ignore_eos": True}))
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == MAX_TOKENS
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in api.models.list().data] == [model]


# ---- what the router reads from the replicas ------------------------------------------------------

def test_each_router_reads_its_own_get_load_shape(front: RouterProcess,
                                                  replicas: Replicas) -> None:
    for replica in replicas.both:
        wait_idle(replica.url)
    loads = {w["worker"]: w["load"] for w in get_json(front.url, "/get_loads")["workers"]}
    # -1 is the router's "could not read a load"; 0 is an idle replica it understood.
    readable = replicas.vllm if front.kind == "vllm-router" else replicas.sglang
    unreadable = replicas.sglang if front.kind == "vllm-router" else replicas.vllm
    assert (loads[readable.url], loads[unreadable.url]) == (0, -1)


def test_flush_through_the_router_resets_prefix_hits(front: RouterProcess,
                                                     replicas: Replicas) -> None:
    api, model = client(front), served_name(replicas)
    prompt = fresh_prompt(seed=hash(front.kind) % 1000)

    def hits_of_one_request() -> float:
        before = sum(wait_idle(r.url)["prefix_cache_hits"] for r in replicas.both)
        api.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0.0)
        return sum(wait_idle(r.url)["prefix_cache_hits"] for r in replicas.both) - before

    hits_of_one_request()
    assert hits_of_one_request() > 0  # cache-aware: the repeat went where the prefix is
    status, body = post(front.url, "/flush_cache")
    assert status == 200, body
    assert hits_of_one_request() == 0
    assert hits_of_one_request() > 0


def test_vllm_router_kv_aware_discovers_the_replicas(replicas: Replicas,
                                                     tmp_path: Path) -> None:
    with router("vllm-router", replicas, tmp_path, policy="kv_aware") as started:
        reply = client(started).completions.create(model=served_name(replicas),
                                                   prompt=fresh_prompt(seed=8), max_tokens=2)
        assert reply.usage is not None and reply.usage.completion_tokens == 2
        log = started.log()
    discovery = [line for line in log.splitlines() if "kv_index" in line and "WARN" in line]
    # /get_server_info gave it the model and block size; /kv_event_sources parsed (and is
    # empty: kvserve publishes no KV events yet, so it logs nothing about subscribers).
    assert not any("get_server_info" in line or "block_size" in line or "parse" in line
                   for line in discovery), discovery

