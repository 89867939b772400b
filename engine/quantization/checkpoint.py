"""AWQ and GPTQ checkpoints: 4-bit codes read from the files, run through the int4 method.

A checkpoint quantized by AutoAWQ or GPTQ tools names its method in config.json's
`quantization_config` and stores, per linear layer, `qweight` (eight 4-bit codes per int32),
`qzeros` (the integer zero points, packed the same way), `scales` ([groups, out], 16-bit) and
for GPTQ `g_idx` (each input row's group). The layouts:

- AWQ ("gemm" version): qweight [in, out / 8], packed along the output dimension in the
  interleaved order 0, 2, 4, 6, 1, 3, 5, 7 (nibble k of word j holds column 8j + ORDER[k]);
  qzeros [groups, out / 8] likewise; w[i, o] = (q - z) x s.
- GPTQ: qweight [in / 8, out], packed along the input dimension in order; qzeros
  [groups, out / 8] packed in order along the output; the classic format ("gptq", version 1)
  stores z - 1, "gptq_v2" stores z; w[i, o] = (q - z) x s[g_idx[i]].

`CheckpointCodes.weights` turns the checkpoint's tensors into float weights for the model's
loader (so fused q/k/v and gate/up rows land where they always do) and keeps each layer's codes;
`layer_codes` then joins a fused layer's codes, from which `quantize_model` builds its int4
tensors exactly: tinygemm's
zero is (8 - z) x s. GPTQ's act-order (`desc_act`, a g_idx that is not contiguous groups) has no
contiguous-group layout: those layers are re-quantized from their float weights, with a WARNING.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("kvserve")

CHECKPOINT_METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class CheckpointQuantization:
    """What config.json's quantization_config says."""

    method: str  # "awq", "gptq", or "gguf" (a GGUF file's quantized blocks)
    group_size: int  # -1: one group over the whole input
    zero_offset: int  # added to the stored zero points (GPTQ v1 stores z - 1)

    @classmethod
    def from_config(cls, cfg: dict[str, Any] | None) -> CheckpointQuantization | None:
        """None for an unquantized config; ValueError for a quantization kvserve cannot run."""
        if not cfg:
            return None
        method = str(cfg.get("quant_method", "")).lower()
        if method not in CHECKPOINT_METHODS:
            raise ValueError(f"checkpoint quantization {method!r} is not supported; kvserve "
                             f"loads {', '.join(CHECKPOINT_METHODS)} (4-bit) checkpoints")
        bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
        if bits != 4:
            raise ValueError(f"{method} checkpoint with {bits}-bit weights: kvserve loads 4-bit "
                             "AWQ and GPTQ checkpoints only")
        group = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
        if method == "awq":
            version = str(cfg.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"AWQ version {version!r} is not supported; kvserve reads the "
                                 "'gemm' layout")
            if not cfg.get("zero_point", True):
                raise ValueError("AWQ checkpoints without zero points are not supported")
            return cls(method, group, 0)
        v1 = str(cfg.get("checkpoint_format", "gptq")).lower() != "gptq_v2"
        return cls(method, group, 1 if v1 else 0)


def read_checkpoint_quantization(folder: Path) -> CheckpointQuantization | None:
    """The quantization an HF folder's config.json names (None when it names none)."""
    path = folder / "config.json"
    if not path.is_file():
        return None
    return CheckpointQuantization.from_config(json.loads(path.read_text())
                                              .get("quantization_config"))


def unpack_rows(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [rows, cols] -> int32 [rows, cols x 8] codes; nibble k goes to column 8j+order[k]."""
    nibbles = (packed[:, :, None] >> SHIFTS) & 0xF  # [rows, cols, 8], nibble k at [.., k]
    out = torch.empty_like(nibbles)
    out[:, :, list(order)] = nibbles
    return out.reshape(packed.shape[0], -1)


@dataclass
class LayerCodes:
    """One quantized layer: codes [out, in] of `bits` bits (4, 5 or 8), and per group
    [out, groups] a scale and an offset: w = (q - center) x scale + offset, the center 8 for
    4-bit codes (tinygemm's offset) and 0 for 5- and 8-bit ones (the offset is then the group's
    min, kept exactly). A checkpoint's integer zero point z gives offset (8 - z) x scale; GGUF's
    Q4_1 (w = d q + m) gives 8 d + m, Q4_0 (d (q - 8)) gives 0, Q8_0 (d c, c signed, stored
    here as q = c + 128) gives -128 d."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    contiguous_groups: bool = True
    bits: int = 4

    @classmethod
    def from_zero_points(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         contiguous_groups: bool = True) -> LayerCodes:
        """Codes with integer zero points z: w = (q - z) x scale."""
        return cls(codes, scales, (8.0 - zeros) * scales, contiguous_groups)

    @property
    def center(self) -> float:
        """The code the offset sits at."""
        return 8.0 if self.bits == 4 else 0.0

    def mins(self) -> torch.Tensor:
        """w at code 0 per group: w = q x scale + min."""
        return self.offsets - self.center * self.scales

    def widened(self, bits: int) -> LayerCodes:
        """The same weights as codes of `bits` >= self.bits (the codes unchanged, the
        offsets moved to 5 and 8 bits' center, 0)."""
        if bits == self.bits:
            return self
        return LayerCodes(self.codes, self.scales, self.mins(), self.contiguous_groups, bits)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] the codes stand for."""
        out_features, in_features = self.codes.shape
        groups = self.scales.shape[1]
        w = (self.codes.reshape(out_features, groups, -1).float() - self.center) * \
            self.scales[..., None] + self.offsets[..., None]
        return w.reshape(out_features, in_features)

    @classmethod
    def concatenated(cls, layers: list[LayerCodes]) -> LayerCodes:
        """The layers' rows stacked (a fused linear), at the widest of their code widths."""
        bits = max(layer.bits for layer in layers)
        layers = [layer.widened(bits) for layer in layers]
        return cls(torch.cat([layer.codes for layer in layers]),
                   torch.cat([layer.scales for layer in layers]),
                   torch.cat([layer.offsets for layer in layers]),
                   all(layer.contiguous_groups for layer in layers), layers[0].bits)


