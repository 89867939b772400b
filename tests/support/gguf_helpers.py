"""Synthetic GGUF files shared by test_gguf.py and test_gguf_format.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray],
               extra: dict[str, Any] | None = None,
               raw_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
               ) -> Path:
    """A tiny GGUF: 2 layers, hidden 16, 2 heads of 8, 1 KV head, and any extra typed keys.

    `raw_tensors` are already quantized (gguf.quants.quantize output) and stored as they are.
    """
    writer = GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_token_list([f"t{i}" for i in range(11)])
    for key, value in (extra or {}).items():
        getattr(writer, key)(value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    for name, (stored, kind) in (raw_tensors or {}).items():
        writer.add_tensor(name, stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_layer_tensors(with_bias: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (16, 16), "attn_k": (8, 16), "attn_v": (8, 16), "attn_output": (16, 16)}
    tensors = {"token_embd.weight": rng.standard_normal((11, 16), dtype=np.float32)}
    for layer in range(2):
        for kind, shape in shapes.items():
            tensors[f"blk.{layer}.{kind}.weight"] = rng.standard_normal(shape, dtype=np.float32)
            if with_bias and kind != "attn_output":
                tensors[f"blk.{layer}.{kind}.bias"] = rng.standard_normal(shape[0],
                                                                         dtype=np.float32)
    return tensors
