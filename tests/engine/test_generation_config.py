"""Request defaults from the generation config (--generation-config, --override-generation-config),
as vLLM reads them: the model's generation_config.json sampling keys and max_new_tokens become
the defaults of fields a request leaves unset."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.generation_config import default_sampling_params, parse_override


@pytest.fixture(scope="module")
def tuned_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a generation_config.json recommending greedy sampling and a
    7-token output cap."""
    folder = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    config.update({"temperature": 0.0, "top_k": 5, "max_new_tokens": 7, "do_sample": False})
    path.write_text(json.dumps(config))
    return folder


def test_generation_config_keys_map_to_sampling_params() -> None:
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
              "repetition_penalty": 1.1, "max_new_tokens": 256, "do_sample": True,
              "eos_token_id": 2, "max_length": 4096}
    assert default_sampling_params(config, {}) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_tokens": 256}
    # The override wins key by key and takes either spelling of the cap.
    assert default_sampling_params(config, {"max_tokens": 8, "temperature": 0.0}) == {
        "temperature": 0.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_tokens": 8}


@pytest.mark.parametrize("value, message", [
    ("{not json", "must be a JSON object"),
    ("[1, 2]", "must be a JSON object"),
    ('{"max_new_tokens": 5, "beams": 4}', "unknown key(s) ['beams']"),
])
def test_bad_override_is_refused_naming_the_flag(value: str, message: str) -> None:
    with pytest.raises(ValueError, match="--override-generation-config") as info:
        EngineArgs(override_generation_config=value).validate()
    assert message in str(info.value)


def test_invalid_default_values_fail_at_startup() -> None:
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        default_sampling_params({}, parse_override('{"temperature": -1}'))


def test_missing_generation_config_folder_is_refused(tiny_llama_dir: Path,
                                                     tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--generation-config"):
        LLM(str(tiny_llama_dir), generation_config=str(tmp_path), num_threads=1)


def test_llm_defaults_follow_the_generation_config(tuned_model_dir: Path) -> None:
    llm = LLM(str(tuned_model_dir), num_threads=1, max_model_len=128)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 5, 7)
    out = llm.generate(["the old snow"] * 2, use_tqdm=False)  # no params: the defaults
    # Greedy (identical choices) and capped at max_new_tokens unless eos came first.
    assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids
    assert len(out[0].outputs[0].token_ids) <= 7
    capped = llm.generate(["the old snow"], SamplingParams(max_tokens=7, temperature=0.0,
                                                           ignore_eos=True), use_tqdm=False)
    assert len(capped[0].outputs[0].token_ids) == 7


@pytest.mark.parametrize("flags, expected", [
    ({"generation_config": "vllm"}, (1.0, -1, 16)),
    ({"override_generation_config": '{"max_new_tokens": 3}'}, (0.0, 5, 3)),
    ({"generation_config": "vllm", "override_generation_config": {"temperature": 0.5}},
     (0.5, -1, 16)),
])
def test_vllm_setting_and_override(tuned_model_dir: Path, flags: dict[str, object],
                                   expected: tuple[float, int, int]) -> None:
    llm = LLM(str(tuned_model_dir), num_threads=1, max_model_len=128, **flags)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == expected
