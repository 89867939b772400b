"""loadtest plots and compare: series helpers on hand-computed examples, PNGs for normal and
degenerate runs, the comparison table and the `compare` entry point, on synthetic results."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from loadtest.compare import compare_main, compare_table, format_value, load_result
from loadtest.plots import (
    MISSING_MPL,
    _pyplot,
    cdf,
    choose_bin_s,
    inflight_series,
    latency_ms,
    plot_compare,
    plot_run,
    token_rate_series,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _stats(values_ms: list[float]) -> dict[str, float | None]:
    """Summary latency stats in the schema's shape (p90/p99 by nearest rank)."""
    if not values_ms:
        empty: dict[str, float | None] = dict.fromkeys(("mean", "median", "p90", "p99", "std"))
        return empty
    xs = sorted(values_ms)
    return {"mean": statistics.mean(xs), "median": statistics.median(xs),
            "p90": xs[int(0.9 * (len(xs) - 1))], "p99": xs[int(0.99 * (len(xs) - 1))],
            "std": statistics.pstdev(xs)}


def _request(start: float, ttft: float, itl: float, n_tokens: int) -> dict[str, Any]:
    """A successful streamed request: first token after ttft, then n_tokens - 1 gaps of itl."""
    gaps = [itl] * (n_tokens - 1)
    return {"start_s": start, "ok": True, "status": 200, "error_kind": "", "error": "",
            "ttft_s": ttft, "tpot_s": itl if gaps else None, "itl_s": gaps,
            "e2e_s": ttft + sum(gaps), "prompt_tokens": 32, "output_tokens": n_tokens,
            "usage_reported": True, "finish_reason": "length"}


def _failed(start: float) -> dict[str, Any]:
    """A request the server refused with HTTP 400."""
    return {"start_s": start, "ok": False, "status": 400,
            "error_kind": "http_400:invalid_request_error", "error": "HTTP 400: {}",
            "ttft_s": None, "tpot_s": None, "itl_s": [], "e2e_s": 0.01,
            "prompt_tokens": None, "output_tokens": 0, "usage_reported": False,
            "finish_reason": None}


def _server_metrics(duration: float) -> list[dict[str, Any]]:
    """/metrics samples every 0.5 s; KV usage ramps up, one sample lacks every gauge."""
    n = int(duration / 0.5) + 1
    samples: list[dict[str, Any]] = [{
        "t": 0.5 * i, "running": float(min(i, 8)), "waiting": float(max(0, i - 8)),
        "kv_cache_usage": min(1.0, 0.05 * i), "preemptions": 0.0,
        "prefix_cache_hit_rate": 0.5} for i in range(n)]
    samples[1] = {"t": 0.5, "running": None, "waiting": None, "kv_cache_usage": None,
                  "preemptions": None, "prefix_cache_hit_rate": None}
    return samples


def make_result(label: str, n_ok: int, spacing: float, n_tokens: int, *, n_failed: int = 0,
                server: bool = True, goodput: bool = False) -> dict[str, Any]:
    """A schema-shaped result: n_ok requests sent every `spacing` s (ttft 0.2 s, itl 0.05 s,
    n_tokens each), then n_failed refused ones; duration is n_ok * spacing."""
    requests = [_request(i * spacing, 0.2, 0.05, n_tokens) for i in range(n_ok)]
    requests += [_failed(i * spacing) for i in range(n_failed)]
    duration = n_ok * spacing if n_ok else 1.0
    lat = latency_ms(requests)
    out_tokens = n_ok * n_tokens
    summary: dict[str, Any] = {
        "successful_requests": n_ok, "failed_requests": n_failed, "not_sent": 0,
        "failures_by_kind": {"http_400:invalid_request_error": n_failed} if n_failed else {},
        "failure_examples": {}, "duration_s": duration,
        "total_input_tokens": 32 * n_ok, "total_output_tokens": out_tokens,
        "request_throughput": n_ok / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (32 * n_ok + out_tokens) / duration,
        "ttft_ms": _stats(lat["TTFT"]), "tpot_ms": _stats(lat["TPOT"]),
        "itl_ms": _stats(lat["ITL"]), "e2el_ms": _stats(lat["E2E"]),
        "goodput": ({"slos_ms": {"ttft": 500.0}, "good_requests": n_ok,
                     "request_throughput": 0.5 * n_ok / duration} if goodput else None),
        "server": ({"max_running": 8.0, "max_waiting": 2.0, "max_kv_cache_usage": 0.75,
                    "preemptions": 3.0, "prefix_cache_hit_rate": 0.5} if server else None),
    }
    config = {"url": "http://127.0.0.1:8000", "transport": "sse", "endpoint": "chat",
              "model": "tiny", "dataset": "random", "num_prompts": n_ok + n_failed,
              "request_rate": 1.0 / spacing, "burstiness": 1.0, "max_concurrency": 16,
              "duration_s": None, "seed": 0, "goodput": None}
    return {"kind": "kvserve-loadtest", "version": 1, "label": label,
            "date": "2026-11-30T02:00:00Z", "config": config,
            "environment": {"client_cores": 2, "python": "3.10"}, "summary": summary,
            "requests": requests, "server_metrics": _server_metrics(duration) if server else []}


