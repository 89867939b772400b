"""AsyncEngine in-process, without HTTP: streamed deltas add up to the offline result, every
way of abandoning a stream frees its blocks (also mid-step), the queue limit, the periodic
stats line, and stop()."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from engine.config import EngineArgs
from engine.outputs import RequestOutput
from tests.support.tiny_models import random_prompts
from tests.support.waiting import wait_until

T = TypeVar("T")
ENGINE_KWARGS: dict[str, Any] = {"num_threads": 1, "kv_cache_memory_bytes": 4 * 2**20,
                                 "max_model_len": 1024}
VOCAB = 512
STATS_LINE = re.compile(
    r"Avg prompt throughput: (?P<prompt>\d+\.\d) tokens/s, "
    r"Avg generation throughput: (?P<gen>\d+\.\d) tokens/s, "
    r"Running: (?P<running>\d+) reqs, Waiting: (?P<waiting>\d+) reqs, "
    r"KV cache usage: (?P<kv>\d+\.\d)%, Prefix cache hit rate: (?P<hit>\d+\.\d)%")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    """The offline API on the same checkpoint and settings: the expected results."""
    return LLM(str(tiny_llama_dir), **ENGINE_KWARGS)


def run_with_engine(model_dir: Path, body: Callable[[AsyncEngine], Awaitable[T]],
                    **kwargs: Any) -> T:
    """Builds and starts an AsyncEngine inside a fresh event loop, runs `body`, stops it."""
    async def main() -> T:
        engine = AsyncEngine.from_args(EngineArgs(model=str(model_dir), **ENGINE_KWARGS),
                                       **kwargs)
        engine.start()
        try:
            return await body(engine)
        finally:
            await engine.stop()

    return asyncio.run(main())


def assert_idle(engine: AsyncEngine) -> None:
    """Nothing queued, nothing running, every block back in the pool."""
    assert engine.num_unfinished == 0
    assert not engine.engine.scheduler.waiting and not engine.engine.scheduler.running
    assert engine.engine.kv.usage() == 0.0
    assert not engine.is_dead


def num_aborted(engine: AsyncEngine) -> float:
    value = engine.metrics.registry.get_sample_value(
        "kvserve:request_success_total", {"model_name": engine.model_name,
                                          "finished_reason": "abort"})
    return value or 0.0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_generate_deltas_concatenate_to_the_offline_result(llm: LLM,
                                                             tiny_llama_dir: Path) -> None:
    prompts = random_prompts(VOCAB, 4, 5, 40, seed=11)
    max_tokens = [7, 30, 1, 50]
    expected = llm.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)

    async def consume(engine: AsyncEngine, i: int) -> list[RequestOutput]:
        return [out async for out in engine.generate(prompts[i], greedy(max_tokens[i]),
                                                     f"req-{i}")]

    async def body(engine: AsyncEngine) -> list[list[RequestOutput]]:
        results = await asyncio.gather(*(consume(engine, i) for i in range(len(prompts))))
        assert_idle(engine)
        # The step-time split counts every step, and the model takes part of each.
        times = engine.step_times
        assert times.num_steps == engine.num_steps >= max(max_tokens)
        assert times.forward_s > 0 and min(times.schedule_s, times.handoff_s,
                                           times.apply_s) >= 0
        assert times.summary().startswith(f"Steps: {engine.num_steps}, mean ")
        return results

    results = run_with_engine(tiny_llama_dir, body)
    for want, outs, num in zip(expected, results, max_tokens, strict=True):
        completion = want.outputs[0]
        assert len(completion.token_ids) == num
        deltas = [o.outputs[0] for o in outs]
        assert [t for d in deltas for t in d.token_ids] == completion.token_ids
        assert "".join(d.text for d in deltas) == completion.text
        # Streamed step by step, not in one piece at the end.
        assert len([d for d in deltas if d.token_ids]) == num
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert deltas[-1].finish_reason == "length"
        # Delta-only: each output carries just its step's token, never the whole history.
        assert [len(d.token_ids) for d in deltas if d.token_ids] == [1] * num


def test_breaking_out_of_the_iteration_aborts_and_frees_blocks(tiny_llama_dir: Path) -> None:
    prompt = random_prompts(VOCAB, 1, 30, 30, seed=12)[0]
    max_tokens = 900

    async def body(engine: AsyncEngine) -> None:
        received = 0
        async for _ in engine.generate(prompt, greedy(max_tokens), "leaver"):
            received += 1
            if received == 3:
                assert engine.engine.kv.usage() > 0
                break
        await wait_until(lambda: engine.num_unfinished == 0
                         and not engine.engine.scheduler.running)
        assert_idle(engine)
        assert num_aborted(engine) == 1
        # Stopped early: far fewer tokens than it was allowed.
        assert engine.engine.scheduler.stats.num_generation_tokens < max_tokens // 2

    run_with_engine(tiny_llama_dir, body)


def test_cancelling_the_consumer_aborts_only_that_request(llm: LLM,
                                                          tiny_llama_dir: Path) -> None:
    prompts = random_prompts(VOCAB, 2, 20, 20, seed=13)
    expected = llm.generate(prompts[1], greedy(60), use_tqdm=False)[0].outputs[0].token_ids

    async def consume(engine: AsyncEngine, prompt: list[int], num: int, rid: str,
                      seen: list[int]) -> list[int]:
        async for out in engine.generate(prompt, greedy(num), rid):
            seen.extend(out.outputs[0].token_ids)
        return seen

    async def body(engine: AsyncEngine) -> None:
        doomed_seen: list[int] = []
        doomed = asyncio.create_task(consume(engine, prompts[0], 900, "doomed", doomed_seen))
        survivor = asyncio.create_task(consume(engine, prompts[1], 60, "survivor", []))
        await wait_until(lambda: len(doomed_seen) >= 5)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert await survivor == expected
        await wait_until(lambda: engine.num_unfinished == 0)
        assert_idle(engine)
        assert num_aborted(engine) == 1
        assert len(doomed_seen) < 900

    run_with_engine(tiny_llama_dir, body)


def test_cancel_during_a_step_is_applied_after_it(llm: LLM, tiny_llama_dir: Path) -> None:
    prompts = random_prompts(VOCAB, 2, 24, 24, seed=14)
    expected = llm.generate(prompts[1], greedy(20), use_tqdm=False)[0].outputs[0].token_ids

    async def body(engine: AsyncEngine) -> None:
        loop = asyncio.get_running_loop()
        in_step, release = asyncio.Event(), threading.Event()
        hold = {"armed": False, "used": False}
        execute = engine.engine.runner.execute

        def held_execute(batch: Any) -> Any:
            # Runs on the worker thread: park the step until the test has cancelled.
            if hold["armed"]:
                hold["armed"] = False
                loop.call_soon_threadsafe(in_step.set)
                assert release.wait(10.0)
            return execute(batch)

        engine.engine.runner.execute = held_execute  # type: ignore[method-assign]
        seen: list[int] = []

        async def consume() -> None:
            async for out in engine.generate(prompts[0], greedy(900), "mid-step"):
                seen.extend(out.outputs[0].token_ids)
                if len(seen) >= 3 and not hold["used"]:
                    hold["armed"] = hold["used"] = True

        task = asyncio.create_task(consume())
        await asyncio.wait_for(in_step.wait(), 10.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The worker is still writing into this request's blocks: they must stay held.
        assert engine.engine.kv.usage() > 0
        assert engine.engine.scheduler.running
        release.set()
        await wait_until(lambda: engine.num_unfinished == 0
                         and not engine.engine.scheduler.running)
        assert_idle(engine)
        assert num_aborted(engine) == 1
        # The loop survived and serves the next request exactly.
        out = [t async for o in engine.generate(prompts[1], greedy(20), "after")
               for t in o.outputs[0].token_ids]
        assert out == expected
        assert_idle(engine)

    run_with_engine(tiny_llama_dir, body)


def test_max_queue_len_rejects_beyond_the_waiting_limit(tiny_llama_dir: Path) -> None:
    prompts = random_prompts(VOCAB, 5, 10, 10, seed=15)

    async def main() -> None:
        engine = AsyncEngine.from_args(EngineArgs(model=str(tiny_llama_dir), **ENGINE_KWARGS),
                                       max_queue_len=2)
        # Not started yet: everything added stays waiting.
        streams = [engine.add_request(prompts[i], greedy(5), f"q{i}") for i in range(2)]
        with pytest.raises(QueueFullError):
            engine.add_request(prompts[2], greedy(5), "q2")
        assert len(engine.engine.scheduler.waiting) == 2 and engine.num_unfinished == 2
        engine.start()
        try:
            for stream in streams:
                outs = [o async for o in stream]
                assert sum(len(o.outputs[0].token_ids) for o in outs) == 5
            # Once the queue drained, new requests are accepted again.
            more = [engine.add_request(prompts[i], greedy(5), f"q{i}") for i in (3, 4)]
            for stream in more:
                assert [o async for o in stream][-1].finished
            assert_idle(engine)
        finally:
            await engine.stop()

    asyncio.run(main())


@dataclass
class _Emitted:
    """A stats line and the engine's state at the moment it was logged."""

    line: str
    time: float
    num_generation_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float


