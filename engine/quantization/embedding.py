"""The embedding a tied int8 LM head shares its codes with."""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization.methods import Int8Method, QuantizedLinear


class Int8Embedding(nn.Module):
    """An embedding table read from an int8 per-row layer's codes and scales.

    With tied embeddings the LM head's int8 codes are one row per vocabulary entry, so the
    lookup shares them instead of keeping a float copy.
    """

    def __init__(self, head: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if not isinstance(head.method, Int8Method):
            raise TypeError("Int8Embedding reads an int8 layer's codes")
        self.head = [head]  # a list, so the head is not registered twice as a submodule
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids -> [num_tokens, hidden] in the model dtype."""
        head = self.head[0]
        tensors = head.tensors()
        if "layout_tiles" in tensors:  # the tiles exist where the CPU ops are loaded
            # one op instead of ~10 torch calls (0.12 ms of a 4.4 ms batch-1 token)
            return torch.ops.kvserve_cpu.q8_embedding(input_ids, tensors["qweight"],
                                                      tensors["scales"], self.dtype)
        codes = tensors["qweight"].index_select(0, input_ids)
        scales = tensors["scales"].index_select(0, input_ids)
        return (codes.to(torch.float32) * scales.float()[:, None]).to(self.dtype)
