"""The embedded SmolLM2-135M (GGUF, float32) against transformers loading the same GGUF.

Both sides dequantize the file (`quantization="none"`): this holds the model's arithmetic to
transformers'. Where the Q4 blocks run in place (the default wherever int4 runs fused, which
quantizes the activations to int8 too) test_gguf_in_place.py and test_smollm2_quality hold
the result to this reference.

A real model has near-ties, so a sequence may diverge only where each side's token is in the
other's top 5, and is compared no further (vLLM's check_logprobs_close rule); at most 1 in 6
sequences may diverge at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.model_loader.gguf.weights import default_model_path
from tests.support.greedy import GreedyTrace, hf_topk_greedy

MAX_TOKENS = 24
TOPICS = ["the moon", "bread", "a river", "prime numbers", "bicycles", "the ocean"]
SHARED = ("You are a careful assistant. Answer in one short paragraph, plainly, without "
          "lists. Explain the idea as you would to a curious student who has read a little "
          "about it already and wants the key point first. Do not repeat the question, do not "
          "apologise, and do not add a closing summary. If a number helps, give one number "
          "with its unit. If a comparison helps, compare with something from daily life, such "
          "as cooking, walking to school, or the weather. Keep every sentence short and keep "
          "the whole answer under sixty words. Topic: ")
CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "budget16": {"max_num_batched_tokens": 16},
    "preemption": {"max_model_len": 256, "kv_cache_memory_bytes": 46080 * 16 * 16},
    "block8": {"block_size": 8},
    "block32": {"block_size": 32},
}


@pytest.fixture(scope="module")
def smol_prompts() -> list[list[int]]:
    from engine.model_loader.gguf.tokenizer import load_gguf_tokenizer

    tok = load_gguf_tokenizer(default_model_path())
    return [tok.encode(SHARED + topic + ".") for topic in TOPICS]


@pytest.fixture(scope="module")
def reference(smol_prompts: list[list[int]]) -> list[GreedyTrace]:
    path = default_model_path()
    return hf_topk_greedy(str(path.parent), smol_prompts, MAX_TOKENS, k=5,
                          gguf_file=path.name)


def tokens_and_top5(outs: list[Any]) -> list[tuple[list[int], list[list[int]]]]:
    """Each output's greedy tokens and, per position, its 5 most likely token ids."""
    ours = []
    for out in outs:
        completion = out.outputs[0]
        assert completion.logprobs is not None
        top5 = [sorted(entry, key=lambda t: entry[t].logprob, reverse=True)[:5]
                for entry in completion.logprobs]
        ours.append((completion.token_ids, top5))
    return ours


def count_divergences(ours: list[tuple[list[int], list[list[int]]]],
                      theirs: list[GreedyTrace]) -> int:
    """Asserts the near-tie rule position by position; returns how many sequences diverged."""
    diverged = 0
    for (tokens, top5), ref in zip(ours, theirs, strict=True):
        for pos, (mine, other) in enumerate(zip(tokens, ref.token_ids, strict=False)):
            if mine != other:
                assert mine in ref.topk_ids[pos] and other in top5[pos], (
                    f"position {pos}: {mine} vs {other} is not a near-tie")
                diverged += 1
                break
        else:
            assert len(tokens) == len(ref.token_ids)
    return diverged


@pytest.mark.slow
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_smollm2_matches_transformers(config_name: str, smol_prompts: list[list[int]],
                                      reference: list[GreedyTrace]) -> None:
    llm = LLM(None, dtype="float32", quantization="none", **CONFIGS[config_name])
    outs = llm.generate([{"prompt_token_ids": p} for p in smol_prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5),
                        use_tqdm=False)
    assert count_divergences(tokens_and_top5(outs), reference) <= len(smol_prompts) // 6
    stats = llm.engine.kv.stats
    if config_name == "preemption":
        assert llm.engine.scheduler.stats.num_preemptions > 0
    if config_name == "defaults":
        assert stats.hits > 0  # the shared 100+-token instruction is a prefix-cache hit
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_default_model_path_is_the_embedded_gguf() -> None:
    path: Path = default_model_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50 * 2**20
