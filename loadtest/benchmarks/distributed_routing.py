"""Cache-aware routing against round robin, 2 replicas of the embedded SmolLM2-135M GGUF (one
thread each), on a load of several shared prefixes interleaved at random.

Three setups get the very same prompts, one after the other:
  ours              `kvserve serve --data-parallel-size 2`: least requests in flight with
                    prompt-prefix affinity (server/dp_routing.py)
  vllm-router       `vllm-router --policy cache_aware` in front of two `kvserve serve`
  round robin       `vllm-router --policy round_robin` in front of the same two (their prefix
                    caches flushed first)
Every prompt is one of P seeded "documents" (the shared prefix, random words) plus its own
short question; each request picks its document at random (seeded), so the prefixes
interleave. Each replica's KV cache holds `cache_fraction` of all the documents plus room for
its share of the requests in flight: one replica cannot keep every document, two can, so only
routing that keeps a document on one replica keeps hitting it (with unbounded caches round
robin would pay just one extra miss per document and replica). Each concurrency level uses
its own documents. Hit rate: hit over looked-up prompt tokens in the replicas' /metrics during
the level; TTFT from the load harness.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.benchmarks.distributed_serving import (
    CpuMeter,
    flush_prefix_cache,
    hit_rates,
    kvserve,
    replicas,
    router,
    scrape_counters,
)
from loadtest.benchmarks.machine import wait_for_quiet
from loadtest.runner import run_fixed_concurrency
from loadtest.sse_client import StreamRequest
from loadtest.stats import percentile

BLOCK = 16
SETUPS = ("ours", "vllm-router cache_aware", "round robin")


@dataclass(frozen=True)
class RoutingConfig:
    """Documents, lengths, (concurrency, requests) levels and the KV cache per replica."""

    documents: int = 8
    document_tokens: int = 256
    question_tokens: int = 32
    max_tokens: int = 16
    levels: tuple[tuple[int, int], ...] = ((1, 32), (16, 64))
    cache_fraction: float = 0.75  # of all documents' tokens, per replica
    max_model_len: int = 1024
    seed: int = 0
    wait_quiet_s: float = 60.0

    @classmethod
    def quick(cls) -> RoutingConfig:
        """3 short documents, few requests: a smoke run (the cache bound means little here)."""
        return cls(documents=3, document_tokens=128, question_tokens=16, max_tokens=4,
                   levels=((1, 6), (16, 16)), max_model_len=512, wait_quiet_s=0.0)


# ---- prompts ------------------------------------------------------------------------------


def words(rng: random.Random, tokenizer: Any, tokens: int) -> str:
    """Random pseudo-words (consonant-vowel syllables) of about `tokens` tokens (at least)."""
    out: list[str] = []
    while len(tokenizer.encode(" ".join(out), add_special_tokens=False)) < tokens:
        out += ["".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou")
                        for _ in range(rng.randint(1, 3))) for _ in range(8)]
    return " ".join(out)


def build_level(cfg: RoutingConfig, level: int, requests: int, tokenizer: Any
                ) -> dict[str, Any]:
    """One level's prompts: `cfg.documents` fresh documents and, per request, a random document
    plus its own question; with each document's token count and the request order."""
    rng = random.Random(cfg.seed * 1000 + level)
    docs = [f"Document {level}.{d}: " + words(rng, tokenizer, cfg.document_tokens)
            for d in range(cfg.documents)]
    order = [rng.randrange(cfg.documents) for _ in range(requests)]
    prompts = [f"{docs[d]} Question {i}: {words(rng, tokenizer, cfg.question_tokens)}?"
               for i, d in enumerate(order)]
    doc_tokens = [len(tokenizer.encode(d, add_special_tokens=False)) for d in docs]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    return {"prompts": prompts, "order": order, "doc_tokens": doc_tokens,
            "prompt_tokens": [len(i) for i in ids], "best_hit_rate": best_hit_rate(ids)}


