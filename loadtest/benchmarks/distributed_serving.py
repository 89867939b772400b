"""Data parallelism on this CPU: `kvserve serve --data-parallel-size 2` (two replicas of one
thread each behind the front) against one `kvserve serve` engine with two threads, under the
same load; plus the process helpers the routing benchmark shares (replicas, vllm-router,
prefix-cache counters per replica, CPU accounting).

Both servers serve the embedded SmolLM2-135M-Instruct GGUF and get the same seeded chat
prompts (the serving benchmark's: user messages of 32..128 tokens, streamed, greedy, EOS
ignored) at each fixed concurrency, through the load harness, after a short warm-up. The KV
cache is the same in total: the one engine gets `kv_gib` GiB, each replica half of it.
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from loadtest.benchmarks.machine import cpu_seconds, other_cores, wait_for_quiet
from loadtest.benchmarks.serving_load import Level, build_messages, level_summary, make_requests
from loadtest.runner import run_fixed_concurrency
from loadtest.serve_process import (
    RunningServer,
    ServerSpec,
    free_port,
    kvserve_spec,
    process_tree_cpu_seconds,
    start_server,
    stop_server,
    thread_env,
    wait_ready,
)

GIB = 1024**3
READY_TIMEOUT_S = 300.0
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


# ---- processes ----------------------------------------------------------------------------


@contextmanager
def kvserve(name: str, threads: int, log_dir: Path, flags: Sequence[str],
            max_num_seqs: int = 64) -> Iterator[tuple[RunningServer, str]]:
    """A ready `kvserve serve` of the embedded GGUF (`--num-threads threads` plus `flags`),
    logging to log_dir/<name>.log; yields it with its model id, stops it on exit."""
    spec = kvserve_spec(None, threads, max_num_seqs, log_dir, list(flags))
    spec.name, spec.log_path = name, log_dir / f"{name}.log"
    server = start_server(spec)
    try:
        yield server, wait_ready(server, READY_TIMEOUT_S)
    finally:
        stop_server(server)


@contextmanager
def replicas(count: int, threads: int, log_dir: Path, flags: Sequence[str],
             max_num_seqs: int = 64) -> Iterator[tuple[list[RunningServer], str]]:
    """`count` separate `kvserve serve` processes started together (for a router)."""
    specs = []
    for i in range(count):
        spec = kvserve_spec(None, threads, max_num_seqs, log_dir, list(flags))
        spec.name, spec.log_path = f"replica{i}", log_dir / f"distributed_replica{i}.log"
        specs.append(spec)
    with ExitStack() as stack:
        servers = []
        for spec in specs:
            server = start_server(spec)
            stack.callback(stop_server, server)
            servers.append(server)
        model_ids = [wait_ready(s, READY_TIMEOUT_S) for s in servers]
        yield servers, model_ids[0]


def router_spec(policy: str, workers: Sequence[str], log_dir: Path) -> ServerSpec:
    """vllm-router (PyPI `vllm-router`, a test-only dependency) with `policy` in front of
    `workers`, on free ports (its own Prometheus port too)."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-port", str(free_port()), "--worker-urls",
            *workers, "--policy", policy, "--health-check-interval-secs", "5",
            "--log-level", "info"]
    return ServerSpec(f"vllm-router {policy}", argv, thread_env(1), port,
                      log_dir / f"distributed_vllm_router_{policy}.log")


@contextmanager
def router(policy: str, workers: Sequence[str], log_dir: Path
           ) -> Iterator[tuple[RunningServer, str]]:
    """A started vllm-router that lists every worker in /get_loads; stopped on exit."""
    server = start_server(router_spec(policy, workers, log_dir))
    try:
        model_id = wait_ready(server, 60.0)
        deadline = time.monotonic() + 60.0
        while len(get_json(server.spec.base_url + "/get_loads").get("workers", [])) \
                < len(workers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm-router did not list {len(workers)} workers:\n"
                                   f"{server.log_tail()}")
            time.sleep(0.3)
        yield server, model_id
    finally:
        stop_server(server)


