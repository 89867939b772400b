"""Per-step overhead outside the model forward, at 64 and 256 running requests.

The AsyncEngine runs in-process on uvloop (as `kvserve serve` does) with a one-layer, hidden-64
Llama whose forward is negligible, so a decode step's wall time is almost all overhead:
scheduling, batch building, bookkeeping, detokenizing, and every request's consumer turning its
delta into the server's SSE bytes (server.generation.Call + server.routes.sse_event). A step is
measured from one step start to the next, so the consumers' work (which runs on the loop while
the worker computes) is inside it. Overhead = that interval - the worker's forward (StepTimes).
SmolLM2-135M's forward for a decode step of the same size and context is then timed alone;
share = overhead / (overhead + SmolLM2 forward), an upper bound, since with a real forward the
consumers overlap it.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from engine.config import EngineArgs
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.llm_engine import LLMEngine
from engine.metrics import StepTimes
from engine.sampling_params import SamplingParams
from loadtest.benchmarks.common import (
    SuiteContext,
    format_table,
    random_prompts,
    run_alone,
    target_line,
)
from loadtest.benchmarks.engines import TINY_VOCAB, engine_args, tiny_model_dir

NAME = "Per-step overhead outside the model forward"
COMMAND = "python -m loadtest.benchmarks.overhead [--quick] [--threads N] [--json PATH]"
TARGET = ("time per decode step outside the model forward < 10% of the step with SmolLM2-135M's "
          "forward, at 64 and 256 running requests")
SHARE_LIMIT = 0.10
NAN = float("nan")


@dataclass(frozen=True)
class OverheadConfig:
    """Workload sizes: concurrent requests, prompt and output lengths, steps to time."""

    sizes: tuple[int, ...] = (64, 256)
    prompt_len: int = 64
    output_len: int = 128
    warmup_steps: int = 4  # steady decode steps not timed at the start
    reference_steps: int = 3  # SmolLM2 forwards timed per size
    seed: int = 0
    warmup_s: float = 2.0  # least time each batch shape runs untimed first (see warm_up)

    @classmethod
    def quick(cls) -> OverheadConfig:
        """16 and 32 requests, a few dozen steps."""
        return cls(sizes=(16, 32), prompt_len=32, output_len=24, warmup_steps=2,
                   reference_steps=2)


# ---- the measured run ---------------------------------------------------------------------


class StepStart(NamedTuple):
    """When a non-empty step started (wall and loop-thread CPU clocks) and its batch (sizes
    and mean context are read afterwards, so the recording adds no work to the step)."""

    wall: float
    cpu: float
    batch: SchedulerOutput

    @property
    def requests(self) -> int:
        """Requests in the step."""
        return len(self.batch.requests)

    @property
    def tokens(self) -> int:
        """Tokens computed in the step."""
        return self.batch.num_tokens

    @property
    def context(self) -> float:
        """Mean context length of its requests."""
        return statistics.fmean(r.start_pos + len(r.token_ids) for r in self.batch.requests)


class RecordingEngine(LLMEngine):
    """An LLMEngine noting each non-empty step's start, size and mean context."""

    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args)
        self.step_starts: list[StepStart] = []

    def schedule(self) -> SchedulerOutput:
        """Schedules as usual (on the event-loop thread) and records the step's start."""
        wall, cpu = time.perf_counter(), time.thread_time()
        batch = super().schedule()
        if batch.requests:
            self.step_starts.append(StepStart(wall, cpu, batch))
        return batch


@dataclass
class StepLog(StepTimes):
    """StepTimes that also keeps every step's (schedule, forward, hand-off, apply) seconds."""

    records: list[tuple[float, float, float, float]] = field(default_factory=list)

    def add(self, schedule_s: float, forward_s: float, handoff_s: float,
            apply_s: float) -> None:
        """Adds one step's times and records them."""
        super().add(schedule_s, forward_s, handoff_s, apply_s)
        self.records.append((schedule_s, forward_s, handoff_s, apply_s))


