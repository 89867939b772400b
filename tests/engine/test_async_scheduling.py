"""Async scheduling (the next step scheduled while the model runs this one) gives exactly the
synchronous loop's outputs, token for token: greedy and seeded sampling, stop strings and stop
tokens, max_tokens, min_tokens, penalties, logprobs, n > 1, preemption and prefix caching, and
requests aborted mid-flight. Also: the pipeline really runs ahead (placeholders reach the
worker), never schedules past max_tokens, and falls back to one step at a time for grammars."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineArgs, add_engine_flags, engine_args_from_flags
from engine.core.async_scheduler import AsyncScheduler
from engine.core.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from engine.outputs import RequestOutput
from engine.sampling_params import StructuredOutputsParams
from tests.support.tiny_models import random_prompts

KWARGS: dict[str, Any] = {"num_threads": 1, "max_model_len": 512, "dtype": "float32"}
VOCAB = 512


def record_batches(llm: LLM) -> list[SchedulerOutput]:
    """Every batch handed to the worker, in order."""
    batches: list[SchedulerOutput] = []
    worker = llm.engine.worker
    submit = worker.submit

    def recording(batch: SchedulerOutput) -> Any:
        batches.append(batch)
        return submit(batch)

    worker.submit = recording  # type: ignore[method-assign]
    return batches


def mixed_params(seed: int) -> list[SamplingParams]:
    """One of each: greedy, seeded at temperature 1 (with top-k/top-p), a stop string, stop
    token ids, min_tokens, penalties with logprobs, n = 3 seeded, and varied max_tokens."""
    return [
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=seed, max_tokens=23, top_k=50, top_p=0.9),
        SamplingParams(temperature=1.0, seed=seed + 1, max_tokens=30, stop=["e", "a "]),
        SamplingParams(temperature=1.0, seed=seed + 2, max_tokens=30,
                       stop_token_ids=list(range(0, VOCAB, 7))),
        SamplingParams(temperature=1.0, seed=seed + 3, max_tokens=12, min_tokens=8,
                       stop_token_ids=list(range(0, VOCAB, 5))),
        SamplingParams(temperature=0.8, seed=seed + 4, max_tokens=19, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.3, logprobs=3),
        SamplingParams(temperature=1.0, seed=seed + 5, n=3, max_tokens=15, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=1.0, seed=seed + 6, max_tokens=26),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, presence_penalty=2.0),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=3.0),
    ]


def summary(outputs: list[RequestOutput]) -> list[Any]:
    """Everything a caller sees of each request, choice by choice: the tokens, text, ending
    and logprob ranks exactly; logprobs to 1e-3 nats (a step's batch differs between the two
    loops, which moves float32 sums by ~1e-5)."""
    return [[(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
              [sorted((t, lp.rank, lp.decoded_token) for t, lp in pos.items())
               for pos in c.logprobs or []],
              [sorted((t, pytest.approx(lp.logprob, abs=1e-3)) for t, lp in pos.items())
               for pos in c.logprobs or []])
             for c in out.outputs] for out in outputs]


def generate_both(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams],
                  **kwargs: Any) -> tuple[list[Any], list[Any], LLM, list[SchedulerOutput]]:
    """The same requests through a synchronous and an async-scheduling engine."""
    results, batches = [], []
    llm = None
    for async_scheduling in (False, True):
        llm = LLM(str(model_dir), async_scheduling=async_scheduling, **{**KWARGS, **kwargs})
        batches = record_batches(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        results.append(summary(outs))
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks  # nothing leaked
    assert llm is not None
    return results[0], results[1], llm, batches


def ran_ahead(batches: list[SchedulerOutput]) -> int:
    """Batches in which some row's input token was still being sampled when scheduled."""
    return sum(any(PLACEHOLDER_TOKEN_ID in r.token_ids for r in b.requests) for b in batches)


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 32}, {"block_size": 8}])
def test_async_matches_sync_token_for_token(tiny_llama_dir: Path, config: dict[str, Any]
                                            ) -> None:
    params = mixed_params(seed=3) * 2
    prompts = random_prompts(VOCAB, len(params), 3, 60, seed=21)
    sync, async_, llm, batches = generate_both(tiny_llama_dir, prompts, params, **config)
    assert async_ == sync
    assert isinstance(llm.engine.scheduler, AsyncScheduler)
    assert ran_ahead(batches) >= 10
    reasons = {c[3] for out in sync for c in out}
    assert reasons == {"stop", "length"}  # both kinds of ending happened mid-flight


