"""Paged attention ops as Triton kernels: the CUDA path. Their torch twins in
kernels/torch_attention.py share the signatures and are the oracle in tests.

`triton.jit` decides at decoration time whether a kernel runs compiled or in Triton's CPU
interpreter (TRITON_INTERPRET=1): set that variable before triton itself is first imported,
since triton's own library functions (tl.cdiv, tl.zeros, ...) are decorated then.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata, OpsBackend, is_fp8

TARGET_PROGRAMS = 132  # an H100/H200's SM count: split-KV decode aims to give each SM work
MAX_SEGMENTS = 16
MIN_TILES_PER_SEGMENT = 4  # below this a segment's partial write costs more than it saves
# Key positions per loop trip of the attention kernel (any KV block size): a decode tile is
# [16 rows x TILE_N] per K/V load. The GPU check (loadtest/benchmarks/gpu_check_kernels.py)
# times the choices; see README, "GPU check", for the measured sweep.
DECODE_TILE = 64
PREFILL_TILE = 64


@triton.jit
def _cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                  NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
                  FP8_MAX: tl.constexpr, FP8_ROUND_FIRST: tl.constexpr,
                  FP8_MANTISSA: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr):
    """One program per token: its K and V rows, all heads, into the slot's cache row."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: it owns no slot
        return
    heads = tl.arange(0, KV_HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + \
        heads * stride_ch + dims
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if FP8:  # stored = value / scale, saturated: fp8 has no room for out-of-range values
        key = tl.clamp(key.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        value = tl.clamp(value.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
        if FP8_ROUND_FIRST:
            key = _round_to_fp8_grid(key, FP8_MANTISSA, FP8_MIN_NORMAL)
            value = _round_to_fp8_grid(value, FP8_MANTISSA, FP8_MIN_NORMAL)
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_fp8_grid(x, MANTISSA: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """x rounded half-to-even onto the fp8 grid, in float32. Only for the interpreter: its
    fp32 -> fp8 cast drops the carry when rounding up crosses a power of two (7.99 -> 4, not
    8); casting an already representable value needs no rounding. GPUs round in hardware."""
    # Below the smallest normal the ulp stays that of the smallest normal (subnormals).
    exp = tl.floor(tl.log2(tl.maximum(tl.abs(x), MIN_NORMAL)))
    ulp = tl.exp2(exp - MANTISSA)
    magic = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds |y| < 2**22 to even
    rounded = ((x / ulp + magic) - magic) * ulp
    return tl.where(rounded == 0.0, x * 0.0, rounded)  # keep the sign of a value rounded to 0


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes key/value [num_tokens, kv_heads, head_dim] into their slots; slot -1 is skipped.
    An fp8 cache stores value / scale."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _unit_last_stride(key), _unit_last_stride(value)
    fp8 = is_fp8(k_cache)
    info = torch.finfo(k_cache.dtype)
    _cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], FP8=fp8, FP8_MAX=info.max if fp8 else 0.0,
        FP8_ROUND_FIRST=fp8 and _interpreting(), FP8_MANTISSA=round(-math.log2(info.eps)),
        FP8_MIN_NORMAL=float(info.smallest_normal))


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    # The kernels index head_dim with unit stride; q/k views split off a fused qkv have it.
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query tile `q_block`: sequence i's tiles start at
    query_start_loc[i] // BLOCK_Q + i, so a binary search finds it without a host plan."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tile_range(seq_len, ctx_len, q_first, window, segment,
                BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
                SLIDING: tl.constexpr):
    """KV tiles of TILE_N tokens [lo, hi) this program reads: those its query rows can see, cut
    into NUM_SEGMENTS equal parts of which it takes part `segment`."""
    last_key = tl.minimum(seq_len, ctx_len + q_first + BLOCK_Q)  # one past the last visible
    hi = tl.cdiv(last_key, TILE_N)
    lo = 0
    if SLIDING:
        lo = tl.maximum(ctx_len + q_first - window + 1, 0) // TILE_N
    per_segment = tl.cdiv(hi - lo, NUM_SEGMENTS)
    seg_lo = lo + segment * per_segment
    return seg_lo, tl.minimum(hi, seg_lo + per_segment)


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Folds one tile of scores s [M, N] (masked = -inf) and values v [N, D] into the running
    row max m_i, exp-sum l_i and output acc, rescaling what came before to the new max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key yet keeps max -inf: subtract 0 so exp gives 0, not the NaN of
    # -inf - -inf.
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
        seg_acc_ptr, seg_max_ptr, seg_sum_ptr, qk_scale, v_scale, num_seqs, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr, BLOCK_Q: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
        SLIDING: tl.constexpr, COMPUTE_F32: tl.constexpr, PRECISION: tl.constexpr):
    """One program: BLOCK_Q query tokens x the GROUP query heads of one KV head (so each K/V
    tile is loaded once for the whole group), over one segment of the sequence's KV tiles.

    A tile is TILE_N consecutive key positions, whatever the KV block size: each position finds
    its block through the block table, so tiles span several small blocks (wide loads, fewer
    loop trips) or part of a large one."""
    q_block, kv_head, segment = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q_first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_first >= q_len:  # the grid is an upper bound on every sequence's tile count
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # the query tokens are the sequence's last q_len positions
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)  # row = token * GROUP_PAD + head in group
    q_local = q_first + rows // GROUP_PAD
    heads = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_local < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_PAD)
    q_off = (q_start + q_local).to(tl.int64)[:, None] * stride_qt + \
        heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    if COMPUTE_F32:
        q = q.to(tl.float32)
    q_pos = ctx_len + q_local
    lo, hi = _tile_range(seq_len, ctx_len, q_first, window, segment,
                         BLOCK_Q, TILE_N, NUM_SEGMENTS, SLIDING)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(lo, hi):
        k_pos = tile * TILE_N + offs_n
        in_seq = k_pos < seq_len
        block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        k_base = block * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        v_base = block * stride_vb + (k_pos % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
        # Keys past seq_len may hold stale or NaN bytes: zero them so 0-weight x NaN can't leak.
        kv_mask = in_seq[None, :] & (dims[:, None] < HEAD_DIM)
        k = tl.load(k_cache_ptr + k_base[None, :] + dims[:, None], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_base[:, None] + dims[None, :], mask=tl.trans(kv_mask),
                    other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * qk_scale  # [M, TILE_N]
        visible = k_pos[None, :] <= q_pos[:, None]
        if SLIDING:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v.to(q.dtype), m_i, l_i, acc, PRECISION)
    out_row = (q_start + q_local).to(tl.int64) * NUM_HEADS + heads
    if NUM_SEGMENTS == 1:
        o_off = (q_start + q_local).to(tl.int64)[:, None] * stride_ot + \
            heads[:, None] * stride_oh + dims[None, :]
        # Only masked-off rows have l_i == 0; keep their (unstored) 0/0 from warning.
        result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale
        tl.store(out_ptr + o_off, result.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (dims[None, :] < HEAD_DIM))
    else:  # partial (max, sum, acc) for the reduce kernel; empty segments write (-inf, 0, 0)
        seg_row = out_row * NUM_SEGMENTS + segment
        tl.store(seg_max_ptr + seg_row, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + seg_row, l_i, mask=row_ok)
        tl.store(seg_acc_ptr + seg_row[:, None] * HEAD_PAD + dims[None, :], acc,
                 mask=row_ok[:, None])


@triton.jit
def _reduce_kernel(out_ptr, seg_acc_ptr, seg_max_ptr, seg_sum_ptr, v_scale,
                   stride_ot, stride_oh, NUM_HEADS: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
                   SEG_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Merges one (token, head)'s segment partials: rescale each to the global max, sum."""
    token, head = tl.program_id(0), tl.program_id(1)
    segs = tl.arange(0, SEG_PAD)
    dims = tl.arange(0, HEAD_PAD)
    base = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SEGMENTS
    seg_ok = segs < NUM_SEGMENTS
    m = tl.load(seg_max_ptr + base + segs, mask=seg_ok, other=float("-inf"))
    l_seg = tl.load(seg_sum_ptr + base + segs, mask=seg_ok, other=0.0)
    acc = tl.load(seg_acc_ptr + (base + segs)[:, None] * HEAD_PAD + dims[None, :],
                  mask=seg_ok[:, None], other=0.0)
    m_all = tl.max(m, 0)
    weight = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)
    result = tl.sum(acc * weight[:, None], 0) / tl.sum(l_seg * weight, 0) * v_scale
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             result.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def choose_num_segments(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                        tile_tokens: int = DECODE_TILE) -> int:
    """KV segments per decode sequence: enough programs to fill the GPU, none shorter than
    MIN_TILES_PER_SEGMENT tiles. Depends only on host ints, so a captured graph can fix it."""
    programs = num_seqs * num_kv_heads
    max_tiles = -(-max_seq_len // tile_tokens)
    wanted = -(-TARGET_PROGRAMS // max(programs, 1))
    return max(1, min(MAX_SEGMENTS, wanted, max_tiles // MIN_TILES_PER_SEGMENT))


def unified_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                      v_scale: float = 1.0, out: torch.Tensor | None = None, *,
                      num_segments: int | None = None, max_seq_len: int | None = None,
                      tile_tokens: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Attention for a mixed batch: query [num_tokens, heads, head_dim] -> same shape, written
    into `out` when given. An fp8 cache is read back as stored x scale.

    Launches from device tensors and host ints only (no sync). A pure decode batch may split
    each sequence's context into segments (flash-decoding); `num_segments` forces the count,
    `max_seq_len` bounds the context for choosing it (default: max of meta.seq_lens_list).
    `tile_tokens` (a power of two >= 16) and `num_warps` override the tuned launch (sweeps).
    """
    query = _unit_last_stride(query)
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty_like(query) if out is None else out
    num_seqs = meta.query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    decode_only = num_tokens == num_seqs  # every sequence has >= 1 query token
    # tl.dot wants >= 16 rows: decodes fill them with the group's heads and padding.
    block_q = max(1, (16 if decode_only else 64) // group_pad)
    # A float32 prefill tile of 64 keys needs 113 KiB of shared memory at head dim 128, over
    # sm_89's 99 KiB: half the keys per trip there.
    tile_n = tile_tokens or (DECODE_TILE if decode_only else
                             PREFILL_TILE // (2 if query.element_size() > 2 else 1))
    if num_segments is None:
        bound = max_seq_len if max_seq_len is not None else max(meta.seq_lens_list)
        num_segments = choose_num_segments(num_seqs, num_kv_heads, bound, tile_n) \
            if decode_only else 1
    if not is_fp8(k_cache):  # the scales only mean something for an fp8 cache (as the twin)
        k_scale = v_scale = 1.0
    head_pad = triton.next_power_of_2(head_dim)
    seg_acc = seg_max = seg_sum = out  # unused placeholders when not split
    if num_segments > 1:
        seg_acc = query.new_empty((num_tokens, num_heads, num_segments, head_pad),
                                  dtype=torch.float32)
        seg_max = query.new_empty((num_tokens, num_heads, num_segments), dtype=torch.float32)
        seg_sum = torch.empty_like(seg_max)
    compute_f32 = query.dtype == torch.float32 or (
        query.dtype == torch.bfloat16 and _interpreting())  # interpreter bf16 dot is broken
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    _attention_kernel[grid](
        out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        seg_acc, seg_max, seg_sum, float(scale * k_scale), float(v_scale), num_seqs,
        meta.sliding_window or 0, query.stride(0), query.stride(1), out.stride(0),
        out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, BLOCK_SIZE=block_size, TILE_N=tile_n, BLOCK_Q=block_q,
        NUM_SEGMENTS=num_segments, SLIDING=meta.sliding_window is not None,
        COMPUTE_F32=compute_f32, PRECISION="ieee" if compute_f32 else "tf32",
        num_warps=num_warps)
    if num_segments > 1:
        _reduce_kernel[(num_tokens, num_heads)](
            out, seg_acc, seg_max, seg_sum, float(v_scale), out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SEGMENTS=num_segments,
            SEG_PAD=triton.next_power_of_2(num_segments), HEAD_DIM=head_dim, HEAD_PAD=head_pad)
    return out


def _interpreting() -> bool:
    """Whether `triton.jit` built this module's kernels for the CPU interpreter."""
    return type(_attention_kernel).__name__ == "InterpretedFunction"


class TritonAttentionBackend(OpsBackend):
    """The CUDA path: Triton kernels over the paged cache (or the interpreter on CPU)."""

    # Launches read only device tensors and host ints (max_seq_len bound from the metadata's
    # lists), so a pure-decode step can be captured in a CUDA graph.
    supports_cuda_graphs = True

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda" and not _interpreting():
            raise ValueError("the triton attention backend needs a CUDA device (or "
                             "TRITON_INTERPRET=1 set before triton kernels are imported)")
        super().__init__(reshape_and_cache, unified_attention)
