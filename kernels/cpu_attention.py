"""The CPU attention backend over kvserve's C++ ops (kernels/cpu_ops.py).

Decode rows (one query token) read K/V in place through the block table (`decode_attention`),
and this step's K/V go into the cache with one `write_kv` call. Prefill chunks keep the torch
twin's path (gather the chunk's context, SDPA): there the gather is small beside the attention
matmuls that SDPA runs blocked.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import torch_attention
from kernels.metadata import AttentionMetadata, TorchPlan


class CpuAttentionBackend:
    """AttentionBackend for CPU tensors with the C++ ops loaded."""

    supports_cuda_graphs = False

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
        if meta.num_seqs == query.shape[0]:  # every row decodes: the batch is in row order
            out = torch.empty_like(query)
            self.ops.decode_attention(out, query, k_cache, v_cache, meta.block_tables,
                                      meta.seq_lens, scale * k_scale, window, v_scale)
            return out
        plan = meta._torch_plan or _prefill_plan(meta, query.device)
        meta._torch_plan = plan
        out = torch.empty_like(query)
        if plan.decode_rows.numel():
            rows = plan.decode_rows
            decoded = torch.empty((rows.numel(),) + query.shape[1:], dtype=query.dtype)
            self.ops.decode_attention(decoded, query.index_select(0, rows), k_cache, v_cache,
                                      plan.decode_block_tables, plan.decode_visible, scale *
                                      k_scale, window, v_scale)
            out.index_copy_(0, rows, decoded)
        for start, end, slots, mask in plan.prefills:
            chunk = torch_attention.prefill_chunk(query[start:end], k_cache, v_cache, slots,
                                                  mask, scale * k_scale)
            out[start:end] = chunk if v_scale == 1.0 else chunk.mul_(v_scale)
        return out


def _prefill_plan(meta: AttentionMetadata, device: torch.device) -> TorchPlan:
    """The torch twin's plan for the prefill chunks; for the decode rows, their block-table rows
    and context lengths (int32, in `decode_block_tables` / `decode_visible`)."""
    starts = meta.query_start_loc.tolist()
    prefills = [torch_attention.prefill_entry(meta, i, starts[i], device)
                for i, n in enumerate(meta.query_lens_list) if n > 1]
    seqs = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
    rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=device)
    index = torch.tensor(seqs, dtype=torch.long, device=device)
    tables = meta.block_tables.index_select(0, index).contiguous()
    lens = meta.seq_lens.index_select(0, index).contiguous()
    return TorchPlan(rows, tables, lens, prefills)