def get_json(url: str) -> Any:
    """GET a JSON document (loopback only)."""
    import orjson

    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 (loopback only)
        return orjson.loads(resp.read())


def flush_prefix_cache(url: str, attempts: int = 20) -> bool:
    """POST /flush_cache on one replica, retried while it still has requests (409)."""
    for _ in range(attempts):
        request = urllib.request.Request(url + "/flush_cache", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10):  # noqa: S310 (loopback only)
                return True
        except urllib.error.HTTPError as err:
            if err.code != 409:
                return False
        time.sleep(0.5)
    return False


# ---- prefix-cache counters ----------------------------------------------------------------


def replica_counters(text: str, replica: int | None = None) -> dict[int, dict[str, float]]:
    """Prefix-cache queries and hits (tokens) and preemptions per replica from a Prometheus
    page: a data-parallel front's page carries a `replica` label; a single server's page
    counts as `replica`."""
    out: dict[int, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("kvserve:") or sample.name.endswith("_created"):
                continue
            name = sample.name.removeprefix("kvserve:").removesuffix("_total")
            if name in COUNTERS:
                index = int(sample.labels.get("replica", replica or 0))
                row = out.setdefault(index, dict.fromkeys(COUNTERS, 0.0))
                row[name] += float(sample.value)
    return out


def scrape_counters(urls: Sequence[str]) -> dict[int, dict[str, float]]:
    """Counters of every replica behind `urls` (one front, or one URL per replica)."""
    out: dict[int, dict[str, float]] = {}
    for i, url in enumerate(urls):
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:  # noqa: S310
            out.update(replica_counters(resp.read().decode(), None if len(urls) == 1 else i))
    return out


def hit_rates(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]]
              ) -> dict[str, Any]:
    """Hit tokens over looked-up tokens between two scrapes, overall and per replica (None
    where nothing was looked up), with each replica's share of the looked-up tokens."""
    zero = dict.fromkeys(COUNTERS, 0.0)
    deltas = {i: {k: after[i][k] - before.get(i, zero)[k] for k in COUNTERS} for i in after}
    queries = sum(d["prefix_cache_queries"] for d in deltas.values())
    hits = sum(d["prefix_cache_hits"] for d in deltas.values())
    return {"hit_rate": hits / queries if queries > 0 else None,
            "queried_tokens": queries, "hit_tokens": hits,
            "preemptions": sum(d["num_preemptions"] for d in deltas.values()),
            "per_replica": [{"replica": i, "hit_rate": (d["prefix_cache_hits"]
                                                         / d["prefix_cache_queries"]
                                                         if d["prefix_cache_queries"] > 0
                                                         else None),
                             "query_share": (d["prefix_cache_queries"] / queries
                                             if queries > 0 else None)}
                            for i, d in sorted(deltas.items())]}


# ---- CPU accounting -----------------------------------------------------------------------


@dataclass
class CpuMeter:
    """Cores used by the servers' process trees and by everything else (not this client)."""

    pids: Sequence[int]

    def __enter__(self) -> CpuMeter:
        self.start = time.perf_counter()
        self.before, self.servers_before = cpu_seconds(), self._servers()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.start
        after, servers = cpu_seconds(), self._servers()
        if self.before is None or after is None or servers is None \
                or self.servers_before is None:
            self.server_cores, self.other_cores = None, None
            return
        self.server_cores = (servers - self.servers_before) / wall
        self.other_cores = max(0.0, other_cores(self.before, after, wall) - self.server_cores)

    def _servers(self) -> float | None:
        times = [process_tree_cpu_seconds(pid) for pid in self.pids]
        return None if any(t is None for t in times) else sum(t or 0.0 for t in times)


# ---- DP=2 x 1 thread vs one engine x 2 threads --------------------------------------------