def test_async_matches_sync_under_preemption_and_prefix_caching(tiny_llama_dir: Path) -> None:
    shared = random_prompts(VOCAB, 1, 40, 40, seed=4)[0]
    tails = random_prompts(VOCAB, 12, 1, 30, seed=5)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(12)]
    # 40 blocks of 16 tokens (512 bytes per token): twelve requests of up to 110 tokens
    # cannot all stay resident
    sync, async_, llm, batches = generate_both(
        tiny_llama_dir, [shared + t for t in tails], params, max_model_len=256,
        kv_cache_memory_bytes=512 * 16 * 40)
    assert async_ == sync
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.kv.stats.hits > 0
    assert ran_ahead(batches) > 0


def test_no_step_is_scheduled_past_max_tokens(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), **KWARGS)
    batches = record_batches(llm)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    rows = [r for b in batches for r in b.requests]
    assert sum(r.sample for r in rows) == 5  # one sampling row per token, none wasted
    assert ran_ahead(batches) == 4


def test_min_tokens_counts_the_token_in_flight(tiny_llama_dir: Path) -> None:
    prompt = {"prompt_token_ids": [9, 8, 7, 6]}
    free = LLM(str(tiny_llama_dir), async_scheduling=False, **KWARGS).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(3, 20) if free[i] not in free[:i])
    # Its k-th token is a stop token that min_tokens = k no longer bans: the async engine must
    # count the token still being sampled, or it bans one step too long and goes on.
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=k,
                            stop_token_ids=[free[k]])
    out = LLM(str(tiny_llama_dir), **KWARGS).generate(prompt, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == free[:k + 1]
    assert out.outputs[0].stop_reason == free[k]


def test_grammar_requests_run_one_step_at_a_time(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), **KWARGS)
    engine = llm.engine
    assert engine.pipeline_depth() == 2
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("free", {"prompt_token_ids": [5, 6, 7]}, plain)
    engine.add_request("json", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(
        temperature=0.0, max_tokens=6,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
    assert engine.pipeline_depth() == 1
    batches = record_batches(llm)
    while engine.has_unfinished_requests():
        engine.step()
        if engine.scheduler.num_grammar_requests:  # type: ignore[attr-defined]
            assert len(engine.in_flight) <= 1
    with_grammar = [b for b in batches if any(r.request_id == "json" for r in b.requests)]
    assert len(with_grammar) >= 2 and ran_ahead(with_grammar) == 0
    assert engine.pipeline_depth() == 2  # back to running ahead once the grammar is done


def test_aborts_mid_flight_leave_the_others_exact(tiny_llama_dir: Path) -> None:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(6)]
    prompts = random_prompts(VOCAB, 6, 5, 50, seed=8)
    sync = LLM(str(tiny_llama_dir), async_scheduling=False, **KWARGS).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stop_after = {1: 3, 4: 10}  # request index -> deltas read before walking away

    async def consume(engine: AsyncEngine, i: int) -> list[int]:
        ids: list[int] = []
        async for out in engine.generate({"prompt_token_ids": prompts[i]}, params[i], f"r{i}"):
            ids += out.outputs[0].token_ids
            if len(ids) >= stop_after.get(i, 10**6):
                break  # cancels the stream: the request is aborted with a step in flight
        return ids

    async def main() -> list[list[int]]:
        engine = AsyncEngine.from_args(EngineArgs(model=str(tiny_llama_dir), **KWARGS))
        engine.start()
        try:
            results = await asyncio.gather(*(consume(engine, i) for i in range(6)))
            assert engine.engine.scheduler.stats.num_generation_tokens < 6 * 40
            while engine.engine.in_flight:
                await asyncio.sleep(0.01)
            assert engine.engine.kv.num_free_blocks == engine.engine.num_blocks
            return results
        finally:
            await engine.stop()

    results = asyncio.run(main())
    for i, ids in enumerate(results):
        want = sync[i].outputs[0].token_ids
        assert ids == (want[:len(ids)] if i in stop_after else want)
        assert len(ids) >= stop_after.get(i, 40)


def test_flag_parses_both_ways() -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser, "serve")
    assert engine_args_from_flags(parser.parse_args([]), "serve").async_scheduling is True
    off = parser.parse_args(["--no-async-scheduling"])
    assert engine_args_from_flags(off, "serve").async_scheduling is False