def assert_png(path: Path) -> None:
    """A PNG file of a real figure, not an empty stub."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 10_000


# ---- series helpers -----------------------------------------------------------------------

HAND_REQUESTS: list[dict[str, Any]] = [
    # token arrivals 0.5, 0.8, 1.2, 2.2
    {"start_s": 0.0, "ok": True, "ttft_s": 0.5, "itl_s": [0.3, 0.4, 1.0], "e2e_s": 2.2},
    # token arrivals 1.25, 1.75, 2.25
    {"start_s": 1.0, "ok": True, "ttft_s": 0.25, "itl_s": [0.5, 0.5], "e2e_s": 1.25},
    # failed after streaming 0.6, 0.7: counted only with only_ok=False
    {"start_s": 0.5, "ok": False, "ttft_s": 0.1, "itl_s": [0.1], "e2e_s": 0.3},
    # refused: no tokens
    {"start_s": 0.0, "ok": False, "ttft_s": None, "itl_s": [], "e2e_s": 0.01},
]


def test_token_rate_series_counts_tokens_per_bin() -> None:
    starts, rates = token_rate_series(HAND_REQUESTS, 1.0)
    assert starts == [0.0, 1.0, 2.0]
    assert rates == [2.0, 3.0, 2.0]
    starts, rates = token_rate_series(HAND_REQUESTS, 0.5)
    assert starts == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    assert rates == pytest.approx([0.0, 4.0, 4.0, 2.0, 4.0])  # 0.5 falls in [0.5, 1.0)


def test_token_rate_series_end_and_failed_requests() -> None:
    starts, rates = token_rate_series(HAND_REQUESTS, 1.0, end_s=4.0)
    assert starts == [0.0, 1.0, 2.0, 3.0] and rates == [2.0, 3.0, 2.0, 0.0]
    _, rates = token_rate_series(HAND_REQUESTS, 1.0, only_ok=False)
    assert rates == [4.0, 3.0, 2.0]
    assert token_rate_series([], 1.0) == ([], [])
    assert token_rate_series([HAND_REQUESTS[3]], 1.0, end_s=2.0) == ([0.0, 1.0], [0.0, 0.0])
    with pytest.raises(ValueError):
        token_rate_series(HAND_REQUESTS, 0.0)


def test_inflight_series_and_bin_choice() -> None:
    assert inflight_series(HAND_REQUESTS, [0.0, 0.6, 1.0, 2.2, 3.0]) == [2, 2, 2, 1, 0]
    for duration in (0.3, 5.0, 20.0, 60.0, 100.0, 900.0):
        n_bins = duration / choose_bin_s(duration)
        assert 20 <= n_bins <= 100 + 1e-9
    assert choose_bin_s(60.0) == 1.0


def test_cdf_is_monotone_and_ends_at_one() -> None:
    xs, ys = cdf([3.0, None, 1.0, 2.0, 2.0, float("nan")])
    assert xs == [1.0, 2.0, 2.0, 3.0]
    assert all(a <= b for a, b in zip(ys, ys[1:], strict=False))
    assert ys[-1] == 1.0 and ys[0] == 0.25
    assert cdf([]) == ([], [])


def test_latency_ms_uses_successful_requests_only() -> None:
    lat = latency_ms(HAND_REQUESTS)
    assert lat["TTFT"] == pytest.approx([500.0, 250.0])
    assert lat["ITL"] == pytest.approx([300.0, 400.0, 1000.0, 500.0, 500.0])
    assert lat["TPOT"] == []  # the hand requests carry no tpot_s


# ---- plots --------------------------------------------------------------------------------

def test_plot_run_normal_run_with_failures(tmp_path: Path) -> None:
    result = make_result("kvserve c=16", 30, 0.5, 20, n_failed=3)
    assert_png(plot_run(result, tmp_path / "sub" / "run.png"))


def test_plot_run_without_successes_or_metrics(tmp_path: Path) -> None:
    result = make_result("broken", 0, 0.5, 20, n_failed=5, server=False)
    assert result["summary"]["ttft_ms"]["mean"] is None
    assert_png(plot_run(result, tmp_path / "none.png"))


def test_plot_run_single_request(tmp_path: Path) -> None:
    result = make_result("one", 1, 2.0, 1)
    del result["server_metrics"]
    assert_png(plot_run(result, str(tmp_path / "one.png")))


def test_plot_compare(tmp_path: Path) -> None:
    runs = [make_result("a", 10, 1.0, 10), make_result("b", 20, 0.25, 40, goodput=True),
            make_result("c", 0, 1.0, 10, n_failed=2, server=False)]
    assert_png(plot_compare(runs, ["a", "b", "c"], tmp_path / "cmp.png"))
    with pytest.raises(ValueError):
        plot_compare(runs, ["a"], tmp_path / "bad.png")


def test_missing_matplotlib_gives_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        _pyplot()
    assert "--plot" in MISSING_MPL


# ---- compare ------------------------------------------------------------------------------

def test_compare_table_text_with_ratio() -> None:
    a, b = make_result("base", 10, 1.0, 10), make_result("new", 20, 0.25, 40, goodput=True)
    table = compare_table([a, b], ["base", "new"])
    lines = table.splitlines()
    assert lines[0].split() == ["metric", "base", "new", "last/first"]
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", ln) for ln in lines[2:])}
    assert rows["output tok/s"] == ["10.00", "160.0", "16.00x"]
    assert rows["request/s"] == ["1.00", "4.00", "4.00x"]
    assert rows["successful requests"] == ["10", "20", "2.00x"]
    assert rows["goodput req/s"] == ["-", "2.00", "-"]
    assert rows["max KV cache usage"] == ["75.0%", "75.0%", "1.00x"]
    assert rows["TTFT median (ms)"] == ["200.0", "200.0", "1.00x"]


def test_compare_table_markdown_and_missing_values() -> None:
    runs = [make_result("a|1", 10, 1.0, 10), make_result("b", 0, 1.0, 10, server=False),
            make_result("c", 5, 1.0, 10)]
    md = compare_table(runs, ["a|1", "b", "c"], markdown=True)
    lines = md.splitlines()
    assert lines[0] == "| metric | a\\|1 | b | c |"
    assert lines[1] == "|:---|---:|---:|---:|"
    assert "last/first" not in md
    assert "| prefix cache hit rate | 50.0% | - | 50.0% |" in lines
    assert "| TTFT mean (ms) | 200.0 | - | 200.0 |" in lines


def test_format_value() -> None:
    assert format_value(None, "num") == "-"
    assert format_value(1523.7, "num") == "1,524"
    assert format_value(0.00412, "num") == "0.00412"
    assert format_value(12345.0, "count") == "12,345"
    assert format_value(0.123, "pct") == "12.3%"


def _write(path: Path, obj: Any) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


def test_load_result_rejects_other_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="other.json"):
        load_result(_write(tmp_path / "other.json", {"kind": "something"}))
    with pytest.raises(ValueError, match="version"):
        load_result(_write(tmp_path / "v2.json", {"kind": "kvserve-loadtest", "version": 2}))
    with pytest.raises(ValueError, match="missing.json"):
        load_result(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="junk.json"):
        load_result(tmp_path / "junk.json")


def test_compare_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path / "a.json", make_result("same", 10, 1.0, 10))
    b = _write(tmp_path / "b.json", make_result("same", 20, 0.25, 40))
    bad = _write(tmp_path / "bad.json", [1, 2, 3])
    assert compare_main([a, bad]) == 2
    assert "bad.json" in capsys.readouterr().err
    assert compare_main([a, b]) == 0
    out = capsys.readouterr().out
    assert "same (a.json)" in out and "same (b.json)" in out and "160.0" in out
    png = tmp_path / "cmp.png"
    assert compare_main([a, b, "--labels", "x", "y", "--markdown", "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("| metric | x | y | last/first |")
    assert str(png) in captured.err
    assert_png(png)
    assert compare_main([a, b, "--labels", "x"]) == 2
    assert compare_main([]) == 2  # usage error: argparse prints, we return its code
