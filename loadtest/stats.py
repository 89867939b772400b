"""The numbers a load run reports: throughput, latency distributions, goodput, failures.

Definitions follow vLLM's serving benchmark so figures compare across tools:
  TTFT   send to the first content chunk
  TPOT   (E2E - TTFT) / (output tokens - 1), per request with at least two tokens
  ITL    every gap between consecutive content chunks, pooled over requests
  E2EL   send to the end of the stream
Percentiles interpolate linearly between order statistics (numpy's default); std is the
population standard deviation. Goodput counts successful requests that meet every SLO given.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from loadtest.records import RequestRecord

SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 and std of a sample given in seconds, reported in ms; every
    entry None for an empty sample."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None, "std": None}
    ms = [v * 1e3 for v in values_s]
    mean = math.fsum(ms) / len(ms)
    var = math.fsum((v - mean) ** 2 for v in ms) / len(ms)
    return {"mean": mean, "median": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "std": math.sqrt(var)}


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(SLO_KEYS)}, "
                             f"got {spec!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput {spec!r}: the limit must be a positive number of ms")
        slos[key] = ms
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """True when a successful request is within every SLO (ms). A request with one token
    has no TPOT and passes that SLO, as in vLLM."""
    if not record.ok:
        return False
    measured = {"ttft": record.ttft_s, "tpot": record.tpot_s(), "e2el": record.e2e_s}
    for key, limit_ms in slos.items():
        value = measured[key]
        if value is None:
            if key == "ttft":
                return False
            continue
        if value * 1e3 > limit_ms:
            return False
    return True


def failure_counts(records: Sequence[RequestRecord]) -> tuple[dict[str, int], dict[str, str]]:
    """Failed requests counted by error kind, and the first error text seen for each kind."""
    counts = Counter(r.error_kind or "unknown" for r in records if not r.ok)
    examples: dict[str, str] = {}
    for r in records:
        if not r.ok:
            examples.setdefault(r.error_kind or "unknown", r.error[:1000])
    return dict(counts), examples


def summarize(records: Sequence[RequestRecord], duration_s: float, not_sent: int = 0,
              slos: dict[str, float] | None = None,
              server: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's summary (the "summary" object of the result file)."""
    ok = [r for r in records if r.ok]
    failures, examples = failure_counts(records)
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    tpots = [t for t in (r.tpot_s() for r in ok) if t is not None]
    summary: dict[str, Any] = {
        "successful_requests": len(ok), "failed_requests": len(records) - len(ok),
        "not_sent": not_sent, "failures_by_kind": failures, "failure_examples": examples,
        "duration_s": duration_s, "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens, "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "ttft_ms": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution(list(itertools.chain.from_iterable(r.itl_s for r in ok))),
        "e2el_ms": distribution([r.e2e_s for r in ok]),
        "goodput": None, "server": server,
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        summary["goodput"] = {"slos_ms": dict(slos), "good_requests": good,
                              "request_throughput": per_s(good)}
    return summary
