"""What a prefill chunk costs beside the decodes, by chunk size and by how deep into its prompt
it is: the surface the adaptive budget (engine/core/step_budget.py) chooses on, measured.

One engine in this process (the benchmark's model and threads, default flags otherwise) runs
synthetic steps straight on its worker, as the overhead benchmark does: the decoders' rows
(one token each at a short context) alone, then the same rows plus one chunk of C prompt tokens
whose context already holds D tokens, for each C and D. The KV cache holds zeros (the same
work as real keys and values). Medians of a few steps after two warm-up ones.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from loadtest.benchmarks.engines import engine_args

CHUNKS = (4, 8, 16, 32, 64, 128)
DECODE_CONTEXT = 40


def surface_batch(decoders: int, chunk: int, depth: int, block_size: int
                  ) -> SchedulerOutput:
    """`decoders` decode rows, plus (chunk > 0) one chunk of `chunk` tokens at `depth`."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    per = -(-(DECODE_CONTEXT + 1) // block_size)
    rows = [ScheduledRequest(f"d{i}", (100 + i,), DECODE_CONTEXT - 1,
                             tuple(range(i * per, (i + 1) * per)), True, params)
            for i in range(decoders)]
    if chunk:
        first, blocks = decoders * per, -(-(depth + chunk) // block_size)
        rows.append(ScheduledRequest("chunk", tuple(range(200, 200 + chunk)), depth,
                                     tuple(range(first, first + blocks)), False, params))
    return SchedulerOutput(tuple(rows))


def _median_ms(engine: LLMEngine, batch: SchedulerOutput, steps: int) -> float:
    for _ in range(2):
        engine.worker.submit(batch).result()
    return statistics.median(engine.worker.submit(batch).result()[1]
                             for _ in range(steps)) * 1e3


def measure_surface(model: str, threads: int, decoders: int, depths: Sequence[int],
                    max_model_len: int, chunks: Sequence[int] = CHUNKS, steps: int = 5
                    ) -> dict[str, Any]:
    """Decode-only step and decode + chunk steps (ms) for every (depth, chunk)."""
    kv_tokens = decoders * (DECODE_CONTEXT + 16) + max(depths) + max(chunks) + 16
    args = dataclasses.replace(engine_args(model, threads, max(decoders, 1) + 1, kv_tokens),
                               max_model_len=max_model_len)
    engine = LLMEngine(args)
    try:
        block_size = engine.args.block_size
        decode_ms = _median_ms(engine, surface_batch(decoders, 0, 0, block_size), steps)
        rows = [{"depth": depth, "chunk": chunk,
                 "step_ms": _median_ms(engine, surface_batch(decoders, chunk, depth,
                                                             block_size), steps)}
                for depth in depths for chunk in chunks]
    finally:
        engine.shutdown()
    return {"decoders": decoders, "decode_ms": decode_ms, "rows": rows, "steps": steps}


def surface_findings(surface: dict[str, Any], goal: float) -> list[str]:
    """Per depth: the smallest chunk's step over the decode-only step, and the largest chunk
    whose step stays within `goal` x it (None when none does)."""
    decode_ms = surface["decode_ms"]
    lines = []
    for depth in sorted({r["depth"] for r in surface["rows"]}):
        rows = sorted((r for r in surface["rows"] if r["depth"] == depth),
                      key=lambda r: r["chunk"])
        fits = [r["chunk"] for r in rows if r["step_ms"] <= goal * decode_ms]
        smallest = rows[0]
        lines.append(f"at context {depth:,}: a {smallest['chunk']}-token chunk makes the step "
                     f"{smallest['step_ms'] / decode_ms:.1f}x a decode-only step; "
                     + (f"the largest chunk within {goal:g}x is {max(fits)} tokens"
                        if fits else f"no chunk keeps it within {goal:g}x"))
    return lines


def render_surface(surface: dict[str, Any], goal: float) -> list[str]:
    """The table (one row per depth, step ms and its ratio to a decode-only step per chunk)
    and the findings, as markdown lines."""
    from loadtest.benchmarks.common import format_table

    decode_ms = surface["decode_ms"]
    chunks = sorted({r["chunk"] for r in surface["rows"]})
    table = []
    for depth in sorted({r["depth"] for r in surface["rows"]}):
        cells = {r["chunk"]: r["step_ms"] for r in surface["rows"] if r["depth"] == depth}
        table.append([f"{depth:,}", *[f"{cells[c]:.1f} ({cells[c] / decode_ms:.1f}x)"
                                       for c in chunks]])
    return [
        f"**Step cost of one chunk beside the decodes** (same model and threads, in-process, "
        f"synthetic steps on the engine's worker; medians of {surface['steps']}): "
        f"{surface['decoders']} decode rows alone take {decode_ms:.1f} ms per step; with one "
        "chunk of C prompt tokens whose context already holds the given tokens, in ms and "
        "as a multiple of that:", "",
        format_table(["context", *[f"C = {c}" for c in chunks]], table), "",
        "So " + "; ".join(surface_findings(surface, goal)) + ". A chunk's attention reads its "
        "whole context, so deep into a long prompt even a few tokens cost more than the ITL "
        "goal allows, and smaller chunks only stretch the prompt's TTFT.", ""]
