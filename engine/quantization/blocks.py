"""Weight formats of codes per block of 32 inputs with a float16 scale and min each,
w = q x scale + min: 5-bit codes (q in 0..31) and 8-bit ones (q in 0..255). A GGUF file's Q5_0,
Q5_1 and Q5_K blocks keep their codes exactly as 5-bit ones, its Q8_0 blocks (w = d c, c signed:
q = c + 128, min -128 d) as 8-bit ones (engine/model_loader/gguf/codes.py). The fused kernels are
kvserve's tiled `u5_linear` and `u8_linear` (torch has none for them); elsewhere each call
dequantizes. Made from a float weight (the startup probe, the tests) they are Q5_1 and Q8_0."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.quantization import tiles
from engine.quantization.methods import LinearMethod

Layout = tuple[torch.Tensor, torch.Tensor]


class CodeBlockMethod(LinearMethod):
    """Codes of `bits` bits per block of 32 inputs with a float16 scale and min."""

    bits = 8
    group_size = 32

    @classmethod
    def pack(cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
             dtype: torch.dtype) -> Layout:
        """tiles.pack_u5 or pack_u8."""
        packer: Callable[..., Layout] = getattr(tiles, f"pack_u{cls.bits}")
        return packer(codes, scales, mins, dtype)

    @classmethod
    def unpack(cls, qweight: torch.Tensor, scale_mins: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tiles.unpack_u5 or unpack_u8."""
        unpacker: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = \
            getattr(tiles, f"unpack_u{cls.bits}")
        return unpacker(qweight, scale_mins)

    def supports_fused(self, out_features: int, in_features: int) -> bool:
        return self.uses_tiles(out_features, in_features)

    def _grouped(self, weight: torch.Tensor) -> torch.Tensor:
        out_features, in_features = weight.shape
        if in_features % self.group_size:
            raise ValueError(f"{self.bits}-bit blocks need input sizes divisible by "
                             f"{self.group_size}; a layer has {in_features}")
        return weight.float().reshape(out_features, -1, self.group_size)

    def weights_from_codes(self, codes: torch.Tensor, scales: torch.Tensor,
                           mins: torch.Tensor) -> dict[str, torch.Tensor]:
        """The layer's tensors for codes [out, in] and scales and mins [out, groups of 32]
        (w = q x scale + min), kept in float16."""
        out_features, in_features = codes.shape
        if self.uses_tiles(out_features, in_features):
            qweight, scale_mins = self.pack(codes, scales.float(), mins.float(), torch.float16)
            return {"qweight": qweight, "scale_mins": scale_mins,
                    "layout_tiles": torch.empty(0, dtype=torch.uint8)}
        return {"qweight": codes.to(torch.uint8).contiguous(),
                "scale_mins": torch.stack((scales, mins)).half().contiguous()}

    def dequantize(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        if "layout_tiles" in tensors:
            codes, scales, mins = self.unpack(tensors["qweight"], tensors["scale_mins"])
        else:
            codes = tensors["qweight"]
            scales, mins = tensors["scale_mins"]
        out_features, in_features = codes.shape
        grouped = codes.reshape(out_features, scales.shape[1], -1).float()
        w = grouped * scales.float()[..., None] + mins.float()[..., None]
        return w.reshape(out_features, in_features).to(self.plan.compute_dtype)

    def fused_matmul(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        kernel = getattr(torch.ops.kvserve_cpu, f"u{self.bits}_linear")
        return kernel(x, tensors["qweight"], tensors["scale_mins"])


class U5BlockMethod(CodeBlockMethod):
    """5-bit codes; from a float weight, Q5_1: scale (max - min) / 31 and the min per block."""

    name = "u5"
    bits = 5

    def create_weights(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = self._grouped(weight)
        low = w.amin(dim=-1).half().float()
        scales = ((w.amax(dim=-1) - low) / 31.0).half().float().clamp(
            min=float(torch.finfo(torch.float16).tiny))
        codes = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 31)
        return self.weights_from_codes(codes.reshape(weight.shape).to(torch.int32), scales, low)


class U8BlockMethod(CodeBlockMethod):
    """8-bit codes; from a float weight, Q8_0: symmetric, scale max |w| / 127 per block."""

    name = "u8"
    bits = 8

    def create_weights(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = self._grouped(weight)
        scales = (w.abs().amax(dim=-1) / 127.0).half().float().clamp(
            min=float(torch.finfo(torch.float16).tiny))
        codes = (w / scales[..., None]).round().clamp(-127, 127) + 128
        return self.weights_from_codes(codes.reshape(weight.shape).to(torch.int32), scales,
                                       -128.0 * scales)


BLOCK_METHODS: dict[int, type[CodeBlockMethod]] = {5: U5BlockMethod, 8: U8BlockMethod}
