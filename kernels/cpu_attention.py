"""The CPU attention backend over kvserve's C++ ops (kernels/cpu_ops.py).

Every row reads K/V in place through the block table: a batch of decodes (one query token per
sequence) through `decode_attention`, a mixed batch (prefill chunks beside decodes) through
`varlen_attention`, whose tiles of query tokens walk their context's blocks with an online
softmax; this step's K/V go into the cache with one `write_kv` call. (Prefill chunks used to
gather their whole context out of the blocks and run SDPA: deep into a long prompt the copy
cost more than the attention.)
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.metadata import AttentionMetadata


class CpuAttentionBackend:
    """AttentionBackend for CPU tensors with the C++ ops loaded."""

    supports_cuda_graphs = False
    # A prefill chunk's query rows (its tokens x the query heads of a KV head) fill the varlen
    # kernel's vectors this many at a time (varlen_tiles.h, kLanes): the adaptive step budget
    # sizes short chunks to whole tiles.
    query_rows_per_tile = 16

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: AttentionMetadata,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Writes this step's K/V [tokens, kv_heads, head_dim] into their slots."""
        self.ops.write_kv(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)

    def attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
        """query [tokens, heads, head_dim] -> attention output of the same shape."""
        window = meta.sliding_window or 0
        out = torch.empty_like(query)
        if meta.num_seqs == query.shape[0]:  # every row decodes: the batch is in row order
            self.ops.decode_attention(out, query, k_cache, v_cache, meta.block_tables,
                                      meta.seq_lens, scale * k_scale, window, v_scale)
            return out
        self.ops.varlen_attention(out, query, k_cache, v_cache, meta.block_tables,
                                  meta.seq_lens, meta.query_start_loc, scale * k_scale, window,
                                  v_scale)
        return out