def awq_layer(tensors: dict[str, torch.Tensor], group: int) -> LayerCodes:
    """AWQ gemm tensors -> codes and per-group scales/zeros in [out, ...] layout."""
    codes = unpack_rows(tensors["qweight"].to(torch.int32), AWQ_ORDER).t()  # [out, in]
    zeros = unpack_rows(tensors["qzeros"].to(torch.int32), AWQ_ORDER).t().float()
    scales = tensors["scales"].float().t()  # [out, groups]
    _check_groups(codes.shape[1], scales.shape[1], group)
    return LayerCodes.from_zero_points(codes.contiguous(), scales.contiguous(),
                                       zeros.contiguous())


def gptq_layer(tensors: dict[str, torch.Tensor], group: int, zero_offset: int) -> LayerCodes:
    """GPTQ tensors -> codes and per-group scales/zeros in [out, ...] layout; a g_idx that is
    not contiguous groups (act-order) is expanded to one group per input row."""
    packed = tensors["qweight"].to(torch.int32)  # [in / 8, out], packed along the input
    codes = unpack_rows(packed.t().contiguous()).contiguous()  # [out, in]
    zeros = unpack_rows(tensors["qzeros"].to(torch.int32)).t().float() + zero_offset
    scales = tensors["scales"].float().t()
    in_features, groups = codes.shape[1], scales.shape[1]
    g_idx = tensors.get("g_idx")
    size = in_features // groups
    if g_idx is not None and not torch.equal(g_idx.long(),
                                             torch.arange(in_features) // size):
        rows = g_idx.long()  # act-order: each input row's own group, no contiguous blocks
        return LayerCodes.from_zero_points(codes, scales[:, rows].contiguous(),
                                           zeros[:, rows].contiguous(), contiguous_groups=False)
    _check_groups(in_features, groups, group)
    return LayerCodes.from_zero_points(codes, scales.contiguous(), zeros.contiguous())


def _check_groups(in_features: int, groups: int, group: int) -> None:
    expected = 1 if group == -1 else in_features // group
    if groups != expected:
        raise ValueError(f"quantized layer has {groups} scale groups for {in_features} inputs; "
                         f"group_size {group} means {expected}")


@dataclass
class CheckpointCodes:
    """The codes of every quantized layer of one checkpoint, by HF module name."""

    quant: CheckpointQuantization
    layers: dict[str, LayerCodes] = field(default_factory=dict)

    def weights(self, tensors: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each quantized layer as `<module>.weight` (float32,
        exact), keeping its codes in `self.layers`."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        parts = ("qweight", "qzeros", "scales", "g_idx")
        for name, tensor in tensors:
            module, _, part = name.rpartition(".")
            if part not in parts:
                yield name, tensor
                continue
            entry = pending.setdefault(module, {})
            entry[part] = tensor
            needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if self.quant.method ==
                                                         "gptq" else set())
            if needed <= entry.keys():
                layer = (awq_layer(entry, self.quant.group_size) if self.quant.method == "awq"
                         else gptq_layer(entry, self.quant.group_size, self.quant.zero_offset))
                self.layers[module] = layer
                del pending[module]
                yield f"{module}.weight", layer.dequantize()
        if pending:
            raise ValueError(f"incomplete quantized layers in the checkpoint: "
                             f"{sorted(pending)[:3]} (each needs qweight, qzeros, scales"
                             f"{', g_idx' if self.quant.method == 'gptq' else ''})")

    def layer_codes(self, parts: list[str]) -> LayerCodes | None:
        """The codes of a fused layer made of the checkpoint modules `parts` (in row order);
        None when a part is act-order (re-quantize instead)."""
        codes = LayerCodes.concatenated([self.layers[p] for p in parts])
        return codes if codes.contiguous_groups else None
