"""Weight-only quantization methods for linear layers (vLLM's `LinearMethod` idea).

A method turns a loaded float weight into the tensors it keeps (`create_weights`, at load),
computes `x W^T + b` from them (`apply`), and can rebuild the float weight (`dequantize`, the
reference the startup probe and the tests compare against). Each method runs in one of two
modes, fixed at load:

- `fused`: kernels that read the quantized weight directly, with the activations in the mode's
  compute dtype. On CPU (plan kernel "cpu") kvserve's C++ ones (kernels/cpu/quant/qgemm.cpp, weights
  in the tiled layouts of `tiles.py`) where they were built with AVX512-VNNI, else torch's
  (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`); on CUDA (plan kernel
  "triton") kvserve's Triton kernel (kernels/triton_quant_linear.py: int8 codes as they are,
  int4 nibbles input-major, layout "kmajor"), or for int4 layers that torch's tinygemm kernel
  takes where the plan says so (`ApplyPlan.tinygemm`), that kernel (layout "tinygemm",
  `tinygemm.py`);
- `dequant`: rebuild the float weight for each call and run `F.linear` (the fallback, taken
  with a WARNING when the startup probe finds a kernel missing or wrong on this torch).

Codes are symmetric int8 per output channel (scale = max |w| / 127), or asymmetric int4 per
group of `group_size` input columns (w = q x scale + min, q in 0..15; torch's tinygemm kernel
reads the same codes as w = (q - 8) x scale + zero, zero = min + 8 x scale).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from engine.config import INT4_GROUP_SIZES
from engine.quantization import tiles, tinygemm

# Without --quantization-group-size, each layer takes the first of these dividing its input size.
# 32 divides every Llama-family shape and is GGUF's Q4_0/Q4_1 block, so a Q4_1 file's 4-bit
# blocks requantize onto the same grid; coarser groups cost quality on small models (README).
DEFAULT_INT4_GROUP_SIZES = (32,)
# Rows of the int4 kernel's packed layout come in tiles of this many output channels.
INT4_ROW_TILE = 16
# Above this many rows a CUDA layer dequantizes and runs cuBLAS instead of the Triton kernel
# (prefill: compute-bound, where the weight's one extra pass costs less than the kernel's
# per-tile dequantization). Set from an H200 run with torch ops dequantizing (docs/gpu_check.md:
# an 8B layer's int4 linears at 256 rows 3.9 ms fused vs 5.1, at 1,024 rows 12.0 vs 5.5); int4's
# dequantizing kernel came after it and is not timed yet, so the crossover may sit lower.
TRITON_MAX_FUSED_ROWS = 256


@dataclass(frozen=True)
class ApplyPlan:
    """How a method computes: `mode` and the activations' dtype. Modes: `fused` (every layer
    whose shape a fused kernel takes runs it), `tiled` (only the layers in kvserve's tiled
    layout run fused, the rest dequantize) and `dequant` (every layer dequantizes)."""

    mode: str
    compute_dtype: torch.dtype
    # Whose fused kernels: "cpu" (kvserve's C++ tiles, else torch's CPU kernels) or "triton"
    # (kernels/triton_quant_linear.py on CUDA; the interpreter where TRITON_INTERPRET=1).
    kernel: str = "cpu"
    # On "triton": int4 layers that torch's tinygemm takes (bfloat16) use it instead
    # (tinygemm.py; set where its check passed on the device).
    tinygemm: bool = False

    @property
    def fuses(self) -> bool:
        """Whether any layer may run a fused kernel (`fused` or `tiled`)."""
        return self.mode != "dequant"


class LinearMethod(ABC):
    """One weight format: how it is made from a float weight, applied and dequantized."""

    name: str = ""
    # Above this many rows a fused layer dequantizes instead: torch's CPU kernels cost each row
    # a full pass over the weight, so past the crossover a dequantize + float matmul is faster.
    max_fused_rows: int | None = None

    def __init__(self, plan: ApplyPlan) -> None:
        self.plan = plan

    @abstractmethod
    def create_weights(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors a layer keeps for float `weight` [out, in] (float32 recommended)."""

    @abstractmethod
    def dequantize(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float weight [out, in] the tensors stand for, in the compute dtype."""

    @abstractmethod
    def fused_matmul(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [rows, in] (compute dtype, contiguous) @ W^T through torch's quantized kernel."""

    def supports_fused(self, out_features: int, in_features: int) -> bool:
        """Whether the fused kernel takes this shape (else the layer dequantizes)."""
        return True

    def matmul_weight(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float weight a dequantizing call multiplies by: `dequantize`'s, unless a kernel
        builds the same values faster (int4's input-major codes on the Triton path)."""
        return self.dequantize(tensors)

    def uses_tiles(self, out_features: int, in_features: int) -> bool:
        """Whether a layer of this shape keeps kvserve's tiled layout (fused on CPU, the C++
        kernels built with AVX512-VNNI, the shape tiles)."""
        return (self.plan.mode in ("fused", "tiled") and self.plan.kernel == "cpu"
                and tiles.tile_ops() is not None
                and tiles.tiles_fit(out_features, in_features))

    def runs_fused(self, out_features: int, in_features: int) -> bool:
        """Whether a layer of this shape runs a fused kernel under the plan."""
        if self.plan.mode == "tiled":
            return self.uses_tiles(out_features, in_features)
        return self.plan.mode == "fused" and self.supports_fused(out_features, in_features)

    def scale_dtype(self) -> torch.dtype:
        """The dtype int4 keeps its group scales and offsets in (torch's kernel layout aside,
        which takes the compute dtype): the compute dtype when it is 16-bit, else float16. A
        GGUF block's and an AWQ/GPTQ group's scale are float16 already, so they stay exact; a
        scale made at load rounds by 2^-11 of itself, far inside a 4-bit step; and they take
        half the bytes of float32 ones (SmolLM2's int4 layers: 0.625 instead of 0.75 bytes a
        weight)."""
        dtype = self.plan.compute_dtype
        return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float16

    def fused_rows_limit(self, tensors: dict[str, torch.Tensor]) -> int | None:
        """`max_fused_rows` for a layer's tensors: the tiled kernels win at every row count
        (at 64 rows SmolLM2's int4 layers take 29 ms tiled vs 81 ms in torch's kernel); the
        Triton kernel's limit is TRITON_MAX_FUSED_ROWS."""
        if "layout_tiles" in tensors:
            return None
        if "layout_tinygemm" in tensors:
            return tinygemm.MAX_ROWS
        if self.plan.kernel == "triton":
            return TRITON_MAX_FUSED_ROWS
        return self.max_fused_rows

    def apply(self, x: torch.Tensor, tensors: dict[str, torch.Tensor],
              bias: torch.Tensor | None, fused: bool) -> torch.Tensor:
        """y = x W^T + b in x's dtype; x is [rows, in], computed in the plan's dtype."""
        dtype = x.dtype
        if fused and "layout_tiles" in tensors:
            # kvserve's tile kernels take float32, bfloat16 or float16 activations as they are
            # (quantizing them to int8 per block) and return their dtype: no cast either way,
            # so a float32 model keeps float32 activations and the C++ layer can run it.
            y = self.fused_matmul(x.contiguous(), tensors)
            return y if bias is None else y + bias
        x = x.to(self.plan.compute_dtype)
        limit = self.fused_rows_limit(tensors)
        if fused and (limit is None or x.shape[0] <= limit):
            y = self.fused_matmul(x.contiguous(), tensors)
        else:
            y = F.linear(x, self.matmul_weight(tensors))
        y = y.to(dtype)
        return y if bias is None else y + bias


class Int8Method(LinearMethod):
    """Symmetric int8 per output channel: w = q x scale, q in -127..127."""

    name = "int8"
    # Measured on SmolLM2's decoder shapes, bf16, 2 threads: the fused kernel wins up to 16
    # rows (gate_up 0.05 vs 0.40 ms at 1 row), the dequantized matmul from 32 (0.93 vs 1.52 ms
    # at 64 rows). The LM head (49152 rows) stays fused at every row count (see the factory).
    max_fused_rows: int | None = 24

    def create_weights(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        out: dict[str, torch.Tensor] = {"scales": scales.to(self.plan.compute_dtype)}
        if self.uses_tiles(*codes.shape):
            out.update(qweight=tiles.pack_int8(codes), layout_tiles=torch.empty(0))
        else:
            out["qweight"] = codes.contiguous()
        return out

    def codes(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The int8 codes [out, in], from either layout."""
        if "layout_tiles" in tensors:
            return tiles.unpack_int8(tensors["qweight"])
        return tensors["qweight"]

    def dequantize(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        scales = tensors["scales"]
        return self.codes(tensors).to(scales.dtype) * scales[:, None]

    def fused_matmul(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if "layout_tiles" in tensors:
            return torch.ops.kvserve_cpu.q8_linear(x, tensors["qweight"], tensors["scales"])
        if self.plan.kernel == "triton":
            return triton_linear(x, tensors["qweight"], tensors["scales"], 8)
        return torch.ops.aten._weight_int8pack_mm(x, tensors["qweight"], tensors["scales"])


class Int4Method(LinearMethod):
    """Asymmetric int4 per group of `group_size` input columns, two codes per byte."""

    name = "int4"

    def __init__(self, plan: ApplyPlan, group_size: int | None) -> None:
        super().__init__(plan)
        self.group_size = group_size

    def layer_group_size(self, in_features: int) -> int:
        """The group size for a layer `in_features` wide (ValueError when none fits)."""
        if self.group_size is not None:
            if in_features % self.group_size:
                raise ValueError(
                    f"--quantization-group-size {self.group_size} does not divide a layer's "
                    f"input size {in_features}; use one of "
                    f"{[g for g in INT4_GROUP_SIZES if in_features % g == 0] or 'none'}")
            return self.group_size
        for size in DEFAULT_INT4_GROUP_SIZES:
            if in_features % size == 0:
                return size
        raise ValueError(f"int4 needs input sizes divisible by {DEFAULT_INT4_GROUP_SIZES[-1]}; a "
                         f"layer has {in_features}")

    def supports_fused(self, out_features: int, in_features: int) -> bool:
        group = self.group_size or DEFAULT_INT4_GROUP_SIZES[0]
        return ((self.plan.kernel == "triton" or out_features % INT4_ROW_TILE == 0)
                and group in INT4_GROUP_SIZES)

    def create_weights(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        out_features, in_features = weight.shape
        group = self.layer_group_size(in_features)
        w = weight.float().reshape(out_features, in_features // group, group)
        low, high = w.amin(dim=-1), w.amax(dim=-1)  # [out, groups]
        scales = ((high - low) / 15.0).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 15)
        codes = codes.reshape(out_features, in_features).to(torch.int32)
        return self.weights_from_codes(codes, scales, low + 8.0 * scales)

    def weights_from_codes(self, codes: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor, scale_dtype: torch.dtype | None = None
                           ) -> dict[str, torch.Tensor]:
        """The layer's tensors for codes [out, in] in 0..15 and per-group scales and tinygemm
        zeros [out, groups]: w = (q - 8) x scale + zero. (A checkpoint's integer zero point z,
        w = (q - z) x scale, is the tinygemm zero (8 - z) x scale.) `scale_dtype` overrides
        `scale_dtype()` for the tiles (float16: a checkpoint's float16 scales stay exact)."""
        out_features, in_features = codes.shape
        if self.uses_tiles(out_features, in_features):
            mins = zeros.float() - 8.0 * scales.float()
            qweight, scale_mins = tiles.pack_int4(codes, scales.float(), mins,
                                                  scale_dtype or self.scale_dtype())
            return {"qweight": qweight, "scale_mins": scale_mins,
                    "layout_tiles": torch.empty(0, dtype=torch.uint8)}
        # [groups, out, 2]: the layout `_weight_int4pack_mm_for_cpu` reads.
        scale_zeros = torch.stack((scales.float(), zeros.float()), dim=-1).transpose(0, 1)
        fused = self.plan.mode == "fused" and self.supports_fused(out_features, in_features)
        group = in_features // scales.shape[1]
        if fused and self.plan.tinygemm and tinygemm.fits(out_features, in_features, group,
                                                          self.plan.compute_dtype):
            return {"qweight": tinygemm.pack(codes),
                    "scale_zeros": scale_zeros.contiguous().to(self.plan.compute_dtype),
                    "layout_tinygemm": torch.empty(0, dtype=torch.uint8)}
        if fused and self.plan.kernel == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
            layout = "kernel"
        else:
            packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
            layout = "nibbles"
            if fused:  # the Triton kernel reads them input-major: [in/2, out]
                packed, layout = packed.t(), "kmajor"
        return {"qweight": packed.contiguous(),
                "scale_zeros": scale_zeros.contiguous().to(
                    self.plan.compute_dtype if layout == "kernel" else self.scale_dtype()),
                f"layout_{layout}": torch.empty(0, dtype=torch.uint8)}

    def unpack_codes(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The int4 codes [out, in] as int32, from any layout."""
        packed = tensors["qweight"]
        if "layout_tiles" in tensors:
            return tiles.unpack_int4(packed, tensors["scale_mins"])[0]
        if "layout_tinygemm" in tensors:
            return tinygemm.unpack(packed)
        if "layout_nibbles" in tensors or "layout_kmajor" in tensors:
            if "layout_kmajor" in tensors:
                packed = packed.t()
            low, high = packed & 0xF, packed >> 4
            return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1).to(torch.int32)
        # The kernel layout is opaque: multiply the identity through it to read codes back.
        out_features, in_features = packed.shape[0], packed.shape[1] * 2
        group = in_features // tensors["scale_zeros"].shape[0]
        eye = torch.eye(in_features, dtype=torch.float32)
        ones = torch.ones(in_features // group, out_features, 2, dtype=torch.float32)
        ones[..., 1] = 0.0  # scale 1, zero 0: the kernel yields q - 8
        q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, group, ones)
        return (q.t() + 8).round().to(torch.int32)

    def dequantize(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if "layout_tiles" in tensors:
            codes, scales, mins = tiles.unpack_int4(tensors["qweight"], tensors["scale_mins"])
            out_features, in_features = codes.shape
            grouped = codes.reshape(out_features, scales.shape[1], -1).float()
            w = grouped * scales.float()[..., None] + mins.float()[..., None]
            return w.reshape(out_features, in_features).to(self.plan.compute_dtype)
        scale_zeros = tensors["scale_zeros"]
        codes = self.unpack_codes(tensors)  # [out, in]
        groups = scale_zeros.shape[0]
        out_features, in_features = codes.shape
        scales = scale_zeros[..., 0].t().float()[..., None]  # [out, groups, 1]
        zeros = scale_zeros[..., 1].t().float()[..., None]
        w = (codes.reshape(out_features, groups, -1).float() - 8.0) * scales + zeros
        return w.reshape(out_features, in_features).to(self.plan.compute_dtype)

    def matmul_weight(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if "layout_kmajor" in tensors:
            from kernels.triton_quant_linear import dequantize_int4

            qweight, scale_zeros = tensors["qweight"], tensors["scale_zeros"]
            group = 2 * qweight.shape[0] // scale_zeros.shape[0]
            return dequantize_int4(qweight, scale_zeros, group, self.plan.compute_dtype).t()
        if "layout_tinygemm" in tensors:
            from kernels.triton_quant_linear import dequantize_tinygemm

            qweight, scale_zeros = tensors["qweight"], tensors["scale_zeros"]
            group = 32 * qweight.shape[1] * qweight.shape[3] // scale_zeros.shape[0]
            return dequantize_tinygemm(qweight, scale_zeros, group, self.plan.compute_dtype).t()
        return self.dequantize(tensors)

    def fused_matmul(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if "layout_tiles" in tensors:
            return torch.ops.kvserve_cpu.q4_linear(x, tensors["qweight"], tensors["scale_mins"])
        scale_zeros = tensors["scale_zeros"]
        group = x.shape[1] // scale_zeros.shape[0]
        if "layout_kmajor" in tensors:  # the Triton kernel reads the nibbles in place
            return triton_linear(x, tensors["qweight"], scale_zeros, 4, group)
        if "layout_tinygemm" in tensors:
            return tinygemm.matmul(x, tensors["qweight"], group, scale_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, tensors["qweight"], group,
                                                          scale_zeros)


def triton_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int,
                  group: int = 0) -> torch.Tensor:
    """The Triton kernel's product (imported here: CPU installs need no triton)."""
    from kernels.triton_quant_linear import quant_linear

    return quant_linear(x, qweight, scales, bits, group)


class QuantizedLinear(nn.Module):
    """A linear layer whose weight lives in a LinearMethod's format (buffers, not parameters)."""

    def __init__(self, linear: nn.Linear, method: LinearMethod,
                 tensors: dict[str, torch.Tensor] | None = None,
                 device: torch.device | None = None) -> None:
        """`tensors`: the method's tensors when they come ready-made (a quantized checkpoint's
        codes); else they are made from the float weight. `device`: where the layer lives
        (default: the float weight's device); a float weight in host memory is quantized
        there, one layer's worth of floats at a time (a CUDA model loaded on the host first)."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.method = method
        self.fused = method.runs_fused(self.out_features, self.in_features)
        self._names: list[str] = []
        device = device or linear.weight.device
        if tensors is None:
            tensors = method.create_weights(linear.weight.detach().to(device))
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor.to(device))
            self._names.append(name)
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if linear.bias is None else
                             linear.bias.detach().to(device, method.plan.compute_dtype))

    @property
    def activation_dtype(self) -> torch.dtype | None:
        """The dtype the activations are multiplied in: None for kvserve's tile kernels, which
        take them in the model's dtype (see LinearMethod.apply), else the plan's."""
        return None if self.fused and "layout_tiles" in self._names \
            else self.method.plan.compute_dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        """The method's tensors by name."""
        return {name: getattr(self, name) for name in self._names}

    def dequantized_weight(self) -> torch.Tensor:
        """The float weight [out, in] these codes stand for."""
        return self.method.dequantize(self.tensors())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in_features] -> [rows, out_features]."""
        return self.method.apply(x, self.tensors(), self.bias, self.fused)

    def extra_repr(self) -> str:
        mode = "fused" if self.fused else "dequant"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"method={self.method.name}, mode={mode}, "
                f"compute_dtype={self.method.plan.compute_dtype}")
