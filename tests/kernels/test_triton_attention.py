"""The Triton attention kernels against their torch twins, in Triton's CPU interpreter (or
compiled on a GPU when one is present), and the tiny model end to end through them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from engine import LLM, SamplingParams  # noqa: E402
from kernels import cpu_ops  # noqa: E402
from kernels import torch_attention as torch_ops  # noqa: E402
from kernels.cpu_attention import CpuAttentionBackend  # noqa: E402
from kernels.metadata import AttentionMetadata  # noqa: E402
from kernels.selector import get_attention_backend  # noqa: E402
from tests.support import paged_batches  # noqa: E402
from tests.support.triton_interpreter import import_kernels  # noqa: E402

triton_ops = import_kernels("kernels.triton_attention")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_meta(query_lens: list[int], context_lens: list[int], num_blocks: int,
              window: int | None = None, block_size: int = BLOCK_SIZE) -> AttentionMetadata:
    """A random paged batch on DEVICE (tests/support/paged_batches.py)."""
    return paged_batches.make_meta(query_lens, context_lens, num_blocks, window, block_size,
                                   DEVICE)


def random_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, scale: float) -> torch.Tensor:
    """A random cache on DEVICE, stored as value / scale."""
    return paged_batches.random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype,
                                      scale, DEVICE)


def nan_like(x: torch.Tensor) -> torch.Tensor:
    """An output buffer whose unwritten elements fail any comparison."""
    return torch.full_like(x, float("nan"))


ATTENTION_CASES = {
    "decode": ([1, 1, 1], [5, 40, 70]),
    "prefill": ([23, 9], [0, 0]),
    "mixed": ([1, 20, 1, 7], [33, 0, 78, 0]),
    "chunk_after_prefix": ([17, 5], [48, 21]),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_matches_torch(case: str, group: int, dtype: torch.dtype) -> None:
    query_lens, context_lens = ATTENTION_CASES[case]
    check_attention(query_lens, context_lens, group=group, dtype=dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_segments", [1, 2])
def test_attention_fp8_cache(cache_dtype: torch.dtype, dtype: torch.dtype,
                             num_segments: int) -> None:
    """Scales != 1 on both paths: v_scale applies in the kernel and in the split reduce."""
    check_attention([1, 12, 1], [30, 9, 64], group=2, dtype=dtype, cache_dtype=cache_dtype,
                    scales=(0.5, 1.7), num_segments=num_segments)


@pytest.mark.parametrize("num_segments", [None, 1, 3])
def test_attention_sliding_window(num_segments: int | None) -> None:
    check_attention([1, 19, 1], [70, 30, 9], group=2, window=24, num_segments=num_segments)


@pytest.mark.parametrize("block_size", [32, 64])
def test_attention_block_sizes(block_size: int) -> None:
    check_attention([1, 9, 1], [70, 40, 0], group=2, block_size=block_size)


@pytest.mark.parametrize(("block_size", "tile"), [(8, 16), (16, 64), (64, 16), (128, 32)])
def test_tiles_span_or_split_blocks(block_size: int, tile: int) -> None:
    """A tile of key positions need not match the KV block: it spans several small blocks or
    part of a large one, on a decode (split and whole) and a chunk after a prefix."""
    for query_lens, context_lens, segments in (([1, 1], [70, 130], None), ([1, 1], [70, 130], 3),
                                               ([9, 1], [50, 100], None)):
        check_attention(query_lens, context_lens, group=2, block_size=block_size,
                        num_segments=segments, tile_tokens=tile)


def test_attention_bfloat16() -> None:
    """bf16 runs its dots in bf16 on a GPU (in float32 in the interpreter, whose bf16 dot is
    wrong)."""
    check_attention([1, 9], [40, 12], group=2, dtype=torch.bfloat16)


def test_attention_head_dim_80_pads_to_128() -> None:
    check_attention([1, 11], [50, 20], group=2, head_dim=80)


ON_GPU = pytest.mark.skipif(DEVICE.type != "cuda", reason="compiled on a GPU only (the "
                            "interpreter takes minutes for these shapes)")


@ON_GPU
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_model_dtypes_and_head_dims(case: str, head_dim: int,
                                              dtype: torch.dtype) -> None:
    """The 16-bit dtypes models run in, at the head dims of real models, GQA group 8."""
    query_lens, context_lens = ATTENTION_CASES[case]
    check_attention(query_lens, context_lens, group=8, dtype=dtype, head_dim=head_dim)


@ON_GPU
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn, torch.float8_e5m2])
def test_long_decodes_take_the_split_path(cache_dtype: torch.dtype | None) -> None:
    """Contexts of thousands of tokens, where the launcher picks split-KV by itself."""
    check_attention([1, 1, 1, 64], [4000, 1500, 9000, 700], group=4, dtype=torch.bfloat16,
                    head_dim=128, cache_dtype=cache_dtype, scales=(0.5, 1.5))


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("num_segments", [2, 4])
def test_split_kv_decode(group: int, num_segments: int) -> None:
    """Flash-decoding forced on: segments, some empty for the short sequence, then a reduce."""
    check_attention([1, 1, 1], [3, 45, 79], group=group, num_segments=num_segments)


def test_split_kv_mixed_batch() -> None:
    """The split path is generic: forced on a mixed batch it still matches."""
    check_attention([1, 13, 1], [60, 20, 0], group=2, num_segments=3,
                    dtype=torch.float16)


def test_split_kv_is_chosen_for_long_decodes() -> None:
    assert triton_ops.choose_num_segments(2, 2, 4096, 16) == triton_ops.MAX_SEGMENTS
    assert triton_ops.choose_num_segments(2, 2, 16, 16) == 1
    assert triton_ops.choose_num_segments(256, 8, 4096, 16) == 1


def check_attention(query_lens: list[int], context_lens: list[int], *, group: int,
                    dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None,
                    scales: tuple[float, float] = (1.0, 1.0), head_dim: int = 64,
                    window: int | None = None, num_segments: int | None = None,
                    block_size: int = BLOCK_SIZE, tile_tokens: int | None = None) -> None:
    """Triton unified_attention == the torch twin on one random batch."""
    num_kv_heads = 2 if group == 1 else 1
    num_heads = num_kv_heads * group
    num_blocks = max(24, sum(-(-(q + c) // block_size)
                             for q, c in zip(query_lens, context_lens, strict=True)) + 1)
    meta = make_meta(query_lens, context_lens, num_blocks, window, block_size)
    k_scale, v_scale = scales
    cache_args = (num_blocks, block_size, num_kv_heads, head_dim, cache_dtype or dtype)
    k_cache = random_cache(*cache_args, k_scale)
    v_cache = random_cache(*cache_args, v_scale)
    query = torch.randn(sum(query_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    expected = torch_ops.unified_attention(query, k_cache, v_cache, meta, scale, k_scale,
                                           v_scale)
    got = triton_ops.unified_attention(query, k_cache, v_cache, meta, scale, k_scale, v_scale,
                                       out=nan_like(query), num_segments=num_segments,
                                       tile_tokens=tile_tokens)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.float8_e4m3fn,
                                         torch.float8_e5m2])
def test_reshape_and_cache_matches_torch(cache_dtype: torch.dtype) -> None:
    """Same bytes as the twin, from a strided key view; slot -1 leaves the cache untouched."""
    num_blocks, num_kv_heads, head_dim = 4, 2, 80
    meta = make_meta([5, 3], [0, 20], num_blocks)
    slots = meta.slot_mapping.clone()
    slots[[1, 6]] = -1  # padding rows
    num_tokens = slots.numel()
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, device=DEVICE) * 3
    key, value = kv.split(num_kv_heads, dim=1)  # non-contiguous, as split off a fused qkv
    if cache_dtype not in torch_ops.FP8_DTYPES:
        key, value = key.to(cache_dtype), value.to(cache_dtype)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    sentinel = torch.randn(shape, device=DEVICE).to(cache_dtype)
    expected_k, expected_v = sentinel.clone(), sentinel.clone()
    got_k, got_v = sentinel.clone(), sentinel.clone()
    torch_ops.reshape_and_cache(key, value, expected_k, expected_v, slots, 0.4, 2.5)
    triton_ops.reshape_and_cache(key, value, got_k, got_v, slots, 0.4, 2.5)
    as_bytes = (lambda t: t.view(torch.uint8)) if cache_dtype in torch_ops.FP8_DTYPES \
        else (lambda t: t)
    assert torch.equal(as_bytes(got_k), as_bytes(expected_k))
    assert torch.equal(as_bytes(got_v), as_bytes(expected_v))
    skipped = meta.slot_mapping[[1, 6]]
    untouched = sentinel.view(-1, num_kv_heads, head_dim)[skipped]
    assert torch.equal(as_bytes(got_k.view(-1, num_kv_heads, head_dim)[skipped]),
                       as_bytes(untouched))


def test_backend_selection() -> None:
    cpu = torch.device("cpu")
    expected = torch_ops.TorchAttentionBackend if cpu_ops.load() is None else CpuAttentionBackend
    assert isinstance(get_attention_backend("auto", cpu), expected)
    assert isinstance(get_attention_backend("torch", cpu),
                      torch_ops.TorchAttentionBackend)
    assert isinstance(get_attention_backend("triton", DEVICE),
                      triton_ops.TritonAttentionBackend)
    with pytest.raises(ValueError, match="auto, cpu, triton or torch"):
        get_attention_backend("flash", cpu)


def test_tiny_llama_greedy_matches_torch_backend(tiny_llama_dir: Path) -> None:
    """Two prompts x 8 tokens: same greedy tokens through Triton as through torch."""
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (21, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama_dir), dtype="float32", attention_backend=backend,
                  kv_cache_memory_bytes=1 << 22)
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
    assert outputs["triton"] == outputs["torch"]
