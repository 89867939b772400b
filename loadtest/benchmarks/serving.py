"""Serving benchmark: `kvserve serve` vs. `transformers serve --continuous-batching` at fixed
concurrency 16 and 64 and at a Poisson rate near saturation, same model and same load.

Both servers serve the same float32 HF export of the embedded SmolLM2-135M-Instruct
(`loadtest.benchmarks.hf_export`), and kvserve also serves the GGUF file itself (`kvserve-gguf`:
issue 12's 64-stream target is on the GGUF; transformers can only dequantize a GGUF, which is
what the export holds). They run one after the other on 127.0.0.1, each on a fresh free port,
and get the same seeded chat prompts at each level (streamed, greedy, EOS ignored so every
request makes exactly --max-tokens tokens) after a short warm-up, through the load harness.
Alone: `python -m loadtest.benchmarks.serving [--concurrency 16 64]
[--only kvserve|kvserve-gguf|peer] [--no-gguf] [--json PATH] [--markdown PATH]`;
`--setup-peer` builds the peer's venv (.venv-bench) once.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from loadtest.benchmarks.common import SuiteContext, target_line
from loadtest.benchmarks.hf_export import DEFAULT_EXPORT_DIR
from loadtest.benchmarks.serving_load import measure
from loadtest.benchmarks.serving_report import (
    GGUF_NAME,
    ISSUE12_LEVEL,
    PEER_NOTES,
    THROUGHPUT_TARGET,
    ceiling_lines,
    results_table,
    verdict_table,
    warnings,
)
from loadtest.serve_process import setup_peer_venv

NAME = "Serving: kvserve vs transformers serve"
RATE = 1.0  # requests/s: kvserve saturates near 1.2 req/s on this workload (2 cores)
FULL_ARGS = ["--concurrency", "16", "64", "--request-rates", str(RATE), "--wait-quiet", "120"]
QUICK_ARGS = ["--concurrency", "2", "--request-rates", "1", "--num-requests", "4",
              "--max-tokens", "8", "--warmup", "1", "--wait-quiet", "0"]
COMMAND = "python -m loadtest.benchmarks.serving " + shlex.join(FULL_ARGS)


def _plots(report: dict[str, Any], ctx: SuiteContext) -> list[str]:
    """A comparison plot per level both servers ran; the markdown image links."""
    from loadtest.compare import load_result
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


def judge(report: dict[str, Any], plots: list[str]) -> dict[str, Any]:
    """The suite result of a measured report: met when kvserve on the HF export meets the
    target at every level and kvserve on the GGUF at 64 streams (issue 12's)."""
    judged = [v for v in report["verdicts"] if v.get("server", "kvserve") == "kvserve"
              or v["level"] == ISSUE12_LEVEL]
    summary = "; ".join(f"{v.get('server', 'kvserve')} {v['level']}: {v['tok_s_ratio']:.2f}x "
                        f"tok/s, p99 TTFT {v['ttft_p99_ratio']:.2f}x, p99 ITL "
                        f"{v['itl_p99_ratio']:.2f}x"
                        for v in judged if v["tok_s_ratio"] is not None
                        and v["ttft_p99_ratio"] is not None and v["itl_p99_ratio"] is not None)
    return {"target": f">= {THROUGHPUT_TARGET:g}x output tok/s with lower p99 TTFT and ITL "
                      f"at every load; issue 12: the same for {GGUF_NAME} (the GGUF file "
                      f"itself) at {ISSUE12_LEVEL}",
            "met": all(v["met"] for v in judged) if judged else None,
            "summary": summary or "the peer did not complete", "report": report,
            "plots": plots}


def run(ctx: SuiteContext) -> dict[str, Any]:
    """Both servers at every level (tiny levels with --quick), plots into ctx.plot_dir. A full
    run first builds the peer's venv where it is missing (as the llama.cpp section builds
    llama.cpp): without it the peer's levels were reported as not measured."""
    if not ctx.quick:
        setup_peer_venv()
    args = [*(QUICK_ARGS if ctx.quick else FULL_ARGS), "--server-threads", str(ctx.threads)]
    report = measure(parse_args(args), args)
    return judge(report, _plots(report, ctx))


def render(result: dict[str, Any]) -> str:
    """Workload, results and ratio tables, ceiling, plots, target, notes and commands."""
    r = result["report"]
    cfg = r["config"]
    commands = [r["env"]["command"], *(f"    {s['name']}: {s['command']}" for s in r["servers"])]
    return "\n\n".join([
        f"Streamed chat completions, user messages {cfg['min_input']}..{cfg['max_input']} "
        f"tokens plus the chat template, {cfg['max_tokens']} output tokens (EOS ignored), "
        f"greedy. Fixed concurrency C sends 2 x C requests with C in flight; the Poisson "
        f"level sends 64 at the rate. Server threads {cfg['server_threads']}, on the "
        "cores the client also uses.",
        results_table(r), verdict_table(r) if r["verdicts"] else "(no level ran on both)",
        *ceiling_lines(r), *result["plots"],
        target_line(result["target"], result["met"], result["summary"]),
        "TTFT: to the first content chunk. ITL: gaps between later content chunks, pooled "
        "over requests. Output tok/s: usage tokens of successful requests / level wall time. "
        "Server CPU: the server's process tree; others: all other processes but this client.",
        "\n".join(f"- {n}" for n in [*warnings(r), *PEER_NOTES]),
        "```\n" + "\n".join(commands) + "\n```"])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (the suite passes FULL_ARGS or QUICK_ARGS)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setup-peer", action="store_true",
                   help="create .venv-bench with transformers[serving] and exit")
    p.add_argument("--only", choices=["kvserve", GGUF_NAME, "peer"])
    p.add_argument("--no-gguf", dest="gguf", action="store_false",
                   help=f"skip {GGUF_NAME}: kvserve on the GGUF file the HF export came from")
    p.add_argument("--concurrency", type=int, nargs="*", default=[16, 64])
    p.add_argument("--request-rates", type=float, nargs="*", default=[],
                   help="also run Poisson arrivals at these rates (requests/s)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per level (default: 2 x concurrency; 64 for a rate)")
    p.add_argument("--peer-num-requests", type=int, default=None,
                   help="requests per level for transformers (default: as --num-requests)")
    p.add_argument("--min-input", type=int, default=32, help="fewest user-message tokens")
    p.add_argument("--max-input", type=int, default=128, help="most user-message tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (output lengths then differ)")
    p.add_argument("--server-threads", type=int, default=2,
                   help="torch threads of the server (client and server share the cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests before measuring")
    p.add_argument("--time-limit", type=float, default=300.0,
                   help="seconds after which a level starts no new request")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--wait-quiet", type=float, default=120.0, metavar="SECONDS",
                   help="before each server, wait up to this long for other processes to idle")
    p.add_argument("--model", type=Path, default=DEFAULT_EXPORT_DIR,
                   help="HF folder both servers load (exported from the GGUF if missing)")
    p.add_argument("--kvserve-args", default="", help="extra kvserve serve flags, one string")
    p.add_argument("--peer-args", default="", help="extra transformers serve flags")
    p.add_argument("--json", dest="json_path", type=Path, default=None)
    p.add_argument("--markdown", dest="markdown_path", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: sets up the peer's venv, or measures, prints and writes when asked."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(argv)
    if ns.setup_peer:
        setup_peer_venv()
        return
    result = judge(measure(ns, argv), [])
    text = f"## {NAME}\n\n{render(result)}\n"
    print(text)
    if ns.json_path:
        ns.json_path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    if ns.markdown_path:
        ns.markdown_path.write_text(text)


if __name__ == "__main__":
    main()
