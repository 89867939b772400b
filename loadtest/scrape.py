"""Samples a server's Prometheus `/metrics` during a load run: queue depth, KV cache usage,
preemptions and the prefix-cache hit rate over time.

Both kvserve (`kvserve:` prefix) and vLLM (`vllm:`) are understood; they use the same names.
Scraping is best effort: a failed scrape (timeout, connection error) is skipped, and a server
without a usable `/metrics` (404, or text with none of the metrics) is scraped once and then
left alone (`available` turns False). Nothing here ever raises into the run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("kvserve.loadtest")

PREFIXES = ("kvserve:", "vllm:")
# Our key -> metric names without prefix or _total, in order of preference: the first name a
# server exports is used (vLLM renamed gpu_cache_usage_perc and gpu_prefix_cache_* in v1).
METRICS: dict[str, tuple[str, ...]] = {
    "running": ("num_requests_running",),
    "waiting": ("num_requests_waiting",),
    "kv_cache_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "preemptions": ("num_preemptions",),
    "prefix_cache_queries": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("prefix_cache_hits", "gpu_prefix_cache_hits"),
}
# A fraction per engine: several label sets (data-parallel engines) are averaged, not summed.
MEAN_KEYS = {"kv_cache_usage"}
COUNTERS = ("preemptions", "prefix_cache_queries", "prefix_cache_hits")


def _base_name(sample_name: str) -> str | None:
    """The metric name without a known prefix or a `_total` suffix; None for other servers'
    metrics and for `_created` timestamps."""
    for prefix in PREFIXES:
        if sample_name.startswith(prefix):
            name = sample_name[len(prefix):]
            if name.endswith("_created"):
                return None
            return name.removesuffix("_total")
    return None


def parse_metrics(text: str) -> dict[str, float | None]:
    """The sampled values from Prometheus text: each name summed over its label sets (KV cache
    usage averaged); None for a metric the text lacks. Raises ValueError on text that is not
    Prometheus exposition format."""
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = _base_name(sample.name)
            if name is not None:
                values.setdefault(name, []).append(float(sample.value))
    result: dict[str, float | None] = {}
    for key, names in METRICS.items():
        found = next((values[n] for n in names if n in values), None)
        if found is None:
            result[key] = None
        else:
            result[key] = sum(found) / len(found) if key in MEAN_KEYS else sum(found)
    return result


def _delta(now: float | None, before: float | None) -> float | None:
    return None if now is None or before is None else now - before


def _ratio(hits: float | None, queries: float | None) -> float | None:
    """hits / queries, None when either is missing or there were no queries."""
    if hits is None or queries is None or queries <= 0:
        return None
    return hits / queries


class MetricsScraper:
    """Scrapes `base_url/metrics` every `interval_s` in a background task.

    Each sample: t (s since the run's t0), running, waiting, kv_cache_usage, preemptions
    (cumulative since the first sample), prefix_cache_hit_rate (over the interval since the
    previous sample), plus the raw prefix_cache_queries/hits counters since the first sample,
    which `server_summary` needs for the whole-run rate.
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, interval_s: float = 1.0,
                 api_key: str | None = None) -> None:
        self.session = session
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.samples: list[dict[str, Any]] = []
        self._available = True
        self._t0 = time.perf_counter()
        self._first: dict[str, float | None] = {}  # each counter's first value seen
        self._last: dict[str, float | None] = {}  # raw values of the previous sample
        self._task: asyncio.Task[None] | None = None

    @property
    def available(self) -> bool:
        """False once /metrics turned out absent (404 and the like) or unusable."""
        return self._available

    def start(self, t0: float) -> None:
        """Starts sampling; `t0` is the run's `time.perf_counter()` start."""
        self._t0 = t0
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> list[dict[str, Any]]:
        """Stops the background task, takes one final sample and returns all samples."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.scrape_once()
        return self.samples

    async def _loop(self) -> None:
        next_at = time.perf_counter()
        while self._available:
            await self.scrape_once()
            next_at += self.interval_s
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    async def scrape_once(self) -> None:
        """Fetches and records one sample; failures are logged and skipped."""
        if not self._available:
            return
        text = await self._fetch()
        if text is None:
            return
        try:
            raw = parse_metrics(text)
        except ValueError as exc:
            raw = {}
            logger.debug("unparseable /metrics: %s", exc)
        if all(raw.get(key) is None for key in METRICS):
            self._give_up("has none of the expected metrics")
            return
        self.samples.append(self._sample(raw))

    async def _fetch(self) -> str | None:
        """The /metrics text, or None when this scrape failed (404 also ends scraping)."""
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.interval_s))
        try:
            async with self.session.get(self.url, headers=self.headers,
                                        timeout=timeout) as resp:
                if 400 <= resp.status < 500:
                    self._give_up(f"answered HTTP {resp.status}")
                    return None
                if resp.status != 200:
                    logger.debug("/metrics answered HTTP %s; skipped", resp.status)
                    return None
                return await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            logger.debug("scraping %s failed: %s: %s", self.url, type(exc).__name__, exc)
            return None

    def _give_up(self, why: str) -> None:
        """Stops scraping a server without usable metrics, unless it already gave samples
        (then this was a glitch, and the scrape is just skipped)."""
        if self.samples:
            logger.debug("%s %s; skipped", self.url, why)
            return
        logger.info("%s %s: not sampling server metrics", self.url, why)
        self._available = False

    def _sample(self, raw: dict[str, float | None]) -> dict[str, Any]:
        """One sample from parsed values: counters relative to their first value."""
        for key in COUNTERS:
            if self._first.get(key) is None:
                self._first[key] = raw.get(key)
        queries = _delta(raw["prefix_cache_queries"], self._last.get("prefix_cache_queries"))
        hits = _delta(raw["prefix_cache_hits"], self._last.get("prefix_cache_hits"))
        self._last = raw
        sample: dict[str, Any] = {
            "t": time.perf_counter() - self._t0,
            "running": raw["running"], "waiting": raw["waiting"],
            "kv_cache_usage": raw["kv_cache_usage"],
            "prefix_cache_hit_rate": _ratio(hits, queries),
        }
        for key in COUNTERS:
            sample[key] = _delta(raw[key], self._first[key])
        return sample


def _max(samples: list[dict[str, Any]], key: str) -> float | None:
    values = [s[key] for s in samples if s.get(key) is not None]
    return max(values) if values else None


def _last(samples: list[dict[str, Any]], key: str) -> float | None:
    return next((s[key] for s in reversed(samples) if s.get(key) is not None), None)


def server_summary(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Peaks over the run, preemptions during it, and the whole run's prefix-cache hit rate
    (hits over queries since the first sample); None without samples."""
    if not samples:
        return None
    last: dict[str, Any] = next(
        (s for s in reversed(samples) if s.get("prefix_cache_queries") is not None),
        {})
    return {
        "max_running": _max(samples, "running"), "max_waiting": _max(samples, "waiting"),
        "max_kv_cache_usage": _max(samples, "kv_cache_usage"),
        "preemptions": _last(samples, "preemptions"),
        "prefix_cache_hit_rate": _ratio(last.get("prefix_cache_hits"),
                                        last.get("prefix_cache_queries")),
    }
