"""Tensor x pipeline parallelism on 4 CPU ranks (gloo): TP=2 x PP=2 gives the same greedy tokens
and logprobs as one process on the tiny Llama and Qwen2 (chunked prefill, prefix caching); the
startup lines name each rank's part and the per-rank KV capacity; greedy tokens under
preemption equal transformers' `generate` with TP=2, PP=2 and TP=2 x PP=2; a killed rank fails
requests and every rank is reaped; `kvserve serve -tp 2 -pp 2`, also SIGTERM under load; SmolLM2
(9 heads, 3 KV heads) under TP=3 against transformers on the same GGUF (the near-tie rule); the
weight shards concatenate back to the checkpoint's tensors."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.llm import LLM
from engine.model_loader.gguf.weights import default_model_path
from engine.sampling_params import SamplingParams
from tests.engine.test_parity import MAX_TOKENS, NUM_PROMPTS, greedy, preemption_budget
from tests.engine.test_tensor_parallel import (
    KV_BYTES,
    _assert_same,
    _prompts,
    _run,
    logged_llm,
    one_process_reference,
)
from tests.support.greedy import GreedyTrace, hf_greedy, hf_topk_greedy
from tests.support.tiny_models import random_prompts

TP_PP = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}


def _llm(model: Path, **kwargs: object) -> tuple[LLM, list[str]]:
    return logged_llm(model, **{**TP_PP, **kwargs})


@pytest.fixture(scope="module")
def tp_pp_llama(tiny_llama_dir: Path) -> Iterator[tuple[LLM, list[str]]]:
    """A TP=2 x PP=2 engine of the tiny Llama (2 layers, 4 heads / 2 KV heads) and its log."""
    llm, lines = _llm(tiny_llama_dir)
    yield llm, lines
    llm.engine.shutdown()


def test_tp2_pp2_matches_one_process_llama(tiny_llama_dir: Path,
                                           tp_pp_llama: tuple[LLM, list[str]]) -> None:
    """Greedy ids and logprobs equal one process through chunked prefill and prefix hits."""
    reference = one_process_reference(tiny_llama_dir)
    llm = tp_pp_llama[0]
    hits_before = llm.engine.stats().prefix_cache_hits
    _assert_same(reference, _run(llm))
    assert llm.engine.stats().prefix_cache_hits > hits_before


def test_tp2_pp2_matches_one_process_qwen2(tiny_qwen2_dir: Path) -> None:
    """Qwen2: q/k/v bias, an untied LM head split over the last stage's two tensor ranks, and
    its single KV head replicated on both tensor ranks of each stage."""
    reference = one_process_reference(tiny_qwen2_dir)
    llm, _ = _llm(tiny_qwen2_dir)
    try:
        _assert_same(reference, _run(llm))
    finally:
        llm.engine.shutdown()


def test_batch_queue_with_tensor_parallel_stages(tiny_llama_dir: Path,
                                                 tp_pp_llama: tuple[LLM, list[str]]) -> None:
    """TP x PP keeps a batch per stage in flight too: the last stage's second tensor rank runs
    each step when rank 0 finishes it (its own control group), not when it is launched."""
    from tests.engine.test_pipeline_parallel import assert_batch_queue

    llm = tp_pp_llama[0]
    assert llm.engine.ranks is not None and llm.engine.ranks.deferred
    assert llm.engine.ranks.groups.last_stage_group is not None
    assert_batch_queue(tiny_llama_dir, llm)


def test_layout_and_capacity_lines(tp_pp_llama: tuple[LLM, list[str]]) -> None:
    """Rank 0 is tensor rank 0 of the last stage; three spawned ranks; each rank's KV cache
    holds 1 KV head of 1 layer (a quarter of the bytes per token), for the engine's tokens."""
    llm, lines = tp_pp_llama
    ranks = llm.engine.ranks
    assert ranks is not None and llm.engine.tp is ranks and llm.engine.pp is ranks
    assert len(ranks.procs) == 3 and all(p.is_alive() for p in ranks.procs)
    layout = next(line for line in lines if line.startswith("tensor parallel size 2 x"))
    assert layout.startswith("tensor parallel size 2 x pipeline parallel size 2: tensor rank 0 "
                             "of stage 1 of 2 (layers 1-1) in this process (rank 0, samples)")
    assert "tensor rank 1 of stage 1 of 2 (layers 1-1) in process" in layout
    assert "tensor rank 0 of stage 0 of 2 (layers 0-0) in process" in layout
    assert "tensor rank 1 of stage 0 of 2 (layers 0-0) in process" in layout
    plan = llm.engine.kv_cache_plan
    full = llm.engine.model_config.kv_bytes_per_token(4)
    assert plan.bytes_per_token == full // 4
    assert plan.num_tokens == KV_BYTES // (full // 4) // 8 * 8
    assert ("Available KV cache memory: 0.00 GiB per rank (tensor parallel size 2 x pipeline "
            "parallel size 2, 0.02 GiB in all)") in lines
    caches = llm.engine.runner.kv_caches
    assert len(caches) == 1 and caches[0][0].shape == (plan.num_blocks, 8, 1, 16)


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                   TP_PP], ids=["tp2", "pp2", "tp2xpp2"])
def test_preemption_matches_transformers(tiny_llama_dir: Path, sizes: dict[str, int]) -> None:
    """40 blocks per rank for 12 prompts of up to 400 tokens: requests are preempted and
    recomputed, and every greedy token still equals transformers' `generate`."""
    prompts = random_prompts(512, NUM_PROMPTS, 1, 400, seed=11)
    expected = hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
    ranks = sizes.get("tensor_parallel_size", 1) * sizes.get("pipeline_parallel_size", 1)
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512, **sizes,
              kv_cache_memory_bytes=preemption_budget(tiny_llama_dir, 40) // ranks)
    try:
        assert llm.engine.num_blocks == 40
        assert greedy(llm, prompts) == expected
        assert llm.engine.scheduler.stats.num_preemptions > 0
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.engine.shutdown()


@pytest.mark.timeout(120)
def test_killed_rank_fails_requests_and_reaps_all(tiny_llama_dir: Path) -> None:
    """A rank of the first stage killed: the next step raises naming it, shutdown reaps all."""
    llm, _ = _llm(tiny_llama_dir)
    ranks = llm.engine.ranks
    assert ranks is not None
    victim = ranks.procs[2]  # world rank 3: tensor rank 1 of stage 0
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel x pipeline-parallel rank 3 "
                                           r"\(tensor rank 1 of stage 0 of 2"):
        llm.generate(_prompts(), SamplingParams(max_tokens=5), use_tqdm=False)
    assert time.monotonic() - started < 10
    llm.engine.shutdown()
    assert all(not p.is_alive() for p in ranks.procs)


@pytest.mark.timeout(180)
def test_serve_tp2_pp2_completes_and_reaps(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`kvserve serve -tp 2 -pp 2` answers; SIGTERM drains it and reaps its three ranks."""
    import psutil

    from tests.support.api import assert_serves
    from tests.support.server_process import kvserve

    with kvserve(tiny_llama_dir, "-tp", "2", "-pp", "2", log_dir=tmp_path) as server:
        assert_serves(server)
        ranks = [p for p in psutil.Process(server.proc.pid).children()
                 if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 3
        assert "per rank (tensor parallel size 2 x pipeline parallel size 2" in server.log()
        assert server.stop() == 0
    for rank in ranks:
        assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_tp3_matches_transformers() -> None:
    """SmolLM2-135M (9 heads / 3 KV heads, MLP 1,536) split over 3 tensor ranks, the GGUF
    dequantized: greedy tokens against transformers on the same file, where a sequence may
    leave the reference only at a near-tie (each side's token in the other's top 5)."""
    from engine.model_loader.gguf.tokenizer import load_gguf_tokenizer
    from tests.engine.test_smollm2_parity import SHARED, count_divergences, tokens_and_top5

    path = default_model_path()
    tok = load_gguf_tokenizer(path)
    prompts = [tok.encode(SHARED + topic + ".") for topic in ("the moon", "bread", "a river")]
    reference: list[GreedyTrace] = hf_topk_greedy(str(path.parent), prompts, 16, k=5,
                                                  gguf_file=path.name)
    llm = LLM(None, dtype="float32", tensor_parallel_size=3, max_model_len=512,
              kv_cache_memory_bytes=1 << 24)
    try:
        assert llm.engine.tp is not None and len(llm.engine.tp.procs) == 2
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=16, logprobs=5),
                            use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert count_divergences(tokens_and_top5(outs), reference) <= 1


@pytest.mark.parametrize("model_name,size", [("tiny_llama_dir", 2), ("tiny_llama_dir", 4),
                                             ("tiny_qwen2_dir", 2)])
def test_weight_shards_concatenate_to_the_full_weights(request: pytest.FixtureRequest,
                                                       model_name: str, size: int) -> None:
    """Every rank's slice of every checkpoint tensor, put back together (rows of q/k/v,
    gate/up, the vocab matrices and biases; columns of o_proj and down_proj), is the whole
    tensor; KV heads replicated over ranks (TP=4 over 2 KV heads) are the same on each."""
    from safetensors.torch import load_file

    from engine.config import ModelConfig
    from engine.distributed.parallel_state import ParallelGroups, kv_heads_per_rank
    from engine.models.parallel_layers import shard_weights

    folder: Path = request.getfixturevalue(model_name)
    cfg = ModelConfig.from_folder(folder)
    tensors = load_file(folder / "model.safetensors")
    shards = [dict(shard_weights(tensors.items(), cfg,
                                 ParallelGroups(rank, size, torch.device("cpu"), None, None,
                                                None))) for rank in range(size)]
    kv_owners = max(1, size // cfg.num_key_value_heads)  # ranks holding the same KV head
    for name, full in tensors.items():
        parts = [shard[name] for shard in shards]
        if ".o_proj." in name or ".down_proj." in name:
            assert torch.equal(torch.cat(parts, dim=1), full), name
        elif ".k_proj." in name or ".v_proj." in name:
            heads = kv_heads_per_rank(cfg, size) * cfg.head_dim
            assert all(p.shape[0] == heads for p in parts), name
            for rank in range(0, size, kv_owners):
                assert all(torch.equal(parts[rank], parts[rank + j]) for j in range(kv_owners))
            assert torch.equal(torch.cat(parts[::kv_owners]), full), name
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            whole = torch.cat(parts)
            assert torch.equal(whole[:full.shape[0]], full), name  # the last rank pads
        elif "norm" in name:
            assert all(torch.equal(p, full) for p in parts), name
        else:
            assert torch.equal(torch.cat(parts), full), name


@pytest.mark.timeout(180)
def test_sigterm_under_load_drains_and_reaps(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`kvserve serve -tp 2` (and -pp 2 with it) under four streams: SIGTERM lets every stream
    finish its tokens, the server exits 0 and no rank process is left."""
    import asyncio

    import aiohttp
    import psutil

    from tests.server.test_server_shutdown import start_streams, wait_exit
    from tests.support.server_process import kvserve

    max_tokens = 150

    async def main(url: str, send_sigterm: Any) -> list[Any]:
        async with aiohttp.ClientSession() as session:
            streams, tasks = await start_streams(session, url, max_tokens)
            send_sigterm()
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 120))

    with kvserve(tiny_llama_dir, "-tp", "2", "-pp", "2", log_dir=tmp_path) as server:
        ranks = [p for p in psutil.Process(server.proc.pid).children()
                 if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 3
        streams = asyncio.run(main(server.url,
                                   lambda: server.proc.send_signal(signal.SIGTERM)))
        code, _ = wait_exit(server, 60)
        assert code == 0, server.log()
    for stream in streams:
        assert stream.error is None and stream.done and stream.finish_reasons == ["length"]
        assert stream.usage is not None and stream.usage["completion_tokens"] == max_tokens
    for rank in ranks:
        assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE
