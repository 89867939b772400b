"""The serving benchmark's measurement: seeded chat workloads, both servers started in turn,
every load level driven through the load harness, CPU accounting and the compute ceiling.
The command line and the page are in `loadtest.benchmarks.serving`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import random
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.benchmarks.common import spread_lengths
from loadtest.benchmarks.hf_export import export_smollm2
from loadtest.benchmarks.machine import (
    cpu_seconds,
    environment,
    matmul_gflops,
    other_cores,
    wait_for_quiet,
)
from loadtest.benchmarks.serving_report import GGUF_NAME, PEER_NAME, ceiling_tok_s, verdicts
from loadtest.datasets import Prompt
from loadtest.results import build_result, write_result
from loadtest.runner import LoadConfig, LoadRun, run_fixed_concurrency, run_load
from loadtest.serve_process import (
    ROOT,
    RunningServer,
    ServerSpec,
    kvserve_spec,
    peer_spec,
    process_tree_cpu_seconds,
    start_server,
    stop_server,
    wait_ready,
)
from loadtest.sse_client import StreamRequest
from loadtest.stats import summarize

RESULTS = ROOT / "results"

TOPICS = ["photosynthesis", "black holes", "the French Revolution", "compound interest",
          "volcanoes", "the immune system", "machine learning", "the water cycle",
          "plate tectonics", "the Roman Empire", "vaccines", "electric cars", "honey bees",
          "the stock market", "climate change", "the internet", "DNA", "jazz music",
          "the Moon landing", "recycling", "coffee", "earthquakes", "chess", "rainbows"]
QUESTIONS = ["Can you explain {t} in simple terms?", "What are the most important facts "
             "about {t}?", "Why does {t} matter to ordinary people?", "How would you teach "
             "{t} to a ten-year-old?", "What are common misconceptions about {t}?",
             "Write a short summary of {t}.", "What is the history of {t}?"]
CONTEXT = ["I am preparing a short presentation for my class next week.",
           "Please keep the answer clear and avoid jargon where you can.",
           "My friend and I disagreed about this yesterday and I want to settle it.",
           "I read an article about it but some parts were confusing.",
           "Examples from everyday life would help me a lot.",
           "I have only a basic background in science and history.",
           "If there are numbers involved, please give rough figures.",
           "I would also like to know what experts still argue about."]


def build_messages(count: int, min_tokens: int, max_tokens: int, seed: int,
                   tokenizer: Any) -> list[list[dict[str, str]]]:
    """`count` single-turn chats whose user message is `min_tokens..max_tokens` tokens long
    (evenly spread, shuffled): a question on a seeded topic padded with context sentences."""
    rng = random.Random(seed)
    chats = []
    for target in spread_lengths(count, min_tokens, max_tokens, seed):
        topic = rng.choice(TOPICS)
        text = rng.choice(QUESTIONS).format(t=topic)
        while len(tokenizer.encode(text, add_special_tokens=False)) < target:
            text += " " + rng.choice(CONTEXT)
        chats.append([{"role": "user", "content": text}])
    return chats


def make_requests(chats: Sequence[list[dict[str, str]]], model_id: str, max_tokens: int,
                  extra_body: dict[str, Any]) -> list[StreamRequest]:
    """Greedy streaming chat requests for one server (its model id and extra fields)."""
    return [StreamRequest("chat", {"model": model_id, "messages": chat,
                                   "max_tokens": max_tokens, "temperature": 0.0, **extra_body})
            for chat in chats]


def server_specs(ns: argparse.Namespace) -> list[ServerSpec]:
    """The servers to run, kvserve first: on the HF export the peer loads too, then on the
    GGUF file that export came from (its int4 blocks kept in place, kvserve's default for a
    GGUF file), unless --no-gguf."""
    from engine.model_loader.gguf.weights import default_model_path

    specs = []
    max_seqs = max([*ns.concurrency, 64])
    if ns.only in (None, "kvserve"):
        specs.append(kvserve_spec(ns.model, ns.server_threads, max_seqs, RESULTS,
                                  shlex.split(ns.kvserve_args)))
    if ns.only in (None, GGUF_NAME) and ns.gguf:
        specs.append(kvserve_spec(default_model_path(), ns.server_threads, max_seqs, RESULTS,
                                  shlex.split(ns.kvserve_args), name=GGUF_NAME))
    if ns.only in (None, "peer"):
        specs.append(peer_spec(ns.model, ns.server_threads, RESULTS, shlex.split(ns.peer_args)))
    if not ns.ignore_eos:
        for spec in specs:
            spec.extra_body = {}
    return specs


@dataclasses.dataclass(frozen=True)
class Level:
    """One measured load: a fixed concurrency (all sent at once, C in flight) or a Poisson
    request rate (no cap)."""

    concurrency: int | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        """"c=16" or "rate=1/s"."""
        return f"c={self.concurrency}" if self.rate is None else f"rate={self.rate:g}/s"


def levels(ns: argparse.Namespace) -> list[Level]:
    """Every load level of the command line: the concurrencies, then the rates."""
    return ([Level(concurrency=c) for c in ns.concurrency]
            + [Level(rate=r) for r in ns.request_rates])


def requests_for(ns: argparse.Namespace, spec: ServerSpec, level: Level) -> int:
    """How many requests one level sends to one server."""
    default = ns.num_requests or (2 * level.concurrency if level.concurrency else 64)
    return (ns.peer_num_requests or default) if spec.name == PEER_NAME else default


def load_config(ns: argparse.Namespace, server: RunningServer, level: Level) -> LoadConfig:
    """The harness's settings for one level against one server."""
    return LoadConfig(url=server.spec.base_url, max_concurrency=level.concurrency,
                      request_rate=level.rate or float("inf"), seed=ns.seed,
                      duration_s=ns.time_limit, request_timeout_s=ns.request_timeout,
                      progress=False)


