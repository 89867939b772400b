"""Prefix caching: TTFT of prompts sharing a 90% prefix, with caching on and then off.

Two `kvserve serve` processes, one after the other, with the same flags except
--enable-prefix-caching / --no-enable-prefix-caching. Every prompt is the same seeded prefix
of 0.9 x L token ids plus its own 0.1 x L suffix, sent to /v1/completions as token ids so
its length is exact. One warm-up request (not counted) puts the prefix in the cache; then N
requests go one at a time (so TTFT is the prefill alone) and again N at concurrency 4.
The prefix hit rate comes from each server's /metrics, counted over the measured requests.

The server helpers here (`serve`, `token_prompts`, `completion`) are shared with the
chunked-prefill benchmark. Run alone as
`python -m loadtest.benchmarks.prefix_cache [--quick] [--threads N] [--json PATH]`.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loadtest.benchmarks.common import (
    SuiteContext,
    format_table,
    random_prompts,
    run_alone,
    target_line,
)
from loadtest.runner import run_fixed_concurrency
from loadtest.scrape import parse_metrics
from loadtest.serve_process import RunningServer, kvserve_spec, serving
from loadtest.sse_client import StreamRequest
from loadtest.stats import percentile

NAME = "Prefix caching"
COMMAND = "python -m loadtest.benchmarks.prefix_cache"
TARGET = "TTFT with a 90% shared prefix, caching on vs off: >= 5x lower with caching"
GOAL_RATIO = 5.0
SHARED = 0.9
MIN_TOKEN_ID = 256  # above every special token id of SmolLM2 (0..16) and the tiny models (0..2)


# ---- servers and prompts (shared with chunked_prefill) ------------------------------------


def model_path(ctx: SuiteContext) -> Path:
    """ctx.extra["model"] when given (tests pass a tiny model), else the SmolLM2 HF export."""
    if ctx.extra.get("model"):
        return Path(ctx.extra["model"]).expanduser()
    from loadtest.benchmarks.hf_export import export_smollm2

    return export_smollm2()


def vocab_size(model: Path) -> int:
    """The model's vocabulary size from config.json (a GGUF: SmolLM2's, 49152)."""
    config = model / "config.json"
    return int(json.loads(config.read_text())["vocab_size"]) if config.is_file() else 49152


@contextmanager
def serve(ctx: SuiteContext, name: str, flags: Sequence[str]
          ) -> Iterator[tuple[RunningServer, str]]:
    """A started, ready `kvserve serve` (threads from ctx, flags plus ctx.extra["server_args"]),
    logging to ctx.log_dir/<name>.log; yields it with its model id and stops it on exit."""
    extra = [*flags, *ctx.extra.get("server_args", [])]
    spec = kvserve_spec(model_path(ctx), ctx.threads, int(ctx.extra.get("max_num_seqs", 16)),
                        ctx.log_dir, extra)
    spec.log_path = ctx.log_dir / f"{name}.log"
    with serving(spec, float(ctx.extra.get("ready_timeout_s", 300.0))) as running:
        yield running


def token_prompts(vocab: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Seeded random prompts of token ids in [MIN_TOKEN_ID, vocab), one per length."""
    return random_prompts(lengths, vocab, set(range(MIN_TOKEN_ID)), seed)


def completion(model_id: str, prompt: list[int], max_tokens: int) -> StreamRequest:
    """A greedy streaming text completion of a token-id prompt that ignores EOS."""
    return StreamRequest("completions", {"model": model_id, "prompt": prompt,
                                         "max_tokens": max_tokens, "temperature": 0.0,
                                         "ignore_eos": True})


# ---- metrics ------------------------------------------------------------------------------


def parse_prefix_counters(text: str) -> dict[str, float]:
    """prefix_cache_queries / prefix_cache_hits (tokens) from a Prometheus text page, read by
    the load harness's parser; missing counters read as 0."""
    metrics = parse_metrics(text)
    return {key: metrics[key] or 0.0 for key in ("prefix_cache_queries", "prefix_cache_hits")}