async def _consume(engine: Any, served: Any, body: bytes) -> int:
    """One client's request, turned into SSE bytes exactly as server/routes.py writes them."""
    from server.generation import start_completion
    from server.protocol import CompletionRequest, decode
    from server.routes import DONE, sse_event

    call = start_completion(engine, served, decode(CompletionRequest, body))
    return sum([len(sse_event(chunk)) async for chunk in call.chunks()]) + len(DONE)


async def _drive(engine: RecordingEngine, bodies: list[bytes]) -> tuple[StepLog, int]:
    """Streams every request to the end through an AsyncEngine; returns its step log."""
    from engine.async_engine import AsyncEngine
    from server.generation import ServedModel

    front = AsyncEngine(engine, model_name="tiny", stats_interval_s=1e9)
    log = StepLog()
    front.step_times = front.stats_logger.step_times = log
    front.start()
    served = ServedModel(["tiny"], "tiny", engine.max_model_len)
    sent = await asyncio.gather(*(_consume(front, served, b) for b in bodies))
    await front.stop()
    return log, sum(sent)


def steady_steps(engine: RecordingEngine, log: StepLog, size: int,
                 warmup: int) -> list[dict[str, float]]:
    """Per pure-decode step of `size` requests (after `warmup` of them, with a next step to
    end its interval): the interval to the next step start, its parts and the event-loop
    thread's CPU time, in seconds."""
    starts, steps = engine.step_starts, []
    for k in range(len(starts) - 1):
        if starts[k].requests != size or starts[k].tokens != size:
            continue
        schedule, forward, handoff, apply = log.records[k]
        interval = starts[k + 1].wall - starts[k].wall
        steps.append({"interval": interval, "forward": forward, "schedule": schedule,
                      "handoff": handoff, "apply": apply,
                      "other": interval - schedule - forward - handoff - apply,
                      "loop_cpu": starts[k + 1].cpu - starts[k].cpu,
                      "context": starts[k].context})
    return steps[warmup:]


def stream_requests(engine: RecordingEngine, size: int, cfg: OverheadConfig
                    ) -> tuple[list[dict[str, float]], int]:
    """Streams `size` seeded requests to the end through the server's SSE path; returns the
    steady pure-decode steps and the SSE bytes sent."""
    import uvloop

    prompts = random_prompts([cfg.prompt_len] * size, engine.model_config.vocab_size, {0},
                             cfg.seed + size)
    bodies = [orjson.dumps({"model": "tiny", "prompt": p, "max_tokens": cfg.output_len,
                            "temperature": 1.0, "ignore_eos": True, "stream": True})
              for p in prompts]
    log, sent = uvloop.run(_drive(engine, bodies))
    return steady_steps(engine, log, size, cfg.warmup_steps), sent


def measure_size(model_dir: Path, size: int, cfg: OverheadConfig, threads: int
                 ) -> dict[str, Any]:
    """Runs `size` concurrent streamed requests on the tiny model; per-step medians in ms."""
    args = engine_args(str(model_dir), threads, size, size * (cfg.prompt_len + cfg.output_len))
    engine = RecordingEngine(args)
    batch = decode_batch(size, cfg.prompt_len, args.block_size, SamplingParams(max_tokens=1))
    warm_up(engine, batch, cfg.warmup_s)
    steps, sent = stream_requests(engine, size, cfg)
    result: dict[str, Any] = {"running": size, "steady_steps": len(steps), "sse_bytes": sent,
                              "per_step": steps}
    for key in ("interval", "forward", "schedule", "handoff", "apply", "other", "loop_cpu"):
        result[f"{key}_ms"] = statistics.median([s[key] * 1000 for s in steps] or [NAN])
    result["context"] = statistics.fmean(s["context"] for s in steps) if steps else 0.0
    return result


def add_overhead(row: dict[str, Any], forward_alone_ms: float) -> None:
    """Overhead = step - forward (the smaller of in-loop and alone: GIL contention counts), or
    the loop thread's CPU per step if larger (work hidden under the forward still takes a core)."""
    row["forward_alone_ms"] = forward_alone_ms
    per_step = [(s["interval"] - min(s["forward"], forward_alone_ms / 1000)) * 1000
                for s in row.pop("per_step")]
    row["wall_overhead_ms"] = statistics.median(per_step or [NAN])
    row["overhead_ms"] = max(row["wall_overhead_ms"], row["loop_cpu_ms"])
    row["overhead_mean_ms"] = statistics.fmean(per_step or [NAN])


