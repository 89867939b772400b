"""Pipeline parallelism on CPU ranks (gloo): the same greedy tokens and logprobs as one process
on the tiny Llama (2 stages, tied embeddings), the tiny Qwen2 (untied LM head) and a 3-layer
Llama over 3 stages, through chunked prefill and prefix caching; per-stage KV capacity (lines,
cache shapes, `kvserve plan -pp 2`); refusal of more stages than layers (TP x PP: test_tp_pp.py); a killed
stage ending requests with an error; shutdown reaping every stage; `kvserve serve -pp 2`."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.async_engine import AsyncEngine
from engine.core.scheduler_output import SchedulerOutput
from engine.llm import LLM
from engine.models.pipeline_layers import split_layers
from engine.sampling_params import SamplingParams
from tests.engine.test_tensor_parallel import (
    ENGINE_KWARGS,
    KV_BYTES,
    _assert_same,
    _ending,
    _prompts,
    _run,
    logged_llm,
    one_process_reference,
)


def _pp_llm(model: Path, size: int = 2, **kwargs: object) -> tuple[LLM, list[str]]:
    return logged_llm(model, pipeline_parallel_size=size, **kwargs)


@pytest.fixture(scope="module")
def pp_llama(tiny_llama_dir: Path) -> Iterator[tuple[LLM, list[str]]]:
    """A PP=2 engine of the tiny Llama and its startup log, shared by this module."""
    llm, lines = _pp_llm(tiny_llama_dir)
    yield llm, lines
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def tiny_llama3_layers(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a third layer (layer 1's weights, scaled): three stages of one."""
    path = tmp_path_factory.mktemp("tiny_llama_3_layers")
    for item in tiny_llama_dir.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, path / item.name)
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        scale = 1.0 if "norm" in name else 0.7
        tensors[name.replace("layers.1.", "layers.2.")] = (tensors[name] * scale).contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_split_layers() -> None:
    """Contiguous, as even as possible, the remainder on the earlier stages."""
    assert split_layers(2, 2) == [(0, 1), (1, 2)]
    assert split_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]


def test_pp2_matches_one_process_llama(tiny_llama_dir: Path,
                                       pp_llama: tuple[LLM, list[str]]) -> None:
    """Greedy ids and logprobs of PP=2 equal one process, through chunked prefill (prompts of
    30-60 tokens in 16-token steps) and prefix-cache hits."""
    reference = one_process_reference(tiny_llama_dir)
    llm = pp_llama[0]
    hits_before = llm.engine.stats().prefix_cache_hits
    _assert_same(reference, _run(llm))
    assert llm.engine.stats().prefix_cache_hits > hits_before


def test_pp2_matches_one_process_qwen2(tiny_qwen2_dir: Path) -> None:
    """Qwen2: q/k/v bias and an untied LM head, which only the last stage holds."""
    reference = one_process_reference(tiny_qwen2_dir)
    llm, _ = _pp_llm(tiny_qwen2_dir)
    try:
        _assert_same(reference, _run(llm))
        assert not hasattr(llm.engine.runner.model.embed_tokens, "num_embeddings")
    finally:
        llm.engine.shutdown()


def test_pp3_matches_one_process(tiny_llama3_layers: Path) -> None:
    """Three stages of one layer each (a middle stage that neither embeds nor samples), with
    async scheduling off (one step at a time) as well as on."""
    reference = one_process_reference(tiny_llama3_layers)
    llm, lines = _pp_llm(tiny_llama3_layers, size=3, async_scheduling=False)
    try:
        _assert_same(reference, _run(llm))
        assert any("stage 2 of 3 (layers 2-2) in this process" in line for line in lines)
    finally:
        llm.engine.shutdown()
    assert llm.engine.pp is not None and all(not p.is_alive() for p in llm.engine.pp.procs)


def test_kv_capacity_is_per_stage(tiny_llama_dir: Path,
                                  pp_llama: tuple[LLM, list[str]]) -> None:
    """Each stage holds the KV of its one layer of two: half the bytes per token, so the same
    per-stage budget holds twice the tokens; rank 0's cache has its one layer only."""
    llm, lines = pp_llama
    plan = llm.engine.kv_cache_plan
    full = llm.engine.model_config.kv_bytes_per_token(4)
    assert plan.bytes_per_token == full // 2
    assert plan.num_tokens == KV_BYTES // (full // 2) // 8 * 8
    assert "Available KV cache memory: 0.00 GiB per stage (pipeline parallel size 2, " \
           "0.01 GiB in all)" in lines
    assert f"CPU KV cache size: {plan.num_tokens:,} tokens" in lines
    caches = llm.engine.runner.kv_caches
    assert len(caches) == 1 and caches[0][0].shape == (plan.num_blocks, 8, 2, 16)
    assert len(llm.engine.runner.model.layers) == 1
    pp = llm.engine.pp  # its own store port and group names; a share of the threads each
    assert pp is not None and pp.prefix.startswith("kvserve-par-") and pp.store.port > 0
    assert any(f"{pp.num_threads} CPU threads per rank" in line for line in lines)
    assert llm.engine.worker.call(torch.get_num_threads) == pp.num_threads  # rank 0 too


