"""Tensor parallelism on 2 CPU ranks (gloo): the same greedy tokens and logprobs as one process
on the tiny Llama and Qwen2 (GQA; Qwen2's single KV head is replicated), with prefix caching
and chunked prefill; per-rank capacity lines; refusal of sizes that do not split the model; a
killed rank ending requests with an error; two engines side by side."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs, add_engine_flags, engine_args_from_flags
from engine.errors import EngineDeadError
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.planner import build_plan, format_plan
from engine.sampling_params import SamplingParams
from tests.support.tiny_models import random_prompts

KV_BYTES = 1 << 22  # per rank: the same block count whatever the machine's RAM
# Chunked prefill (prompts up to 60 tokens in 16-token steps) and small blocks.
ENGINE_KWARGS = {"dtype": "float32", "kv_cache_memory_bytes": KV_BYTES, "block_size": 8,
                 "max_num_batched_tokens": 16, "enable_prefix_caching": True}
LOGPROB_TOL = 1e-4


def _prompts() -> list[dict[str, list[int]]]:
    """Prompts sharing a 24-token prefix (prefix-cache hits on the second pass), 30-60 long."""
    prefix = random_prompts(512, 1, 24, 24, seed=7)[0]
    return [{"prompt_token_ids": prefix + tail} for tail in random_prompts(512, 4, 6, 36, seed=3)]


def _run(llm: LLM) -> list[RequestOutput]:
    """Two passes over the prompts: the second reads the shared prefix from the cache."""
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3)
    first = llm.generate(_prompts(), params, use_tqdm=False)
    return first + llm.generate(_prompts(), params, use_tqdm=False)


class _Lines(logging.Handler):
    """Collects the kvserve log lines of an engine's startup."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def logged_llm(model: Path, **kwargs: object) -> tuple[LLM, list[str]]:
    """An LLM with ENGINE_KWARGS (overridden by `kwargs`) and the kvserve log lines of its
    startup."""
    handler, log = _Lines(), logging.getLogger("kvserve")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        llm = LLM(str(model), **{**ENGINE_KWARGS, **kwargs})
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return llm, handler.lines


def one_process_reference(model: Path) -> list[RequestOutput]:
    """`_run` on one process with ENGINE_KWARGS, the engine stopped after."""
    single = LLM(str(model), **ENGINE_KWARGS)
    try:
        return _run(single)
    finally:
        single.engine.shutdown()


def _tp_llm(model: Path, size: int = 2, **kwargs: object) -> tuple[LLM, list[str]]:
    return logged_llm(model, tensor_parallel_size=size, **kwargs)


@pytest.fixture(scope="module")
def tp_llama(tiny_llama_dir: Path) -> Iterator[tuple[LLM, list[str]]]:
    """A TP=2 engine of the tiny Llama and its startup log, shared by this module."""
    llm, lines = _tp_llm(tiny_llama_dir)
    yield llm, lines
    llm.engine.shutdown()


def _assert_same(reference: list[RequestOutput], got: list[RequestOutput]) -> None:
    for ref, out in zip(reference, got, strict=True):
        ref_c, got_c = ref.outputs[0], out.outputs[0]
        assert got_c.token_ids == ref_c.token_ids
        assert ref_c.logprobs is not None and got_c.logprobs is not None
        for ref_lp, got_lp in zip(ref_c.logprobs, got_c.logprobs, strict=True):
            assert ref_lp.keys() == got_lp.keys()
            for token_id, lp in ref_lp.items():
                assert abs(got_lp[token_id].logprob - lp.logprob) < LOGPROB_TOL


def test_tp2_matches_one_process_llama(tiny_llama_dir: Path,
                                       tp_llama: tuple[LLM, list[str]]) -> None:
    """Greedy ids and logprobs of TP=2 equal one process, through chunked prefill and
    prefix-cache hits."""
    single = LLM(str(tiny_llama_dir), **ENGINE_KWARGS)
    reference = _run(single)
    single.engine.shutdown()
    llm = tp_llama[0]
    hits_before = llm.engine.stats().prefix_cache_hits
    _assert_same(reference, _run(llm))
    assert llm.engine.stats().prefix_cache_hits > hits_before


def test_tp2_matches_one_process_qwen2(tiny_qwen2_dir: Path) -> None:
    """Qwen2 (q/k/v bias, untied head, one KV head replicated on both ranks)."""
    single = LLM(str(tiny_qwen2_dir), **ENGINE_KWARGS)
    reference = _run(single)
    single.engine.shutdown()
    llm, _ = _tp_llm(tiny_qwen2_dir)
    try:
        _assert_same(reference, _run(llm))
    finally:
        llm.engine.shutdown()


def test_capacity_lines_are_per_rank(tiny_llama_dir: Path,
                                     tp_llama: tuple[LLM, list[str]]) -> None:
    """Each rank holds 1 of the 2 KV heads: half the bytes per token, so the same per-rank
    budget holds twice the tokens; the memory line says it is per rank."""
    llm, lines = tp_llama
    plan = llm.engine.kv_cache_plan
    full = llm.engine.model_config.kv_bytes_per_token(4)
    assert plan.bytes_per_token == full // 2
    assert plan.num_tokens == KV_BYTES // (full // 2) // 8 * 8
    assert "Available KV cache memory: 0.00 GiB per rank (tensor parallel size 2, " \
           "0.01 GiB in all)" in lines
    assert f"CPU KV cache size: {plan.num_tokens:,} tokens" in lines
    shapes = {tuple(k.shape) for k, _ in llm.engine.runner.kv_caches}
    assert shapes == {(plan.num_blocks, 8, 1, 16)}  # [blocks, block_size, kv heads, head_dim]