def best_hit_rate(prompts: Sequence[Sequence[int]]) -> float | None:
    """The hit rate of one cache that never evicts, as the server counts it: each prompt's
    longest token prefix shared with any earlier prompt, in whole blocks and never its last
    token, over all prompt tokens. Perfect cache-aware routing with room to spare gets it;
    with 2 replicas each document missed on both, round robin gets less."""
    hits = 0
    for i, ids in enumerate(prompts):
        shared = max((_common(ids, earlier) for earlier in prompts[:i]), default=0)
        hits += min(shared, len(ids) - 1) // BLOCK * BLOCK
    total = sum(len(ids) for ids in prompts)
    return hits / total if total else None


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def kv_tokens_per_replica(cfg: RoutingConfig) -> int:
    """`cache_fraction` of all documents, plus each in-flight request's own tokens (half the
    largest concurrency, +1), in whole blocks, and at least one max_model_len request."""
    in_flight = max(c for c, _ in cfg.levels) // 2 + 1
    own = cfg.question_tokens + cfg.max_tokens + 2 * BLOCK
    tokens = int(cfg.cache_fraction * cfg.documents * cfg.document_tokens) + in_flight * own
    return max(-(-tokens // BLOCK) * BLOCK, cfg.max_model_len)


def kv_bytes_per_token() -> int:
    """The embedded model's KV bytes per token in the dtype `kvserve serve` picks here."""
    import torch

    from engine.config import EngineArgs
    from engine.model_loader.loader import resolve_model

    dtype = EngineArgs().resolved_dtype(torch.device("cpu"))
    return resolve_model(None).config.kv_bytes_per_token(dtype.itemsize)


# ---- one setup ----------------------------------------------------------------------------


def request(model_id: str, prompt: str, max_tokens: int) -> StreamRequest:
    """A greedy streamed text completion that ignores EOS."""
    return StreamRequest("completions", {"model": model_id, "prompt": prompt,
                                         "max_tokens": max_tokens, "temperature": 0.0,
                                         "ignore_eos": True})


def measure_level(url: str, metric_urls: Sequence[str], pids: Sequence[int], model_id: str,
                  prompts: Sequence[str], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """One level through `url`: TTFT, tok/s, hit rates from the replicas' counters."""
    before = scrape_counters(metric_urls)
    with CpuMeter(pids) as cpu:
        run = asyncio.run(run_fixed_concurrency(
            url, [request(model_id, p, max_tokens) for p in prompts], concurrency))
    after = scrape_counters(metric_urls)
    ok = [r for r in run.records if r.ok and r.ttft_s is not None]
    ttfts = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    return {"concurrency": concurrency, "requests": len(prompts), "ok": len(ok),
            "failed": len(run.records) - len(ok),
            "errors": [r.error for r in run.records if not r.ok][:3],
            "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else None,
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "output_tok_s": sum(r.output_tokens for r in ok) / run.duration_s
            if run.duration_s > 0 else None,
            "server_cores": cpu.server_cores, "other_cores": cpu.other_cores,
            **hit_rates(before, after)}


def run_setup(name: str, url: str, metric_urls: Sequence[str], pids: Sequence[int],
              model_id: str, levels: Sequence[dict[str, Any]], cfg: RoutingConfig
              ) -> dict[str, Any]:
    """Two warm-up requests (unrelated prompt), then every level."""
    warm = [request(model_id, "Warm-up: say something about the weather.", 4)] * 2
    asyncio.run(run_fixed_concurrency(url, warm, 2))
    rows = []
    for level, (conc, _) in zip(levels, cfg.levels, strict=True):
        row = measure_level(url, metric_urls, pids, model_id, level["prompts"], conc,
                            cfg.max_tokens)
        rows.append(row)
        rate = row["hit_rate"]
        print(f"[routing] {name} c={conc}: hit rate "
              f"{'-' if rate is None else f'{rate:.1%}'}, mean TTFT "
              f"{row['ttft_mean_ms'] or 0:.0f} ms, {row['failed']} failed", flush=True)
    return {"name": name, "levels": rows}


def run_routing(cfg: RoutingConfig, threads: int, log_dir: Path) -> dict[str, Any]:
    """Every setup on the same prompts; vllm-router's are skipped (and said so) when the
    package is not installed."""
    from engine.model_loader.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    levels = [build_level(cfg, i, n, tokenizer) for i, (_, n) in enumerate(cfg.levels)]
    per_replica = max(1, threads // 2)
    kv_tokens = kv_tokens_per_replica(cfg)
    flags = ["--kv-cache-memory-bytes", str(kv_tokens * kv_bytes_per_token()),
             "--max-model-len", str(cfg.max_model_len)]
    max_seqs = max(c for c, _ in cfg.levels)
    setups, commands = [], []
    if cfg.wait_quiet_s > 0:
        wait_for_quiet(cfg.wait_quiet_s)
    with kvserve("distributed_routing_dp2", threads, log_dir,
                 ["--data-parallel-size", "2", *flags], max_seqs) as (front, model_id):
        commands.append(front.spec.command_line())
        setups.append(run_setup("ours", front.spec.base_url, [front.spec.base_url],
                                [front.proc.pid], model_id, levels, cfg))
    skipped = None
    if importlib.util.find_spec("vllm_router") is None:
        skipped = "vllm-router is not installed (pip install vllm-router; it is in the dev extra)"
    else:
        if cfg.wait_quiet_s > 0:
            wait_for_quiet(cfg.wait_quiet_s)
        with replicas(2, per_replica, log_dir, flags, max_seqs) as (servers, model_id):
            urls = [s.spec.base_url for s in servers]
            commands += [s.spec.command_line() for s in servers]
            for name, policy in (("vllm-router cache_aware", "cache_aware"),
                                 ("round robin", "round_robin")):
                for url in urls:
                    flush_prefix_cache(url)
                with router(policy, urls, log_dir) as (front_router, _):
                    commands.append(front_router.spec.command_line())
                    pids = [s.proc.pid for s in servers] + [front_router.proc.pid]
                    setups.append(run_setup(name, front_router.spec.base_url, urls, pids,
                                            model_id, levels, cfg))
    return {"config": cfg.__dict__ | {"levels": [list(lv) for lv in cfg.levels]},
            "threads_per_replica": per_replica, "kv_tokens_per_replica": kv_tokens,
            "best_hit_rates": [lv["best_hit_rate"] for lv in levels],
            "doc_tokens_mean": [statistics.fmean(lv["doc_tokens"]) for lv in levels],
            "prompt_tokens_mean": [statistics.fmean(lv["prompt_tokens"]) for lv in levels],
            "commands": commands, "setups": setups, "skipped": skipped}


def compare(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per level: each setup's hit rate and mean TTFT, and ours / vllm-router's mean TTFT
    over round robin's."""
    by_name = {s["name"]: s["levels"] for s in result["setups"]}
    rows = []
    for i, (conc, _) in enumerate(result["config"]["levels"]):
        row: dict[str, Any] = {"concurrency": conc}
        rr = by_name.get("round robin", [None] * (i + 1))[i]
        for name in SETUPS:
            level = by_name[name][i] if name in by_name else None
            row[name] = {"hit_rate": level and level["hit_rate"],
                         "ttft_mean_ms": level and level["ttft_mean_ms"],
                         "ttft_vs_rr": (level["ttft_mean_ms"] / rr["ttft_mean_ms"]
                                        if level and rr and level["ttft_mean_ms"]
                                        and rr["ttft_mean_ms"] else None)}
        rows.append(row)
    return rows
