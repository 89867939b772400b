"""When requests are sent: Poisson or gamma-distributed gaps, as vLLM's serving benchmark does.

With rate R (requests per second) and burstiness B, the gaps between requests are drawn from
a gamma distribution with shape B and scale 1 / (R * B): the mean gap is 1 / R for every B,
and the variance is 1 / (B * R^2). B = 1 is the exponential distribution (a Poisson
process); B < 1 sends in bursts with long pauses between them; B > 1 spaces requests more
evenly, approaching a fixed interval as B grows. R = inf sends everything at once.
"""

from __future__ import annotations

import math

import numpy as np


def check_arrival_params(rate: float, burstiness: float) -> None:
    """ValueError unless rate > 0 (inf allowed) and 0 < burstiness < inf."""
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf to send all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")


def arrival_gaps(rate: float, burstiness: float, count: int, seed: int) -> list[float]:
    """`count` seconds-between-requests gaps (the first one included: the first request waits
    one gap too, as in vLLM); all zero for an infinite rate. Seeded and reproducible."""
    check_arrival_params(rate, burstiness)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if math.isinf(rate):
        return [0.0] * count
    rng = np.random.default_rng(seed)
    theta = 1.0 / (rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=theta, size=count)]


def send_times(gaps: list[float]) -> list[float]:
    """Cumulative send times, in seconds from the start, for a list of gaps."""
    times, now = [], 0.0
    for gap in gaps:
        now += gap
        times.append(now)
    return times