class _StatsCapture(logging.Filter):
    """Records the engine's counters when each stats line is emitted (same thread, so no step
    can run in between)."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__()
        self.engine = engine
        self.emitted: list[_Emitted] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Avg prompt throughput"):
            engine = self.engine.engine
            self.emitted.append(_Emitted(
                message, record.created, engine.scheduler.stats.num_generation_tokens,
                len(engine.scheduler.running), len(engine.scheduler.waiting), engine.kv.usage()))
        return True


def test_stats_line_format_and_generation_throughput(tiny_llama_dir: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvserve")
    prompts = random_prompts(VOCAB, 4, 30, 30, seed=16)
    # Long enough that scheduling jitter of a few ms on a busy machine stays small against it.
    interval = 0.2
    num_lines = 5

    async def body(engine: AsyncEngine) -> _StatsCapture:
        capture = _StatsCapture(engine)
        caplog.handler.addFilter(capture)
        # At least 2 ms a step, so the 900 steps outlast the lines awaited however fast the
        # engine gets (the tiny model's steps alone took well under 1 ms).
        runner = engine.engine.runner
        execute = runner.execute

        def slow_execute(batch: Any) -> Any:
            time.sleep(0.002)
            return execute(batch)

        runner.execute = slow_execute  # type: ignore[method-assign]

        async def consume(i: int) -> None:
            async for _ in engine.generate(prompts[i], greedy(900), f"s{i}"):
                pass

        tasks = [asyncio.create_task(consume(i)) for i in range(len(prompts))]
        try:
            await wait_until(lambda: len(capture.emitted) >= num_lines, timeout=60.0)
            assert not any(task.done() for task in tasks)  # all ran the whole time
        finally:
            caplog.handler.removeFilter(capture)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return capture

    emitted = run_with_engine(tiny_llama_dir, body, stats_interval_s=interval).emitted
    logged = [r.getMessage() for r in caplog.records if "Avg prompt throughput" in
              r.getMessage()]
    assert logged == [e.line for e in emitted]
    assert len(emitted) >= num_lines, logged
    parsed = []
    for e in emitted:
        match = STATS_LINE.fullmatch(e.line)
        assert match, e.line
        parsed.append(match)
        assert int(match["running"]) == e.num_running
        assert int(match["waiting"]) == e.num_waiting
        assert float(match["kv"]) == pytest.approx(e.kv_usage * 100, abs=0.051)
    assert float(parsed[0]["prompt"]) > 0  # the prefills happened in the first interval
    assert all(int(m["running"]) == len(prompts) and float(m["kv"]) > 0 for m in parsed)
    # Each later line covers the time since the previous one: its generation throughput is
    # the tokens generated in between over that time.
    rates = []
    for (e0, e1), match in zip(pairwise(emitted), parsed[1:], strict=True):
        assert e1.time - e0.time >= 0.9 * interval
        rates.append(float(match["gen"]))
        expected = (e1.num_generation_tokens - e0.num_generation_tokens) / (e1.time - e0.time)
        assert rates[-1] == pytest.approx(expected, rel=0.05, abs=0.2)
    # Over all lines, rate x time adds up to the tokens generated.
    generated = emitted[-1].num_generation_tokens - emitted[0].num_generation_tokens
    assert generated > 0
    assert sum(rate * (e1.time - e0.time) for rate, (e0, e1) in
               zip(rates, pairwise(emitted), strict=True)) == pytest.approx(generated, rel=0.02)


def test_stop_ends_pending_streams_with_engine_dead_error(tiny_llama_dir: Path) -> None:
    prompts = random_prompts(VOCAB, 2, 10, 10, seed=17)

    async def main() -> None:
        engine = AsyncEngine.from_args(EngineArgs(model=str(tiny_llama_dir), **ENGINE_KWARGS))
        engine.start()
        first = engine.add_request(prompts[0], greedy(900), "running")
        await anext(first)  # it is running
        waiting_task = asyncio.create_task(_drain(engine.generate(prompts[1], greedy(900),
                                                                  "other")))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(engine.stop(), 10.0)
        with pytest.raises(EngineDeadError):
            while True:
                await asyncio.wait_for(anext(first), 5.0)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiting_task, 5.0)
        assert engine.num_unfinished == 0

    asyncio.run(main())


async def _drain(outputs: Any) -> None:
    async for _ in outputs:
        pass


def test_abort_all_ends_streams_with_the_reason_and_frees_blocks(tiny_llama_dir: Path) -> None:
    prompts = random_prompts(VOCAB, 3, 10, 10, seed=18)

    async def body(engine: AsyncEngine) -> None:
        streams = [engine.add_request(p, greedy(900), f"a{i}") for i, p in enumerate(prompts)]
        for stream in streams:
            await anext(stream)  # all running
        engine.abort_all("going away")
        for stream in streams:
            with pytest.raises(EngineDeadError, match="going away"):
                async for _ in stream:
                    pass
        await wait_until(lambda: not engine.engine.scheduler.running)
        assert_idle(engine)
        assert num_aborted(engine) == len(prompts)

    run_with_engine(tiny_llama_dir, body)