def level_summary(run: LoadRun, level: Level) -> dict[str, Any]:
    """The harness's summary plus the flat keys of the report's table."""
    s = summarize(run.records, run.duration_s, run.not_sent, None, run.server_summary)
    return {**s, "level": level.label, "concurrency": level.concurrency,
            "request_rate": level.rate, "requests": len(run.records),
            "ok": s["successful_requests"], "failed": s["failed_requests"],
            "not_started": run.not_sent, "output_tokens": s["total_output_tokens"],
            "wall_s": run.duration_s, "output_tok_s": s["output_throughput"],
            "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "itl_p50_ms": s["itl_ms"]["median"], "itl_p99_ms": s["itl_ms"]["p99"],
            "e2e_p50_ms": s["e2el_ms"]["median"],
            "errors": list(s["failure_examples"].values())[:5]}


def measure_level(ns: argparse.Namespace, server: RunningServer, model_id: str,
                  chats: Sequence[list[dict[str, str]]], level: Level) -> dict[str, Any]:
    """One level through the load harness, with the CPU used meanwhile by the server, this
    client and everything else; the harness's result file goes to results/."""
    requests = make_requests(chats, model_id, ns.max_tokens, server.spec.extra_body)
    prompts = [Prompt(0, ns.max_tokens, messages=chat) for chat in chats]
    before, server_before = cpu_seconds(), process_tree_cpu_seconds(server.proc.pid)
    run = asyncio.run(run_load(load_config(ns, server, level), prompts, requests))
    after, server_after = cpu_seconds(), process_tree_cpu_seconds(server.proc.pid)
    summary = level_summary(run, level)
    summary["server_alive"] = server.proc.poll() is None
    summary["prompt_tokens_mean"] = _mean([r.prompt_tokens for r in run.records
                                           if r.usage_reported and r.prompt_tokens])
    summary.update(_cpu_split(before, after, server_before, server_after, run.duration_s))
    label = f"{server.spec.name} {level.label}"
    path = RESULTS / f"serving_{server.spec.name}_{level.label.replace('/', '')}.json"
    config = {"url": server.spec.base_url, "transport": "sse", "endpoint": "chat",
              "model": model_id, "dataset": "chat", "num_prompts": len(prompts),
              "request_rate": level.rate or float("inf"), "max_concurrency": level.concurrency}
    summary["result_json"] = str(write_result(build_result(label, config, run, summary), path))
    return summary


