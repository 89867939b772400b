"""What every attention kernel shares: the per-step batch layout (`AttentionMetadata`), the
backend interface a model layer calls, and the fp8 KV element types. No kernel code lives here,
so the torch twins, the Triton kernels and the selector all import it and never each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """One step's batch layout, built once by the model runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 marks padding that writes nowhere
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 (cu_seqlens_q)
    seq_lens: torch.Tensor  # [num_seqs] int32: cached prefix + this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_size: int
    sliding_window: int | None = None
    _torch_plan: TorchPlan | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return len(self.query_lens_list)


@dataclass
class TorchPlan:
    """Index tensors for the torch path, derived once per step from the metadata."""

    decode_rows: torch.Tensor  # [num_decodes] token index of each decode
    decode_block_tables: torch.Tensor  # [num_decodes, num_blocks_needed]
    decode_visible: torch.Tensor  # [num_decodes, 1, 1, num_blocks_needed * block_size]
    # (start, end, slots, visibility mask or None for plain causal)
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]


class AttentionBackend(Protocol):
    """The two ops a model layer needs; the torch and Triton backends share this shape.

    `k_scale` / `v_scale` are the per-layer dequantization scales of an fp8 KV cache (stored =
    value / scale); they are 1.0 and unused when the cache has the model's dtype.
    """

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: AttentionMetadata,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None: ...

    def attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor: ...


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether a KV cache tensor stores fp8."""
    return cache.dtype in FP8_DTYPES


# The signatures every kernel module's two ops share (the torch twins define them).
CacheOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float,
                    float], None]
AttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float,
                        float, float], torch.Tensor]


class OpsBackend:
    """An AttentionBackend over one kernel module's `reshape_and_cache` and
    `unified_attention`."""

    supports_cuda_graphs = False

    def __init__(self, cache_op: CacheOp, attention_op: AttentionOp) -> None:
        self._cache_op = cache_op
        self._attention_op = attention_op

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: AttentionMetadata,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Writes this step's K/V into the cache."""
        self._cache_op(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)

    def attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
        """Attention over the cache for the mixed batch."""
        return self._attention_op(query, k_cache, v_cache, meta, scale, k_scale, v_scale)
