"""The step-overhead benchmark's fixed-forward part: the model step is replaced by a sleep of
2 ms or 10 ms (the GIL released, as during a GPU forward), so the share of each decode step
that the engine itself adds (scheduling, output processing, streaming through the server's
SSE path) shows as it would beside a fast GPU. Issue 15's target: under 5% at 2 ms."""

from __future__ import annotations

import statistics
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
    return {"running": size, "forward_ms": forward_ms, "step_ms": step_ms,
            "share": (step_ms - forward_ms) / step_ms, "steady_steps": len(steps)}


def run(model_dir: Path, cfg: Any, threads: int) -> list[dict[str, Any]]:
    """Every size x fixed forward."""
    return [measure(model_dir, size, forward, cfg, threads)
            for forward in FORWARDS_MS for size in cfg.sizes]


def render(rows: list[dict[str, Any]]) -> str:
    """The table and the verdict on issue 15's target."""
    table = format_table(["fixed forward ms", "running requests", "step ms", "engine share"],
                         [(r["forward_ms"], r["running"], r["step_ms"], f"{r['share']:.1%}")
                          for r in rows])
    at_2ms = [r for r in rows if r["forward_ms"] == 2.0]
    met = all(r["share"] < SHARE_LIMIT for r in at_2ms)
    return ("With the forward replaced by a fixed sleep (the worker releases the GIL as a GPU "
            "forward does), the share of a decode step the engine adds = (step - forward) / "
            "step.\n\n"
            f"{table}\n\nIssue 15's target, under {SHARE_LIMIT:.0%} at 2 ms: "
            f"{'met' if met else 'missed'} (" + ", ".join(
                f"{r['share']:.1%} at {r['running']}" for r in at_2ms) + ").")
