"""Engine lifecycle on the tiny Llama: aborts and failed steps free everything and leave the
engine serving; the prefix cache never offers blocks a failed step did not write."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.support.tiny_models import random_prompts


@pytest.fixture()
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), kv_cache_memory_bytes=4 * 2**20, block_size=8)


def test_abort_mid_generation_frees_blocks_at_once(llm: LLM) -> None:
    engine = llm.engine
    rid = engine.add_request(None, {"prompt_token_ids": random_prompts(512, 1, 40, 40, 1)[0]},
                             SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv.num_free_blocks < engine.num_blocks
    engine.abort_request(rid)
    assert engine.kv.num_free_blocks == engine.num_blocks
    assert not engine.has_unfinished_requests()


def test_failed_step_ends_its_requests_with_error_and_uncaches_their_blocks(llm: LLM) -> None:
    engine = llm.engine
    prompt = random_prompts(512, 1, 64, 64, 2)[0]
    engine.add_request("doomed", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4))
    batch = engine.schedule()
    outs = engine.fail(batch)  # as the async loop does when the worker raises
    assert [o.outputs[0].finish_reason for o in outs] == ["error"]
    assert engine.kv.num_free_blocks == engine.num_blocks
    assert engine.kv.pool.cached == {}  # nothing unwritten is left findable
    again = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and len(again.outputs[0].token_ids) == 4


def test_finished_requests_keep_their_prefix_for_the_next_one(llm: LLM) -> None:
    prompt = random_prompts(512, 1, 64, 64, 3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 56  # 7 full blocks of 8; the last token is recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_model_is_built_and_stepped_on_the_worker_thread(llm: LLM) -> None:
    """All torch work runs on one thread (engine/worker/worker.py: a second OpenMP team halves
    the speed of every parallel op on a machine without spare cores)."""
    import threading

    engine = llm.engine
    stepped_on: list[int] = []
    execute = engine.runner.execute

    def spy(batch):  # type: ignore[no-untyped-def]
        stepped_on.append(threading.get_ident())
        return execute(batch)

    engine.runner.execute = spy  # type: ignore[method-assign]
    llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert engine.runner.thread_id == engine.worker.thread_id != threading.get_ident()
    assert stepped_on and set(stepped_on) == {engine.worker.thread_id}
