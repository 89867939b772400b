"""The prefix-caching and chunked-prefill benchmarks: their pure analysis on hand-built
timings, and one quick end-to-end run of each against a tiny model (no timing thresholds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.benchmarks import chunked_prefill, prefix_cache
from loadtest.benchmarks.common import SuiteContext

# ---- chunked prefill: window selection ----------------------------------------------------

# Decoder 1 streams every 0.1 s, slows to 0.2 s while the long prompt prefills, then speeds
# up; decoder 2 stalls for the whole window. The long prompt is sent at 0.35 s and its first
# token arrives at 0.95 s.
DECODER_1 = [0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0]
DECODER_2 = [0.05, 0.15, 0.25, 1.05]
SENT, FIRST = 0.35, 0.95


def test_gaps_overlapping_keeps_the_gaps_in_progress_at_both_ends() -> None:
    assert chunked_prefill.gaps_overlapping(DECODER_1, SENT, FIRST) == pytest.approx(
        [0.2, 0.2, 0.2, 0.1])
    assert chunked_prefill.gaps_overlapping(DECODER_2, SENT, FIRST) == pytest.approx([0.8])
    assert chunked_prefill.gaps_overlapping([0.0, 0.1], SENT, FIRST) == []


def test_gaps_before_counts_gaps_that_ended_before_the_send() -> None:
    assert chunked_prefill.gaps_before(DECODER_1, SENT) == pytest.approx([0.1, 0.1, 0.1])
    assert chunked_prefill.gaps_before(DECODER_2, SENT) == pytest.approx([0.1, 0.1])


def test_analyze_gives_exact_window_statistics() -> None:
    stats = chunked_prefill.analyze([DECODER_1, DECODER_2], SENT, FIRST)
    # Window gaps sorted: 0.1 0.2 0.2 0.2 0.8; p99 interpolates at rank 3.96 of 0..4.
    assert stats["window_gaps"] == 5
    assert stats["itl_p50_ms"] == pytest.approx(200.0)
    assert stats["itl_p99_ms"] == pytest.approx(200.0 + 600.0 * 0.96)
    assert stats["itl_max_ms"] == pytest.approx(800.0)
    assert stats["p99_over_p50"] == pytest.approx(776.0 / 200.0)
    assert stats["baseline_gaps"] == 5
    assert stats["baseline_p50_ms"] == pytest.approx(100.0)
    assert stats["p99_over_baseline"] == pytest.approx(7.76)
    assert stats["ttft_ms"] == pytest.approx(600.0)


def test_analyze_without_gaps_reports_none() -> None:
    stats = chunked_prefill.analyze([[0.0]], 1.0, 2.0)
    assert stats["window_gaps"] == 0
    assert stats["itl_p99_ms"] is None and stats["p99_over_baseline"] is None
    assert chunked_prefill.verdict_of([{**stats, "budget": 64}])[0] is None


def test_chunked_verdict_uses_the_smallest_budget() -> None:
    small = {**chunked_prefill.analyze([DECODER_1], SENT, FIRST), "budget": 64}
    large = {**chunked_prefill.analyze([DECODER_2], SENT, FIRST), "budget": 8192}
    met, summary = chunked_prefill.verdict_of([small, large])
    assert met is True  # window gaps 0.1 0.2 0.2 0.2: p99 = median = 0.2 s
    assert "budget 64" in summary and "= 1.0x" in summary and "2.0x the decoders'" in summary
    assert chunked_prefill.verdict_of([large])[0] is True  # one gap: p99 = median
    assert chunked_prefill.verdict_of([])[0] is None


# ---- prefix caching: metrics and arithmetic -----------------------------------------------

METRICS = """# HELP kvserve:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE kvserve:prefix_cache_queries_total counter
kvserve:prefix_cache_queries_total{model_name="m"} 2048.0
kvserve:prefix_cache_hits_total{model_name="m"} 1792.0
kvserve:prefix_cache_hits_created{model_name="m"} 1.7e9
"""


def test_parse_prefix_counters_reads_the_totals() -> None:
    counters = prefix_cache.parse_prefix_counters(METRICS)
    assert counters == {"prefix_cache_queries": 2048.0, "prefix_cache_hits": 1792.0}
    assert prefix_cache.parse_prefix_counters("") == {"prefix_cache_queries": 0.0,
                                                      "prefix_cache_hits": 0.0}


def test_hit_rate_and_ideal_ratio() -> None:
    before = {"prefix_cache_queries": 1024.0, "prefix_cache_hits": 0.0}
    after = {"prefix_cache_queries": 3072.0, "prefix_cache_hits": 1824.0}
    assert prefix_cache.hit_rate(before, after) == pytest.approx(1824 / 2048)
    assert prefix_cache.hit_rate(before, before) is None
    assert prefix_cache.ideal_ratio(1024, 912.0) == pytest.approx(1024 / 112)
    assert prefix_cache.ideal_ratio(1024, 1024.0) is None


def test_prompts_share_exactly_the_prefix() -> None:
    w = {"prompt_len": 100, "num_requests": 3, "concurrency": [1, 4], "seed": 5}
    warm, prompts = prefix_cache.build_prompts(512, w)
    assert len(prompts) == 6 and all(len(p) == 100 for p in [warm, *prompts])
    assert all(p[:90] == warm[:90] for p in prompts)
    assert len({tuple(p[90:]) for p in [warm, *prompts]}) == 7
    assert all(prefix_cache.MIN_TOKEN_ID <= t < 512 for p in prompts for t in p)


def test_ttft_stats_in_ms() -> None:
    stats = prefix_cache.ttft_stats([0.1, 0.2, 0.3, 0.4])
    assert stats["p50_ms"] == pytest.approx(250.0)
    assert stats["p90_ms"] == pytest.approx(370.0)
    assert stats["mean_ms"] == pytest.approx(250.0)


# ---- end to end on a tiny model -----------------------------------------------------------


def _ctx(tmp_path: Path, model: Path, **extra: object) -> SuiteContext:
    return SuiteContext(threads=1, quick=True, log_dir=tmp_path, plot_dir=tmp_path,
                        extra={"model": model, **extra})


@pytest.mark.slow
def test_prefix_cache_quick_run_on_a_tiny_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, tiny_llama_dir, prompt_len=160, num_requests=3, max_tokens=2,
               concurrency=[1, 2])
    result = prefix_cache.run(ctx)
    assert {"target", "met", "summary"} <= set(result) and result["met"] in (True, False)
    assert [r["concurrency"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["on"]["ok"] == row["off"]["ok"] == 3
        assert row["ratio"] > 0
        assert row["on"]["hit_rate"] > 0.8  # 144 of 160 tokens are the cached prefix
        assert row["off"]["hit_rate"] in (None, 0.0)
    assert "**Target:**" in prefix_cache.render(result)


@pytest.mark.slow
def test_chunked_prefill_quick_run_on_a_tiny_model(tiny_llama_dir: Path, tmp_path: Path
                                                   ) -> None:
    ctx = _ctx(tmp_path, tiny_llama_dir, long_prompt_len=600,
               budgets=[1024, 32, chunked_prefill.ADAPTIVE], max_model_len=1024, decoders=2,
               decoder_prompt_len=8, baseline_tokens=3)
    result = chunked_prefill.run(ctx)
    assert {"target", "met", "summary"} <= set(result) and result["met"] in (True, False)
    assert [r["budget"] for r in result["rows"]] == [32, 1024, chunked_prefill.ADAPTIVE]
    surface = result["cost_surface"]  # measured for the adaptive row
    assert surface["decode_ms"] > 0
    assert sorted({(r["depth"], r["chunk"]) for r in surface["rows"]}) == [
        (d, c) for d in (150, 300, 500) for c in (4, 16, 64)]
    assert all(r["step_ms"] > 0 for r in surface["rows"])
    assert "Step cost of one chunk beside the decodes" in chunked_prefill.render(result)
    for row in result["rows"]:
        assert row["window_gaps"] > 0 and row["baseline_gaps"] > 0
        assert row["ttft_ms"] > 0 and row["itl_max_ms"] >= row["itl_p99_ms"] > 0
        assert row["p99_over_p50"] >= 1.0
    assert "**Target:**" in chunked_prefill.render(result)


def test_a_full_serving_run_builds_the_peer_venv_first(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """`--only serving` on a fresh checkout: the suite builds .venv-bench before measuring
    (it used to report the peer as not measured); a quick run never installs anything."""
    from loadtest.benchmarks import serving

    calls: list[str] = []
    monkeypatch.setattr(serving, "setup_peer_venv", lambda: calls.append("setup"))
    monkeypatch.setattr(serving, "measure", lambda *a: calls.append("measure") or {})
    monkeypatch.setattr(serving, "_plots", lambda *a: [])
    monkeypatch.setattr(serving, "judge", lambda report, plots: {"report": report})
    serving.run(SuiteContext(threads=1, quick=False, log_dir=tmp_path, plot_dir=tmp_path))
    assert calls == ["setup", "measure"]
    calls.clear()
    serving.run(SuiteContext(threads=1, quick=True, log_dir=tmp_path, plot_dir=tmp_path))
    assert calls == ["measure"]
