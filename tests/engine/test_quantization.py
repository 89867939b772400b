"""`--quantization int8|int4`: the kernels against the dequantized reference, the fallback when a
kernel is missing or wrong, quality against the float model (resident bytes and `kvserve plan`:
test_quantization_plan.py).

The session sees a CPU without native bf16 (tests/conftest.py), so float32 models run kvserve's
tiled kernels where its C++ ops were built with AVX512-VNNI (plan `tiled`) and dequantize
elsewhere; bfloat16 models, or flags faked with avx512_bf16, take the fused kernels: kvserve's
tiled ones where they were built (the `layout` fixture's "tiles"), else torch's ("torch", also
forced on such a machine by hiding the tiled ops).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import engine.quantization as quant
from engine import LLM, SamplingParams, cpu_features
from engine.quantization import (
    ApplyPlan,
    Int4Method,
    Int8Method,
    QuantizedLinear,
    apply_plan,
    quantized_weight_bytes,
    tiles,
)
from tests.support.cpu_ops import require_cpu_ops
from tests.support.greedy import logprob_agreement, tokens_and_logprobs

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 12], [300, 301, 2, 77, 45, 9], [60, 61, 62, 63, 64, 65, 66],
           [128, 4, 4, 90, 311, 27, 8, 150, 200]]
MAX_TOKENS = 16


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * 0.05


# Relative error of the tiled kernels (int8 activations per block of 32) against the
# dequantized reference; torch's kernels keep float activations.
TILED_TOLERANCE = 1.5e-2


@pytest.fixture(params=["torch", "tiles"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which fused layouts quantized layers take: torch's (tiled ops hidden) or kvserve's."""
    if request.param == "torch":
        monkeypatch.setattr(tiles, "tile_ops", lambda: None)
    else:
        require_cpu_ops()
    return str(request.param)


@pytest.fixture
def torch_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized layers take torch's layouts and kernels (the tests of their fallbacks)."""
    monkeypatch.setattr(tiles, "tile_ops", lambda: None)


def _method(name: str, mode: str, dtype: torch.dtype, group: int | None = None
            ) -> Int8Method | Int4Method:
    plan = ApplyPlan(mode, dtype)
    return Int8Method(plan) if name == "int8" else Int4Method(plan, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, group", [("int8", None), ("int4", 32), ("int4", 64),
                                         ("int4", 128)])
def test_fused_kernel_matches_the_dequantized_reference(name: str, group: int | None,
                                                        dtype: torch.dtype, layout: str) -> None:
    linear = torch.nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        linear.weight.copy_(_weight(96, 256))
    layer = QuantizedLinear(linear, _method(name, "fused", dtype, group))
    assert layer.fused
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = layer(x).float()
    assert layer.bias is not None
    assert ("layout_tiles" in layer.tensors()) == (layout == "tiles")
    want = x.float() @ layer.dequantized_weight().float().t() + layer.bias.float()
    tol = TILED_TOLERANCE if layout == "tiles" else 1e-4 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tol * want.abs().max()


# int4's bound: half a step plus its float16 scale and offset's rounding (2^-11 of each)
@pytest.mark.parametrize("name, group, bound", [("int8", None, 0.5 / 127), ("int4", 32, 0.51 / 15)])
def test_dequantized_weight_is_within_half_a_step(name: str, group: int | None,
                                                  bound: float) -> None:
    weight = _weight(64, 128)
    method = _method(name, "dequant", torch.float32, group)
    w = method.dequantize(method.create_weights(weight))
    if name == "int8":
        step_range = weight.abs().amax(dim=1, keepdim=True)  # the step is max|w| / 127
    else:
        grouped = weight.reshape(64, -1, 32)
        step_range = (grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)
                      ).expand_as(grouped).reshape(64, 128)  # the step is range / 15
    assert ((w - weight).abs() <= bound * step_range + 1e-6).all()


