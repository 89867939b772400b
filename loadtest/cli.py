"""`python -m loadtest run`: load an OpenAI-compatible server and report what it did.

Example (a Poisson rate of 4 req/s, 200 random prompts, over the WebSocket):
  python -m loadtest run --url http://127.0.0.1:8000 --transport ws --request-rate 4
      --num-prompts 200 --input-len 256 --output-len 128 --result-json r.json --plot r.png
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import orjson

from loadtest.datasets import (
    DATASETS,
    DatasetSpec,
    LocalTokenizer,
    Prompt,
    ServerTokenizer,
    Tokenizer,
    attach_text,
    build_prompts,
    to_request,
)
from loadtest.results import build_result, format_summary, write_result
from loadtest.runner import TRANSPORTS, LoadConfig, count_output_tokens, first_model, run_load
from loadtest.stats import parse_goodput, summarize

T = TypeVar("T")


def _rate(text: str) -> float:
    value = float(text)
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_target_args(p: argparse.ArgumentParser) -> None:
    """Where the load goes: URL, transport, endpoint, key, model, label."""
    g = p.add_argument_group("target")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    g.add_argument("--transport", choices=TRANSPORTS, default="sse",
                   help="sse: one HTTP stream a request; ws: all requests over kvserve's /v1/ws")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    g.add_argument("--model", default=None, help="default: the first model in /v1/models")
    g.add_argument("--label", default=None, help="the run's name in tables and plots")


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """What is sent: the dataset, its sizes, the tokenizer and the prompt format."""
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="the JSONL file for --dataset jsonl")
    g.add_argument("--num-prompts", type=_positive_int, default=100)
    g.add_argument("--input-len", type=_positive_int, default=256,
                   help="prompt tokens (for shared-prefix: tokens after the prefix)")
    g.add_argument("--output-len", type=_positive_int, default=128, help="max_tokens")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from L * [1 - r, 1 + r]")
    g.add_argument("--prefix-len", type=_positive_int, default=256)
    g.add_argument("--num-prefixes", type=_positive_int, default=10)
    g.add_argument("--long-prompt-len", type=_positive_int, default=4096)
    g.add_argument("--long-prompt-delay", type=float, default=2.0,
                   help="seconds into the run the long prompt is sent")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default=None, help="a local HF folder or GGUF ('default' = "
                   "the embedded model); default: the server's /tokenize and /detokenize")
    g.add_argument("--prompt-format", choices=("text", "ids"), default="text",
                   help="completions only: send prompts as text or as token ids")


def add_load_args(p: argparse.ArgumentParser) -> None:
    """How it is sent: rate, burstiness, concurrency cap, duration, sampling fields."""
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests/s (Poisson when burstiness is 1); inf sends all at once")
    g.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 steadier")
    g.add_argument("--max-concurrency", type=_positive_int, default=None)
    g.add_argument("--duration", type=_positive_float, default=None,
                   help="stop sending after this many seconds")
    g.add_argument("--request-timeout", type=_positive_float, default=600.0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    g.add_argument("--extra-body", default=None, help="JSON object merged into each body")


def add_output_args(p: argparse.ArgumentParser) -> None:
    """What is reported: goodput SLOs, scraping, the result file and the plot."""
    g = p.add_argument_group("metrics and output")
    g.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    g.add_argument("--scrape-interval", type=_positive_float, default=1.0,
                   help="seconds between /metrics scrapes")
    g.add_argument("--result-json", default=None)
    g.add_argument("--plot", default=None, help="a PNG of latency CDFs and time series")
    g.add_argument("--no-progress", action="store_true")


def parser() -> argparse.ArgumentParser:
    """The `python -m loadtest run` parser with every flag group."""
    p = argparse.ArgumentParser(prog="python -m loadtest run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for add in (add_target_args, add_dataset_args, add_load_args, add_output_args):
        add(p)
    return p


def sampling(ns: argparse.Namespace) -> dict[str, Any]:
    """The sampling fields every request body carries."""
    body: dict[str, Any] = {"temperature": ns.temperature}
    if ns.ignore_eos:
        body["ignore_eos"] = True
    if ns.extra_body:
        extra = orjson.loads(ns.extra_body)
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        body.update(extra)
    return body


def dataset_spec(ns: argparse.Namespace) -> DatasetSpec:
    """The dataset flags as a DatasetSpec."""
    return DatasetSpec(ns.dataset, ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio,
                       ns.prefix_len, ns.num_prefixes, ns.long_prompt_len,
                       ns.long_prompt_delay, ns.dataset_path, ns.seed)


def load_config(ns: argparse.Namespace) -> LoadConfig:
    """The arrival and transport flags as a LoadConfig."""
    return LoadConfig(ns.url, ns.transport, ns.api_key, ns.request_rate, ns.burstiness,
                      ns.max_concurrency, ns.duration, ns.seed, ns.request_timeout,
                      ns.scrape_interval, progress=not ns.no_progress)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine on uvloop when it is installed (a lighter client), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def prepare(ns: argparse.Namespace, model: str) -> tuple[Tokenizer, list[Prompt]]:
    """The tokenizer and the dataset's prompts (with text when text is sent)."""
    tokenizer: Tokenizer = (LocalTokenizer(ns.tokenizer) if ns.tokenizer
                            else ServerTokenizer(ns.url, model, ns.api_key))
    prompts = build_prompts(dataset_spec(ns), tokenizer)
    if ns.endpoint == "chat" or ns.prompt_format == "text":
        attach_text(prompts, tokenizer)
    return tokenizer, prompts


def run_main(argv: Sequence[str] | None = None) -> int:
    """`python -m loadtest run`: 0 when a request succeeded, 1 when none did, 2 on bad input."""
    ns = parser().parse_args(argv)
    try:
        slos = parse_goodput(ns.goodput)
        body = sampling(ns)
        model = ns.model or run_async(first_model(ns.url, ns.api_key))
        tokenizer, prompts = prepare(ns, model)
    except (ValueError, OSError, ConnectionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    requests = [to_request(p, ns.endpoint, model, body, ns.prompt_format == "ids")
                for p in prompts]
    run = run_async(run_load(load_config(ns), prompts, requests))
    count_output_tokens(run, tokenizer)
    summary = summarize(run.records, run.duration_s, run.not_sent, slos, run.server_summary)
    config = {k: v for k, v in vars(ns).items() if k != "api_key"}
    config["model"] = model
    result = build_result(ns.label or f"{ns.transport} {ns.endpoint}", config, run, summary)
    print(format_summary(result))
    if ns.result_json:
        print(f"result: {write_result(result, ns.result_json)}")
    if ns.plot:
        from loadtest.plots import plot_run

        try:
            print(f"plot: {plot_run(result, ns.plot)}")
        except RuntimeError as exc:  # matplotlib missing: the result file is still written
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0 if summary["successful_requests"] else 1
