"""Prometheus metrics under vLLM's names (prefix `kvserve:`, and also `vllm:` with
--vllm-metric-names) and the periodic stats log line.

Counters that the scheduler and KV manager already keep (tokens, preemptions, prefix-cache
queries and hits) are read live at scrape time by a custom collector, so there is one source
of truth. Latency histograms are observed by the async engine as tokens arrive. Each engine
gets its own registry: no module-level mutable state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from engine.llm_engine import EngineStats

StatsSource = Callable[[], "EngineStats"]

logger = logging.getLogger("kvserve")

PREFIX = "kvserve:"
# The prefix vLLM itself uses: Kubernetes' Gateway API inference extension and llm-d pick
# replicas from vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc.
VLLM_PREFIX = "vllm:"
# Buckets as vLLM uses them, so dashboards built for it read the same here.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _LiveCollector:
    """Reads the engine's own counters and gauges when Prometheus scrapes."""

    def __init__(self, stats: StatsSource, cache_info: dict[str, Any], model_name: str) -> None:
        self.stats = stats
        self.cache_info = cache_info
        self.labels = {"model_name": model_name}

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        yield self._gauge("num_requests_running", "Requests being computed.", stats.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                          stats.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "KV cache usage: 1 means 100 percent.",
                          stats.kv_cache_usage)
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            stats.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            stats.prefix_cache_hits)
        yield self._counter("num_preemptions", "Requests preempted (recomputed later).",
                            stats.num_preemptions)
        yield self._counter("prompt_tokens", "Prompt tokens computed (prefill).",
                            stats.num_prompt_tokens)
        yield self._counter("generation_tokens", "Tokens generated.",
                            stats.num_generation_tokens)
        yield self._cache_config()

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _cache_config(self) -> GaugeMetricFamily:
        info = self.cache_info
        labels = {
            "block_size": str(info["block_size"]),
            "num_gpu_blocks": str(info["num_gpu_blocks"]),
            "num_kv_cache_tokens": str(info["num_kv_cache_tokens"]),
            "max_concurrency": f"{info['max_concurrency']:.2f}",
            "cache_dtype": str(info["cache_dtype"]),
            "enable_prefix_caching": str(info["enable_prefix_caching"]),
        }
        family = GaugeMetricFamily(PREFIX + "cache_config_info", "KV cache configuration.",
                                   labels=list(labels))
        family.add_metric(list(labels.values()), 1.0)
        return family


class _Renamed:
    """Every `kvserve:` family of another registry again under another prefix, read at scrape
    time, so the two names always agree."""

    def __init__(self, source: CollectorRegistry, prefix: str) -> None:
        self.source = source
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if family.name.startswith(PREFIX):
                renamed = Metric(self._rename(family.name), family.documentation, family.type)
                renamed.samples = [s._replace(name=self._rename(s.name))
                                   for s in family.samples]
                yield renamed

    def _rename(self, name: str) -> str:
        return self.prefix + name.removeprefix(PREFIX)


def observe_many(histogram: Any, amount: float, count: int) -> None:
    """`count` observations of `amount`: the bucket found once and its counters bumped by
    `count` (prometheus_client's own fields); one observe() at a time where those are absent."""
    bounds, buckets, total = (getattr(histogram, name, None)
                              for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None or count == 1:
        for _ in range(count):
            histogram.observe(amount)
        return
    total.inc(amount * count)
    for i, bound in enumerate(bounds):
        if amount <= bound:
            buckets[i].inc(count)
            break


class EngineMetrics:
    """The engine's Prometheus registry: live counters plus latency histograms; with
    `vllm_names` each family is also exposed under vLLM's own prefix, `vllm:`."""

    def __init__(self, stats: StatsSource, cache_info: dict[str, Any], model_name: str,
                 vllm_names: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.vllm_registry: CollectorRegistry | None = None
        if vllm_names:
            self.vllm_registry = CollectorRegistry(auto_describe=False)
            alias = _Renamed(self.registry, VLLM_PREFIX)
            self.vllm_registry.register(alias)  # type: ignore[arg-type]
        self.registry.register(_LiveCollector(stats, cache_info, model_name))  # type: ignore[arg-type]
        labels = ["model_name"]
        reg = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time to first token.", labels, registry=reg,
                              buckets=TTFT_BUCKETS).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Inter-token latency.",
                             labels, registry=reg, buckets=ITL_BUCKETS).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "End-to-end request latency.", labels, registry=reg,
                             buckets=REQUEST_BUCKETS).labels(model_name)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Time from arrival to first scheduling.", labels,
                                    registry=reg, buckets=REQUEST_BUCKETS).labels(model_name)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens_total",
                                          "Tokens computed per engine step.", labels,
                                          registry=reg,
                                          buckets=ITERATION_TOKEN_BUCKETS).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=reg)
        self.model_name = model_name

    def observe_token(self, since_previous: float, first: bool) -> None:
        """A choice's new token: time to first token, or the gap since its previous one."""
        (self.ttft if first else self.itl).observe(since_previous)

    def observe_tokens(self, since_previous: float, count: int) -> None:
        """`count` tokens (none a first), each `since_previous` after its previous one: in a
        decode step most running requests share one gap, observed here at once."""
        observe_many(self.itl, since_previous, count)

    def observe_finished(self, e2e: float | None, queue_time: float | None,
                         reason: str) -> None:
        """A finished request: its latencies (None when aborted) and its finish reason."""
        if e2e is not None:
            self.e2e.observe(e2e)
        if queue_time is not None:
            self.queue_time.observe(queue_time)
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        text = bytes(generate_latest(self.registry))
        if self.vllm_registry is not None:
            text += bytes(generate_latest(self.vllm_registry))
        return text


