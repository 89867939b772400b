"""Checks of the tiny-model helpers that the parity tests rely on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.greedy import hf_greedy, hf_logprobs, hf_topk_greedy
from tests.support.tiny_models import (
    EOS_TOKEN_ID,
    SPECIAL_TOKEN_IDS,
    _trained_tokenizer_json,
    random_prompts,
    train_tokenizer,
)

TINY_DIRS = ("tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3_dir")


def test_tokenizer_training_is_deterministic() -> None:
    """Two fresh trainings (bypassing the cache) give the same vocab, merges and encodings."""
    first = json.loads(_trained_tokenizer_json.__wrapped__(512))
    second = json.loads(_trained_tokenizer_json.__wrapped__(512))
    assert first["model"]["vocab"] == second["model"]["vocab"]
    assert first["model"]["merges"] == second["model"]["merges"]
    assert len(first["model"]["vocab"]) == 512
    text = "The old sailor reads a strange letter near the river, 42 times!"
    assert train_tokenizer().encode(text) == train_tokenizer().encode(text)


def test_tokenizer_special_tokens_and_roundtrip() -> None:
    """Specials sit at ids 0..2, eos is bos is pad, and byte-level decoding is lossless."""
    tokenizer = train_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert isinstance(ids, list) and tuple(ids) == SPECIAL_TOKEN_IDS
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == EOS_TOKEN_ID
    text = "Über 3 cats — naïve 🙂 text\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_renders_chatml() -> None:
    """apply_chat_template produces ChatML with an open assistant turn."""
    tokenizer = train_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    assert isinstance(ids, list) and ids[0] == 1 and ids.count(2) == 2


@pytest.mark.parametrize("fixture_name", TINY_DIRS)
def test_folder_loads_offline(fixture_name: str, request: pytest.FixtureRequest) -> None:
    """The folder loads with the Auto classes from local files, eos ids agreeing everywhere."""
    model_dir: Path = request.getfixturevalue(fixture_name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert tokenizer.eos_token_id == EOS_TOKEN_ID
    assert model.config.eos_token_id == model.generation_config.eos_token_id == EOS_TOKEN_ID
    config = json.loads((model_dir / "config.json").read_text())
    assert "rope_parameters" in config and config["vocab_size"] == len(tokenizer)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


def test_checkpoint_shapes_differ_by_arch(tiny_llama_dir: Path, tiny_qwen2_dir: Path,
                                          tiny_llama3_dir: Path) -> None:
    """Llama ties lm_head to the embeddings; Qwen2 stores lm_head and q/k/v biases."""
    with safe_open(tiny_llama_dir / "model.safetensors", "pt") as f:
        llama_keys = set(f.keys())
    with safe_open(tiny_qwen2_dir / "model.safetensors", "pt") as f:
        qwen_keys = set(f.keys())
    assert "lm_head.weight" not in llama_keys
    assert {"lm_head.weight", "model.layers.0.self_attn.q_proj.bias"} <= qwen_keys
    rope = json.loads((tiny_llama3_dir / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 256


def test_random_prompts_are_seeded_and_avoid_specials() -> None:
    """Same seed, same prompts; lengths cover the range; no special ids."""
    tokenizer = train_tokenizer()
    prompts = random_prompts(tokenizer, 9, 3, 11, seed=7)
    assert prompts == random_prompts(512, 9, 3, 11, seed=7)
    assert sorted(len(p) for p in prompts) == list(range(3, 12))
    assert not set(SPECIAL_TOKEN_IDS) & {t for p in prompts for t in p}
    assert prompts != random_prompts(tokenizer, 9, 3, 11, seed=8)


@torch.no_grad()
def _manual_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by full re-forward and argmax, independent of `generate`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    ids = list(prompt)
    for _ in range(max_new_tokens):
        next_id = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(next_id)
        if next_id == EOS_TOKEN_ID:
            break
    return ids[len(prompt):]


@pytest.mark.parametrize("fixture_name", TINY_DIRS)
def test_hf_greedy_matches_manual_argmax(fixture_name: str,
                                         request: pytest.FixtureRequest) -> None:
    """hf_greedy returns max_new_tokens ids (or stops at eos) equal to a manual argmax loop."""
    model_dir: Path = request.getfixturevalue(fixture_name)
    prompt = random_prompts(512, 1, 20, 20, seed=3)[0]
    generated = hf_greedy(model_dir, [prompt], max_new_tokens=12)[0]
    assert len(generated) == 12 or generated[-1] == EOS_TOKEN_ID
    assert generated == _manual_greedy(model_dir, prompt, 12)


def test_logprobs_and_topk_agree_with_greedy(tiny_qwen2_dir: Path) -> None:
    """Greedy tokens are the argmax of hf_logprobs and the top-1 of hf_topk_greedy."""
    prompts = random_prompts(512, 3, 5, 30, seed=11)
    traces = hf_topk_greedy(tiny_qwen2_dir, prompts, max_new_tokens=8, k=3)
    logprobs = hf_logprobs(tiny_qwen2_dir, [p + t.token_ids for p, t in zip(prompts, traces, strict=True)])
    for prompt, trace, lp in zip(prompts, traces, logprobs, strict=True):
        assert lp.shape == (len(prompt) + len(trace.token_ids), 512) and lp.dtype == torch.float32
        predicted = lp[len(prompt) - 1:-1].argmax(dim=-1).tolist()
        assert predicted == trace.token_ids == [ids[0] for ids in trace.topk_ids]
        assert all(gap > 0 for gap in trace.top2_gaps())
        torch.testing.assert_close(torch.tensor([row[0] for row in trace.topk_logprobs]),
                                   lp[len(prompt) - 1:-1].max(dim=-1).values)