@dataclass(frozen=True)
class DPConfig:
    """The chat load: concurrency levels (2 x C requests each), lengths, warm-up, KV total."""

    concurrency: tuple[int, ...] = (16, 64)
    min_input: int = 32
    max_input: int = 128
    max_tokens: int = 64
    warmup: int = 4
    kv_gib: float = 2.0
    seed: int = 0
    wait_quiet_s: float = 120.0

    @classmethod
    def quick(cls) -> DPConfig:
        """Concurrency 4, 8-token outputs, no wait for a quiet machine."""
        return cls(concurrency=(4,), max_tokens=8, warmup=1, wait_quiet_s=0.0)


def measure_server(name: str, server: RunningServer, model_id: str, cfg: DPConfig,
                   tokenizer: Any) -> dict[str, Any]:
    """Warm-up, then each concurrency level with its own seeded chats."""
    warm = build_messages(cfg.warmup, cfg.min_input, cfg.max_input, cfg.seed + 999, tokenizer)
    body = {"ignore_eos": True}
    asyncio.run(run_fixed_concurrency(server.spec.base_url,
                                      make_requests(warm, model_id, 8, body), cfg.warmup))
    levels = []
    for i, conc in enumerate(cfg.concurrency):
        chats = build_messages(2 * conc, cfg.min_input, cfg.max_input, cfg.seed + 1 + i,
                               tokenizer)
        with CpuMeter([server.proc.pid]) as cpu:
            run = asyncio.run(run_fixed_concurrency(
                server.spec.base_url, make_requests(chats, model_id, cfg.max_tokens, body), conc))
        s = level_summary(run, Level(concurrency=conc))
        levels.append({k: s[k] for k in ("level", "concurrency", "requests", "ok", "failed",
                                         "output_tokens", "wall_s", "output_tok_s",
                                         "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                         "itl_p99_ms", "errors")}
                      | {"server_cores": cpu.server_cores, "other_cores": cpu.other_cores})
        print(f"[dp] {name} c={conc}: {s['ok']} ok, {s['output_tok_s']:.1f} tok/s, "
              f"TTFT p99 {s['ttft_p99_ms'] or 0:.0f} ms", flush=True)
    return {"name": name, "command": server.spec.command_line(), "levels": levels}


def run_dp(cfg: DPConfig, threads: int, log_dir: Path) -> dict[str, Any]:
    """One engine with `threads` threads, then -dp 2 with `threads` split between replicas."""
    from engine.model_loader.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    kv_bytes = int(cfg.kv_gib * GIB)
    setups = [("one engine", ["--kv-cache-memory-bytes", str(kv_bytes)]),
              ("dp=2", ["--data-parallel-size", "2", "--kv-cache-memory-bytes",
                        str(kv_bytes // 2)])]
    servers = []
    for name, flags in setups:
        waited = wait_for_quiet(cfg.wait_quiet_s) if cfg.wait_quiet_s > 0 else 0.0
        log_name = "distributed_" + name.replace(" ", "_").replace("=", "")
        with kvserve(log_name, threads, log_dir, flags) as (server, model_id):
            measured = measure_server(name, server, model_id, cfg, tokenizer)
        servers.append(measured | {"waited_for_quiet_s": waited})
    return {"config": cfg.__dict__ | {"concurrency": list(cfg.concurrency)}, "threads": threads,
            "replica_threads": max(1, threads // 2), "servers": servers,
            "ratios": dp_ratios(servers)}


def dp_ratios(servers: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level: DP=2's output tok/s and p99 TTFT over the one engine's."""
    if len(servers) < 2:
        return []
    one = {lv["concurrency"]: lv for lv in servers[0]["levels"]}
    out = []
    for lv in servers[1]["levels"]:
        base = one.get(lv["concurrency"])
        if base is None:
            continue
        out.append({"concurrency": lv["concurrency"],
                    "tok_s_ratio": _ratio(lv["output_tok_s"], base["output_tok_s"]),
                    "ttft_p99_ratio": _ratio(lv["ttft_p99_ms"], base["ttft_p99_ms"])})
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
