"""The data-parallel front's routing and /metrics merge as pure functions (server/dp_routing.py,
server/dp_replicas.py): least loaded, prefix affinity, overload spill, dead replicas."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from server.dp_replicas import child_argv, merge_metrics, threads_per_replica
from server.dp_routing import (
    MAX_EXTRA_LOAD,
    PREFIX_LENGTHS,
    Balancer,
    choose_replica,
    prefix_keys,
    prompt_text,
)

LONG = "You are a helpful assistant. " * 20  # 580 characters: keys at 64 .. 512


def test_least_loaded_wins() -> None:
    assert choose_replica([3, 1, 2], [True] * 3, None) == 1
    assert choose_replica([0, 5, 0, 5], [True] * 4, None, start=1) == 2  # ties: from start on
    assert choose_replica([0, 0], [True, True], None, start=1) == 1


def test_unhealthy_replicas_are_skipped() -> None:
    assert choose_replica([9, 0, 5], [True, False, True], None) == 2
    assert choose_replica([0, 0], [False, False], None) is None
    assert choose_replica([0, 9], [False, True], 0) == 1  # affinity to a dead replica ignored


def test_affinity_wins_until_overloaded() -> None:
    assert choose_replica([2, 0], [True, True], 0, max_extra_load=4) == 0
    assert choose_replica([4, 0], [True, True], 0, max_extra_load=4) == 0  # at the limit
    assert choose_replica([5, 0], [True, True], 0, max_extra_load=4) == 1  # spills over


def test_balancer_spreads_and_counts() -> None:
    balancer = Balancer(2)
    first, second = balancer.acquire(), balancer.acquire()
    assert {first, second} == {0, 1}
    assert balancer.in_flight == [1, 1]
    assert balancer.acquire() == 0 and balancer.in_flight == [2, 1]
    balancer.release(0)
    balancer.release(0)
    assert balancer.acquire() == 0  # now the least loaded
    assert balancer.routed == [3, 1]


def test_balancer_prefix_affinity_and_spill() -> None:
    balancer = Balancer(2, max_extra_load=MAX_EXTRA_LOAD)
    keys = prefix_keys(LONG + "first question")
    assert keys[:4] == prefix_keys(LONG + "another question")[:4]  # same 512-char prefix
    home = balancer.acquire(keys)
    assert home is not None
    # Same prefix keeps going home while home carries <= MAX_EXTRA_LOAD more than the other.
    for _ in range(MAX_EXTRA_LOAD):
        assert balancer.acquire(prefix_keys(LONG + "another question")) == home
    assert balancer.affinity_hits == MAX_EXTRA_LOAD
    other = balancer.acquire(keys)  # home is now MAX_EXTRA_LOAD + 1 ahead: spill
    assert other == 1 - home
    balancer.release(home)
    balancer.release(home)
    # The spill did not move the prefix: once the load allows, it goes home again.
    assert balancer.acquire(keys) == home
    # A different prefix goes to the least loaded replica, not to a prefix's home.
    assert balancer.acquire(prefix_keys("z" * 300)) == other


def test_longest_shared_prefix_wins() -> None:
    """A shared system prompt owned by one replica, a conversation's history by the other:
    the conversation's next turn follows its history (the longer prefix)."""
    balancer = Balancer(2, max_extra_load=0)
    system = "system: " + "Answer briefly and cite the document. " * 4  # > 128 characters
    assert balancer.acquire(prefix_keys(system + "user: hello")) == 0
    history = system + "user: " + "tell me about rivers and lakes " * 6  # > 256 characters
    assert balancer.acquire(prefix_keys(history)) == 1  # replica 0 is busier: spills
    balancer.release(0)
    balancer.release(1)
    follow_up = history + "assistant: they hold water. user: and oceans?"
    assert balancer.acquire(prefix_keys(follow_up)) == 1  # its history lives on replica 1
    assert balancer.acquire(prefix_keys(system + "user: something else")) == 0


def test_dead_replica_loses_its_prefixes() -> None:
    balancer = Balancer(3)
    keys = prefix_keys(LONG)
    home = balancer.acquire(keys)
    assert home is not None
    balancer.release(home)
    balancer.mark_dead(home)
    for _ in range(5):
        chosen = balancer.acquire(keys)
        assert chosen is not None and chosen != home


def test_prefix_table_is_bounded() -> None:
    balancer = Balancer(2, capacity=8)
    for i in range(50):
        balancer.acquire(prefix_keys(f"{i:04d}" + LONG))
    assert len(balancer._prefixes) == 8


def test_prompt_text_and_keys() -> None:
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert prompt_text(chat) == "system: Be brief.\nuser: Hi"
    assert prompt_text({"prompt": ["a", "b"]}) == "a"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text(None) == "" and prompt_text({"prompt": 5}) == ""
    assert prefix_keys("short") == ()  # too short to pin
    assert len(prefix_keys(LONG)) == 4 and len(prefix_keys("x" * PREFIX_LENGTHS[-1])) == 9
    assert prefix_keys(LONG + "a") == prefix_keys(LONG + "b")
    assert set(prefix_keys("a" + LONG)).isdisjoint(prefix_keys("b" + LONG))
    # Each key hashes exactly its prefix: a prompt's 128-character key is another's whose
    # first 128 characters are the same, multi-byte characters included.
    text = "é" * 100 + "x" * 100
    assert prefix_keys(text)[1] == prefix_keys(text[:128] + "y" * 50)[1]
    assert prefix_keys(text)[1] != prefix_keys(text[:127] + "y" * 50)[1]


def test_threads_and_child_argv() -> None:
    assert threads_per_replica(8, 2) == 4
    assert threads_per_replica(3, 2) == 1
    assert threads_per_replica(1, 4) == 1
    argv = child_argv(["serve", "m", "-dp", "2", "--port", "9"], 1234, 3)
    assert argv[-8:] == ["--data-parallel-size", "1", "--host", "127.0.0.1", "--port", "1234",
                         "--num-threads", "3"]


def test_merge_metrics_is_valid_prometheus() -> None:
    page = ("# HELP kvserve:running Running.\n# TYPE kvserve:running gauge\n"
            'kvserve:running{model_name="m"} 2.0\n'
            "# HELP kvserve:done_total Done.\n# TYPE kvserve:done_total counter\n"
            "kvserve:done_total 3.0\n")
    merged = merge_metrics([page, None, page.replace("2.0", "5.0")])
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    running = {s.labels["replica"]: s.value for s in families["kvserve:running"].samples}
    assert running == {"0": 2.0, "2": 5.0}
    assert all(s.labels.get("model_name") == "m" for s in families["kvserve:running"].samples)
    assert len(families["kvserve:done"].samples) == 2
    assert merged.count("# TYPE kvserve:running") == 1
