"""`python -m loadtest compare`: load result JSON files, print a side-by-side table of their
summaries (text or markdown) and optionally draw the comparison plot."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULT_KIND = "kvserve-loadtest"
RESULT_VERSION = 1

# (row name, key path under the result's "summary", format kind)
Metric = tuple[str, tuple[str, ...], str]


def _latency_rows() -> list[Metric]:
    """Mean, median and p99 rows for each latency the summary reports."""
    rows: list[Metric] = []
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                      ("E2E", "e2el_ms")):
        rows += [(f"{name} {stat} (ms)", (key, stat), "num") for stat in ("mean", "median", "p99")]
    return rows


METRICS: list[Metric] = [
    ("successful requests", ("successful_requests",), "count"),
    ("failed requests", ("failed_requests",), "count"),
    ("duration (s)", ("duration_s",), "num"),
    ("request/s", ("request_throughput",), "num"),
    ("output tok/s", ("output_throughput",), "num"),
    ("total tok/s", ("total_token_throughput",), "num"),
    *_latency_rows(),
    ("goodput req/s", ("goodput", "request_throughput"), "num"),
    ("max KV cache usage", ("server", "max_kv_cache_usage"), "pct"),
    ("preemptions", ("server", "preemptions"), "count"),
    ("prefix cache hit rate", ("server", "prefix_cache_hit_rate"), "pct"),
]


def load_result(path: str | Path) -> dict[str, Any]:
    """Read one `run --result-json` file; ValueError naming the path when it cannot be read
    or is not a version-1 kvserve loadtest result (so compare fails early and clearly)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a loadtest result: {e}") from e
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind != RESULT_KIND:
        raise ValueError(f"{path}: not a kvserve loadtest result (kind {kind!r}, "
                         f"expected {RESULT_KIND!r})")
    if data.get("version") != RESULT_VERSION:
        raise ValueError(f"{path}: unsupported result version {data.get('version')!r} "
                         f"(this reader knows version {RESULT_VERSION})")
    return data


def metric_value(result: dict[str, Any], keys: Sequence[str]) -> float | None:
    """The number at summary[keys...], or None when any level is missing or null."""
    node: Any = result.get("summary")
    for key in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def format_value(value: float | None, kind: str) -> str:
    """Readable cell text: counts as integers, fractions as percent, other numbers with
    precision that shrinks as they grow; None as '-'."""
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100.0 * value:.1f}%"
    if kind == "count" and value == int(value):
        return f"{int(value):,}"
    mag = abs(value)
    if mag >= 1000:
        return f"{value:,.0f}"
    if mag >= 100:
        return f"{value:.1f}"
    if mag >= 1 or value == 0:
        return f"{value:.2f}"
    return f"{value:.3g}"


def format_ratio(first: float | None, last: float | None) -> str:
    """last / first as '1.23x', '-' when either is missing or first is 0."""
    if first is None or last is None or first == 0:
        return "-"
    return f"{last / first:.2f}x"


def table_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One row of cell text per metric; a ratio cell is added when there are two runs."""
    rows = []
    for name, keys, kind in METRICS:
        values = [metric_value(r, keys) for r in results]
        row = [name, *(format_value(v, kind) for v in values)]
        if len(values) == 2:
            row.append(format_ratio(values[0], values[1]))
        rows.append(row)
    return rows


def _text_table(headers: list[str], rows: list[list[str]]) -> str:
    """Aligned plain-text table: names left, numbers right, a dash rule under the header."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        parts = [c.ljust(w) if i == 0 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


def _markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """GitHub pipe table, numbers right-aligned, '|' in labels escaped."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    align = "|:---|" + "---:|" * (len(headers) - 1)
    return "\n".join([line(headers), align, *map(line, rows)])


def compare_table(results: Sequence[dict[str, Any]], labels: Sequence[str],
                  markdown: bool = False) -> str:
    """Side-by-side summary table: rows are metrics, columns are runs (plus 'last/first'
    when exactly two runs are compared)."""
    if len(results) != len(labels):
        raise ValueError(f"{len(results)} results but {len(labels)} labels")
    headers = ["metric", *labels] + (["last/first"] if len(results) == 2 else [])
    rows = table_rows(results)
    return _markdown_table(headers, rows) if markdown else _text_table(headers, rows)


def default_labels(results: Sequence[dict[str, Any]], paths: Sequence[str]) -> list[str]:
    """Each result's own label (else its file name); repeats get ' (file name)' appended
    so columns and legend entries stay distinguishable."""
    labels = [str(r.get("label") or Path(p).stem) for r, p in zip(results, paths, strict=True)]
    return [f"{lab} ({Path(p).name})" if labels.count(lab) > 1 else lab
            for lab, p in zip(labels, paths, strict=True)]


def _parser() -> argparse.ArgumentParser:
    """argparse for `compare FILES... [--labels L...] [--plot PNG] [--markdown]`."""
    p = argparse.ArgumentParser(prog="python -m loadtest compare",
                                description="Compare loadtest result JSON files.")
    p.add_argument("files", nargs="+", help="result JSON files from `run --result-json`")
    p.add_argument("--labels", nargs="+", help="column names, one per file "
                   "(default: each result's label)")
    p.add_argument("--plot", help="also write a comparison PNG here")
    p.add_argument("--markdown", action="store_true", help="print a markdown pipe table")
    return p


def compare_main(argv: list[str] | None = None) -> int:
    """Entry point of the `compare` subcommand (argv is what follows 'compare'). Prints the
    table; returns 0, or 2 with a message on stderr for bad files, labels or plotting."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error: argparse already printed it
        return e.code if isinstance(e.code, int) else 2
    if args.labels and len(args.labels) != len(args.files):
        print(f"compare: {len(args.files)} files but {len(args.labels)} labels",
              file=sys.stderr)
        return 2
    try:
        results = [load_result(f) for f in args.files]
    except ValueError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    labels = args.labels or default_labels(results, args.files)
    print(compare_table(results, labels, markdown=args.markdown))
    if args.plot:
        from loadtest.plots import plot_compare
        try:
            out = plot_compare(results, labels, args.plot)
        except (RuntimeError, OSError) as e:
            print(f"compare: {e}", file=sys.stderr)
            return 2
        print(f"plot written to {out}", file=sys.stderr)  # stdout stays just the table
    return 0
