"""The adaptive budget's steps while a long prompt prefills beside decoding streams, one by
one: the in-process counterpart of the chunked prefill benchmark, showing what the budget
(engine/core/step_budget.py) chose and how its cost model predicted each step.

One engine in this process (default flags but the threads and context: no
--max-num-batched-tokens, so the budget adapts) runs D decoders (random short prompts, greedy,
EOS ignored) until each has streamed a few tokens, then takes one long prompt. Every step until
its first token is logged: the measured forward time, the cost model's prediction for it (made
before the step joins the fit), the decode-only step the budget holds it to (the measured
pace of the same number of decoders, `AdaptiveStepBudget.decode_step_seconds`), and the
chunk. The window is split into parts by step; each part's medians, and over the window the
steps' p99 against the decoders' pace before the prompt came (the benchmark's reference) and
against that decode-only reference.

    python -m loadtest.benchmarks.chunked_prefill_trace [--threads N] [--prompt-len L]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from engine.core.step_cost import step_features
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOutputKind, SamplingParams
from loadtest.benchmarks.common import format_table
from loadtest.benchmarks.engines import engine_args
from loadtest.stats import percentile


def summarize(steps: Sequence[dict[str, float]], base_s: float, parts: int = 10
              ) -> dict[str, Any]:
    """Per part of the window (by step): the chunks' context range and median size, the
    median step, decode-only reference and measured / predicted (median, max); overall,
    the steps' p50 and p99 over `base_s` and over their decode-only reference."""
    rows = []
    for i in range(parts):
        part = steps[i * len(steps) // parts:(i + 1) * len(steps) // parts]
        if not part:
            continue
        errors = [s["seconds"] / s["predicted"] for s in part if s["predicted"] > 0]
        rows.append({
            "context": (min(s["context"] for s in part), max(s["context"] for s in part)),
            "chunk": statistics.mean(s["chunk"] for s in part),
            "step_ms": statistics.median(s["seconds"] for s in part) * 1e3,
            "decode_only_ms": statistics.median(s["decode_only"] for s in part) * 1e3,
            "error_median": statistics.median(errors) if errors else None,
            "error_max": max(errors) if errors else None})
    own = [s["seconds"] / s["decode_only"] for s in steps if s["decode_only"] > 0]
    paced = [s["seconds"] / base_s for s in steps]
    return {"parts": rows, "steps": len(steps),
            "over_base": (percentile(paced, 50), percentile(paced, 99)),
            "over_decode_only": (percentile(own, 50), percentile(own, 99)) if own else None}


def trace_window(model: str, threads: int, decoders: int = 4, prompt_len: int = 7900,
                 max_model_len: int = 8192, baseline_tokens: int = 8, seed: int = 0
                 ) -> dict[str, Any]:
    """Runs the workload and returns its steps, the decoders' median ITL before the prompt
    came (s) and the prompt's time to first token (s)."""
    args = dataclasses.replace(
        engine_args(model, threads, decoders + 1, decoders * 1024 + max_model_len + 64),
        max_model_len=max_model_len, max_num_batched_tokens=None)
    engine = LLMEngine(args)
    budget = engine.step_budget
    if budget is None:
        raise RuntimeError("the engine's budget is fixed: nothing adaptive to trace")
    steps: list[dict[str, float]] = []
    observe = budget.observe

    def logged(batch: Any, seconds: float) -> None:
        rows = [(len(r.token_ids), r.start_pos + len(r.token_ids)) for r in batch.requests]
        decodes = [row for row in rows if row[0] == 1]
        steps.append({"seconds": seconds,
                      "predicted": budget.model.predict(step_features(rows)),
                      "decode_only": budget.decode_step_seconds(step_features(decodes))
                      if decodes else 0.0,
                      "chunk": float(sum(q for q, _ in rows if q > 1)),
                      "context": float(max((c for q, c in rows if q > 1), default=0))})
        observe(batch, seconds)

    budget.observe = logged  # type: ignore[method-assign]
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    ids = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    times: dict[str, list[float]] = {f"d{i}": [] for i in range(decoders)}
    try:
        for name in times:
            engine.add_request(name, ids(32), SamplingParams(
                temperature=0.0, max_tokens=max_model_len - 33, ignore_eos=True,
                output_kind=RequestOutputKind.DELTA))
        while min(len(t) for t in times.values()) <= baseline_tokens:
            for out in engine.step():
                times[out.request_id].append(time.perf_counter())
        steps.clear()
        sent = time.perf_counter()
        engine.add_request("long", ids(prompt_len), SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True))
        while not any(out.request_id == "long" for out in engine.step()):
            pass
        first = time.perf_counter()
    finally:
        engine.shutdown()
    before = [b - a for t in times.values() for a, b in itertools.pairwise(t) if b <= sent]
    return {"steps": steps, "base_s": statistics.median(before), "ttft_s": first - sent}


def measure_trace(model: str, threads: int, decoders: int, prompt_len: int,
                  max_model_len: int = 8192, parts: int = 10) -> dict[str, Any]:
    """trace_window, summarized (what the benchmark's JSON keeps)."""
    trace = trace_window(model, threads, decoders, prompt_len, max_model_len)
    return {"ttft_s": trace["ttft_s"], "base_s": trace["base_s"],
            "summary": summarize(trace["steps"], trace["base_s"], parts)}


def render_trace(trace: dict[str, Any]) -> list[str]:
    """Markdown lines: the parts' table and the window's ratios."""
    summary = trace["summary"]
    table = format_table(
        ("chunk context", "chunk (tokens)", "step median (ms)", "decode-only reference (ms)",
         "measured / predicted, median", "max"),
        [(f"{p['context'][0]:,.0f}-{p['context'][1]:,.0f}", p["chunk"], p["step_ms"],
          p["decode_only_ms"], p["error_median"], p["error_max"]) for p in summary["parts"]])
    own = summary["over_decode_only"]
    return [
        "**The adaptive budget's steps, traced** (the same workload on one engine in this "
        "process, every step until the long prompt's first token logged with the cost model's "
        "prediction made before it ran; `python -m loadtest.benchmarks.chunked_prefill_trace`; "
        f"the window in {len(summary['parts'])} parts by step):", "", table, "",
        f"TTFT {trace['ttft_s']:.1f} s over {summary['steps']} steps. Steps over the decoders' "
        f"pace before the prompt came ({trace['base_s'] * 1e3:.1f} ms, the benchmark's "
        f"reference): p50 {summary['over_base'][0]:.2f}x, p99 {summary['over_base'][1]:.2f}x"
        + (f"; over the decode-only reference the budget held them to (the measured pace "
           f"of as many decoders): p50 {own[0]:.2f}x, p99 "
           f"{own[1]:.2f}x." if own else "."), ""]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the SmolLM2 HF export")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=7900)
    parser.add_argument("--parts", type=int, default=10)
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from loadtest.benchmarks.hf_export import export_smollm2

        model = str(export_smollm2())
    trace = measure_trace(model, args.threads, 4, args.prompt_len, parts=args.parts)
    print("\n".join(render_trace(trace)))


if __name__ == "__main__":
    main()
