"""`cache_salt` over HTTP: requests share prefix-cache blocks only when their salts match, and
a bad salt is a 400 naming it."""

from __future__ import annotations

from tests.support.api import assert_error, http, post_json
from tests.support.metrics import scrape
from tests.support.server_process import ServerProcess
from tests.support.tiny_models import random_prompts


def prefix_hits_of(server: ServerProcess, prompt: list[int], salt: str | None) -> float:
    """Prefix-cache hit tokens that one completion of `prompt` added."""
    before = scrape(server.url)["prefix_cache_hits"]
    body: dict[str, object] = {"prompt": prompt, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    post_json(server, "/v1/completions", body)
    return scrape(server.url)["prefix_cache_hits"] - before


def test_only_requests_with_the_same_salt_share_the_prefix(tiny_server: ServerProcess) -> None:
    (prompt,) = random_prompts(512, 1, 40, 40, seed=4242)  # 2 full blocks of 16 can hit
    assert prefix_hits_of(tiny_server, prompt, "alice") == 0
    assert prefix_hits_of(tiny_server, prompt, "bob") == 0
    assert prefix_hits_of(tiny_server, prompt, "alice") == 32
    assert prefix_hits_of(tiny_server, prompt, None) == 0
    assert prefix_hits_of(tiny_server, prompt, None) == 32
    assert prefix_hits_of(tiny_server, prompt, "bob") == 32


def test_an_empty_salt_is_refused(tiny_server: ServerProcess) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        assert_error(http(tiny_server, "POST", path, {**body, "cache_salt": ""}), 400,
                     "cache_salt")
