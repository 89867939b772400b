"""Sampling behaviour on the tiny Llama: seeds, top-k, stops, penalties, n > 1, text."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.support.greedy import generated_ids
from tests.support.tiny_models import random_prompts

PROMPTS = random_prompts(512, 6, 4, 40, seed=21)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory_bytes=8 * 2**20)


def test_seeded_sampling_reproduces_across_batch_compositions(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = generated_ids(llm, [PROMPTS[0]], params)[0]
    unseeded = SamplingParams(temperature=1.0, max_tokens=24)
    mixed = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:4]], unseeded,
                         use_tqdm=False)
    mixed_batch = [{"prompt_token_ids": p} for p in [*PROMPTS[1:4], PROMPTS[0]]]
    together = llm.generate(mixed_batch, [unseeded] * 3 + [params], use_tqdm=False)
    assert together[-1].outputs[0].token_ids == alone
    assert len(mixed) == 3
    other_seed = generated_ids(llm, [PROMPTS[0]], SamplingParams(
        temperature=1.0, top_p=0.9, seed=99, max_tokens=16))[0]
    assert other_seed != alone  # the seed matters


def test_top_k_1_equals_greedy(llm: LLM) -> None:
    greedy = generated_ids(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    top1 = generated_ids(llm, PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=12))
    assert top1 == greedy


def test_max_tokens_ends_with_length(llm: LLM) -> None:
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_id_ends_with_stop_and_reason(llm: LLM) -> None:
    greedy = generated_ids(llm, [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12,
                                                             ignore_eos=True))[0]
    stop_id = greedy[4]
    first = greedy.index(stop_id)
    out = llm.generate({"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id],
                                      ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_stop_string_is_cut_from_the_text(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    greedy = llm.generate({"prompt_token_ids": PROMPTS[2]},
                          SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    full = tok.decode(greedy.token_ids, skip_special_tokens=True)
    assert greedy.text == full
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    out = llm.generate({"prompt_token_ids": PROMPTS[2]},
                       SamplingParams(temperature=0.0, max_tokens=20, stop=[stop],
                                      ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]
    assert stop not in out.text


def test_min_tokens_holds_back_stop_ids(llm: LLM) -> None:
    greedy = generated_ids(llm, [PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=10,
                                                             ignore_eos=True))[0]
    out = llm.generate({"prompt_token_ids": PROMPTS[3]},
                       SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6,
                                      stop_token_ids=[greedy[0]], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 6
    assert greedy[0] not in out.token_ids[:5]


def test_repetition_penalty_changes_a_repetitive_continuation(llm: LLM) -> None:
    prompt = PROMPTS[4]
    plain = generated_ids(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=24,
                                                        ignore_eos=True))[0]
    penalised = generated_ids(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=24,
                                                            repetition_penalty=5.0,
                                                            ignore_eos=True))[0]
    assert penalised != plain
    # with a strong penalty the output repeats fewer of the prompt's tokens
    seen = set(prompt)
    assert sum(t in seen for t in penalised) <= sum(t in seen for t in plain)


def test_n_choices_share_the_prompt_blocks_and_differ(llm: LLM) -> None:
    prompt = random_prompts(512, 1, 70, 70, seed=2)[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "the cat sees a bird"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=False)
    assert out.prompt == expected
    assert out.prompt_token_ids == llm.get_tokenizer().encode(expected,
                                                              add_special_tokens=False)
