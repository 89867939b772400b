"""The Triton weight-only quantized linear (the CUDA path of `--quantization int8|int4`) against
a reference built here from the codes' definition, in Triton's CPU interpreter (or compiled on
a GPU when one is present); then the quantized layers and the tiny model running on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import engine.quantization as quant  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.quantization import (  # noqa: E402
    ApplyPlan,
    Int4Method,
    Int8Method,
    QuantizedLinear,
    apply_plan,
    methods,
    probe_fused,
)
from tests.support.greedy import logprob_agreement, tokens_and_logprobs  # noqa: E402
from tests.support.triton_interpreter import import_kernels  # noqa: E402

tq = import_kernels("kernels.triton_quant_linear")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bfloat16 and float16 `tl.dot` are wrong in the interpreter: on CPU the kernel runs float32.
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
Config = tq.TileConfig


def _int4(rows: int, out_features: int, in_features: int, group: int, dtype: torch.dtype,
          seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x, packed codes input-major [in/2, out], [groups, out, 2] scales and zeros, and the
    weight they stand for."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).t().contiguous()
    groups = in_features // group
    scale_zeros = (torch.rand(groups, out_features, 2, generator=gen) * 0.1 - 0.02).to(dtype)
    scales = scale_zeros[..., 0].t().float().repeat_interleave(group, dim=1)
    zeros = scale_zeros[..., 1].t().float().repeat_interleave(group, dim=1)
    weight = ((codes.float() - 8.0) * scales + zeros).to(dtype)  # rounded as the kernel rounds
    return x, packed, scale_zeros, weight


def _check(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
           scale: torch.Tensor | None = None) -> None:
    want = x.double() @ weight.double().t()
    if scale is not None:
        want = want * scale.double()
    assert got.dtype == x.dtype and got.shape == want.shape
    error = (got.double().cpu() - want).abs().max() / want.abs().max()
    assert error <= TOLERANCE[x.dtype], float(error)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, out_features, in_features, group, config", [
    (3, 48, 128, 32, None),  # picked: decode rows, inputs split until the launch is wide
    (1, 40, 256, 64, Config(16, 32, 64, 2)),  # columns masked
    (5, 64, 256, 128, Config(16, 64, 32, 4)),  # four steps inside one group
    (20, 32, 128, 32, Config(16, 16, 32, 1)),  # rows over two tiles, no split
    (70, 64, 256, 256, None),  # many rows: the wide tile
])
def test_int4_equals_the_weight_its_codes_stand_for(
        rows: int, out_features: int, in_features: int, group: int,
        config: tq.TileConfig | None, dtype: torch.dtype) -> None:
    x, packed, scale_zeros, weight = _int4(rows, out_features, in_features, group, dtype)
    got = tq.quant_linear(x.to(DEVICE), packed.to(DEVICE), scale_zeros.to(DEVICE), 4, group,
                          config)
    _check(got, x, weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, config", [(2, None), (17, Config(16, 32, 32, 2)), (65, None)])
def test_int8_scales_each_output_channel(rows: int, config: tq.TileConfig | None,
                                         dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 192, generator=gen).to(dtype)
    codes = torch.randint(-127, 128, (80, 192), generator=gen, dtype=torch.int8)
    scales = (torch.rand(80, generator=gen) * 0.01).to(dtype)
    got = tq.quant_linear(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), 8, 0, config)
    _check(got, x, codes.to(dtype), scales.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features, in_features, group", [(48, 128, 32), (40, 256, 128)])
def test_dequantizing_kernel_builds_the_weight_its_codes_stand_for(
        out_features: int, in_features: int, group: int, dtype: torch.dtype) -> None:
    _, packed, scale_zeros, weight = _int4(1, out_features, in_features, group, dtype)
    got = tq.dequantize_int4(packed.to(DEVICE), scale_zeros.to(DEVICE), group, dtype)
    assert got.shape == (in_features, out_features) and got.dtype == dtype
    if DEVICE.type == "cpu":  # the interpreter computes as the reference does
        assert torch.equal(got.t(), weight)
    else:  # a GPU may fuse the scale and the offset into one rounding
        torch.testing.assert_close(got.t().cpu(), weight, rtol=2**-7, atol=1e-6)


def test_picked_configs_fill_the_gpu_and_tile_the_inputs() -> None:
    for rows in (1, 8, 16, 32, 64, 65, 512):
        for out_features, in_features, group in ((4096, 4096, 128), (1024, 4096, 32),
                                                  (14336, 4096, 64), (4096, 14336, 128),
                                                  (576, 1536, 32), (128256, 4096, 32),
                                                  (4096, 4096, 0), (576, 1536, 0)):
            cfg = tq.pick_config(rows, out_features, in_features, group)
            assert in_features % (cfg.split * cfg.block_k) == 0
            assert cfg.block_k <= 128 and 1 <= cfg.split <= tq.MAX_SPLIT
            if group:
                assert group % cfg.block_k == 0  # an int4 step never spans two groups
            programs = (-(-out_features // cfg.block_n) * -(-rows // cfg.block_m)) * cfg.split
            steps = in_features // cfg.block_k
            # a split doubles while the launch is short of its target and the steps divide
            assert (programs >= tq.TARGET_PROGRAMS[4 if group and rows <= 64 else 8]
                    or cfg.split == tq.MAX_SPLIT or steps % (2 * cfg.split)
                    or (rows > 64 and not group))
    assert tq.pick_config(1, 4096, 4096, 128).split == tq.MAX_SPLIT
    assert tq.pick_config(512, 4096, 4096, 0).split == 1


def test_mismatched_shapes_are_refused() -> None:
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="do not match 64 inputs in groups of 32"):
        tq.quant_linear(x, torch.zeros(8, 16, dtype=torch.uint8, device=DEVICE),
                        torch.zeros(2, 8, 2, device=DEVICE), 4, 32)
    with pytest.raises(ValueError, match="does not tile 64 inputs in groups of 32"):
        tq.quant_linear(x, torch.zeros(32, 8, dtype=torch.uint8, device=DEVICE),
                        torch.zeros(2, 8, 2, device=DEVICE), 4, 32, Config(16, 16, 64, 1))
    with pytest.raises(ValueError, match="4- or 8-bit"):
        tq.quant_linear(x, torch.zeros(8, 64, dtype=torch.int8, device=DEVICE),
                        torch.zeros(8, device=DEVICE), 5)
    with pytest.raises(ValueError, match="does not tile 64 inputs"):
        tq.quant_linear(x, torch.zeros(8, 64, dtype=torch.int8, device=DEVICE),
                        torch.zeros(8, device=DEVICE), 8, 0, Config(16, 16, 64, 2))


# ---- the quantized layers and the engine on this kernel ------------------------------------

TRITON = ApplyPlan("fused", torch.float32, "triton")


@pytest.mark.parametrize("name, group", [("int8", None), ("int4", 32), ("int4", 128)])
def test_layers_on_the_triton_plan_read_their_codes_in_place(
        name: str, group: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    method = Int8Method(TRITON) if name == "int8" else Int4Method(TRITON, group)
    assert probe_fused(method) is None  # the startup probe accepts the kernel
    linear = torch.nn.Linear(256, 40, bias=True)  # 40 outputs: no 16-row tiles needed
    layer = QuantizedLinear(linear, method).to(DEVICE)
    assert layer.fused
    tensors = layer.tensors()
    assert "layout_tiles" not in tensors and "layout_kernel" not in tensors
    assert tensors["qweight"].dtype == (torch.int8 if name == "int8" else torch.uint8)
    if name == "int4":  # input-major nibbles, the codes of the nibble layout transposed
        assert tensors["qweight"].shape == (128, 40) and "layout_kmajor" in tensors
        nibbles = Int4Method(ApplyPlan("dequant", torch.float32), group)
        assert torch.equal(method.unpack_codes(tensors), nibbles.unpack_codes(
            nibbles.create_weights(linear.weight.detach())).to(DEVICE))
    calls: list[int] = []
    kernel, dequant = tq.quant_linear, tq.dequantize_int4
    monkeypatch.setattr(tq, "quant_linear", lambda x, *a: calls.append(len(x)) or kernel(x, *a))
    monkeypatch.setattr(tq, "dequantize_int4", lambda *a: calls.append(0) or dequant(*a))
    x = torch.randn(6, 256, device=DEVICE)
    want = x @ layer.dequantized_weight().t() + linear.bias.detach().to(DEVICE)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
    # Past the row limit a layer dequantizes and runs one float matmul (prefill on CUDA):
    # int4's codes through the dequantizing kernel, int8's by two torch ops.
    monkeypatch.setattr(methods, "TRITON_MAX_FUSED_ROWS", 4)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
    assert calls == ([6, 0] if name == "int4" else [6])


def test_cuda_plans_the_triton_kernel_unless_triton_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    # (a bfloat16 model's int4 layers on tinygemm where its check passes: test_tinygemm.py)
    tinygemm = quant.tinygemm.unavailable_reason(cuda) is None
    assert apply_plan("int4", torch.bfloat16, cuda) == ApplyPlan("fused", torch.bfloat16,
                                                                 "triton", tinygemm)
    assert apply_plan("int8", torch.float32, cuda).kernel == "triton"
    monkeypatch.setattr(quant.importlib.util, "find_spec", lambda name: None)
    assert apply_plan("int4", torch.bfloat16, cuda) == ApplyPlan("dequant", torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_tiny_model_on_the_triton_kernel_decodes_as_the_dequantized_path(
        tiny_llama_dir: Path, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250]}, {"prompt_token_ids": [60, 61, 62]}]

    def run(plan: ApplyPlan) -> list[tuple[list[int], list[dict[int, float]]]]:
        monkeypatch.setattr(quant, "apply_plan", lambda *args: plan)
        llm = LLM(str(tiny_llama_dir), dtype="float32", quantization=method,
                  device=DEVICE.type, max_model_len=128, num_threads=1,
                  kv_cache_memory_bytes=64 * 2**20)
        model = llm.engine.runner.model
        fused = [m.fused for m in model.modules() if isinstance(m, QuantizedLinear)]
        assert fused and all(fused) == (plan.kernel == "triton")
        result = tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False))
        del llm, model
        return result

    dequantized = run(ApplyPlan("dequant", torch.float32))
    on_kernel = run(TRITON)
    agree, mad, rule = logprob_agreement(dequantized, on_kernel)
    assert agree == 1.0 and mad < 1e-3 and rule, (agree, mad)
