"""A step's cost in seconds as a linear function of its shape, fit from measured steps.

    seconds ~= a + b x tokens + c x decode rows + d x decode context
               + e x prefill context + f x prefill (query x context)

`a` is what every step pays (Python, launching, reading every weight once); `b` the linears per
token; `c` what a sampling row adds (LM head, sampler); `d` and `e` reading a row's cached K/V;
`f` a prefill chunk's attention, which grows with the prefix it attends over. The coefficients
are fit by non-negative least squares on the relative error (a 10 ms step counts as much as a
2 s one) over the startup profile's steps (kept, with less weight as recent steps fill the window) and
the last `window` observed steps, with one Huber-style reweighting so a step slowed by another process on the machine does not drag the
fit. Pure Python: it runs on the event-loop thread, a few hundred multiplications per fit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

from engine.core.scheduler_output import SchedulerOutput

# Feature scales: the fit works on features of order 1 for conditioning; coefficients are
# reported per unscaled unit.
FEATURE_SCALES = (1.0, 1e3, 1e2, 1e4, 1e4, 1e7)
FEATURE_NAMES = ("step", "token", "decode row", "decode context token",
                 "prefill context token", "prefill query x context")
NUM_FEATURES = len(FEATURE_SCALES)
# Relative residual beyond which an observation's weight shrinks (Huber): a step measured at
# twice its prediction counts a quarter as much as one measured right.
HUBER_RELATIVE = 0.25
# The weight a profile step keeps once the recent window is full (1.0 while it is empty).
ANCHOR_MIN_WEIGHT = 0.05
Features = tuple[float, ...]


def step_features(rows: Iterable[tuple[int, int]]) -> Features:
    """Features of a step from (query tokens, context after the step) per row: a row of one
    token is a decode (its attention is one batched call), a longer one a prefill chunk."""
    tokens = decodes = decode_ctx = prefill_ctx = prefill_qk = 0
    for num_query, context in rows:
        tokens += num_query
        if num_query == 1:
            decodes += 1
            decode_ctx += context
        else:
            prefill_ctx += context
            prefill_qk += num_query * context
    return (1.0, float(tokens), float(decodes), float(decode_ctx), float(prefill_ctx),
            float(prefill_qk))


def batch_features(batch: SchedulerOutput) -> Features:
    """Features of a scheduled batch (step_features over its rows, in one plain loop: it runs
    after every step)."""
    tokens = decodes = decode_ctx = prefill_ctx = prefill_qk = 0
    for row in batch.requests:
        num_query = len(row.token_ids)
        tokens += num_query
        if num_query == 1:
            decodes += 1
            decode_ctx += row.start_pos + 1
        else:
            context = row.start_pos + num_query
            prefill_ctx += context
            prefill_qk += num_query * context
    return (1.0, float(tokens), float(decodes), float(decode_ctx), float(prefill_ctx),
            float(prefill_qk))


def add_features(x: Features, y: Features) -> Features:
    """Features of two sets of rows run in one step (the step's constant counted once)."""
    return (1.0, *(a + b for a, b in zip(x[1:], y[1:], strict=True)))


class StepCostModel:
    """Predicts a step's seconds from its features; refit lazily after new observations."""

    def __init__(self, window: int = 64) -> None:
        self._anchors: list[tuple[Features, float]] = []  # the startup profile, always kept
        self._recent: deque[tuple[Features, float]] = deque(maxlen=window)
        self._coef: list[float] | None = None  # per scaled feature
        self._dirty = False

    @property
    def ready(self) -> bool:
        """Whether any step has been measured."""
        return bool(self._anchors or self._recent)

    @property
    def num_observations(self) -> int:
        """Profile steps plus recent steps in the fit."""
        return len(self._anchors) + len(self._recent)

    def add_anchor(self, features: Features, seconds: float) -> None:
        """A startup-profile measurement: kept for good, so the chunk terms stay identified
        while the recent window holds only decode steps."""
        if seconds > 0:
            self._anchors.append((features, seconds))
            self._dirty = True

    def observe(self, features: Features, seconds: float) -> None:
        """A measured step; the oldest recent one drops out of the window."""
        if seconds > 0:
            self._recent.append((features, seconds))
            self._dirty = True

    def predict(self, features: Features) -> float:
        """Predicted seconds (0.0 before any measurement)."""
        coef = self.coefficients_scaled()
        return sum(c * x / s for c, x, s in zip(coef, features, FEATURE_SCALES, strict=True))

    def coefficients(self) -> tuple[float, ...]:
        """Seconds per unit of each feature (FEATURE_NAMES), as fit now."""
        return tuple(c / s for c, s in zip(self.coefficients_scaled(), FEATURE_SCALES,
                                           strict=True))

    def coefficients_scaled(self) -> list[float]:
        """The fit on scaled features, refit first if steps arrived since."""
        if self._coef is None or self._dirty:
            self._coef = self._fit()
            self._dirty = False
        return self._coef

    def _fit(self) -> list[float]:
        samples = [*self._anchors, *self._recent]
        if not samples:
            return [0.0] * NUM_FEATURES
        rows = [[x / s for x, s in zip(f, FEATURE_SCALES, strict=True)] for f, _ in samples]
        targets = [t for _, t in samples]
        # The profile yields to recent steps as they accumulate (the machine's load changes),
        # but keeps a little weight for the terms recent steps do not exercise.
        fill = len(self._recent) / (self._recent.maxlen or 1)
        prior = [max(ANCHOR_MIN_WEIGHT, 1.0 - fill)] * len(self._anchors)
        weights = prior + [1.0] * len(self._recent)
        coef = _weighted_nnls(rows, targets, weights)
        for i, (row, t) in enumerate(zip(rows, targets, strict=True)):
            residual = abs(sum(c * x for c, x in zip(coef, row, strict=True)) - t) / t
            if residual > HUBER_RELATIVE:
                weights[i] *= HUBER_RELATIVE / residual
        return _weighted_nnls(rows, targets, weights)


def _weighted_nnls(rows: Sequence[Sequence[float]], targets: Sequence[float],
                   weights: Sequence[float]) -> list[float]:
    """min sum w (x.c / t - 1)^2 over c >= 0: Lawson-Hanson's active set on the normal
    equations, scaled to a unit diagonal (a tiny ridge keeps unused features at zero). Exact in
    a few passes of a 6x6 solve (~0.3 ms): cyclic coordinate descent took its full 200 sweeps
    on these ill-conditioned features, ~3 ms a fit and two fits a step on the event loop while
    a long prompt is chunked."""
    n = NUM_FEATURES
    gram = [[0.0] * n for _ in range(n)]
    rhs = [0.0] * n
    for row, t, w in zip(rows, targets, weights, strict=True):
        r = [x / t for x in row]
        for j in range(n):
            if r[j]:
                rhs[j] += w * r[j]
                for k in range(j, n):
                    gram[j][k] += w * r[j] * r[k]
    scale = [math.sqrt(gram[j][j]) if gram[j][j] > 0 else 0.0 for j in range(n)]
    used = [j for j in range(n) if scale[j]]
    a = {(j, k): gram[min(j, k)][max(j, k)] / (scale[j] * scale[k]) + (1e-9 if j == k else 0.0)
         for j in used for k in used}
    b = {j: rhs[j] / scale[j] for j in used}
    x = dict.fromkeys(used, 0.0)
    active: list[int] = []
    for _ in range(3 * n):
        grad = {j: b[j] - sum(a[j, k] * x[k] for k in used) for j in used}
        free = [j for j in used if j not in active and grad[j] > 1e-12]
        if not free:
            break
        active.append(max(free, key=lambda j: grad[j]))
        for _ in range(3 * n):
            z = _solve([[a[j, k] for k in active] for j in active], [b[j] for j in active])
            if all(v > 0 for v in z):
                for j, v in zip(active, z, strict=True):
                    x[j] = v
                break
            # step from x toward z until a coefficient reaches zero; drop those at zero
            alpha = min(x[j] / (x[j] - v) for j, v in zip(active, z, strict=True) if v <= 0)
            for j, v in zip(active, z, strict=True):
                x[j] += alpha * (v - x[j])
            active = [j for j in active if x[j] > 1e-15]
            for j in used:
                if j not in active:
                    x[j] = 0.0
            if not active:
                break
    return [x[j] / scale[j] if scale[j] else 0.0 for j in range(n)]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b for a small symmetric positive definite a (Gaussian elimination with partial
    pivoting)."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0.0:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        acc = m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))
        x[r] = acc / m[r][r] if m[r][r] else 0.0
    return x
