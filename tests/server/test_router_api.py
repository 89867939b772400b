"""The endpoints routers call on their workers (server/router_api.py), read directly from a real
`kvserve serve`: their shapes, /flush_cache really forgetting cached prefixes (and refusing while
a request runs), and the `vllm:` metric names only with --vllm-metric-names. The routers
themselves in front of two replicas: test_routers.py."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from tests.support.api import assert_error, http, post_json
from tests.support.metrics import scrape, wait_idle
from tests.support.server_process import ServerProcess, kvserve

BLOCK_SIZE = 16  # the engine's default --block-size


@pytest.fixture(scope="module")
def server(tiny_server: ServerProcess) -> ServerProcess:
    """The session's default server (tests/conftest.py): SGLang's /get_load, no vllm: names."""
    return tiny_server


@pytest.fixture(scope="module")
def aliased(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[ServerProcess]:
    """The tiny Llama with --vllm-metric-names and vllm-router's /get_load shape."""
    with kvserve(tiny_llama_dir, "--vllm-metric-names", "--get-load-format", "vllm-router",
                 log_dir=tmp_path_factory.mktemp("aliased")) as started:
        yield started


def get_json(server: ServerProcess, path: str) -> Any:
    with urllib.request.urlopen(server.url + path, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/json")
        return json.loads(resp.read())


def fresh_prompt_ids(seed: int, length: int) -> list[int]:
    """Random token ids no other test sends, so only this test's requests can hit them."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


# ---- the prefix-cache reset in the KV cache manager ---------------------------------------------

def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4)


def test_reset_is_refused_while_a_block_is_held_and_forgets_every_prefix_once_free() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(1, 14))  # three full blocks and one token
    first = _request("a", tokens)
    assert kv.allocate_slots(first, len(tokens))
    kv.cache_blocks(first, len(tokens))
    assert kv.reset_prefix_cache() is False  # "a" holds its blocks: nothing changes
    assert len(kv.get_computed_blocks(_request("b", tokens))[0]) == 3
    kv.free(first)
    assert len(kv.get_computed_blocks(_request("c", tokens))[0]) == 3  # cached, not held
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(_request("d", tokens)) == ([], 0)
    assert kv.pool.cached == {}
    assert kv.num_free_blocks == 8  # the blocks stay free, only their hashes are gone
    again = _request("e", tokens)  # and the cache fills again
    assert kv.allocate_slots(again, len(tokens))
    kv.cache_blocks(again, len(tokens))
    kv.free(again)
    assert len(kv.get_computed_blocks(_request("f", tokens))[0]) == 3


# ---- shapes ---------------------------------------------------------------------------------------

def test_server_info_has_sglangs_fields_and_vllms_config(server: ServerProcess) -> None:
    info = get_json(server, "/server_info")
    assert get_json(server, "/get_server_info") == info
    (served,) = [m["id"] for m in get_json(server, "/v1/models")["data"]]
    assert info["served_model_name"] == served
    assert Path(info["model_path"]).is_dir()
    assert (info["tp_size"], info["dp_size"]) == (1, 1)
    assert info["block_size"] == info["page_size"] == BLOCK_SIZE
    assert info["max_total_tokens"] == info["num_gpu_blocks"] * BLOCK_SIZE > 0
    assert info["max_running_requests"] == info["max_num_seqs"] >= 1
    assert isinstance(info["version"], str)
    assert "model" not in info and "model_id" not in info  # SGLang's aliases of one field
    vllm = info["vllm_config"]
    assert vllm["cache_config"]["block_size"] == BLOCK_SIZE
    assert vllm["model_config"]["model"] == info["model_path"]


def test_model_info_has_sglangs_fields(server: ServerProcess) -> None:
    info = get_json(server, "/model_info")
    assert get_json(server, "/get_model_info") == info
    assert info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert info["model_path"] == info["tokenizer_path"] == get_json(server,
                                                                   "/server_info")["model_path"]


def test_get_load_is_sglangs_per_rank_list_by_default(server: ServerProcess) -> None:
    wait_idle(server.url)
    assert get_json(server, "/get_load") == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_get_load_is_vllm_routers_number_with_the_flag(aliased: ServerProcess) -> None:
    wait_idle(aliased.url)
    assert get_json(aliased, "/get_load") == {"load": 0}


def test_render_gives_the_token_ids_a_request_would_compute(server: ServerProcess) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = post_json(server, "/tokenize", {"prompt": text})["tokens"]
    rendered = post_json(server, "/v1/completions/render",
                         {"prompt": text, "max_tokens": 5, "no_stop_trim": False})
    assert isinstance(rendered, list) and len(rendered) == 1
    (one,) = rendered
    assert one["token_ids"] == ids
    assert one["request_id"].startswith("cmpl-") and one["stream"] is False
    many = post_json(server, "/v1/completions/render",
                     {"prompt": [text, "Hello"], "stream": True})
    assert [r["token_ids"] for r in many] == [
        ids, post_json(server, "/tokenize", {"prompt": "Hello"})["tokens"]]
    assert all(r["stream"] is True for r in many)
    assert post_json(server, "/v1/completions/render",
                     {"prompt": [5, 6, 7]})[0]["token_ids"] == [5, 6, 7]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    chat = post_json(server, "/v1/chat/completions/render",
                     {"messages": messages, "separate_reasoning": True})
    assert chat["token_ids"] == post_json(server, "/tokenize", {"messages": messages})["tokens"]
    assert chat["request_id"].startswith("chatcmpl-")


def test_render_refuses_what_the_real_call_refuses(server: ServerProcess) -> None:
    assert_error(http(server, "POST", "/v1/completions/render",
                      {"model": "no-such-model", "prompt": "hi"}), 404, "model")
    assert_error(http(server, "POST", "/v1/chat/completions/render", {"messages": []}), 400)
    assert_error(http(server, "POST", "/v1/completions/render", {"prompt": ""}), 400, "prompt")
    assert_error(http(server, "POST", "/v1/completions/render", b"{not json"), 400)


def test_kv_event_sources_lists_none_without_kv_events_config(server: ServerProcess) -> None:
    # vllm-router reads this as "no publisher"; with --kv-events-config it lists the bound
    # endpoint under "0" (tests/server/test_kv_events.py).
    assert get_json(server, "/kv_event_sources") == {"sources": []}


# ---- /flush_cache ---------------------------------------------------------------------------------

def _hits_of(server: ServerProcess, prompt: list[int]) -> float:
    """Prefix-cache hit tokens that one greedy request for `prompt` adds."""
    before = wait_idle(server.url)["prefix_cache_hits"]
    post_json(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                          "temperature": 0.0, "ignore_eos": True})
    return wait_idle(server.url)["prefix_cache_hits"] - before


def test_flush_cache_turns_the_next_repeat_into_a_miss(server: ServerProcess) -> None:
    prompt = fresh_prompt_ids(seed=1301, length=5 * BLOCK_SIZE + 3)
    assert _hits_of(server, prompt) == 0
    assert _hits_of(server, prompt) == 5 * BLOCK_SIZE  # a repeat hits every full block
    reply = http(server, "POST", "/flush_cache")
    assert reply.status == 200, reply.raw
    assert _hits_of(server, prompt) == 0  # forgotten
    assert _hits_of(server, prompt) == 5 * BLOCK_SIZE  # and cached again


def test_flush_cache_is_refused_while_a_request_runs(server: ServerProcess) -> None:
    prompt = fresh_prompt_ids(seed=1302, length=3 * BLOCK_SIZE)
    body = json.dumps({"prompt": prompt, "max_tokens": 900, "ignore_eos": True,
                       "stream": True}).encode()
    request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as stream:
        assert stream.readline().startswith(b"data: ")  # it is running
        load = get_json(server, "/get_load")[0]
        assert load["num_reqs"] == 1 and load["num_waiting_reqs"] == 0
        assert load["num_tokens"] >= 3 * BLOCK_SIZE  # KV slots it holds
        error = assert_error(http(server, "POST", "/flush_cache"), 409)
        assert error["code"] == "requests_in_flight"
    wait_idle(server.url)  # closing the stream aborted it
    assert http(server, "POST", "/flush_cache").status == 200


# ---- vllm: metric names ---------------------------------------------------------------------------

VLLM_GAUGES = ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc")


def test_vllm_metric_names_only_with_the_flag(server: ServerProcess,
                                              aliased: ServerProcess) -> None:
    post_json(aliased, "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    page = wait_idle(aliased.url)
    for name in VLLM_GAUGES:
        (ours,) = page.find(name)
        (theirs,) = [s for s in page.samples if s.name == "vllm:" + name]
        assert theirs.labels == ours.labels and theirs.value == ours.value
    # every family is mirrored: same samples under the other prefix
    lines = page.text.splitlines()
    assert [line.replace("vllm:", "kvserve:") for line in lines if "vllm:" in line] == \
        [line for line in lines if "kvserve:" in line]
    assert "vllm:" not in scrape(server.url).text