def scrape(server: RunningServer) -> dict[str, float]:
    """The server's prefix-cache counters now."""
    url = server.spec.base_url + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 (loopback only)
        return parse_prefix_counters(resp.read().decode())


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Hit tokens over queried tokens between two scrapes; None when nothing was queried."""
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return hits / queries if queries > 0 else None


def ttft_stats(ttfts_s: Sequence[float]) -> dict[str, float | None]:
    """Median, p90 and mean TTFT in ms."""
    if not ttfts_s:
        return {"p50_ms": None, "p90_ms": None, "mean_ms": None}
    p50, p90 = percentile(ttfts_s, 50), percentile(ttfts_s, 90)
    return {"p50_ms": None if p50 is None else p50 * 1e3,
            "p90_ms": None if p90 is None else p90 * 1e3,
            "mean_ms": statistics.fmean(ttfts_s) * 1e3}


def ideal_ratio(prompt_len: int, hit_tokens: float) -> float | None:
    """TTFT ratio if prefill cost were linear in computed tokens: L / (L - hits)."""
    return prompt_len / (prompt_len - hit_tokens) if hit_tokens < prompt_len else None


# ---- the measurement ----------------------------------------------------------------------


def workload(ctx: SuiteContext) -> dict[str, Any]:
    """Prompt length, requests per level, output tokens, levels (ctx.extra overrides)."""
    base = {"prompt_len": 512 if ctx.quick else 1024, "num_requests": 4 if ctx.quick else 12,
            "max_tokens": 8, "concurrency": [1, 4], "seed": 0}
    return {k: ctx.extra.get(k, v) for k, v in base.items()}


def build_prompts(vocab: int, w: dict[str, Any]) -> tuple[list[int], list[list[int]]]:
    """The warm-up prompt and the measured prompts (prefix + unique suffix each)."""
    prefix_len = round(SHARED * w["prompt_len"])
    suffix_len = w["prompt_len"] - prefix_len
    prefix = token_prompts(vocab, [prefix_len], w["seed"])[0]
    count = 1 + w["num_requests"] * len(w["concurrency"])
    suffixes = token_prompts(vocab, [suffix_len] * count, w["seed"] + 1)
    prompts = [prefix + s for s in suffixes]
    return prompts[0], prompts[1:]


def measure_server(ctx: SuiteContext, caching: bool, w: dict[str, Any],
                   warm: list[int], prompts: list[list[int]]) -> dict[str, Any]:
    """One server: a warm-up request, then each concurrency level with its own prompts."""
    flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
    name = "prefix_cache_" + ("on" if caching else "off")
    levels = []
    with serve(ctx, name, [flag]) as (server, model_id):
        asyncio.run(run_fixed_concurrency(server.spec.base_url,
                                          [completion(model_id, warm, w["max_tokens"])], 1))
        for i, conc in enumerate(w["concurrency"]):
            batch = prompts[i * w["num_requests"]:(i + 1) * w["num_requests"]]
            before = scrape(server)
            result = asyncio.run(run_fixed_concurrency(
                server.spec.base_url, [completion(model_id, p, w["max_tokens"]) for p in batch],
                conc))
            after = scrape(server)
            ok = [r for r in result.records if r.ok and r.ttft_s is not None]
            hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
            levels.append({"concurrency": conc, "ok": len(ok), "failed": len(batch) - len(ok),
                           "ttft": ttft_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
                           "hit_rate": hit_rate(before, after),
                           "hit_tokens_per_request": hits / len(batch)})
        command = server.spec.command_line()
    return {"caching": caching, "command": command, "levels": levels}


def combine(on: dict[str, Any], off: dict[str, Any], prompt_len: int) -> list[dict[str, Any]]:
    """One row per concurrency: TTFT on/off, the off/on ratio of medians, the ideal ratio."""
    rows = []
    for lv_on, lv_off in zip(on["levels"], off["levels"], strict=True):
        p_on, p_off = lv_on["ttft"]["p50_ms"], lv_off["ttft"]["p50_ms"]
        rows.append({"concurrency": lv_on["concurrency"], "on": lv_on, "off": lv_off,
                     "ratio": p_off / p_on if p_on and p_off else None,
                     "ideal_ratio": ideal_ratio(prompt_len, lv_on["hit_tokens_per_request"])})
    return rows


def verdict_of(rows: Sequence[dict[str, Any]]) -> tuple[bool | None, str]:
    """Decided by the concurrency-1 row (TTFT = prefill alone)."""
    first = rows[0] if rows else None
    if first is None or first["ratio"] is None:
        return None, "no TTFT measured"
    ratio = first["ratio"]
    return ratio >= GOAL_RATIO, (f"median TTFT {first['off']['ttft']['p50_ms']:.0f} ms off vs "
                                 f"{first['on']['ttft']['p50_ms']:.0f} ms on: {ratio:.1f}x lower "
                                 f"with caching (concurrency 1)")


def run(ctx: SuiteContext) -> dict[str, Any]:
    """Measures both servers and returns the JSON-able result."""
    w = workload(ctx)
    warm, prompts = build_prompts(vocab_size(model_path(ctx)), w)
    on = measure_server(ctx, True, w, warm, prompts)
    off = measure_server(ctx, False, w, warm, prompts)
    rows = combine(on, off, w["prompt_len"])
    met, summary = verdict_of(rows)
    return {"target": TARGET, "met": met, "summary": summary, "workload": w,
            "shared_fraction": SHARED, "commands": [on["command"], off["command"]],
            "threads": ctx.threads, "quick": ctx.quick, "rows": rows}


# ---- the report ---------------------------------------------------------------------------


def render(result: dict[str, Any]) -> str:
    """Markdown: the workload, the table, the target line and how to read it."""
    w = result["workload"]
    rows = [[r["concurrency"], r["off"]["ttft"]["p50_ms"], r["on"]["ttft"]["p50_ms"],
             r["off"]["ttft"]["p90_ms"], r["on"]["ttft"]["p90_ms"], r["off"]["ttft"]["mean_ms"],
             r["on"]["ttft"]["mean_ms"], r["ratio"], r["ideal_ratio"], r["on"]["hit_rate"],
             r["off"]["hit_rate"]] for r in result["rows"]]
    table = format_table(["concurrency", "TTFT p50 off (ms)", "TTFT p50 on (ms)",
                          "p90 off", "p90 on", "mean off", "mean on", "ratio off/on",
                          "ideal ratio", "hit rate on", "hit rate off"], rows)
    prefix = round(result["shared_fraction"] * w["prompt_len"])
    return "\n".join([
        f"{w['num_requests']} requests per row, each a {w['prompt_len']}-token prompt: a shared "
        f"{prefix}-token prefix plus its own {w['prompt_len'] - prefix}-token suffix (seeded "
        f"random token ids sent to /v1/completions), {w['max_tokens']} output tokens, greedy, "
        "EOS ignored. One warm-up request puts the prefix in the cache first. Servers "
        f"({result['threads']} threads), one after the other:", "",
        *[f"    {c}" for c in result["commands"]], "",
        table, "",
        target_line(TARGET, result["met"], result["summary"]), "",
        "The ratio is median TTFT without caching over median TTFT with it. The ideal ratio "
        "is what a prefill cost linear in computed tokens would give, L / (L - cached tokens); "
        f"about {1 / (1 - result['shared_fraction']):.0f}x for a 90% prefix, a little less "
        "because only whole 16-token blocks are cached. Measured falls short of it by the "
        "per-request costs that caching does not remove: HTTP and request handling, "
        "scheduling, the sampling step, and attention of the suffix over the whole "
        "context. The hit rate is cached over looked-up prompt tokens in the server's "
        "/metrics during the row; '-' means the server looked nothing up (caching off). "
        "At concurrency 4 TTFT also holds the time a request waits for the others' prefills.",
    ])


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: --quick, --threads, --json, --model; prints the rendered markdown."""
    run_alone(NAME, run, render, argv, model_flag=True)


if __name__ == "__main__":
    main()
