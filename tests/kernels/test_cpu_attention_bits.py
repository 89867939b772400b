"""The AVX-512 decode attention's bits: the same keys give the same output however the blocks
cut them (attention_avx512.cpp reduces sixteen keys of a block at once, the rest one by one,
with the same additions in the same order)."""

from __future__ import annotations

import pytest
import torch

from tests.support.cpu_ops import require_cpu_ops

OPS = require_cpu_ops()


def paged_copy(rows: list[torch.Tensor], block_size: int
               ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each of `rows` [tokens, kv_heads, dim] as a paged cache of `block_size`, in the same
    shuffled blocks, and the block table row that reads them back in order."""
    tokens = rows[0].shape[0]
    table = torch.randperm(-(-tokens // block_size)).to(torch.int32)
    caches = []
    for r in rows:
        cache = torch.zeros(len(table), block_size, *r.shape[1:], dtype=r.dtype)
        for p in range(tokens):
            cache[table[p // block_size], p % block_size] = r[p]
        caches.append(cache)
    return caches, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [0, 45])
def test_decode_attention_bits_do_not_depend_on_the_block_size(dtype: torch.dtype,
                                                               head_dim: int, window: int) -> None:
    """The AVX-512 kernel reduces sixteen keys of a block at once and the rest one by one, in
    the same order of additions: the same keys in blocks of 8 (one by one) and of 32 (mostly
    in sixteens) give the same bits."""
    torch.manual_seed(head_dim + window)
    context, heads, kv_heads = 150, 9, 3
    keys = torch.randn(context, kv_heads, head_dim).to(dtype)
    values = torch.randn(context, kv_heads, head_dim).to(dtype)
    query = torch.randn(1, heads, head_dim).to(dtype)
    outs = []
    for block_size in (8, 32):
        (k_cache, v_cache), table = paged_copy([keys, values], block_size)
        out = torch.empty(1, heads, head_dim, dtype=dtype)
        OPS.decode_attention(out, query, k_cache, v_cache, table[None],
                             torch.tensor([context], dtype=torch.int32), head_dim ** -0.5,
                             window, 1.0)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
