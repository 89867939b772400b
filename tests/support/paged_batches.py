"""Random paged-attention batches for the kernel tests: metadata whose sequences own random
distinct physical blocks, and random KV caches."""

from __future__ import annotations

import torch

from kernels import torch_attention as torch_ops
from kernels.metadata import AttentionMetadata


def make_meta(query_lens: list[int], context_lens: list[int], num_blocks: int,
              window: int | None = None, block_size: int = 16,
              device: torch.device | str = "cpu") -> AttentionMetadata:
    """A batch whose sequences own random distinct physical blocks; slots for the new tokens."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    free = torch.randperm(num_blocks).tolist()
    tables = []
    for n in blocks_needed:
        tables.append(free[:n] + [0] * (max(blocks_needed) - n))
        free = free[n:]
    block_tables = torch.tensor(tables, dtype=torch.int32)  # [num_seqs, max_blocks]
    slots = [tables[i][p // block_size] * block_size + p % block_size
             for i, (c, s) in enumerate(zip(context_lens, seq_lens, strict=True))
             for p in range(c, s)]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device), query_lens_list=query_lens,
        seq_lens_list=seq_lens, block_size=block_size, sliding_window=window)


def random_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, scale: float, device: torch.device | str = "cpu"
                 ) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, head_dim] of random values, stored as value / scale."""
    values = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device)
    return torch_ops.quantize_kv(values, scale, dtype)
