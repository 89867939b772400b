"""A GGUF file's 4-bit blocks as int4 codes, for `--quantization gguf` (the in-place default).

Q4_0 and Q4_1 blocks are 32 weights of one row: an fp16 scale d (and for Q4_1 an fp16 min m)
and 16 bytes of nibbles q (items 0-15 in the low nibbles, 16-31 in the high). Their values,
d (q - 8) and d q + m, are exactly the int4 method's (q - 8) x scale + offset with group 32,
scale d and offset 0 or 8 d + m: the layer keeps the file's codes, and nothing is rounded
again. Other types (Q8_0, F16, K-quants) are not 4-bit blocks of 32 and load as floats.
"""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.quantization.checkpoint import LayerCodes

Q4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
GGUF_GROUP = 32


def q4_layer_codes(raw: torch.Tensor, kind: GGMLQuantizationType,
                   shape: tuple[int, ...]) -> LayerCodes | None:
    """The codes of a Q4_0/Q4_1 matrix of numpy shape [out, in]; None for other types."""
    if kind not in Q4_TYPES or len(shape) != 2:
        return None
    out_features, in_features = shape
    _, type_size = GGML_QUANT_SIZES[kind]
    blocks = raw.view(-1, type_size)  # [out x in / 32, type_size], row-major blocks
    packed = blocks[:, type_size - 16:]
    codes = torch.cat((packed & 0x0F, packed >> 4), dim=1).to(torch.int32)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()[:, 0]
    if kind == GGMLQuantizationType.Q4_1:
        offsets = 8.0 * d + blocks[:, 2:4].contiguous().view(torch.float16).float()[:, 0]
    else:
        offsets = torch.zeros_like(d)
    groups = in_features // GGUF_GROUP
    return LayerCodes(codes.reshape(out_features, in_features),
                      d.reshape(out_features, groups), offsets.reshape(out_features, groups))