def test_int4_fused_and_nibble_layouts_hold_the_same_codes(layout: str) -> None:
    weight = _weight(64, 128)
    fused = Int4Method(ApplyPlan("fused", torch.float32), 32)
    nibbles = Int4Method(ApplyPlan("dequant", torch.float32), 32)
    a, b = fused.create_weights(weight), nibbles.create_weights(weight)
    assert {"torch": "layout_kernel", "tiles": "layout_tiles"}[layout] in a
    assert "layout_nibbles" in b
    assert torch.equal(fused.unpack_codes(a), nibbles.unpack_codes(b))
    # tiles keep w = q x scale + min, the others (q - 8) x scale + zero: equal up to rounding;
    # a float32 plan's tiles hold their scales and mins in float16 (2^-11 relative)
    # (int4 keeps its scales and offsets in float16 under a float32 plan, torch's kernel
    # layout aside: 2^-11 relative)
    assert b["scale_zeros"].dtype == torch.float16
    scales, zeros = b["scale_zeros"][..., 0].float(), b["scale_zeros"][..., 1].float()
    bound = 1e-6 + (16 * scales.abs().max() + 2 * zeros.abs().max()).item() * 2.0**-10
    torch.testing.assert_close(fused.dequantize(a), nibbles.dequantize(b), rtol=0, atol=bound)
    assert a["qweight"].numel() == b["qweight"].numel() == 64 * 128 // 2


def test_every_int4_layout_dequantizes_when_a_call_is_not_fused(layout: str) -> None:
    method = Int4Method(ApplyPlan("fused", torch.float32), 32)
    tensors = method.create_weights(_weight(64, 128))
    x = torch.randn(3, 128)
    torch.testing.assert_close(method.apply(x, tensors, None, fused=False),
                               x @ method.dequantize(tensors).t())


def test_int4_group_size_must_divide_the_inputs() -> None:
    method = _method("int4", "dequant", torch.float32, 128)
    with pytest.raises(ValueError, match=r"does not divide a layer's input size 96.*\[32\]"):
        method.create_weights(_weight(32, 96))
    assert Int4Method(ApplyPlan("dequant", torch.float32), None).layer_group_size(576) == 32


def test_rows_the_int4_kernel_cannot_tile_dequantize() -> None:
    linear = torch.nn.Linear(64, 40, bias=False)  # 40 rows: not a multiple of 16
    layer = QuantizedLinear(linear, _method("int4", "fused", torch.bfloat16, 32))
    assert not layer.fused
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().t())


def test_apply_plan_by_dtype_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert apply_plan("int8", torch.bfloat16, CPU) == ApplyPlan("fused", torch.bfloat16)
    # Without native bf16 a float32 model runs kvserve's tile kernels where they were built
    # (AVX512-VNNI), else dequantizes.
    monkeypatch.setattr(cpu_features, "read_cpu_flags", lambda: frozenset({"avx512_vnni"}))
    monkeypatch.setattr(tiles, "tile_ops", lambda: object())
    assert apply_plan("int8", torch.float32, CPU) == ApplyPlan("tiled", torch.float32)
    monkeypatch.setattr(tiles, "tile_ops", lambda: None)
    assert apply_plan("int8", torch.float32, CPU) == ApplyPlan("dequant", torch.float32)
    monkeypatch.setattr(cpu_features, "read_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert apply_plan("int4", torch.float32, CPU) == ApplyPlan("fused", torch.bfloat16)
    assert apply_plan("int4", torch.bfloat16, torch.device("mps")).mode == "dequant"


def _greedy(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    return tokens_and_logprobs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                             use_tqdm=False))


def _teacher_forced_drift(llm: LLM, ref: list[tuple[list[int], list[dict[int, float]]]]
                         ) -> tuple[float, float]:
    """Runs `llm` on every prefix of the reference's greedy outputs (the same context at every
    position, so no divergence compounds) and returns the mean |logprob difference| of the
    reference's token, and the share of positions where it is in `llm`'s top 20."""
    prompts, wanted = [], []
    for prompt, (ids, lps) in zip(PROMPTS, ref, strict=True):
        for k, token in enumerate(ids):
            prompts.append({"prompt_token_ids": prompt + ids[:k]})
            wanted.append((token, lps[k][token]))
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    outs = llm.generate(prompts, params, use_tqdm=False)
    diffs = []
    for out, (token, ref_lp) in zip(outs, wanted, strict=True):
        top = out.outputs[0].logprobs
        assert top is not None
        if token in top[0]:
            diffs.append(abs(top[0][token].logprob - ref_lp))
    return sum(diffs) / max(len(diffs), 1), len(diffs) / len(wanted)