def test_plan_shows_per_rank_figures(tiny_llama_dir: Path) -> None:
    """`kvserve plan -tp 2`: per-GPU weights and KV bytes per token, tokens in all."""
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_flags(parser, "plan")
    args = engine_args_from_flags(parser.parse_args([str(tiny_llama_dir), "-tp", "2"]), "plan")
    one = build_plan(EngineArgs(model=str(tiny_llama_dir)), 1 << 30)
    two = build_plan(args, 1 << 30)
    assert two.kv_plan.bytes_per_token * 2 == one.kv_plan.bytes_per_token
    assert two.weight_bytes < one.weight_bytes
    text = format_plan(two)
    assert "--tensor-parallel-size 2: each GPU holds 2 heads / 1 KV heads" in text
    assert "x 1 KV heads x 16 head_dim" in text
    assert "per rank (tensor parallel size 2" in text


@pytest.mark.parametrize("size", [3, 8])
def test_refuses_size_that_does_not_divide(tiny_llama_dir: Path, size: int) -> None:
    """4 heads, 2 KV heads, MLP 128: 3 and 8 are refused, naming 1, 2 and 4."""
    with pytest.raises(ValueError, match="use one of 1, 2, 4"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=size, **ENGINE_KWARGS)


def _kill_rank(llm: LLM) -> None:
    tp = llm.engine.tp
    assert tp is not None
    pid = tp.procs[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    tp.procs[0].join(10)


@pytest.mark.timeout(120)
def test_killed_rank_fails_requests_and_stops(tiny_llama_dir: Path) -> None:
    """Offline: the step after a rank's death raises naming the rank; shutdown reaps."""
    llm, _ = _tp_llm(tiny_llama_dir)
    tp = llm.engine.tp
    assert tp is not None
    _kill_rank(llm)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
        llm.generate(_prompts(), SamplingParams(max_tokens=5), use_tqdm=False)
    assert time.monotonic() - started < 10
    llm.engine.shutdown()
    assert all(not p.is_alive() for p in tp.procs)


async def _ending(stream: AsyncIterator[RequestOutput]) -> str | None:
    """How a stream ended: its last finish_reason, or the error it raised."""
    last = None
    try:
        async for out in stream:
            last = out.outputs[0].finish_reason
    except EngineDeadError:
        return "EngineDeadError"
    return last


@pytest.mark.timeout(120)
def test_killed_rank_mid_stream_kills_async_engine(tiny_llama_dir: Path) -> None:
    """Serving: a rank killed mid-generation ends every stream with EngineDeadError, the
    engine reports dead, refuses new requests, and stop() reaps the ranks."""
    llm, _ = _tp_llm(tiny_llama_dir, max_num_batched_tokens=None)

    async def scenario() -> None:
        engine = AsyncEngine(llm.engine)
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        streams = [engine.add_request(p, params, f"r{i}") for i, p in enumerate(_prompts())]
        await streams[0].__anext__()
        _kill_rank(llm)
        for stream in streams:  # the failed step's with finish_reason error, any other dead
            assert await _ending(stream) in ("error", "EngineDeadError")
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            engine.add_request(_prompts()[0], params, "late")
        await engine.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert llm.engine.tp is not None and all(not p.is_alive() for p in llm.engine.tp.procs)


def test_rank_zero_computes_with_its_share_of_the_threads(
        tp_llama: tuple[LLM, list[str]]) -> None:
    """Rank 0's worker thread (where it computes) runs --num-threads / TP threads, as each
    spawned rank does, not the total (which oversubscribed the cores)."""
    engine = tp_llama[0].engine
    assert engine.tp is not None
    assert engine.worker.call(torch.get_num_threads) == engine.tp.num_threads


def test_two_engines_side_by_side(tiny_llama_dir: Path,
                                  tp_llama: tuple[LLM, list[str]]) -> None:
    """A second TP engine beside the first: its own port and groups; both answer alike."""
    other, _ = _tp_llm(tiny_llama_dir)
    try:
        first, second = tp_llama[0].engine.tp, other.engine.tp
        assert first is not None and second is not None
        assert first.store.port != second.store.port and first.prefix != second.prefix
        params = SamplingParams(temperature=0.0, max_tokens=6)
        a = tp_llama[0].generate(_prompts(), params, use_tqdm=False)
        b = other.generate(_prompts(), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    finally:
        other.engine.shutdown()
    assert torch.get_num_threads() >= 1


@pytest.mark.timeout(180)
def test_server_exits_nonzero_when_a_rank_dies(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`kvserve serve -tp 2`: /health is 200, then a rank is killed: the server notices while
    idle, stops, and exits 3 (a supervisor restarts it)."""
    import urllib.request

    import psutil

    from tests.support.server_process import kvserve

    with kvserve(tiny_llama_dir, "-tp", "2", log_dir=tmp_path) as server:
        with urllib.request.urlopen(f"{server.url}/health", timeout=10) as response:
            assert response.status == 200
        ranks = [p for p in psutil.Process(server.proc.pid).children()
                 if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 1
        ranks[0].kill()
        assert server.proc.wait(30) == 3
        assert "tensor-parallel rank 1" in server.log()
        assert "the engine is dead: stopping the server" in server.log()
        assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE
