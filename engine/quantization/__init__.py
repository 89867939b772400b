"""`--quantization`: weight-only int8 / int4 for the linear layers, chosen at load.

`quantize_model` replaces a loaded float model's linear layers by `QuantizedLinear`s of the
chosen method (see `methods.py`); `quantized_weight_bytes` predicts, from the config alone, the
bytes the weights will then take (`kvserve plan`), and `resident_weight_bytes` counts them on a
loaded model (the startup line and the KV budget).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import (
    INT4_GROUP_SIZES,
    QUANTIZATION_METHODS,
    ModelConfig,
    effective_quantization,
)
from engine.cpu_features import auto_cpu_dtype
from engine.models.cpu_linear import PackedLinear
from engine.quantization import tiles, tinygemm
from engine.quantization.blocks import BLOCK_METHODS, U5BlockMethod, U8BlockMethod
from engine.quantization.checkpoint import CheckpointCodes, LayerCodes
from engine.quantization.embedding import Int8Embedding
from engine.quantization.methods import (
    ApplyPlan,
    Int4Method,
    Int8Method,
    LinearMethod,
    QuantizedLinear,
)

logger = logging.getLogger("kvserve")


# The LM head (and, when tied, the embedding that shares its weight) under each method: it is
# the largest single matrix of a small model (21% of SmolLM2's weights), so it is quantized too,
# but never below int8 (see README, "Weight-only quantization", for the measurements).
LM_HEAD_METHOD = {"int8": "int8", "int4": "int8", "gguf": "int8"}
# Relative error the startup probe allows between the fused kernel and the dequantized
# reference, by compute dtype (bf16 activations round to 8 bits of mantissa). kvserve's tiled
# kernels quantize the activations to int8 per block of 32 (GGUF's Q8 blocks): measured up to
# 1.0e-2 of the largest output on random data, so they get TILED_PROBE_TOLERANCE.
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
TILED_PROBE_TOLERANCE = 3e-2


def apply_plan(method: str, model_dtype: torch.dtype, device: torch.device) -> ApplyPlan:
    """How `method` computes for a model of `model_dtype` on `device` (before the probe).

    Measured on SmolLM2 (README, "Weight-only quantization"): torch's fused int8/int4 CPU
    kernels are fast with 16-bit activations and 5-10x slower than a float linear with float32
    ones. So 16-bit models run fused in their dtype; float32 models run fused where the CPU has
    native bf16 (kvserve's tile kernels on the float32 activations as they are, torch's kernels
    on bfloat16 activations, the output cast back to float32). Without native bf16, where
    kvserve's tile kernels were built (AVX512-VNNI: they need no bf16), a float32 model runs
    `tiled`: the layers with the tiled layout fused on their float32 activations, any other
    layer dequantized. Elsewhere every weight is dequantized to float32 before a float32
    matmul. On CUDA the layers run kvserve's Triton kernel (kernels/triton_quant_linear.py) in
    the model's dtype, or dequantize where triton is not installed; a bfloat16 model's int4
    layers run torch's tinygemm kernel where it passes its check on the GPU (tinygemm.py).
    """
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return ApplyPlan("dequant", model_dtype)
        return ApplyPlan("fused", model_dtype, "triton", tinygemm=(
            method == "int4" and model_dtype == torch.bfloat16
            and tinygemm.unavailable_reason(device) is None))
    if device.type != "cpu":
        return ApplyPlan("dequant", model_dtype)
    if model_dtype in (torch.bfloat16, torch.float16):
        return ApplyPlan("fused", model_dtype)
    if auto_cpu_dtype()[0] == torch.bfloat16:
        return ApplyPlan("fused", torch.bfloat16)
    if tiles.tile_ops() is not None:
        return ApplyPlan("tiled", model_dtype)
    return ApplyPlan("dequant", model_dtype)


def make_method(method: str, plan: ApplyPlan, group_size: int | None) -> LinearMethod:
    """The LinearMethod for `method` ("int8" or "int4")."""
    if method == "int8":
        return Int8Method(plan)
    if method == "int4":
        return Int4Method(plan, group_size)
    raise ValueError(f"unknown quantization {method!r}; use one of "
                     f"{', '.join(QUANTIZATION_METHODS)}")


_PROBES: dict[tuple[str, int | None, torch.dtype, str, bool], str | None] = {}


def probe_fused(method: LinearMethod) -> str | None:
    """Runs a small fused matmul against the dequantized reference; None when it agrees, else
    why not (an op missing on this torch, or a wrong result). Cached per method and dtype."""
    group = getattr(method, "group_size", None)
    key = (method.name, group, method.plan.compute_dtype, method.plan.kernel,
           method.plan.tinygemm)
    if key not in _PROBES:
        _PROBES[key] = _run_probe(method)
    return _PROBES[key]


def _run_probe(method: LinearMethod) -> str | None:
    dtype = method.plan.compute_dtype
    gen = torch.Generator().manual_seed(0)
    in_features = 2 * (getattr(method, "group_size", None) or 64)
    weight = torch.randn(64, in_features, generator=gen)
    x = torch.randn(5, in_features, generator=gen).to(dtype)
    if method.plan.kernel == "triton" and torch.cuda.is_available():
        weight, x = weight.cuda(), x.cuda()
    try:
        tensors = method.create_weights(weight)
        got = method.fused_matmul(x, tensors).float()
    except Exception as exc:  # a missing op, or a Triton kernel that fails to compile
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    want = x.float() @ method.dequantize(tensors).float().t()
    error = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
    tolerance = max(PROBE_TOLERANCE.get(dtype, 2e-2),
                    TILED_PROBE_TOLERANCE if "layout_tiles" in tensors else 0.0)
    if not error <= tolerance:
        return f"result off by {error:.2e} of its largest value"
    return None


@dataclass(frozen=True)
class QuantizationReport:
    """What `quantize_model` did, for the startup line."""

    method: str
    layers: int
    fused_layers: int
    compute_dtype: torch.dtype
    lm_head: str
    fallback_reason: str | None


def quantize_model(model: nn.Module, method: str, model_dtype: torch.dtype,
                   device: torch.device, group_size: int | None = None,
                   plan: ApplyPlan | None = None,
                   checkpoint: CheckpointCodes | None = None,
                   place: torch.device | None = None) -> QuantizationReport:
    """Replaces the decoder's linear layers (and the LM head, see LM_HEAD_METHOD) of a loaded
    float model by QuantizedLinears on `device`. Call with float32 weights, then cast the rest.
    The float weights may sit in host memory (a CUDA model loads there first): each goes to
    `device` only to be quantized, so the device never holds the float model; the rest of
    the model stays where it is (`place_on_device` moves it). `place` puts the layers
    elsewhere than `device`, whose kernels they are planned for: host memory under
    --cpu-offload-gb, which then moves the resident share over itself.

    `plan` overrides `apply_plan` (benchmarks). When the fused kernel fails the probe, every
    layer dequantizes instead and a WARNING says why. With `checkpoint` (an AWQ or GPTQ
    checkpoint's codes) the layers take the checkpoint's codes through the int4 method and the
    LM head stays as the checkpoint stores it.
    """
    if checkpoint is not None:
        group_size = checkpoint.quant.group_size
    plan = plan or apply_plan(method, model_dtype, device)
    if checkpoint is not None and group_size not in INT4_GROUP_SIZES:
        plan = ApplyPlan("dequant", model_dtype)  # no fused kernel for this group size
    linear_method = make_method("int4" if checkpoint is not None else method, plan, group_size)
    reason = probe_fused(linear_method) if plan.fuses else None
    if reason is not None:
        logger.warning("--quantization %s: the fused %s kernel failed its startup probe "
                       "(%s); dequantizing each weight before its matmul instead (correct, "
                       "slower)", method, method, reason)
        plan = ApplyPlan("dequant", model_dtype)
        linear_method = make_method(linear_method.name, plan, group_size)
    elif not plan.fuses and device.type == "cpu":
        logger.warning("--quantization %s on a %s model without native bf16 or AVX512-VNNI "
                       "on this CPU: weights are dequantized before each matmul, which saves memory but "
                       "decodes slower than the unquantized model (README, weight-only "
                       "quantization)", method, str(model_dtype).removeprefix("torch."))
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name != "lm_head"]
    parts = checkpoint_parts(model, checkpoint) if checkpoint is not None else {}
    fused = 0
    compute_dtype = plan.compute_dtype
    for name, module in targets:
        tensors, layer_method = None, linear_method
        if checkpoint is not None:
            if name not in parts:
                continue  # a layer the checkpoint keeps in float
            codes = checkpoint.layer_codes(parts[name])
            if codes is not None and codes.codes.shape != module.weight.shape:
                continue  # some of its rows are floats in the file (a GGUF F16 part): float
            if codes is None:
                logger.warning("%s: GPTQ act-order groups are not contiguous; %s is "
                               "re-quantized to int4 groups of 32 from its exact float weight",
                               method, name)
                tensors = make_method("int4", plan, None).create_weights(module.weight.detach())
            else:
                layer_method, tensors = checkpoint_tensors(codes, linear_method)
        layer = QuantizedLinear(module, layer_method, tensors, place or device)
        fused += layer.fused
        compute_dtype = layer.activation_dtype or model_dtype
        _replace(model, name, layer)
    head_method = LM_HEAD_METHOD.get(method, "none")  # awq/gptq: as the checkpoint stores it
    _quantize_lm_head(model, head_method, plan, group_size, model_dtype, place or device)
    return QuantizationReport(method, len(parts) if checkpoint is not None else len(targets),
                              fused, compute_dtype, head_method, reason)


def checkpoint_tensors(codes: LayerCodes, int4: LinearMethod
                       ) -> tuple[LinearMethod, dict[str, torch.Tensor]]:
    """A checkpoint layer's method and tensors, from its codes exactly: 4-bit codes through
    `int4` (its scales in float16, as the checkpoint stores them), 5- and 8-bit ones (a GGUF
    file's Q5 and Q8_0/Q6_K blocks) through the block methods under the same plan."""
    if codes.bits in BLOCK_METHODS:
        method = BLOCK_METHODS[codes.bits](int4.plan)
        reason = probe_fused(method) if method.plan.fuses else None
        if reason is not None:
            logger.warning("the fused %d-bit block kernel failed its startup probe (%s); "
                           "dequantizing each such weight before its matmul instead",
                           codes.bits, reason)
            method = BLOCK_METHODS[codes.bits](ApplyPlan("dequant", int4.plan.compute_dtype))
        return method, method.weights_from_codes(codes.codes, codes.scales, codes.mins())
    return int4, int4.weights_from_codes(codes.codes, codes.scales,  # type: ignore[attr-defined]
                                         codes.offsets, torch.float16)


def checkpoint_parts(model: nn.Module, checkpoint: CheckpointCodes) -> dict[str, list[str]]:
    """Each fused linear of `model` -> the checkpoint modules whose rows it holds, in order."""
    map_name = getattr(model, "_map_name")  # noqa: B009 (the model's HF name mapping)
    found: dict[str, list[tuple[int, str]]] = {}
    for module in checkpoint.layers:
        target, offset = map_name(f"{module}.weight")
        if target is not None:
            found.setdefault(target.removesuffix(".weight"), []).append((offset, module))
    return {name: [m for _, m in sorted(rows)] for name, rows in found.items()}


def _quantize_lm_head(model: nn.Module, head_method: str, plan: ApplyPlan,
                      group_size: int | None, model_dtype: torch.dtype,
                      device: torch.device) -> None:
    """The LM head in `head_method`; a tied embedding reads the same int8 codes."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head_method == "none":
        return
    method = make_method(head_method, plan, group_size)
    if plan.fuses and probe_fused(method) is not None:
        method = make_method(head_method, ApplyPlan("dequant", model_dtype), group_size)
    # Dequantizing a vocabulary-sized head per step costs more than the fused kernel at any
    # batch measured (64 rows: 54.6 vs 38.2 ms for SmolLM2's int8 head).
    method.max_fused_rows = None
    embed = getattr(model, "embed_tokens", None)
    tied = isinstance(embed, nn.Embedding) and embed.weight is head.weight
    quantized = QuantizedLinear(head, method, device=device)
    _replace(model, "lm_head", quantized)
    if tied and isinstance(method, Int8Method):
        _replace(model, "embed_tokens", Int8Embedding(quantized, model_dtype))


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def cast_float_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Casts the remaining float parameters (norms, a float embedding) to `dtype`, leaving the
    quantized layers' buffers (codes, and scales in their compute dtype) as they are."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model`, each storage counted once, plus the
    oneDNN-packed weights of PackedLinears (a tied LM head packed beside its embedding counts
    twice: both copies are resident)."""
    seen: set[int] = set()
    total = sum(m.weight_bytes() for m in model.modules() if isinstance(m, PackedLinear))
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type == "meta":
            continue
        key = tensor.untyped_storage().data_ptr()
        if tensor.numel() == 0 or key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def _linear_bytes(method: str, out_features: int, in_features: int, dtype_bytes: int,
                  scale_bytes: int, group_size: int | None) -> int:
    """Bytes one out x in linear weight takes under `method` (float weights in the model
    dtype, int8 scales in the compute dtype, int4 ones in 16 bits; group_size -1: one group
    over the whole input)."""
    if method == "none":
        return out_features * in_features * dtype_bytes
    if method == "int8":
        return out_features * in_features + out_features * scale_bytes
    group = in_features if group_size == -1 else Int4Method(
        ApplyPlan("dequant", torch.float32), group_size).layer_group_size(in_features)
    # int4 keeps its scales and offsets in 16 bits (Int4Method.scale_dtype)
    return out_features * in_features // 2 + (in_features // group) * out_features * 2 * \
        min(scale_bytes, 2)


def gguf_linear_bytes(out_features: int, in_features: int, bits: float) -> int:
    """Bytes a GGUF matrix [out, in] takes in place at `bits` a code (4, 5 or 8, or a mean over
    layers): its codes and a float16 scale and min per block of 32 inputs."""
    numel = out_features * in_features
    return round(numel * bits / 8) + numel // 32 * 4


def linear_shapes(cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """(out, in) of a decoder layer's fused linears: qkv, o, gate_up, down."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h = cfg.hidden_size
    return (q + 2 * kv, h), (h, q), (2 * cfg.intermediate_size, h), (h, cfg.intermediate_size)


def quantized_weight_bytes(cfg: ModelConfig, method: str, dtype: torch.dtype,
                           group_size: int | None = None,
                           compute_dtype: torch.dtype | None = None) -> int:
    """The weight bytes a model of `cfg` takes after loading with `--quantization method`, from
    the config alone; equal to `resident_weight_bytes` of the loaded model. `compute_dtype` is
    the apply plan's (scales and biases are kept in it; default: `dtype`). An AWQ or GPTQ
    checkpoint counts as int4 at its own group size with its LM head in float; `gguf` by the
    file's code widths (`cfg.gguf_code_bits`: 4, 5 or 8 bits a weight and a float16 scale and min
    per block of 32) with an int8 head; a file with a decoder matrix in a float type (rare:
    its fused linear loads as floats) is counted as int4 throughout, an estimate.
    `auto` counts as `none` for anything but a quantized checkpoint (what a GPU plan loads)."""
    method = effective_quantization(method, cfg, "gguf" if method == "gguf" else "hf")
    if method == "none":
        return cfg.num_params() * dtype.itemsize
    head_method = LM_HEAD_METHOD.get(method, "none")
    if method in ("awq", "gptq"):
        assert cfg.checkpoint_quantization is not None
        method, group_size = "int4", cfg.checkpoint_quantization[1]
    gguf = method == "gguf"
    if gguf:
        method, group_size = "int4", 32
    b = dtype.itemsize
    sb = (compute_dtype or dtype).itemsize
    h, vocab = cfg.hidden_size, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    if gguf and cfg.gguf_code_bits is not None:
        layer = sum(gguf_linear_bytes(n, k, bits)
                    for (n, k), bits in zip(linear_shapes(cfg), cfg.gguf_code_bits, strict=True))
    else:
        layer = sum(_linear_bytes(method, n, k, b, sb, group_size) for n, k in linear_shapes(cfg))
    layer += 2 * h * b + ((q + 2 * kv) * sb if cfg.attention_bias else 0)
    head = _linear_bytes(head_method, vocab, h, b, sb, group_size)
    shared = cfg.tie_word_embeddings and head_method in ("none", "int8")
    embed = 0 if shared else vocab * h * b
    return cfg.num_hidden_layers * layer + head + embed + h * b


__all__ = [
    "QUANTIZATION_METHODS",
    "ApplyPlan",
    "Int4Method",
    "Int8Embedding",
    "Int8Method",
    "LinearMethod",
    "QuantizationReport",
    "QuantizedLinear",
    "U5BlockMethod",
    "U8BlockMethod",
    "apply_plan",
    "gguf_linear_bytes",
    "linear_shapes",
    "cast_float_parameters",
    "make_method",
    "probe_fused",
    "quantize_model",
    "quantized_weight_bytes",
    "resident_weight_bytes",
]
