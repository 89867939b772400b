"""The parallelism and routing benchmark (loadtest/benchmarks/distributed*.py): its cheapest
parts for real (the 70B plan, the TP step timing on the tiny model with the comm hook) and
its pieces on made-up inputs (per-replica counters, hit rates, the best-possible bound, the
page and the verdict). No timing thresholds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loadtest.benchmarks import __main__ as suite
from loadtest.benchmarks import distributed, distributed_plan, distributed_tp
from loadtest.benchmarks.distributed_report import render_all
from loadtest.benchmarks.distributed_routing import (
    RoutingConfig,
    best_hit_rate,
    compare,
    kv_tokens_per_replica,
)
from loadtest.benchmarks.distributed_serving import dp_ratios, hit_rates, replica_counters
from loadtest.benchmarks.engines import tiny_model_dir

FRONT_PAGE = """\
# HELP kvserve:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE kvserve:prefix_cache_queries_total counter
kvserve:prefix_cache_queries_total{replica="0",model_name="m"} 100.0
kvserve:prefix_cache_queries_total{replica="1",model_name="m"} 300.0
# HELP kvserve:prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE kvserve:prefix_cache_hits_total counter
kvserve:prefix_cache_hits_total{replica="0",model_name="m"} 64.0
kvserve:prefix_cache_hits_total{replica="1",model_name="m"} 96.0
# HELP kvserve_dp_routed_requests_total Requests routed to each replica.
# TYPE kvserve_dp_routed_requests_total counter
kvserve_dp_routed_requests_total{replica="0"} 3
"""
SINGLE_PAGE = """\
# TYPE kvserve:prefix_cache_queries_total counter
kvserve:prefix_cache_queries_total{model_name="m"} 50.0
# TYPE kvserve:prefix_cache_hits_total counter
kvserve:prefix_cache_hits_total{model_name="m"} 32.0
# TYPE kvserve:num_preemptions_total counter
kvserve:num_preemptions_total{model_name="m"} 2.0
"""


def test_counters_per_replica_from_a_front_and_from_single_servers() -> None:
    front = replica_counters(FRONT_PAGE)
    assert front[0]["prefix_cache_queries"] == 100 and front[1]["prefix_cache_hits"] == 96
    assert replica_counters(SINGLE_PAGE, 1)[1] == {"prefix_cache_queries": 50.0,
                                                   "prefix_cache_hits": 32.0,
                                                   "num_preemptions": 2.0}
    before = {i: dict.fromkeys(c, 0.0) for i, c in front.items()}
    rates = hit_rates(before, front)
    assert rates["hit_rate"] == pytest.approx(160 / 400)
    assert [r["hit_rate"] for r in rates["per_replica"]] == [pytest.approx(0.64),
                                                             pytest.approx(0.32)]
    assert [r["query_share"] for r in rates["per_replica"]] == [0.25, 0.75]
    assert hit_rates(front, front)["hit_rate"] is None  # nothing looked up in between


def test_best_hit_rate_counts_whole_shared_blocks_never_the_last_token() -> None:
    doc = list(range(100, 140))  # 40 tokens: 2 whole blocks
    prompts = [doc + [1, 2], doc + [3, 4], [7] * 20, doc[:32]]
    # the 2nd hits 32 tokens; the 3rd nothing; the 4th would hit 32 but keeps its last token
    assert best_hit_rate(prompts) == pytest.approx((32 + 0 + 16) / (42 + 42 + 20 + 32))
    assert best_hit_rate([]) is None


def test_routing_cache_holds_part_of_the_documents_and_the_requests_in_flight() -> None:
    cfg = RoutingConfig()
    tokens = kv_tokens_per_replica(cfg)
    documents = cfg.documents * cfg.document_tokens
    assert tokens % 16 == 0 and tokens >= cfg.max_model_len
    assert 0.75 * documents < tokens < documents + 9 * (cfg.question_tokens + cfg.max_tokens + 32)


def test_plan_of_the_70b_config_tp8_and_tp4_pp2(tmp_path: Path) -> None:
    plan = distributed_plan.run_plans(tmp_path)
    tp8, tp4pp2 = plan["layouts"]
    assert (tp8["gpus"], tp8["layers_per_gpu"], tp8["kv_heads_per_gpu"]) == (8, 80, 1)
    assert (tp4pp2["gpus"], tp4pp2["layers_per_gpu"], tp4pp2["kv_heads_per_gpu"]) == (8, 40, 2)
    assert tp8["kv_bytes_per_token"] == tp4pp2["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2 // 8
    assert tp4pp2["kv_tokens"] == pytest.approx(tp8["kv_tokens"], rel=0.01)
    assert tp8["weight_gib"] == pytest.approx(70.55e9 * 2 / 8 / 2**30, rel=0.01)
    assert "--tensor-parallel-size 4 within each stage (8 GPUs)" in tp4pp2["text"]
    assert "per GPU (tensor parallel size 4 x pipeline parallel size 2" in tp4pp2["text"]
    assert str(tmp_path) not in tp8["text"] + tp4pp2["text"]


def test_tp_step_timing_hooks_rank_zeros_collectives(tmp_path: Path) -> None:
    """TP=1 and TP=2 on the one-layer tiny model: TP=2 steps spend time in 6 + 2 x layers
    collectives (inputs and logits broadcasts, embedding all-reduce, two per layer, LM head
    all-gather); TP=1 in none."""
    model = tiny_model_dir(tmp_path)
    cfg = distributed_tp.TPConfig(sizes=(1, 4), context=32, steps=2, warmup_s=0.1,
                                  setups=((1, 1, "-"), (2, 1, "shm"), (2, 1, "gloo")),
                                  wait_quiet_s=0.0)
    result = distributed_tp.run_tp(tmp_path, cfg, model)
    one = [r for r in result["rows"] if r["tp"] == 1]
    two = [r for r in result["rows"] if r["tp"] == 2]
    assert [(r["collectives"], r["sequences"]) for r in two] == [
        ("shm", 1), ("shm", 4), ("gloo", 1), ("gloo", 4)]
    assert all(r["collectives_per_step"] == 0 and r["comm_ms"] == 0 for r in one)
    assert all(r["collectives_per_step"] == 6 + 2 * 1 for r in two)
    assert all(0 < r["comm_ms"] <= r["step_ms"] and 0 < r["comm_share"] <= 1 for r in two)
    assert two[1]["comm_kib_per_step"] > two[0]["comm_kib_per_step"]  # more rows, more bytes
    speedups = distributed_tp.tp_speedups(result["rows"])
    assert set(speedups) == {1, 4} and speedups[4]["comm_share"] == two[1]["comm_share"]
    assert speedups[4]["gloo_comm_share"] == two[3]["comm_share"]
    assert speedups[4]["shm_vs_gloo"] == two[3]["step_ms"] / two[1]["step_ms"]


def test_pp_batch_queue_part_on_the_tiny_model(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """The PP part runs its three setups on the two-layer tiny model (one layer per stage),
    leaves the engine's batch queue on, and renders; no timing thresholds."""
    from loadtest.benchmarks import distributed_pp
    from loadtest.benchmarks.distributed_report import render_pp

    result = distributed_pp.run_pp(tmp_path, distributed_pp.PPConfig.quick(), tiny_llama_dir)
    assert [r["setup"] for r in result["rows"]] == list(distributed_pp.SETUPS)
    assert all(r["tok_s"] > 0 for r in result["rows"])
    assert result["batch_queue_gain"] > 0 and result["vs_one_process"] > 0
    page = render_pp(result)
    assert "| PP=2 x 1 thread, batch queue" in page and "Batch queue over one batch" in page
    verdict = distributed.verdict({"pp": result})[1]
    assert verdict.startswith("PP=2 batch queue ")


