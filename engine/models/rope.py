"""Rotary position embeddings: default, linear and llama3-style frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.config import ModelConfig


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with the checkpoint's scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; kvserve supports default, "
                     "linear and llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scheme: long wavelengths slowed by `factor`, short ones kept, a smooth ramp
    in between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by each token's position.

    A plain object, not a module: the model is built on the meta device and materialised
    empty, and these tables must keep their values through that.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device) -> None:
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        positions = torch.arange(max_len, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_len, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        self.cos_table = emb.cos().to(device)
        self.sin_table = emb.sin().to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens] positions -> cos, sin of shape [num_tokens, 1, head_dim]."""
        cos = self.cos_table.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_table.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates [num_tokens, heads, head_dim] by the half-split (GPT-NeoX) convention."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
