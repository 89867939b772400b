"""The result file of a load run and the summary table printed at its end."""

from __future__ import annotations

import datetime
import math
import os
import platform
from pathlib import Path
from typing import Any

import orjson

from loadtest.runner import LoadRun

RESULT_KIND, RESULT_VERSION = "kvserve-loadtest", 1


def _json_number(value: Any) -> Any:
    """inf as the string "inf" (JSON has no infinity)."""
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def build_result(label: str, config: dict[str, Any], run: LoadRun,
                 summary: dict[str, Any]) -> dict[str, Any]:
    """Everything about one run, in the documented schema (docs/loadtest.md)."""
    return {
        "kind": RESULT_KIND, "version": RESULT_VERSION, "label": label,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": {k: _json_number(v) for k, v in config.items()},
        "environment": {"client_cores": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform(terse=True)},
        "summary": summary,
        "requests": [r.to_json() for r in run.records],
        "server_metrics": run.server_metrics,
    }


def write_result(result: dict[str, Any], path: str | Path) -> Path:
    """Writes the result as indented JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return path


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100.0 * fraction


def summary_lines(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, value) rows of the end-of-run table."""
    rows: list[tuple[str, Any]] = [
        ("Successful requests", summary["successful_requests"]),
        ("Failed requests", summary["failed_requests"]),
        ("Not sent (time limit)", summary["not_sent"]),
        ("Duration (s)", summary["duration_s"]),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", summary["request_throughput"]),
        ("Output token throughput (tok/s)", summary["output_throughput"]),
        ("Total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    if summary.get("goodput"):
        rows.append(("Goodput (req/s)", summary["goodput"]["request_throughput"]))
    for kind, count in sorted(summary["failures_by_kind"].items()):
        rows.append((f"  failed: {kind}", count))
    return rows


def format_summary(result: dict[str, Any]) -> str:
    """The table printed at the end of `python -m loadtest run`."""
    summary = result["summary"]
    width = 50
    out = [f"{' Load test result: ' + result['label'] + ' ':=^{width}}"]
    out += [f"{name:<36}{_fmt(value):>14}" for name, value in summary_lines(summary)]
    for key, title in (("ttft_ms", "Time to first token"), ("tpot_ms", "Time per output token "
                       "(excl. 1st)"), ("itl_ms", "Inter-token latency"),
                       ("e2el_ms", "End-to-end latency")):
        out.append(f"{' ' + title + ' ':-^{width}}")
        dist = summary[key]
        for stat in ("mean", "median", "p90", "p99", "std"):
            out.append(f"{stat + ' (ms)':<36}{_fmt(dist[stat]):>14}")
    server = summary.get("server")
    if server:
        out.append(f"{' Server /metrics ':-^{width}}")
        out += [f"{name:<36}{_fmt(value):>14}" for name, value in (
            ("Max running", server.get("max_running")),
            ("Max waiting", server.get("max_waiting")),
            ("Max KV cache usage (%)", _percent(server.get("max_kv_cache_usage"))),
            ("Preemptions", server.get("preemptions")),
            ("Prefix cache hit rate (%)", _percent(server.get("prefix_cache_hit_rate"))))]
    out.append("=" * width)
    return "\n".join(out)
