"""Tiny AWQ and GPTQ checkpoints written from known 4-bit codes, and the float checkpoint those
codes stand for (the independent reference). Written here from the formats' published layouts,
not with the engine's code:

- AWQ gemm: qweight int32 [in, out/8], nibble k of word j = column 8j + (0,2,4,6,1,3,5,7)[k];
  qzeros [groups, out/8] packed alike; scales fp16 [groups, out]; w = (q - z) * s.
- GPTQ: qweight int32 [in/8, out], nibble k of word r = input row 8r + k; qzeros [groups, out/8]
  packed in order, storing z - 1 (format "gptq") or z ("gptq_v2"); scales fp16 [groups, out];
  g_idx int32 [in], each input row's group.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_words(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[rows, cols] codes 0..15 -> int32 [rows, cols / 8]; word j nibble k = col 8j + order[k]."""
    rows, cols = codes.shape
    grouped = codes.long().reshape(rows, cols // 8, 8)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for k, col in enumerate(order):
        words |= grouped[:, :, col] << (4 * k)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the int32 bit pattern
    return words.to(torch.int32)


def rtn_codes(weight: torch.Tensor, group_rows: torch.Tensor, groups: int, sym: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit codes of weight [out, in] with input row i in group
    group_rows[i]: codes [out, in], fp16 scales and integer zeros [out, groups]."""
    out_features = weight.shape[0]
    scales = torch.empty(out_features, groups)
    zeros = torch.empty(out_features, groups)
    for g in range(groups):
        cols = weight[:, group_rows == g]
        low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            scales[:, g] = torch.maximum(-low, high) / 7.5
            zeros[:, g] = 8
        else:
            scales[:, g] = (high - low) / 15
            zeros[:, g] = (-low / scales[:, g]).round()
    scales = scales.clamp(min=1e-4).half().float()
    codes = (weight / scales[:, group_rows] + zeros[:, group_rows]).round().clamp(0, 15)
    return codes.to(torch.int32), scales, zeros


def write_quantized(src: Path, dst: Path, method: str, group: int = 32, *, sym: bool = False,
                    act_order: bool = False, v2: bool = False, seed: int = 0
                    ) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """`dst`/quant (the AWQ or GPTQ checkpoint) and `dst`/reference (float32 weights equal to
    what the codes stand for), both from `src`'s float checkpoint; and each layer's codes
    [out, in] by module name."""
    quant_dir, ref_dir = dst / "quant", dst / "reference"
    for folder in (quant_dir, ref_dir):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    quant: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    all_codes: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS):
            quant[name] = reference[name] = tensor
            continue
        in_features = tensor.shape[1]
        groups = in_features // group
        group_rows = torch.arange(in_features) // group
        if act_order:
            group_rows = group_rows[torch.randperm(in_features, generator=generator)]
        codes, scales, zeros = rtn_codes(tensor.float(), group_rows, groups, sym)
        all_codes[module] = codes
        reference[name] = ((codes - zeros[:, group_rows]) * scales[:, group_rows]).float()
        quant[f"{module}.scales"] = scales.t().half().contiguous()
        if method == "awq":
            quant[f"{module}.qweight"] = pack_words(codes.t().contiguous(), AWQ_ORDER)
            quant[f"{module}.qzeros"] = pack_words(zeros.t().to(torch.int32), AWQ_ORDER)
        else:
            stored = zeros if v2 else (zeros - 1) % 16
            quant[f"{module}.qweight"] = pack_words(codes.contiguous()).t().contiguous()
            quant[f"{module}.qzeros"] = pack_words(stored.t().to(torch.int32))
            quant[f"{module}.g_idx"] = group_rows.to(torch.int32)
    save_file(quant, str(quant_dir / "model.safetensors"))
    save_file(reference, str(ref_dir / "model.safetensors"))
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
         "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    (quant_dir / "config.json").write_text(json.dumps(config, indent=2))
    return quant_dir, ref_dir, all_codes