@pytest.fixture(scope="module")
def float_reference(tiny_llama_dir: Path) -> list[tuple[list[int], list[dict[int, float]]]]:
    return _greedy(LLM(str(tiny_llama_dir), dtype="float32", num_threads=1, max_model_len=256))


# (method, dtype, least prefix agreement, largest teacher-forced logprob MAD) on the tiny
# Llama, whose random weights leave near-ties everywhere (its top logprobs sit within 0.1 nats
# of each other). Measured free-running (agreement, MAD over the common prefix): int8 0.62 /
# 0.047 (float32 dequantized), 0.33 / 0.055 (float32 on the tile kernels, whose int8
# activations flip an early near-tie) and 1.0 / 0.062 (bfloat16); int4 0.06 / 0.29; bfloat16
# unquantized 1.0 / 0.031; teacher-forced MAD int8 0.053 / 0.066 / 0.061, int4 0.54. On a model this small and random int4 flips the first near-tie at once, so it is held
# to the teacher-forced logprobs (SmolLM2's free-running figures: test_smollm2_quality).
@pytest.mark.parametrize("method, dtype, min_agree, max_forced_mad", [
    ("int8", "float32", 0.25, 0.08),
    ("int8", "bfloat16", 0.4, 0.1),
    ("int4", "float32", 0.0, 0.8),
    ("int4", "bfloat16", 0.0, 0.8),
])
def test_greedy_agreement_and_logprobs_close_to_float(
        tiny_llama_dir: Path, float_reference: list[tuple[list[int], list[dict[int, float]]]],
        method: str, dtype: str, min_agree: float, max_forced_mad: float) -> None:
    llm = LLM(str(tiny_llama_dir), dtype=dtype, quantization=method, num_threads=1,
              max_model_len=256)
    agree, mad, rule = logprob_agreement(float_reference, _greedy(llm))
    forced_mad, in_top = _teacher_forced_drift(llm, float_reference)
    print(f"{method} {dtype}: agreement {agree:.3f}, MAD {mad:.4f}, forced MAD "
          f"{forced_mad:.4f}, in top-20 {in_top:.3f}")
    assert forced_mad <= max_forced_mad and in_top >= 0.9, (forced_mad, in_top)
    assert agree >= min_agree, agree
    if method == "int8":  # check_logprobs_close: each side's token in the other's top 5
        assert rule and mad <= max_forced_mad, mad


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_fp32_model_on_a_bf16_cpu_runs_the_fused_kernels(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    monkeypatch.setattr(cpu_features, "read_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    llm = LLM(str(tiny_llama_dir), dtype="float32", quantization=method, num_threads=1,
              max_model_len=256)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.fused and m.method.plan.compute_dtype == torch.bfloat16
                          for m in layers)
    assert model.norm.weight.dtype == torch.float32
    out = _greedy(llm)
    assert all(len(ids) == MAX_TOKENS for ids, _ in out)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_fp32_model_without_native_bf16_runs_the_tile_kernels(
        tiny_llama_dir: Path, float_reference: list[tuple[list[int], list[dict[int, float]]]],
        method: str) -> None:
    """A CPU with AVX512-VNNI but no bf16 (Ice Lake, Cascade Lake): the tiled layers run fused
    on the float32 activations (they dequantized before, 3-5x slower than unquantized)."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", quantization=method, num_threads=1,
              max_model_len=256)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.fused and "layout_tiles" in m.tensors() and
                          m.method.plan == ApplyPlan("tiled", torch.float32) for m in layers)
    forced_mad, in_top = _teacher_forced_drift(llm, float_reference)
    assert forced_mad <= {"int8": 0.08, "int4": 0.8}[method] and in_top >= 0.9


def _missing(*args: object) -> torch.Tensor:
    raise AttributeError("'_OpNamespace' 'aten' object has no attribute '_weight_int8pack_mm'")


def _wrong(x: torch.Tensor, weight: torch.Tensor, *rest: object) -> torch.Tensor:
    return torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype)


@pytest.mark.parametrize("method, op", [("int8", "_weight_int8pack_mm"),
                                        ("int4", "_weight_int4pack_mm_for_cpu")])
@pytest.mark.parametrize("fault, reason", [(_missing, "AttributeError"), (_wrong, "result off")])
def test_a_missing_or_wrong_kernel_falls_back_to_dequantize(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, torch_layouts: None,
        caplog: pytest.LogCaptureFixture, method: str, op: str, fault: object,
        reason: str) -> None:
    fused = _greedy(LLM(str(tiny_llama_dir), dtype="bfloat16", quantization=method,
                        num_threads=1, max_model_len=256))
    monkeypatch.setattr(quant, "_PROBES", {})
    monkeypatch.setattr(torch.ops.aten, op, fault)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        llm = LLM(str(tiny_llama_dir), dtype="bfloat16", quantization=method, num_threads=1,
                  max_model_len=256)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"--quantization {method}" in w and reason in w and "dequantizing" in w
               for w in warnings), warnings
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and not any(m.fused for m in layers)
    # Same codes, another rounding of the bf16 sums: a random tiny model's near-ties flip, so
    # the check is vLLM's check_logprobs_close rule (each first divergence stays in the other
    # side's top 5) and close logprobs where the tokens agree.
    agree, mad, rule = logprob_agreement(fused, _greedy(llm))
    assert rule and mad <= 0.05



@pytest.mark.slow
def test_gguf_weights_quantize_after_dequantizing() -> None:
    """The embedded GGUF (Q4_1/Q8_0 blocks) loads dequantized, then int8/int4 apply on top."""
    llm = LLM(None, dtype="bfloat16", quantization="int4", num_threads=1, max_model_len=128)
    runner = llm.engine.runner
    assert runner.weight_bytes() == quantized_weight_bytes(runner.config, "int4",
                                                           torch.bfloat16)
    out = llm.generate("The capital of France is",
                       SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# SmolLM2 chat prompts; the float32 model is the reference. Measured (16 prompts x 48 tokens,
# bfloat16 activations): int8 47.8% prefix agreement / 0.047 nats, int4 (group 32) 71.5% /
# 0.029, bfloat16 unquantized 70.4% / 0.020. The GGUF's Q4_1 blocks are groups of 32, so int4's
# grid holds them almost exactly, while int8's per-row grid does not.
SMOLLM2_PROMPTS = ("What is the capital of France, and why is it famous?",
                   "Explain photosynthesis to a ten-year-old.",
                   "Give me three tips for learning a new language.",
                   "Why is the sky blue?")


@pytest.mark.slow
@pytest.mark.parametrize("method, min_agree, max_mad", [("int8", 0.2, 0.1),
                                                        ("int4", 0.3, 0.08),
                                                        ("gguf", 0.3, 0.08)])
def test_smollm2_quality(method: str, min_agree: float, max_mad: float) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=5, ignore_eos=True)
    messages = [[{"role": "user", "content": p}] for p in SMOLLM2_PROMPTS]

    def run(**kwargs: object) -> list[tuple[list[int], list[dict[int, float]]]]:
        llm = LLM(None, num_threads=2, max_model_len=256, **kwargs)  # type: ignore[arg-type]
        return tokens_and_logprobs(llm.chat(messages, params, use_tqdm=False))

    agree, mad, rule = logprob_agreement(run(dtype="float32"), run(dtype="bfloat16", quantization=method))
    assert agree >= min_agree and mad <= max_mad and rule, (agree, mad, rule)


def test_int8_dequantizes_above_its_row_crossover(monkeypatch: pytest.MonkeyPatch,
                                                 torch_layouts: None) -> None:
    linear = torch.nn.Linear(64, 48, bias=False)
    layer = QuantizedLinear(linear, _method("int8", "fused", torch.bfloat16))
    assert layer.fused and Int8Method.max_fused_rows is not None
    calls: list[int] = []
    real = Int8Method.fused_matmul

    def counting(self: Int8Method, x: torch.Tensor, tensors: dict[str, torch.Tensor]
                 ) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(self, x, tensors)

    monkeypatch.setattr(Int8Method, "fused_matmul", counting)
    for rows in (1, Int8Method.max_fused_rows, Int8Method.max_fused_rows + 1, 64):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        want = x.float() @ layer.dequantized_weight().float().t()
        torch.testing.assert_close(layer(x).float(), want, atol=2e-2, rtol=2e-2)
    assert calls == [1, Int8Method.max_fused_rows]
