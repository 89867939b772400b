"""A GGUF file's quantized blocks of every type kvserve keeps in place (Q4_0/1, Q5_0/1, Q8_0,
Q4_K, Q5_K, Q6_K; engine/model_loader/gguf/codes.py), against the `gguf` package's own
dequantizer; the 5- and 8-bit block methods; and a SmolLM2 file re-encoded in a mix of types
served end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from engine.model_loader.gguf.codes import (
    CODE_TYPES,
    REQUANTIZED_TYPES,
    layer_codes,
    linear_code_bits,
)
from tests.support.cpu_ops import require_cpu_ops
from tests.support.gguf_quants import reencode_gguf

T = GGMLQuantizationType
# Byte offsets of each type's fp16 fields (set to sane scales: random bytes make NaN and inf).
F16_FIELDS = {T.Q4_0: (0,), T.Q8_0: (0,), T.Q5_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
              T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes for a [rows, cols] matrix of `kind`, its fp16 fields small positive."""
    block, size = GGML_QUANT_SIZES[kind]
    n = rows * cols // block
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for start in F16_FIELDS[kind]:
        scale = (rng.random(n) * 0.01 + 0.001).astype(np.float16)
        raw[:, start:start + 2] = scale.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", CODE_TYPES, ids=lambda k: k.name)
def test_codes_stand_for_the_files_values(kind: GGMLQuantizationType) -> None:
    raw = _random_blocks(kind, 32, 512, seed=int(kind))
    want = torch.from_numpy(dequantize(raw, kind).reshape(32, 512).copy())
    codes = layer_codes(torch.from_numpy(raw.reshape(-1).copy()), kind, (32, 512))
    assert codes is not None and codes.codes.shape == (32, 512)
    assert codes.scales.shape == (32, 16)
    assert int(codes.codes.min()) >= 0 and int(codes.codes.max()) < 2 ** codes.bits
    got = codes.dequantize()
    if kind in REQUANTIZED_TYPES:  # 6-bit codes on an 8-bit grid: within half its step
        step = codes.scales.repeat_interleave(32, dim=1)
        assert ((got - want).abs() <= step * 0.5 * (1 + 1e-3)).all()
        assert codes.bits == 8
    else:
        assert torch.equal(got, want)


def test_code_widths_of_the_fused_linears_from_the_header() -> None:
    """The widest code of a fused linear's matrices, a mean over the layers, and None where a
    decoder matrix loads as floats."""
    names = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_0,
             "ffn_gate": T.Q4_1, "ffn_up": T.Q5_0, "ffn_down": T.Q8_0}
    tensors = [(f"blk.{layer}.{part}.weight", kind) for layer in range(2)
               for part, kind in names.items()] + [("token_embd.weight", T.F16)]
    tensors[-2] = ("blk.1.ffn_down.weight", T.Q4_K)
    assert linear_code_bits(tensors, 2) == (8.0, 4.0, 5.0, 6.0)
    assert linear_code_bits(tensors + [("blk.0.ffn_up.weight", T.F16)], 2) is None


def test_other_types_and_shapes_load_as_floats() -> None:
    raw = torch.zeros(16 * 64 * 4, dtype=torch.uint8)
    assert layer_codes(raw, T.F32, (16, 64)) is None
    assert layer_codes(raw, T.Q8_0, (16 * 64,)) is None


def _kind_of(name: str) -> GGMLQuantizationType | None:
    """Attention in Q8_0, gate Q5_0, up Q5_1, down by layer in Q4_K, Q5_K, Q6_K (SmolLM2's 576
    inputs are not whole K-quant super-blocks; its down projection's 1,536 are)."""
    if not name.startswith("blk."):
        return None
    _, layer, part, _ = name.split(".")
    if part.startswith("attn_") and part != "attn_norm":
        return T.Q8_0
    return {"ffn_gate": T.Q5_0, "ffn_up": T.Q5_1,
            "ffn_down": (T.Q4_K, T.Q5_K, T.Q6_K)[int(layer) % 3]}.get(part)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.model_loader.gguf.weights import default_model_path
    return reencode_gguf(default_model_path(), tmp_path_factory.mktemp("gguf") / "mixed.gguf",
                         _kind_of)


