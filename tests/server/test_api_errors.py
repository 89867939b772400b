"""Bad input to the Python API raises ValueError saying what to change, and leaves the engine
usable."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_model_len=128, kv_cache_memory_bytes=4 * 2**20)


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"max_tokens": -3}, "max_tokens must be at least 1"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_p": 5e-324}, "top_p must be in (0, 1]"),  # 0 as the sampler's float32
    ({"repetition_penalty": 5e-324}, "repetition_penalty must be in [0.0001, 10000]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
    ({"top_k": -5}, "top_k must be -1"),
    ({"min_p": 2.0}, "min_p must be in [0, 1]"),
    ({"n": 0}, "n must be an integer >= 1"),
    ({"logprobs": 1000}, "logprobs must be between 0 and 20"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
])
def test_bad_sampling_params(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        SamplingParams(**kwargs)
    assert needle in str(info.value)


def test_empty_prompts(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)


def test_prompt_over_max_model_len_names_both_numbers(llm: LLM) -> None:
    with pytest.raises(ValueError) as info:
        llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=50),
                     use_tqdm=False)
    message = str(info.value)
    assert "100" in message and "50" in message and "128" in message
    with pytest.raises(ValueError, match="max_model_len is 128"):
        llm.generate({"prompt_token_ids": [5] * 200}, use_tqdm=False)


def test_token_ids_outside_the_vocabulary(llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 2, 10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, -1]}, use_tqdm=False)


def test_engine_still_works_after_bad_requests(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [5] * 500}],
                     use_tqdm=False)
    outs = llm.generate({"prompt_token_ids": [3, 4, 5]},
                        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3
    assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_unknown_dtype(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown dtype 'float64'; use auto, float32"):
        LLM(str(tiny_llama_dir), dtype="float64")


def test_unknown_engine_argument(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(str(tiny_llama_dir), max_num_seq=4)


def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_a_file_that_is_not_a_model(tmp_path: Path) -> None:
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="is not a model"):
        LLM(str(junk))
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(folder))


def test_max_model_len_that_does_not_fit_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_llama_dir), max_model_len=1024, kv_cache_memory_bytes=8192 * 10)
    message = str(info.value)
    assert "--max-model-len" in message and "160" in message