def decode_batch(size: int, context: int, block_size: int, sampling: SamplingParams
                 ) -> SchedulerOutput:
    """A synthetic all-decode batch: `size` requests at position context-1, own blocks each."""
    per_request = -(-context // block_size)
    return SchedulerOutput(tuple(
        ScheduledRequest(request_id=str(i), token_ids=(100 + i,), start_pos=context - 1,
                         block_ids=tuple(range(i * per_request, (i + 1) * per_request)),
                         sample=True, sampling_params=sampling)
        for i in range(size)))


def warm_up(engine: LLMEngine, batch: SchedulerOutput, seconds: float) -> None:
    """Runs a batch on the worker at least twice and for `seconds`: a fresh engine's first
    second or two of forwards ran several times slower on the 2-core machine."""
    until, calls = time.perf_counter() + seconds, 0
    while calls < 2 or time.perf_counter() < until:
        engine.worker.submit(batch).result()
        calls += 1


def forward_ms(model: str | None, sizes: list[int], contexts: list[int], steps: int,
               threads: int, warmup_s: float) -> list[float]:
    """Median forward+sampling time (ms) of one decode step per (size, context), alone, on
    the engine's worker thread (the main thread ran the same forward ~2x slower); the KV
    cache holds zeros (same work as real keys and values)."""
    kv_tokens = max(n * (c + 16) for n, c in zip(sizes, contexts, strict=True))
    engine = LLMEngine(engine_args(model, threads, max(sizes), kv_tokens))
    sampling = SamplingParams(temperature=1.0, max_tokens=1)
    medians = []
    for size, context in zip(sizes, contexts, strict=True):
        batch = decode_batch(size, context, engine.args.block_size, sampling)
        warm_up(engine, batch, warmup_s)
        # the worker times each forward on its own thread: (result, seconds)
        times = [engine.worker.submit(batch).result()[1] for _ in range(steps)]
        medians.append(statistics.median(times) * 1000)
    engine.shutdown()
    return medians


# ---- suite interface ----------------------------------------------------------------------


def prefix_key_us(block_size: int = 16, num_blocks: int = 20_000) -> float:
    """Microseconds to key one full block for the prefix cache (the sha256 chain), timed over
    a chain of `num_blocks` blocks. A decoding request fills a block every block_size steps, so
    N running requests key N / block_size blocks per step."""
    from engine.core.block_pool import hash_block_tokens

    blocks = [list(range(i, i + block_size)) for i in range(num_blocks)]
    started, parent = time.perf_counter(), None
    for block in blocks:
        parent = hash_block_tokens(parent, block)
    return (time.perf_counter() - started) / num_blocks * 1e6


def run(ctx: SuiteContext) -> dict[str, Any]:
    """Measures the tiny-model overhead per size, then SmolLM2's forward at the same sizes.

    ctx.extra["overhead_reference_model"] swaps SmolLM2 for another model and
    ctx.extra["overhead_warmup_s"] shortens the warm-up (tests)."""
    ctx.apply_threads()
    cfg = OverheadConfig.quick() if ctx.quick else OverheadConfig()
    cfg = replace(cfg, warmup_s=float(ctx.extra.get("overhead_warmup_s", cfg.warmup_s)))
    model_dir = tiny_model_dir(ctx.log_dir)
    sizes = list(cfg.sizes)
    rows = [measure_size(model_dir, n, cfg, ctx.threads) for n in sizes]
    contexts = [max(1, round(r["context"])) for r in rows]
    tiny = forward_ms(str(model_dir), sizes, contexts, 10, ctx.threads, cfg.warmup_s)
    reference = ctx.extra.get("overhead_reference_model")
    forwards = forward_ms(reference, sizes, contexts, cfg.reference_steps, ctx.threads,
                          cfg.warmup_s)
    from loadtest.benchmarks import overhead_fake

    fixed = overhead_fake.run(model_dir, cfg, ctx.threads)
    key_us = prefix_key_us()
    for row, alone, forward in zip(rows, tiny, forwards, strict=True):
        row["prefix_key_ms"] = row["running"] / 16 * key_us / 1000  # inside overhead_ms
        add_overhead(row, alone)
        row["reference_forward_ms"] = forward
        row["share"] = row["overhead_ms"] / (row["overhead_ms"] + forward)
    shares = [r["share"] for r in rows]
    met = None if any(s != s for s in shares) else all(s < SHARE_LIMIT for s in shares)
    summary = ", ".join(f"{r['share']:.2%} at {r['running']} requests" for r in rows)
    return {"target": TARGET, "met": met, "summary": f"overhead share {summary}",
            "quick": ctx.quick, "config": cfg.__dict__, "threads": ctx.threads,
            "reference_model": reference or "SmolLM2-135M-Instruct (embedded GGUF)",
            "prefix_key_us_per_block": key_us, "fixed_forward": fixed, "rows": rows}


def render(result: dict[str, Any]) -> str:
    """What was run, the per-size table, the breakdown, and the target line."""
    cfg, rows = result["config"], result["rows"]
    main = format_table(
        ["running requests", "overhead ms/step (tiny)", "forward ms (tiny, alone)",
         "reference forward ms", "overhead share"],
        [(r["running"], r["overhead_ms"], r["forward_alone_ms"], r["reference_forward_ms"],
          f"{r['share']:.2%}") for r in rows])
    parts = format_table(
        ["running requests", "steady steps", "step ms", "forward in loop ms", "schedule ms",
         "hand-off + consumers ms", "apply ms", "between steps ms", "loop-thread CPU ms",
         "step - forward ms", "mean context"],
        [(r["running"], r["steady_steps"], r["interval_ms"], r["forward_ms"], r["schedule_ms"],
          r["handoff_ms"], r["apply_ms"], r["other_ms"], r["loop_cpu_ms"],
          r["wall_overhead_ms"], r["context"]) for r in rows])
    text = [
        f"AsyncEngine on uvloop, {result['threads']} torch threads, a 1-layer hidden-64 Llama "
        f"(dummy weights, {TINY_VOCAB}-token byte-level BPE). Each request "
        f"({cfg['prompt_len']}-token prompt, {cfg['output_len']} output tokens, temperature 1, "
        "ignore_eos) is streamed by its own task through server.generation.Call into the "
        "server's SSE bytes. Per pure-decode step (medians; the first "
        f"{cfg['warmup_steps']} skipped): overhead = step start to next step start - the "
        "forward (the smaller of its in-loop time and its time alone, so GIL contention from "
        "the consumers counts), or the loop thread's CPU time per step if larger. Reference: "
        f"{result['reference_model']}, forward + sampling of one decode step at the same size "
        f"and mean context, timed alone (median of {cfg['reference_steps']}).",
        "", main, "",
        "Where the step goes (medians; hand-off includes the consumers' SSE work that outlasts "
        "the tiny forward; loop-thread CPU is all event-loop work per step, consumers included; "
        "with async scheduling the next step is scheduled and applied while the forward runs, "
        "so the parts overlap and need not add up to the step: between steps can go negative):",
        "", parts, "",
        "Share = overhead / (overhead + reference forward). It assumes no overlap; with "
        "SmolLM2's forward the consumers run while it computes, so the real share is lower.",
        "", "Prefix-cache keys (sha256 chain over each full block) cost "
        f"{result.get('prefix_key_us_per_block', NAN):.2f} µs per 16-token block: "
        + ", ".join(f"{r.get('prefix_key_ms', NAN):.3f} ms per step at {r['running']} running"
                    for r in rows) + " (included in the overhead above).",
        "", target_line(TARGET, result["met"], result["summary"])]
    if result.get("fixed_forward"):
        from loadtest.benchmarks.overhead_fake import render as render_fixed

        text += ["", render_fixed(result["fixed_forward"])]
    if result.get("quick"):
        text.insert(0, "*Quick run (16 and 32 requests): not the target's sizes.*\n")
    return "\n".join(text)


if __name__ == "__main__":
    run_alone(NAME, run, render)
