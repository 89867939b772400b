"""The data-parallel front's routing and /metrics merge as pure functions (server/dp_routing.py,
server/dp_replicas.py): least loaded, prefix affinity, overload spill, dead replicas."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from server.dp_replicas import child_argv, merge_metrics, threads_per_replica
from server.dp_routing import (
    MAX_EXTRA_LOAD,
    PREFIX_CHARS,
    Balancer,
    choose_replica,
    prefix_key,
    prompt_text,
)

LONG = "You are a helpful assistant. " * 20  # > PREFIX_CHARS


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
    first, second = balancer.acquire(None), balancer.acquire(None)
    assert {first, second} == {0, 1}
    assert balancer.in_flight == [1, 1]
    assert balancer.acquire(None) == 0 and balancer.in_flight == [2, 1]
    balancer.release(0)
    balancer.release(0)
    assert balancer.acquire(None) == 0  # now the least loaded
    assert balancer.routed == [3, 1]


def test_balancer_prefix_affinity_and_spill() -> None:
    balancer = Balancer(2, max_extra_load=MAX_EXTRA_LOAD)
    key = prefix_key(LONG + "first question")
    assert key is not None and key == prefix_key(LONG + "another question")  # same prefix
    home = balancer.acquire(key)
    assert home is not None
    # Same prefix keeps going home while home carries <= MAX_EXTRA_LOAD more than the other.
    for _ in range(MAX_EXTRA_LOAD):
        assert balancer.acquire(key) == home
    assert balancer.affinity_hits == MAX_EXTRA_LOAD
    other = balancer.acquire(key)  # home is now MAX_EXTRA_LOAD + 1 ahead: spill
    assert other == 1 - home
    assert balancer.acquire(key) == other  # the prefix moved with the spill
    # A different prefix goes to the least loaded replica, not to a prefix's home.
    assert balancer.acquire(prefix_key("z" * PREFIX_CHARS)) == other


def test_dead_replica_loses_its_prefixes() -> None:
    balancer = Balancer(3)
    key = prefix_key(LONG)
    home = balancer.acquire(key)
    assert home is not None
    balancer.release(home)
    balancer.mark_dead(home)
    for _ in range(5):
        chosen = balancer.acquire(key)
        assert chosen is not None and chosen != home


def test_prefix_table_is_bounded() -> None:
    balancer = Balancer(2, capacity=8)
    for i in range(50):
        balancer.acquire(prefix_key(f"{i:04d}" + LONG))
    assert len(balancer._prefixes) == 8


def test_prompt_text_and_key() -> None:
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert prompt_text(chat) == "system: Be brief.\nuser: Hi"
    assert prompt_text({"prompt": ["a", "b"]}) == "a"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text(None) == "" and prompt_text({"prompt": 5}) == ""
    assert prefix_key("short") is None  # too short to pin
    assert prefix_key(LONG + "a") == prefix_key(LONG + "b")
    assert prefix_key("a" + LONG) != prefix_key("b" + LONG)


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