@dataclass
class StepTimes:
    """Where step time goes, summed over steps: scheduling, the model on the worker thread,
    handing the batch over and back, and applying results (detokenize, stop checks, routing
    deltas). The non-model shares are the engine's overhead."""

    schedule_s: float = 0.0
    forward_s: float = 0.0
    handoff_s: float = 0.0
    apply_s: float = 0.0
    num_steps: int = 0

    def add(self, schedule_s: float, forward_s: float, handoff_s: float,
            apply_s: float) -> None:
        """Adds one step's times."""
        self.schedule_s += schedule_s
        self.forward_s += forward_s
        self.handoff_s += handoff_s
        self.apply_s += apply_s
        self.num_steps += 1

    def reset(self) -> None:
        """Starts a new interval."""
        self.schedule_s = self.forward_s = self.handoff_s = self.apply_s = 0.0
        self.num_steps = 0

    def summary(self) -> str:
        """One line with each part's share of the total and the mean step."""
        total = self.schedule_s + self.forward_s + self.handoff_s + self.apply_s
        if not self.num_steps or total <= 0:
            return "no steps"
        shares = ", ".join(f"{name} {value / total * 100:.1f}%" for name, value in (
            ("model", self.forward_s), ("schedule", self.schedule_s),
            ("handoff", self.handoff_s), ("apply", self.apply_s)))
        return f"Steps: {self.num_steps}, mean {total / self.num_steps * 1000:.1f} ms ({shares})"


@dataclass
class _Snapshot:
    time: float
    prompt_tokens: int
    generation_tokens: int
    stats: EngineStats


class StatsLogger:
    """Logs vLLM's throughput/usage line at most once per interval, only while busy."""

    def __init__(self, stats: StatsSource, interval_s: float = 10.0,
                 step_times: StepTimes | None = None) -> None:
        self.stats = stats
        self.interval_s = interval_s
        self.step_times = step_times
        self._last = self._snapshot()

    def _snapshot(self) -> _Snapshot:
        stats = self.stats()
        return _Snapshot(time.monotonic(), stats.num_prompt_tokens, stats.num_generation_tokens,
                         stats)

    def maybe_log(self) -> str | None:
        """Logs and returns the line when the interval has passed, else None."""
        now = self._snapshot()
        elapsed = now.time - self._last.time
        if elapsed < self.interval_s:
            return None
        line = self.format_line(now, elapsed)
        self._last = now
        logger.info(line)
        if self.step_times is not None:
            logger.debug(self.step_times.summary())
            self.step_times.reset()  # shares per interval
        return line

    def idle(self) -> None:
        """Restarts the interval so idle time does not dilute the next averages."""
        self._last = self._snapshot()

    def format_line(self, now: _Snapshot, elapsed: float) -> str:
        """vLLM's periodic line."""
        stats = now.stats
        prompt_tps = (now.prompt_tokens - self._last.prompt_tokens) / elapsed
        gen_tps = (now.generation_tokens - self._last.generation_tokens) / elapsed
        return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
                f"Avg generation throughput: {gen_tps:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, "
                f"Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {stats.prefix_cache_hit_rate * 100:.1f}%")