def _level(conc: int, hit: float, ttft: float) -> dict[str, Any]:
    return {"concurrency": conc, "requests": 8, "ok": 8, "failed": 0, "errors": [],
            "ttft_mean_ms": ttft, "ttft_p50_ms": ttft, "ttft_p99_ms": 2 * ttft,
            "output_tok_s": 10.0, "server_cores": 1.9, "other_cores": 0.0, "hit_rate": hit,
            "queried_tokens": 100.0, "hit_tokens": 100.0 * hit, "preemptions": 0.0,
            "per_replica": [{"replica": 0, "hit_rate": hit, "query_share": 0.5},
                            {"replica": 1, "hit_rate": hit, "query_share": 0.5}]}


def _routing(ours: float, rr: float) -> dict[str, Any]:
    setups = [{"name": "ours", "levels": [_level(1, ours, 100.0), _level(16, ours, 400.0)]},
              {"name": "vllm-router cache_aware",
               "levels": [_level(1, 0.5, 110.0), _level(16, 0.5, 500.0)]},
              {"name": "round robin", "levels": [_level(1, rr, 200.0), _level(16, rr, 800.0)]}]
    result: dict[str, Any] = {
        "config": RoutingConfig().__dict__ | {"levels": [[1, 8], [16, 8]]},
        "threads_per_replica": 1, "kv_tokens_per_replica": 2256,
        "best_hit_rates": [0.7, 0.7], "commands": ["kvserve serve -dp 2"], "setups": setups,
        "skipped": None}
    result["compare"] = compare(result)
    return result


def _dp() -> dict[str, Any]:
    level = {"level": "c=16", "concurrency": 16, "requests": 32, "ok": 32, "failed": 0,
             "output_tokens": 2048, "wall_s": 10.0, "output_tok_s": 204.8, "ttft_p50_ms": 500.0,
             "ttft_p99_ms": 900.0, "itl_p50_ms": 40.0, "itl_p99_ms": 90.0, "errors": [],
             "server_cores": 1.9, "other_cores": 0.8}
    servers = [{"name": "one engine", "command": "kvserve serve", "levels": [level]},
               {"name": "dp=2", "command": "kvserve serve -dp 2",
                "levels": [level | {"output_tok_s": 153.6, "ttft_p99_ms": 1800.0}]}]
    return {"config": distributed_serving_config(), "threads": 2, "replica_threads": 1,
            "servers": servers, "ratios": dp_ratios(servers)}


def distributed_serving_config() -> dict[str, Any]:
    from loadtest.benchmarks.distributed_serving import DPConfig

    return DPConfig().__dict__ | {"concurrency": [16]}


def test_page_and_verdict(tmp_path: Path) -> None:
    result: dict[str, Any] = {"target": distributed.TARGET, "threads": 2, "quick": False,
                              "dp": _dp(), "routing": _routing(ours=0.6, rr=0.3),
                              "tp": {"error": "RankDiedError: rank 1 exited"},
                              "plan": distributed_plan.run_plans(tmp_path)}
    assert result["dp"]["ratios"][0]["tok_s_ratio"] == pytest.approx(0.75)
    result["met"], result["summary"] = distributed.verdict(result)
    assert result["met"] is True
    assert "DP=2 c=16: 0.75x tok/s, 2.00x p99 TTFT" in result["summary"]
    assert "c=16 hit rate ours 60% / vllm-router 50% / round robin 30%" in result["summary"]
    assert "failed: tp" in result["summary"]
    page = render_all(result)
    assert "failed to run: `RankDiedError: rank 1 exited`" in page
    assert "| ours                    | 16          | 8/0       | 60.0%" in page
    assert "0.50x" in page  # ours' mean TTFT over round robin's at both levels
    assert "WARNING: other processes were busy during one engine c=16, dp=2 c=16" in page
    assert "$ kvserve plan llama-3.1-70b-config --memory 140GiB --tensor-parallel-size 4" in page
    assert "**Verdict: met.**" in page
    worse = result | {"routing": _routing(ours=0.3, rr=0.3)}
    assert distributed.verdict(worse)[0] is False
    plan_only = {"target": distributed.TARGET, "plan": result["plan"],
                 **dict(zip(("met", "summary"), distributed.verdict({"plan": result["plan"]}),
                            strict=True))}
    assert plan_only["met"] is None
    assert "Parts not run in this measurement: dp, tp, routing, pp" in render_all(plan_only)


def test_the_suite_runs_it_as_distributed() -> None:
    assert ("distributed", "loadtest.benchmarks.distributed", None) in suite.REGISTRY
    assert distributed.COMMAND.startswith("python -m loadtest.benchmarks.distributed")
