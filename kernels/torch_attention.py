"""Paged attention ops over a flat variable-length batch, torch implementation.

The torch versions here are the CPU path and the oracle the Triton kernels are tested against.
KV cache layout per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads,
head_dim]. A batch mixes prefill chunks (q_len > 1, attending causally over a cached prefix)
and decodes (q_len == 1); both read their keys through the block table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import FP8_DTYPES, AttentionMetadata, OpsBackend, TorchPlan, is_fp8


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in the cache dtype; fp8 saturates at its largest finite value instead of
    turning out-of-range values into NaN."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes key/value [num_tokens, kv_heads, head_dim] into their slots; slot -1 is skipped.
    An fp8 cache stores value / scale."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    _write_rows(k_cache, slot_mapping, quantize_kv(key, k_scale, k_cache.dtype))
    _write_rows(v_cache, slot_mapping, quantize_kv(value, v_scale, v_cache.dtype))


def _write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    num_kv_heads, head_dim = cache.shape[-2:]
    flat = cache.view(-1, num_kv_heads, head_dim)
    if is_fp8(cache):  # torch has no CPU index_copy_ for fp8: copy the bytes
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


def unified_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                      v_scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for a mixed batch: query [num_tokens, heads, head_dim] -> same shape, written
    into `out` when given. An fp8 cache is read back as stored x scale."""
    plan = meta._torch_plan or _build_plan(meta, k_cache.device)
    meta._torch_plan = plan
    if not is_fp8(k_cache):
        return _attend(query, k_cache, v_cache, plan, scale, out)
    # softmax(s * q.(k_scale * k)) (v_scale * v) = v_scale * softmax(s * k_scale * q.k) v:
    # the scales fold into the softmax scale and the output; gathered blocks are upcast.
    result = _attend(query, k_cache, v_cache, plan, scale * k_scale, out)
    return result.mul_(v_scale) if v_scale != 1.0 else result


def _attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            plan: TorchPlan, scale: float, out: torch.Tensor | None) -> torch.Tensor:
    if not plan.prefills and out is None:  # pure decode batch: rows are already in order
        return _decode(query, k_cache, v_cache, plan, scale)
    out = torch.empty_like(query) if out is None else out
    if plan.decode_rows.numel():
        out[plan.decode_rows] = _decode(query[plan.decode_rows], k_cache, v_cache, plan, scale)
    for start, end, slots, mask in plan.prefills:
        out[start:end] = prefill_chunk(query[start:end], k_cache, v_cache, slots, mask, scale)
    return out


def _decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            plan: TorchPlan, scale: float) -> torch.Tensor:
    """Batched single-token attention over each sequence's gathered blocks."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    keys = _gather_blocks(k_cache, plan.decode_block_tables).to(query.dtype)
    values = _gather_blocks(v_cache, plan.decode_block_tables).to(query.dtype)
    # The query heads sharing a KV head become that head's "query rows": GQA without
    # repeating K/V, and one fused SDPA call instead of matmul/mask/softmax/matmul.
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.decode_visible,
                                         scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_seqs, blocks] tables -> [num_seqs, kv_heads, blocks * block_size, head_dim].

    index_select on the flat block dimension measured 3x faster than advanced indexing.
    """
    num_seqs, num_blocks = block_tables.shape
    rows = cache.index_select(0, block_tables.flatten())  # [seqs * blocks, bs, kv, d]
    return rows.view(num_seqs, num_blocks * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def prefill_chunk(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One prefill chunk attending causally over its cached prefix and itself."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    keys, values = keys.transpose(0, 1).to(query.dtype), values.transpose(0, 1).to(query.dtype)
    # A chunk with no cached prefix is plain causal attention: SDPA's causal flag lets it skip
    # the masked half instead of reading an explicit mask.
    causal = mask is None
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)  # [1, H, q_len, D]
    return out.squeeze(0).transpose(0, 1)


def _build_plan(meta: AttentionMetadata, device: torch.device) -> TorchPlan:
    starts = meta.query_start_loc.tolist()
    decode_seqs = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
    prefills = [prefill_entry(meta, i, starts[i], device)
                for i, n in enumerate(meta.query_lens_list) if n > 1]
    rows = torch.tensor([starts[i] for i in decode_seqs], dtype=torch.long, device=device)
    if not decode_seqs:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return TorchPlan(empty, empty, empty.bool(), prefills)
    ctx = [meta.seq_lens_list[i] for i in decode_seqs]
    num_blocks = -(-max(ctx) // meta.block_size)
    tables = meta.block_tables[rows.new_tensor(decode_seqs), :num_blocks].long()
    key_pos = torch.arange(num_blocks * meta.block_size, device=device)
    ctx_t = torch.tensor(ctx, device=device)[:, None]
    visible = key_pos[None, :] < ctx_t
    if meta.sliding_window is not None:
        visible &= key_pos[None, :] > ctx_t - 1 - meta.sliding_window
    return TorchPlan(rows, tables, visible[:, None, None, :], prefills)


def prefill_entry(meta: AttentionMetadata, seq: int, start: int, device: torch.device
                   ) -> tuple[int, int, torch.Tensor, torch.Tensor | None]:
    q_len, ctx = meta.query_lens_list[seq], meta.seq_lens_list[seq]
    num_blocks = -(-ctx // meta.block_size)
    table = meta.block_tables[seq, :num_blocks].long()
    offsets = torch.arange(meta.block_size, device=device)
    slots = (table[:, None] * meta.block_size + offsets[None, :]).flatten()[:ctx]
    key_pos = torch.arange(ctx, device=device)
    query_pos = torch.arange(ctx - q_len, ctx, device=device)
    if q_len == ctx and meta.sliding_window is None:
        return start, start + q_len, slots, None
    visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, ctx], True = attend
    if meta.sliding_window is not None:
        visible &= key_pos[None, :] > query_pos[:, None] - meta.sliding_window
    return start, start + q_len, slots, visible


class TorchAttentionBackend(OpsBackend):
    """The CPU path: plain torch ops over the paged cache."""

    def __init__(self) -> None:
        super().__init__(reshape_and_cache, unified_attention)
