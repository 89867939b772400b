"""The step-overhead benchmark's fixed-forward part: the model step is replaced by a sleep of
2 ms or 10 ms (the GIL released, as during a GPU forward), so the share of each decode step
that the engine itself adds (scheduling, output processing, streaming through the server's
SSE path) shows as it would beside a fast GPU. Issue 15's target: under 5% at 2 ms.

With async scheduling (the default) the engine's work overlaps the sleep, so a step lasts the
longer of the two. time.sleep itself oversleeps (~0.09 ms of 2 ms here), which even a
zero-cost engine would show; each row also gives the sleep's own period, timed alone, and the
share against it."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

from engine.core.scheduler_output import SchedulerOutput, StepResult
from loadtest.benchmarks.common import format_table
from loadtest.benchmarks.engines import engine_args

FORWARDS_MS = (2.0, 10.0)
SHARE_LIMIT = 0.05


def fake_forward(seconds: float) -> Any:
    """A model step that takes `seconds` and samples token 5 for every row that samples."""
    def execute(batch: SchedulerOutput) -> StepResult:
        time.sleep(seconds)
        return StepResult(sampled={r.request_id: 5 for r in batch.requests if r.sample})
    return execute


def sleep_alone_ms(seconds: float, total_s: float = 0.4) -> float:
    """Median period of the fake forward's sleep, back to back on a thread of its own."""
    periods: list[float] = []

    def run() -> None:
        for _ in range(max(20, int(total_s / seconds))):
            started = time.perf_counter()
            time.sleep(seconds)
            periods.append(time.perf_counter() - started)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return statistics.median(periods) * 1000


def measure(model_dir: Path, size: int, forward_ms: float, cfg: Any, threads: int
            ) -> dict[str, Any]:
    """Median pure-decode step interval with a fixed forward, and the engine's share of it."""
    from loadtest.benchmarks.overhead import RecordingEngine, stream_requests

    args = engine_args(str(model_dir), threads, size, size * (cfg.prompt_len + cfg.output_len))
    engine = RecordingEngine(args)
    engine.runner.execute = fake_forward(forward_ms / 1000)  # type: ignore[method-assign]
    steps, _ = stream_requests(engine, size, cfg)
    engine.shutdown()
    step_ms = statistics.median(s["interval"] * 1000 for s in steps) if steps else float("nan")
    alone = sleep_alone_ms(forward_ms / 1000)
    return {"running": size, "forward_ms": forward_ms, "step_ms": step_ms,
            "share": (step_ms - forward_ms) / step_ms, "steady_steps": len(steps),
            "sleep_alone_ms": alone, "share_vs_sleep": max(0.0, step_ms - alone) / step_ms,
            "async_scheduling": engine.args.async_scheduling}


def run(model_dir: Path, cfg: Any, threads: int) -> list[dict[str, Any]]:
    """Every size x fixed forward."""
    return [measure(model_dir, size, forward, cfg, threads)
            for forward in FORWARDS_MS for size in cfg.sizes]


def render(rows: list[dict[str, Any]]) -> str:
    """The table and the verdict on issue 15's target."""
    table = format_table(["fixed forward ms", "running requests", "step ms", "engine share",
                          "sleep alone ms", "share vs sleep alone"],
                         [(r["forward_ms"], r["running"], r["step_ms"], f"{r['share']:.1%}",
                           r.get("sleep_alone_ms", float("nan")),
                           f"{r.get('share_vs_sleep', float('nan')):.1%}") for r in rows])
    at_2ms = [r for r in rows if r["forward_ms"] == 2.0]
    # What the engine adds is the step beyond the forward's own duration: a 2 ms sleep lasts
    # ~2.1 ms here even with nothing else running (timer slack), which no engine could remove.
    met = all(r.get("share_vs_sleep", 1.0) < SHARE_LIMIT for r in at_2ms)
    mode = "async scheduling" if all(r.get("async_scheduling") for r in rows) else \
        "synchronous steps"
    return ("With the forward replaced by a fixed sleep (the worker releases the GIL as a GPU "
            "forward does), the share of a decode step the engine adds = (step - forward) / "
            f"step ({mode}). The sleep alone oversleeps its nominal time; the last column "
            "counts only what the engine adds beyond the sleep's own period.\n\n"
            f"{table}\n\nIssue 15's target, under {SHARE_LIMIT:.0%} at 2 ms, judged on the "
            "step beyond the sleep's own period (the engine's share): "
            f"{'met' if met else 'missed'} (" + ", ".join(
                f"{r.get('share_vs_sleep', float('nan')):.1%} at {r['running']}, "
                f"{r['share']:.1%} against the nominal 2 ms" for r in at_2ms) + ").")