def _cpu_split(before: tuple[float, float] | None, after: tuple[float, float] | None,
               server_before: float | None, server_after: float | None, wall: float
               ) -> dict[str, float | None]:
    """Mean cores used by the server, by this client, and by other processes."""
    if before is None or after is None or server_before is None or server_after is None:
        return {"server_cores": None, "client_cores": None, "other_cores": None}
    server = (server_after - server_before) / wall
    client = (after[1] - before[1]) / wall
    # other_cores() already excludes this process; the server is excluded here.
    return {"server_cores": server, "client_cores": client,
            "other_cores": max(0.0, other_cores(before, after, wall) - server)}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_server(ns: argparse.Namespace, spec: ServerSpec, tokenizer: Any) -> dict[str, Any]:
    """Start, warm up, measure every concurrency level, stop; the log tail on failure."""
    waited = wait_for_quiet(ns.wait_quiet) if ns.wait_quiet > 0 else 0.0
    print(f"[{spec.name}] {spec.command_line()}", flush=True)
    server = start_server(spec)
    measured: list[dict[str, Any]] = []
    try:
        model_id = wait_ready(server, ns.ready_timeout)
        warm = build_messages(ns.warmup, ns.min_input, ns.max_input, ns.seed + 999, tokenizer)
        warmed = asyncio.run(run_fixed_concurrency(spec.base_url, make_requests(
            warm, model_id, 8, spec.extra_body), max(1, ns.warmup)))
        for record in warmed.records:
            if not record.ok:  # the same failure would repeat in every level; show it early
                print(f"[{spec.name}] warm-up request failed: {record.error}", flush=True)
        for i, level in enumerate(levels(ns)):
            chats = build_messages(requests_for(ns, spec, level), ns.min_input, ns.max_input,
                                   ns.seed + 1 + i, tokenizer)
            measured.append(measure_level(ns, server, model_id, chats, level))
            print(f"[{spec.name}] {level.label}: {_short(measured[-1])}", flush=True)
            if not measured[-1]["server_alive"]:
                break
    finally:
        code = stop_server(server)
    return {"name": spec.name, "command": spec.command_line(), "log": str(spec.log_path),
            "model_id": model_id, "levels": measured, "exit_code": code,
            "waited_for_quiet_s": waited}


def _short(s: dict[str, Any]) -> str:
    return (f"{s['ok']} ok, {s['failed']} failed, {s['output_tok_s']:.1f} tok/s, "
            f"TTFT p99 {s['ttft_p99_ms'] or 0:.0f} ms, ITL p99 {s['itl_p99_ms'] or 0:.0f} ms")


def compute_ceiling(ns: argparse.Namespace, model: Path, servers: Sequence[dict[str, Any]]
                    ) -> dict[str, Any] | None:
    """The workload's output tok/s at the machine's matmul peak (measured now, with the
    servers' thread count, after they stopped)."""
    import torch

    from engine.config import ModelConfig

    prompts = [lv["prompt_tokens_mean"] for s in servers for lv in s["levels"]
               if lv.get("prompt_tokens_mean")]
    if not prompts:
        return None
    mc = ModelConfig.from_folder(model)
    torch.set_num_threads(ns.server_threads)
    peak = matmul_gflops(2048, 2048, 2048)
    prompt = sum(prompts) / len(prompts)
    tok_s = ceiling_tok_s(peak, mc.num_params(), mc.vocab_size * mc.hidden_size, prompt,
                          ns.max_tokens)
    return {"tok_s": tok_s, "peak_gflops": peak, "prompt_tokens": prompt,
            "output_tokens": ns.max_tokens, "params": mc.num_params()}


def measure(ns: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Runs every server through every level; the report the tables are drawn from."""
    from transformers import AutoTokenizer

    model = export_smollm2(ns.model.expanduser())
    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    servers = []
    for spec in server_specs(ns):
        try:
            servers.append(run_server(ns, spec, tokenizer))
        except (RuntimeError, TimeoutError, OSError) as exc:  # report it, run the other
            print(f"[{spec.name}] FAILED: {exc}", file=sys.stderr, flush=True)
            servers.append({"name": spec.name, "command": spec.command_line(),
                            "log": str(spec.log_path), "levels": [], "error": str(exc)})
        gc.collect()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()}
    env = environment(ns.server_threads, "python -m loadtest.benchmarks.serving " + shlex.join(argv))
    report: dict[str, Any] = {"config": config, "env": env, "servers": servers}
    report["ceiling"] = compute_ceiling(ns, model, servers)
    report["verdicts"] = verdicts(report)
    return report