def test_plan_shows_per_stage_figures(tiny_llama_dir: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`kvserve plan -pp 2`: one layer's KV bytes per token and fewer weight bytes per GPU."""
    from server.cli import main

    assert main(["plan", str(tiny_llama_dir), "--memory", "1GiB"]) == 0
    one = capsys.readouterr().out
    assert main(["plan", str(tiny_llama_dir), "--memory", "1GiB", "-pp", "2"]) == 0
    two = capsys.readouterr().out
    assert "bytes per token     256 B = 2 x 2 layers" in one
    assert "bytes per token     128 B = 2 x 1 layers" in two
    assert "--pipeline-parallel-size 2: stage 0 holds layers 0-0, stage 1 layers 1-1" in two
    assert "Memory per GPU" in two and "per stage (pipeline parallel size 2" in two


def test_refuses_more_stages_than_layers(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="larger than this model's 2 layers.*use 1 to 2"):
        LLM(str(tiny_llama_dir), pipeline_parallel_size=3, **ENGINE_KWARGS)


def _kill_stage(llm: LLM) -> None:
    pp = llm.engine.pp
    assert pp is not None
    pid = pp.procs[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    pp.procs[0].join(10)


@pytest.mark.timeout(120)
def test_killed_stage_fails_requests_and_stops(tiny_llama_dir: Path) -> None:
    """Offline: the step after a stage's death raises naming the stage; shutdown reaps."""
    llm, _ = _pp_llm(tiny_llama_dir)
    pp = llm.engine.pp
    assert pp is not None
    _kill_stage(llm)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"pipeline-parallel rank 1 \(stage 0 of 2"):
        llm.generate(_prompts(), SamplingParams(max_tokens=5), use_tqdm=False)
    assert time.monotonic() - started < 10
    llm.engine.shutdown()
    assert all(not p.is_alive() for p in pp.procs)


@pytest.mark.timeout(120)
def test_killed_stage_mid_stream_kills_async_engine(tiny_llama_dir: Path) -> None:
    """Serving: a stage killed mid-generation ends every stream with an error, the engine
    reports dead, and stop() reaps the stages."""
    from engine.errors import EngineDeadError

    llm, _ = _pp_llm(tiny_llama_dir, max_num_batched_tokens=None)

    async def scenario() -> None:
        engine = AsyncEngine(llm.engine)
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        streams = [engine.add_request(p, params, f"r{i}") for i, p in enumerate(_prompts())]
        await streams[0].__anext__()
        _kill_stage(llm)
        for stream in streams:
            assert await _ending(stream) in ("error", "EngineDeadError")
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            engine.add_request(_prompts()[0], params, "late")
        await engine.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert llm.engine.pp is not None and all(not p.is_alive() for p in llm.engine.pp.procs)


@pytest.mark.timeout(180)
def test_serve_pp2_completes_and_reaps(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`kvserve serve -pp 2` answers a completion; SIGTERM stops it and its stage process."""
    import psutil

    from tests.support.api import assert_serves
    from tests.support.server_process import kvserve

    with kvserve(tiny_llama_dir, "-pp", "2", log_dir=tmp_path) as server:
        assert_serves(server)
        ranks = [p for p in psutil.Process(server.proc.pid).children()
                 if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 1
        assert "per stage (pipeline parallel size 2" in server.log()
        assert server.stop() == 0
    assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE


def assert_batch_queue(model: Path, llm: LLM) -> None:
    """The batch queue of `llm` (PP=2, alone or with TP): rank 0 launches a second batch before
    it finishes the first (the worker thread runs launch, launch, finish, launch, finish, ...),
    the batches in flight never share a request whose token is pending, each takes at most
    half the live requests, and the tokens still equal one process."""
    from engine.core.async_scheduler import BatchQueueScheduler

    engine = llm.engine
    assert engine.batch_queue and isinstance(engine.scheduler, BatchQueueScheduler)
    assert engine.pipeline_depth() == 2
    worker = engine.worker
    calls: list[str] = []
    outstanding: list[frozenset[str]] = []
    sizes: list[int] = []
    launch, finish = worker.launch, worker.finish

    def sampling_ids(batch: SchedulerOutput) -> frozenset[str]:
        return frozenset(r.request_id for r in batch.requests if r.sample)

    def traced_launch(batch: SchedulerOutput) -> Future[None]:
        ids = sampling_ids(batch)
        assert all(not (ids & other) for other in outstanding), "a pending token rescheduled"
        outstanding.append(ids)
        calls.append("L")
        sizes.append(len(batch.requests))
        return launch(batch)

    def traced_finish(batch: SchedulerOutput, launched: Future[None]) -> Future[Any]:
        assert outstanding.pop(0) == sampling_ids(batch)
        calls.append("F")
        return finish(batch, launched)

    # 8 two-token prompts fit one step's 16-token budget: only the cap splits them.
    prompts = [{"prompt_token_ids": [5 + i, 17 + i]} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    single = LLM(str(model), **ENGINE_KWARGS)
    try:
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, params,
                                                                    use_tqdm=False)]
    finally:
        single.engine.shutdown()
    worker.launch, worker.finish = traced_launch, traced_finish  # type: ignore[method-assign]
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del worker.launch, worker.finish
    assert got == expected
    assert "".join(calls).startswith("LLFLF")
    assert max(sizes) <= 4  # 8 live requests over 2 stages


def test_batch_queue_keeps_one_batch_per_stage_in_flight(tiny_llama_dir: Path,
                                                         pp_llama: tuple[LLM, list[str]]) -> None:
    assert_batch_queue(tiny_llama_dir, pp_llama[0])
