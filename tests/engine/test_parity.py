"""Greedy output token for token against transformers' `generate`, one prompt at a time,
under every scheduling regime: defaults, tiny token budget, preemption, prefix caching,
block sizes 8/16/32. Also logprobs against transformers' log_softmax."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, ModelConfig, SamplingParams
from tests.support.greedy import generated_ids, hf_greedy, hf_logprobs
from tests.support.tiny_models import random_prompts

MAX_TOKENS = 32
NUM_PROMPTS = 12


def preemption_budget(model_dir: Path, num_blocks: int, block_size: int = 16) -> int:
    """KV bytes for `num_blocks` float32 blocks, from the seed's per-token formula."""
    cfg = ModelConfig.from_folder(model_dir)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * \
        block_size * num_blocks


CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "budget16": {"max_num_batched_tokens": 16},
    "preemption": {"max_model_len": 512, "kv_blocks": 40},
    "block8": {"block_size": 8},
    "block32": {"block_size": 32},
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_case(request: pytest.FixtureRequest) -> tuple[Path, list[list[int]],
                                                         list[list[int]]]:
    model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    prompts = random_prompts(512, NUM_PROMPTS, 1, 400, seed=11)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


def make_llm(model_dir: Path, config: dict[str, Any]) -> LLM:
    kwargs = dict(config)
    if "kv_blocks" in kwargs:
        kwargs["kv_cache_memory_bytes"] = preemption_budget(model_dir, kwargs.pop("kv_blocks"))
    return LLM(str(model_dir), dtype="float32", **kwargs)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
           ) -> list[list[int]]:
    return generated_ids(llm, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_transformers_generate(model_case: Any, config_name: str) -> None:
    model_dir, prompts, expected = model_case
    llm = make_llm(model_dir, CONFIGS[config_name])
    assert greedy(llm, prompts) == expected
    engine = llm.engine
    if config_name == "preemption":
        assert engine.scheduler.stats.num_preemptions > 0
    assert engine.kv.num_free_blocks == engine.num_blocks  # nothing leaked


def test_prefix_caching_hits_and_keeps_parity(tiny_llama_dir: Path) -> None:
    shared = random_prompts(512, 1, 120, 120, seed=5)[0]
    tails = random_prompts(512, 6, 1, 40, seed=6)
    prompts = [shared + tail for tail in tails]
    expected = hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)
    llm = make_llm(tiny_llama_dir, {})
    assert greedy(llm, prompts[:1]) == expected[:1]
    assert greedy(llm, prompts[1:]) == expected[1:]
    stats = llm.engine.kv.stats
    assert stats.hits >= 5 * 112  # 7 full blocks of the shared prefix for each later prompt
    # and the same within one batch: later prompts hit blocks the first computes in that step
    llm2 = make_llm(tiny_llama_dir, {"block_size": 8})
    assert greedy(llm2, prompts) == expected
    assert llm2.engine.kv.stats.hits > 0


def test_prefix_caching_off_never_hits(tiny_llama_dir: Path) -> None:
    llm = make_llm(tiny_llama_dir, {"enable_prefix_caching": False})
    prompt = random_prompts(512, 1, 64, 64, seed=3)[0]
    greedy(llm, [prompt, prompt])
    assert llm.engine.kv.stats.hits == 0


def test_logprobs_equal_transformers_log_softmax(tiny_qwen2_dir: Path) -> None:
    prompts = random_prompts(512, 3, 5, 60, seed=8)
    llm = make_llm(tiny_qwen2_dir, {"max_num_batched_tokens": 24})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, logprobs=5),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        completion = out.outputs[0]
        reference = hf_logprobs(tiny_qwen2_dir, [prompt + completion.token_ids])[0]
        assert completion.logprobs is not None
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs,
                                                 strict=True)):
            ref_row = reference[len(prompt) - 1 + step]  # logits that produced this token
            assert abs(entry[token].logprob - float(ref_row[token])) < 1e-4
            assert entry[token].rank == 1  # greedy picks the top token
            top_values, top_ids = ref_row.topk(5)
            for tid, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
                assert abs(entry[tid].logprob - value) < 1e-4
        assert completion.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs,
                                             strict=True)), abs=1e-5)


def test_llama3_rope_scaling_matches_transformers(tiny_llama3_dir: Path) -> None:
    prompts = random_prompts(512, 3, 100, 300, seed=4)
    expected = hf_greedy(tiny_llama3_dir, prompts, 16)
    llm = LLM(str(tiny_llama3_dir), dtype="float32")
    assert greedy(llm, prompts, 16) == expected
    assert torch.get_num_threads() >= 1


def test_mistral_sliding_window_matches_transformers(tiny_mistral_dir: Path) -> None:
    cfg = ModelConfig.from_folder(tiny_mistral_dir)
    assert cfg.architecture == "MistralForCausalLM" and cfg.sliding_window == 48
    prompts = random_prompts(512, 4, 30, 200, seed=9)  # most longer than the window
    expected = hf_greedy(tiny_mistral_dir, prompts, 24)
    for kwargs in ({}, {"max_num_batched_tokens": 16, "block_size": 8}):
        llm = LLM(str(tiny_mistral_dir), dtype="float32", **kwargs)
        assert greedy(llm, prompts, 24) == expected
