"""The offline benchmarks' pure helpers and the benchmarks' shared ones: workload shape,
roofline arithmetic, tables, contention accounting (no timing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.benchmarks.common import (
    format_table,
    random_prompts,
    ratio,
    spread_lengths,
    target_line,
    verdict,
)
from loadtest.benchmarks.machine import median_run, other_cores, other_cpu_values
from loadtest.benchmarks.offline import parse_args
from loadtest.benchmarks.offline_config import BenchConfig
from loadtest.benchmarks.offline_report import (
    bandwidth_floor_tokens_per_s,
    decode_step_flops,
    faster,
    roofline_step_seconds,
    roofline_summary,
)


def test_spread_lengths_cover_the_range_evenly() -> None:
    lengths = spread_lengths(64, 32, 512, seed=0)
    assert len(lengths) == 64
    assert min(lengths) == 32 and max(lengths) == 512
    assert sum(lengths) / 64 == pytest.approx(272, abs=0.5)
    assert sorted(lengths) == sorted(spread_lengths(64, 32, 512, seed=1))
    assert lengths == spread_lengths(64, 32, 512, seed=0)
    assert lengths != sorted(lengths)  # shuffled


def test_spread_lengths_single_prompt_is_the_midpoint() -> None:
    assert spread_lengths(1, 32, 512, seed=0) == [272]


def test_random_prompts_avoid_excluded_ids_and_are_seeded() -> None:
    prompts = random_prompts([5, 40, 7], vocab_size=20, excluded_ids={0, 1, 2, 3}, seed=3)
    assert [len(p) for p in prompts] == [5, 40, 7]
    assert all(4 <= t < 20 for p in prompts for t in p)
    assert prompts == random_prompts([5, 40, 7], 20, {0, 1, 2, 3}, seed=3)
    assert prompts != random_prompts([5, 40, 7], 20, {0, 1, 2, 3}, seed=4)


def test_decode_step_flops_smollm2_shape() -> None:
    # 134,515,008 params, 30 layers x 9 heads x 64 head_dim, mean context 100, 64 sequences:
    # linear 2 * 134515008 * 64 = 17,217,921,024; attention 4 * 30 * 9 * 64 * 100 * 64 =
    # 442,368,000.
    flops = decode_step_flops(134_515_008, 30, 9, 64, 100.0, 64)
    assert flops == 17_217_921_024 + 442_368_000


def test_roofline_takes_the_slower_bound() -> None:
    # 18 GFLOP at 100 GFLOP/s = 0.18 s; 538 MB at 20 GB/s = 0.0269 s -> compute-bound.
    assert roofline_step_seconds(18e9, 538e6, 100e9, 20e9) == pytest.approx(0.18)
    # 0.2 GFLOP at 100 GFLOP/s = 0.002 s; 538 MB at 20 GB/s = 0.0269 s -> memory-bound.
    assert roofline_step_seconds(0.2e9, 538e6, 100e9, 20e9) == pytest.approx(0.0269)


def test_roofline_times_each_part_at_the_peak_of_its_arithmetic(tiny_llama_dir: Path) -> None:
    from engine.config import ModelConfig

    mc = ModelConfig.from_folder(tiny_llama_dir)
    rates = {"gemm_square_gflops": 100.0, "read_gbs": 1e6,  # compute-bound by far
             "gemm_square_by_arithmetic": {"float32": 100.0, "bfloat16": 200.0, "int8": 800.0}}
    decode = {"mean_context": 50.0, "num_seqs": 8, "median_step_s": 1.0, "median_worker_s": 1.0}
    linear = 2 * mc.num_params() * 8
    attention = 4 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * 50.0 * 8
    plain = roofline_summary(mc, rates, decode, 1000)
    assert plain["compute_s"] == pytest.approx((linear + attention) / 100e9)
    tiled = roofline_summary(mc, rates, decode, 1000, {"linear": "int8", "attention": "bfloat16"})
    assert tiled["compute_s"] == pytest.approx(linear / 800e9 + attention / 200e9)
    assert tiled["roofline_s"] == pytest.approx(tiled["compute_s"])
    # the KV attended: every sequence's context, in the cache's element size (not the weights')
    per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
    assert plain["kv_bytes"] == pytest.approx(8 * 50.0 * per_token * 4)
    assert roofline_summary(mc, rates, decode, 1000, kv_element_bytes=2)["kv_bytes"] == \
        pytest.approx(8 * 50.0 * per_token * 2)
    del rates["gemm_square_by_arithmetic"]  # an older run: the float32 peak for everything
    assert roofline_summary(mc, rates, decode, 1000, {"linear": "int8"})["compute_s"] == \
        pytest.approx(plain["compute_s"])


def test_bandwidth_floor() -> None:
    assert bandwidth_floor_tokens_per_s(538e6, 21.52e9) == pytest.approx(40.0)


def test_ratio_handles_missing_values() -> None:
    assert ratio(300.0, 30.0) == pytest.approx(10.0)
    assert ratio(None, 30.0) is None
    assert ratio(300.0, 0.0) is None


def test_target_lines() -> None:
    assert target_line(">= 10x", True, "12.0x") == \
        "**Target:** >= 10x. **Measured:** 12.0x. **Verdict: met.**"
    assert target_line(">= 50%", False, "42%") == \
        "**Target:** >= 50%. **Measured:** 42%. **Verdict: missed.**"
    assert "not measured" in target_line(">= 85%", None, "-")
    assert verdict(None, skipped=True) == "skipped" and verdict(True) == "met"


def test_format_table() -> None:
    text = format_table(("a", "bb"), [(1.23456, None), ("long cell", 12345.6)])
    assert text.splitlines() == [
        "| a         | bb    |",
        "|-----------|-------|",
        "| 1.23      | -     |",
        "| long cell | 12346 |",
    ]


def test_parse_args_quick_shrinks_the_workload() -> None:
    cfg = parse_args(["--quick", "--threads", "1"])
    assert cfg.threads == 1 and cfg.num_prompts < BenchConfig().num_prompts
    assert parse_args([]).num_prompts == 64 and parse_args([]).hf_sequential_prompts == 8


def test_other_cores_subtracts_this_process() -> None:
    # Machine busy 9 CPU-seconds over 3 s of wall time, 6 of them ours: others held 1 core.
    assert other_cores((100.0, 10.0), (109.0, 16.0), 3.0) == pytest.approx(1.0)
    assert other_cores((100.0, 10.0), (105.0, 16.0), 3.0) == 0.0  # clock skew never negative


def test_other_cpu_values_walks_nested_results() -> None:
    report = {"a": {"other_cpu_cores": 0.5, "b": {"other_cpu_cores": None}},
              "c": {"d": {"other_cpu_cores": 1.5}}, "e": [1, 2]}
    assert sorted(other_cpu_values(report)) == [0.5, 1.5]


def test_faster_names_the_winner_and_its_margin() -> None:
    assert faster(("float32", 150.0), ("bfloat16", 50.0)) == "float32 (3.00x)"
    assert faster(("float32", 10.0), ("bfloat16", 12.5)) == "bfloat16 (1.25x)"


def test_kvserve_decode_reaches_all_decoding_with_async_scheduling(tiny_llama_dir: Path) -> None:
    """The timed decode steps start once every prompt decodes; with async scheduling a request's
    next token is already in flight then (it never has exactly one token left), which once made
    this loop spin forever."""
    from engine import LLM
    from loadtest.benchmarks.offline_run import kvserve_decode

    llm = LLM(str(tiny_llama_dir), async_scheduling=True, kv_cache_memory_bytes=2**20)
    try:
        result = kvserve_decode(llm, [[5, 6, 7], [8, 9, 10, 11]], 3, False)
    finally:
        llm.engine.shutdown()
    assert result["tokens_per_s"] > 0


def test_batch1_takes_the_median_run_and_keeps_every_runs_rate() -> None:
    rates = iter([240.0, 210.0, 250.0])
    result = median_run(lambda: {"tokens": 256, "tokens_per_s": next(rates)}, 3)
    assert result["tokens_per_s"] == 240.0
    assert result["runs_tokens_per_s"] == [210.0, 240.0, 250.0]
