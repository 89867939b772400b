"""The CPU execution path chosen once at load (engine/worker/cpu_path.py): the decision on each
configuration, what the fused step accepts of a layer description (engine/models/layer_desc.py),
and on a loaded engine the one log line and the model following the choice."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.models.layer_desc import LayerDesc, Rotary, describe_llama, fused_step_supports
from engine.worker.cpu_path import CpuFacts, CpuPath, decide_cpu_path

DESC = LayerDesc(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, eps=1e-5)
# SmolLM2's GGUF in bfloat16 on an AVX2 machine: Q4 layers in place, the tied int8 head.
GGUF = CpuFacts(vector_isa="avx2", attention="cpu", forced_torch=False, dtype=torch.bfloat16,
                quantization="gguf", tensor_parallel=1, pipeline_parallel=1, offload=False,
                num_layers=30, layer_desc=DESC, unfused=None, ends_unfit=None)


def decide(**changes: Any) -> tuple[CpuPath, str, bool, bool]:
    d = decide_cpu_path(dataclasses.replace(GGUF, **changes))
    return d.path, d.reason, d.fused_layers, d.step_ends


def test_gguf_bfloat16_runs_the_whole_step_in_one_call() -> None:
    d = decide_cpu_path(GGUF)
    assert d.path is CpuPath.WHOLE_STEP and d.fused_layers and d.step_ends
    assert d.log_line() == ("CPU execution path: whole_step (vector ISA avx2, bfloat16, "
                            "--quantization gguf: 30 layers and the LM head in one C++ call "
                            "per decode step)")


@pytest.mark.parametrize("changes, words", [
    ({"vector_isa": None}, "C++ ops are not loaded"),
    ({"vector_isa": None, "attention": "torch"}, "not loaded"),
    ({"forced_torch": True, "attention": "torch"}, "--attention-backend torch"),
])
def test_no_cpp_ops_or_forced_torch_is_the_torch_reference(changes: dict[str, Any],
                                                          words: str) -> None:
    path, reason, fused, ends = decide(**changes)
    assert path is CpuPath.TORCH and words in reason and not fused and not ends


@pytest.mark.parametrize("changes, words", [
    ({"tensor_parallel": 2}, "--tensor-parallel-size 2"),
    ({"layer_desc": dataclasses.replace(DESC, qk_norm=True)}, "q/k norm"),
    ({"layer_desc": dataclasses.replace(DESC, activation="gelu_tanh")}, "gelu_tanh"),
    ({"layer_desc": dataclasses.replace(DESC, norm="rms_one_plus")}, "rms_one_plus"),
    ({"layer_desc": dataclasses.replace(DESC, attn_logit_softcap=50.0)}, "soft-cap"),
    ({"layer_desc": dataclasses.replace(DESC, rotary="partial")}, "rotary partial"),
    ({"attention": "_Fp8RoundTripBackend"}, "_Fp8RoundTripBackend"),
])
def test_what_the_cpp_layer_cannot_compute_runs_each_module_forward(
        changes: dict[str, Any], words: str) -> None:
    """No decoder_layer_ either: the C++ layer would compute something else."""
    path, reason, fused, ends = decide(**changes)
    assert path is CpuPath.LAYER_OPS and words in reason and not fused and not ends


@pytest.mark.parametrize("changes, words", [
    ({"pipeline_parallel": 2}, "--pipeline-parallel-size 2"),
    ({"offload": True}, "--cpu-offload-gb"),
    ({"unfused": "layer 3: down_proj (QuantizedLinear) has no C++ form"}, "layer 3"),
])
def test_a_step_that_cannot_be_one_call_runs_one_call_per_layer(changes: dict[str, Any],
                                                                words: str) -> None:
    path, reason, fused, ends = decide(**changes)
    assert path is CpuPath.LAYER_OPS and words in reason and fused and not ends


@pytest.mark.parametrize("changes, words", [
    ({"ends_unfit": "the LM head is not tied int8 tiles"}, "not tied int8"),
    ({"layer_desc": dataclasses.replace(DESC, qkv_bias=True)}, "biased linears"),
])
def test_ends_that_do_not_fit_leave_the_layers_in_one_call(changes: dict[str, Any],
                                                          words: str) -> None:
    path, reason, fused, ends = decide(**changes)
    assert path is CpuPath.WHOLE_STEP and words in reason and "LM head in torch" in reason
    assert fused and not ends


def test_fused_step_takes_the_llama_family_and_table_rotaries() -> None:
    table: tuple[Rotary, ...] = ("default", "llama3", "linear", "yarn")
    for rotary in table:
        assert fused_step_supports(dataclasses.replace(DESC, rotary=rotary))[0]
    biased = dataclasses.replace(DESC, qkv_bias=True, o_bias=True, mlp_bias=True,
                                 sliding_window=4096)
    assert fused_step_supports(biased)[0]  # decoder_layer_ adds a bias to any linear
    untabled: tuple[Rotary, ...] = ("dynamic", "partial", "none")
    for rotary in untabled:
        ok, why = fused_step_supports(dataclasses.replace(DESC, rotary=rotary))
        assert not ok and rotary in why
    ok, why = fused_step_supports(dataclasses.replace(DESC, final_logit_softcap=30.0))
    assert not ok and "final logit soft-cap" in why


def test_llama_family_descriptions() -> None:
    base = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=1e4, max_position_embeddings=128, tie_word_embeddings=True)
    assert describe_llama(base) == dataclasses.replace(DESC, eps=1e-5)
    qwen2 = dataclasses.replace(base, architecture="Qwen2ForCausalLM", attention_bias=True)
    assert describe_llama(qwen2).qkv_bias and not describe_llama(qwen2).o_bias
    llama3 = dataclasses.replace(base, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert describe_llama(llama3).rotary == "llama3"
    mistral = dataclasses.replace(base, sliding_window=32)
    assert describe_llama(mistral).sliding_window == 32


def path_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("CPU execution path:")]


def test_engine_logs_its_path_once_and_follows_it(tiny_llama_dir: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A tiny int8 Llama in bfloat16 (tied int8 head) takes the whole step; one log line; a
    backend swapped after load takes effect through choose_cpu_path, which says so."""
    from tests.support.cpu_ops import require_cpu_ops

    require_cpu_ops()
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(tiny_llama_dir), dtype="bfloat16", quantization="int8",
                  kv_cache_memory_bytes=2**20, block_size=8)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        want = llm.generate([{"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
    runner: Any = llm.engine.runner
    lines = path_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("CPU execution path: whole_step (vector ISA")
    assert runner.cpu_path.path is CpuPath.WHOLE_STEP and runner.model._fused_stack is not None

    class Wrapped:  # the layers' own attention, behind a Python wrapper
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    for layer in runner.model.layers:
        layer.self_attn.backend = Wrapped(layer.self_attn.backend)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvserve"):
        decision = llm.engine.worker.call(runner.choose_cpu_path)
    assert decision.path is CpuPath.LAYER_OPS and "Wrapped" in decision.reason
    assert len(path_lines(caplog)) == 1
    assert runner.model._fused_stack is None
    assert all(layer._fused is None and layer.ops is not None for layer in runner.model.layers)
    got = llm.generate([{"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    llm.engine.shutdown()


def test_torch_attention_backend_is_the_torch_reference(tiny_llama_dir: Path,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(tiny_llama_dir), attention_backend="torch", kv_cache_memory_bytes=2**20,
                  block_size=8)
    runner: Any = llm.engine.runner
    assert path_lines(caplog) == [runner.cpu_path.log_line()]
    assert runner.cpu_path.path is CpuPath.TORCH and "--attention-backend torch" in \
        runner.cpu_path.reason
    assert runner.model._fused_stack is None
    assert all(m.ops is None for m in runner.model.modules() if hasattr(m, "ops"))
    llm.engine.shutdown()