@pytest.mark.slow
def test_a_file_of_mixed_types_runs_in_place(mixed_file: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decoder matrix keeps its codes (8-bit ones through the u8 tiles), decode steps
    still run in one C++ call, and greedy text holds to vLLM's check_logprobs_close rule
    against the same file dequantized (`--quantization none`)."""
    from gguf import GGUFReader

    from engine import LLM, SamplingParams
    from engine.model_loader.gguf.weights import read_gguf_config
    from engine.quantization import (
        Int4Method,
        QuantizedLinear,
        U5BlockMethod,
        U8BlockMethod,
        quantized_weight_bytes,
    )
    from tests.support.greedy import count_one_call_steps, logprob_agreement, tokens_and_logprobs

    taken = count_one_call_steps(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
    prompts = ["The capital of France is", "Water boils at"]
    in_place = LLM(str(mixed_file), dtype="float32", max_model_len=256, num_threads=2)
    try:
        model = in_place.engine.runner.model
        methods = {name: type(model.get_submodule(name).method) for name in (
            "layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj",
            "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj", "layers.1.mlp.down_proj",
            "layers.2.mlp.down_proj")}
        assert list(methods.values()) == [U8BlockMethod, U8BlockMethod,  # Q8_0
                                          U5BlockMethod,  # Q5_0 and Q5_1
                                          Int4Method, U5BlockMethod, U8BlockMethod]  # Q4/5/6_K
        # kvserve plan's arithmetic from the header alone: the bytes the loaded layers hold
        cfg = read_gguf_config(mixed_file)
        assert cfg.gguf_code_bits is not None and cfg.gguf_code_bits[:3] == (8, 8, 5)
        assert cfg.gguf_code_bits[3] == pytest.approx(17 / 3)  # Q4_K, Q5_K, Q6_K in turn
        assert quantized_weight_bytes(cfg, "gguf", torch.float32) == \
            in_place.engine.runner.weight_bytes() < 150 * 2**20
        reader = GGUFReader(str(mixed_file))
        for layer in range(3):
            tensor = next(t for t in reader.tensors if t.name == f"blk.{layer}.ffn_down.weight")
            want = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
            down = model.get_submodule(f"layers.{layer}.mlp.down_proj")
            assert isinstance(down, QuantizedLinear) and down.fused
            # scales in float16: K-quant d x sc products rounded by at most 2^-11 of themselves
            got = down.dequantized_weight().float()
            tolerance = 2.0**-10 * float(want.abs().max())
            if tensor.tensor_type in REQUANTIZED_TYPES:
                tolerance = float(want.abs().max()) / 127  # an 8-bit step at most
            assert (got - want).abs().max() <= tolerance, (layer, tensor.tensor_type.name)
        ours = tokens_and_logprobs(in_place.generate(prompts, params, use_tqdm=False))
        assert sum(taken) >= 10  # the decode steps in one call (u8 and int4 tiles)
    finally:
        in_place.engine.shutdown()
    dequantized = LLM(str(mixed_file), dtype="float32", max_model_len=256, num_threads=2,
                      quantization="none")
    try:
        assert dequantized.engine.runner.weight_bytes() > 600 * 2**20
        reference = tokens_and_logprobs(dequantized.generate(prompts, params, use_tqdm=False))
    finally:
        dequantized.engine.shutdown()
    agree, mad, rule = logprob_agreement(reference, ours)
    assert rule and mad <= 0.15 and agree >= 0.25, (agree, mad)


@pytest.mark.parametrize("bits", [5, 8])
@pytest.mark.parametrize("mode", ["tiled", "dequant"])
def test_block_methods_from_floats_and_codes(mode: str, bits: int) -> None:
    """Made from a float weight they are Q5_1 and Q8_0 (each weight within half a step); from
    codes they keep them; both layouts (the tiles, and the plain codes a CPU without the tile
    kernels dequantizes per call) compute x W^T of the weight they hold."""
    from engine.quantization import ApplyPlan
    from engine.quantization.blocks import BLOCK_METHODS

    if mode == "tiled":
        require_cpu_ops()
    method = BLOCK_METHODS[bits](ApplyPlan(mode, torch.float32))
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(48, 96, generator=gen)
    tensors = method.create_weights(weight)
    assert ("layout_tiles" in tensors) == (mode == "tiled")
    w = method.dequantize(tensors)
    blocks = weight.reshape(48, 3, 32)
    step = (blocks.abs().amax(-1, keepdim=True) / 127 if bits == 8 else
            (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 31)
    assert ((w - weight).reshape(48, 3, 32).abs() <= step * 0.5 * (1 + 1e-2) + 1e-3).all()
    x = torch.randn(5, 96, generator=gen)
    got = method.apply(x, tensors, None, fused=mode == "tiled")
    want = x @ w.t()
    assert (got - want).abs().max() <= (1.5e-2 if mode == "tiled" else 1e-5) * want.abs().max()
    codes = torch.randint(0, 1 << bits, (48, 96), generator=gen, dtype=torch.int32)
    scales, mins = torch.rand(48, 3, generator=gen) / 100, -torch.rand(48, 3, generator=gen)
    held = method.dequantize(method.weights_from_codes(codes, scales, mins))
    exact = codes.reshape(48, 3, 32).float() * scales.half().float()[..., None] + \
        mins.half().float()[..., None]
    assert torch.equal(held, exact.reshape(48, 96))


@pytest.mark.slow
def test_a_fused_linear_with_a_float_part_stays_float(tmp_path: Path) -> None:
    """Layer 0's V in F16 beside Q8_0 Q and K: its fused QKV cannot hold codes for only some
    rows, so it loads as floats; every other linear keeps its codes, and the model runs."""
    from engine import LLM, SamplingParams
    from engine.model_loader.gguf.weights import default_model_path
    from engine.quantization import QuantizedLinear, U5BlockMethod, U8BlockMethod

    def kind_of(name: str) -> GGMLQuantizationType | None:
        return T.F16 if name == "blk.0.attn_v.weight" else _kind_of(name)

    path = reencode_gguf(default_model_path(), tmp_path / "f16_part.gguf", kind_of)
    llm = LLM(str(path), dtype="float32", max_model_len=128, num_threads=2)
    try:
        model = llm.engine.runner.model
        assert not isinstance(model.get_submodule("layers.0.self_attn.qkv_proj"),
                              QuantizedLinear)
        assert isinstance(model.get_submodule("layers.0.mlp.gate_up_proj").method, U5BlockMethod)
        assert isinstance(model.get_submodule("layers.1.self_attn.qkv_proj").method,
                          U8BlockMethod)
        out = llm.generate(["The capital of France is"],
                           SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        assert "Paris" in out[0].outputs[0].text
    finally:
        llm.engine.shutdown()
