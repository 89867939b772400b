"""The GPU check's kernel measurements: the device's copy bandwidth and the attention kernel's
achieved KV bandwidth (KV bytes read / median time) for decode batches and prefill chunks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from loadtest.benchmarks.gpu_check_report import Report


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds of fn: Triton's do_bench on CUDA, a short loop on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return sorted(times)[1]


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device)
    return 2 * num_bytes / (ms / 1000) / 1e9


def decode_metadata(num_seqs: int, ctx: int, block_size: int, device: torch.device
                    ) -> tuple[AttentionMetadata, int]:
    """A decode batch: each sequence at `ctx` tokens over its own shuffled blocks."""
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = num_seqs * blocks_per_seq
    tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq)
    pos = ctx - 1
    slots = tables[:, pos // block_size].long() * block_size + pos % block_size
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32,
                                                         device=device),
        seq_lens=torch.full((num_seqs,), ctx, dtype=torch.int32, device=device),
        block_tables=tables.to(torch.int32), query_lens_list=[1] * num_seqs,
        seq_lens_list=[ctx] * num_seqs, block_size=block_size)
    return meta, num_blocks


def prefill_metadata(q_len: int, ctx: int, block_size: int, device: torch.device
                     ) -> tuple[AttentionMetadata, int]:
    """One prefill chunk of q_len tokens ending at ctx (so ctx - q_len are cached)."""
    num_blocks = -(-ctx // block_size)
    table = torch.randperm(num_blocks, device=device)[None, :]
    pos = torch.arange(ctx - q_len, ctx, device=device)
    slots = table[0, pos // block_size].long() * block_size + pos % block_size
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor([0, q_len], dtype=torch.int32,
                                                         device=device),
        seq_lens=torch.tensor([ctx], dtype=torch.int32, device=device),
        block_tables=table.to(torch.int32), query_lens_list=[q_len], seq_lens_list=[ctx],
        block_size=block_size)
    return meta, num_blocks


def attention_bandwidth(report: Report, device: torch.device, batches: list[int],
                        contexts: list[int], heads: tuple[int, int, int], dtype: torch.dtype,
                        copy_gbs: float) -> None:
    """Decode and prefill-chunk attention: KV GB/s and its share of the copy bandwidth."""
    attend = _attention_fn(device)
    num_heads, num_kv_heads, head_dim = heads
    rows: list[dict[str, Any]] = []
    for name, builder, shapes in (
            ("decode", decode_metadata, [(b, c) for b in batches for c in contexts]),
            ("prefill", prefill_metadata, [(c // 4, c) for c in contexts])):
        for first, ctx in shapes:
            meta, num_blocks = builder(first, ctx, 16, device)
            k_cache = torch.randn(num_blocks, 16, num_kv_heads, head_dim, dtype=dtype,
                                  device=device)
            v_cache = torch.randn_like(k_cache)
            num_tokens = meta.query_start_loc.shape[0] - 1 if name == "decode" else first
            query = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
            ms = timed(lambda q=query, k=k_cache, v=v_cache, m=meta:  # type: ignore[misc]
                       attend(q, k, v, m, head_dim ** -0.5), device)
            kv_tokens = sum(meta.seq_lens_list)
            gbs = kv_tokens * num_kv_heads * head_dim * 2 * k_cache.element_size() / ms / 1e6
            rows.append({"kind": name, "first": first, "ctx": ctx, "ms": ms, "kv_gbs": gbs,
                         "share_of_copy": gbs / copy_gbs})
            print(f"  {name} {first} x {ctx}: {ms:.3f} ms, {gbs:.0f} GB/s "
                  f"({gbs / copy_gbs:.0%} of copy)", flush=True)
    report.sections["attention"] = rows
    best = [r for r in rows if r["kind"] == "decode" and r["first"] >= 64
            and r["ctx"] == contexts[min(1, len(contexts) - 1)]]
    if best:
        share = max(r["share_of_copy"] for r in best)
        report.add("decode attention, batch >= 64, 4k ctx", f"{share:.0%} of copy bandwidth",
                   "MET" if share >= 0.8 else "MISSED (target 80%)")


def _attention_fn(device: torch.device) -> Callable[..., torch.Tensor]:
    if device.type == "cuda":
        from kernels.triton_attention import unified_attention

        return unified_attention
    from kernels.torch_attention import unified_attention as torch_attention

    return torch_attention


def tile_sweep(report: Report, device: torch.device, heads: tuple[int, int, int],
               dtype: torch.dtype, copy_gbs: float, small: bool) -> None:
    """The attention kernel's KV tile (key positions per loop trip) and warps per program,
    timed on decodes at 64 and 256 sequences of 4k and one prefill chunk: what the defaults in
    kernels/triton_attention.py (DECODE_TILE, PREFILL_TILE) are chosen from."""
    from kernels.triton_attention import unified_attention

    num_heads, num_kv_heads, head_dim = heads
    shapes = [("decode", decode_metadata, 4, 64)] if small else [
        ("decode", decode_metadata, 64, 4096), ("decode", decode_metadata, 256, 4096),
        ("prefill", prefill_metadata, 1024, 4096)]
    rows: list[dict[str, Any]] = []
    for kind, builder, first, ctx in shapes:
        meta, num_blocks = builder(first, ctx, 16, device)
        k_cache = torch.randn(num_blocks, 16, num_kv_heads, head_dim, dtype=dtype, device=device)
        v_cache = torch.randn_like(k_cache)
        query = torch.randn(first if kind == "prefill" else meta.seq_lens.shape[0], num_heads,
                            head_dim, dtype=dtype, device=device)
        kv_bytes = sum(meta.seq_lens_list) * num_kv_heads * head_dim * 2 * k_cache.element_size()
        for tile in (16, 32, 64, 128):
            for warps in (4, 8):
                try:
                    ms = timed(lambda q=query, k=k_cache, v=v_cache, m=meta, t=tile, w=warps:  # type: ignore[misc]
                               unified_attention(q, k, v, m, head_dim ** -0.5, tile_tokens=t,
                                                 num_warps=w), device)
                except Exception as exc:  # a tile the compiler rejects: recorded, not fatal
                    rows.append({"kind": kind, "first": first, "ctx": ctx, "tile": tile,
                                 "warps": warps, "error": str(exc)[:200]})
                    continue
                gbs = kv_bytes / ms / 1e6
                rows.append({"kind": kind, "first": first, "ctx": ctx, "tile": tile,
                             "warps": warps, "ms": ms, "share_of_copy": gbs / copy_gbs})
        best = min((r for r in rows if r["first"] == first and r["kind"] == kind and "ms" in r),
                   key=lambda r: r["ms"], default=None)
        if best is not None:
            report.add(f"best tile, {kind} {first} x {ctx}",
                       f"tile {best['tile']}, {best['warps']} warps: {best['ms']:.3f} ms "
                       f"({best['share_of_copy']:.0%} of copy)")
    report.sections["tile_sweep"] = rows
