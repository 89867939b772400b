"""Benchmark 3: serving at concurrency 16 and 64 and at a Poisson rate near saturation,
kvserve vs `transformers serve --continuous-batching`, same model (the float32 HF export of
SmolLM2) and the same load, through the load harness (`loadtest.bench_serve`)."""

from __future__ import annotations

import shlex
from typing import Any

from loadtest.bench_serve import measure, parse_args
from loadtest.bench_serve_report import (
    THROUGHPUT_TARGET,
    ceiling_lines,
    results_table,
    verdict_table,
    warnings,
)
from loadtest.benchmarks.common import SuiteContext, target_line
from loadtest.compare import load_result

NAME = "Serving: kvserve vs transformers serve"
RATE = 1.0  # requests/s: kvserve saturates near 1.2 req/s on this workload (2 cores)
FULL_ARGS = ["--concurrency", "16", "64", "--request-rates", str(RATE), "--wait-quiet", "120"]
QUICK_ARGS = ["--concurrency", "2", "--request-rates", "1", "--num-requests", "4",
              "--max-tokens", "8", "--warmup", "1", "--wait-quiet", "0"]
COMMAND = "python -m loadtest.bench_serve " + shlex.join(FULL_ARGS)


def _plots(report: dict[str, Any], ctx: SuiteContext) -> list[str]:
    """A comparison plot per level both servers ran; the markdown image links."""
    from loadtest.plots import plot_compare

    by_level: dict[str, list[tuple[str, str]]] = {}
    for server in report["servers"]:
        for lv in server["levels"]:
            by_level.setdefault(lv["level"], []).append((server["name"], lv["result_json"]))
    links = []
    for level, runs in by_level.items():
        if len(runs) < 2:
            continue
        name = f"serving_{level.replace('=', '').replace('/', '').replace('.', '_')}.png"
        plot_compare([load_result(p) for _, p in runs], [n for n, _ in runs],
                     ctx.plot_path(name))
        links.append(f"![{level}](benchmarks/{name})")
    return links


def run(ctx: SuiteContext) -> dict[str, Any]:
    args = [*(QUICK_ARGS if ctx.quick else FULL_ARGS), "--server-threads", str(ctx.threads)]
    report = measure(parse_args(args), args)
    both = report["verdicts"]
    met = bool(both) and all(v["met"] for v in both)
    summary = "; ".join(f"{v['level']}: {v['tok_s_ratio']:.2f}x tok/s, p99 TTFT "
                        f"{v['ttft_p99_ratio']:.2f}x, p99 ITL {v['itl_p99_ratio']:.2f}x"
                        for v in both if v["tok_s_ratio"] is not None
                        and v["ttft_p99_ratio"] is not None and v["itl_p99_ratio"] is not None)
    return {"target": f">= {THROUGHPUT_TARGET:g}x output tok/s with lower p99 TTFT and ITL "
                      "at every load", "met": met if both else None,
            "summary": summary or "the peer did not complete", "report": report,
            "plots": _plots(report, ctx)}


def render(result: dict[str, Any]) -> str:
    r = result["report"]
    cfg = r["config"]
    notes = warnings(r)
    return "\n\n".join([
        f"Streamed chat completions, user messages {cfg['min_input']}..{cfg['max_input']} "
        f"tokens plus the chat template, {cfg['max_tokens']} output tokens (EOS ignored), "
        f"greedy. Fixed concurrency C sends 2 x C requests with C in flight; the Poisson "
        f"level sends 64 at the rate. Server threads {r['env']['server_threads']}, on the "
        "cores the client also uses.",
        results_table(r), verdict_table(r) if r["verdicts"] else "(no level ran on both)",
        *ceiling_lines(r), *result["plots"],
        target_line(result["target"], result["met"], result["summary"]),
        *(f"- {n}" for n in notes)])
