"""A server's /metrics page for tests: the load harness's parser (loadtest.scrape.parse_metrics)
for the usual figures, every labelled sample for the rest, and wait-until-idle."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from loadtest.scrape import parse_metrics

PREFIX = "kvserve:"
IDLE_TIMEOUT_S = 15.0


class MetricsPage:
    """One parsed /metrics page.

    `page[key]` is parse_metrics's figure (running, waiting, kv_cache_usage, preemptions,
    prefix_cache_queries, prefix_cache_hits); `value` and `labels_of` read single samples by
    their name without the `kvserve:` prefix (counters with their `_total` suffix).
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.figures = parse_metrics(text)
        self.samples = [s for family in text_string_to_metric_families(text)
                        for s in family.samples]

    def __getitem__(self, key: str) -> float:
        figure = self.figures[key]
        assert figure is not None, f"/metrics lacks {key}"
        return figure

    def find(self, sample_name: str, **labels: str) -> list[Sample]:
        """The samples with this name whose labels include `labels`."""
        return [s for s in self.samples
                if s.name == PREFIX + sample_name and labels.items() <= s.labels.items()]

    def value(self, sample_name: str, **labels: str) -> float:
        """The one sample with this name whose labels include `labels`; 0 if none yet."""
        found = self.find(sample_name, **labels)
        assert len(found) <= 1, (sample_name, labels)
        return float(found[0].value) if found else 0.0

    def labels_of(self, sample_name: str) -> dict[str, str]:
        """The labels of the one sample with this name."""
        (sample,) = self.find(sample_name)
        return dict(sample.labels)

    def buckets(self, histogram: str) -> dict[float, float]:
        """A histogram's cumulative buckets: upper bound (`le`) -> count."""
        return {float(s.labels["le"]): float(s.value) for s in self.find(histogram + "_bucket")}

    def is_idle(self) -> bool:
        """Nothing runs or waits and KV usage is exactly 0 (the gauge is 1 - free / total
        blocks, so 0.0 means every block is free)."""
        return (self["running"], self["waiting"], self["kv_cache_usage"]) == (0.0, 0.0, 0.0)


def scrape(url: str) -> MetricsPage:
    """GET url/metrics: 200, Prometheus text, parsed."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return MetricsPage(resp.read().decode())


def wait_idle(url: str, timeout: float = IDLE_TIMEOUT_S) -> MetricsPage:
    """Polls /metrics until the server is idle (MetricsPage.is_idle); returns that page.

    From a coroutine: `await asyncio.to_thread(wait_idle, url)`.
    """
    deadline = time.monotonic() + timeout
    while True:
        page = scrape(url)
        if page.is_idle():
            return page
        busy = (page["running"], page["waiting"], page["kv_cache_usage"])
        assert time.monotonic() < deadline, \
            f"still busy after {timeout} s: (running, waiting, usage) = {busy}"
        time.sleep(0.05)
