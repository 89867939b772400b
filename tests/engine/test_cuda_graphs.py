"""The decode-graph path on CPU: batch sizes, padding rows that write nowhere, and the static
buffers giving the same greedy tokens as the plain path and as transformers. CUDA graph capture
itself needs a GPU (kernels/gpu_check.py); the path it replays is the one exercised here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.cuda_graphs import (
    DecodeBatch,
    DecodeGraphRunner,
    _StaticBuffers,
    capture_sizes,
    padded_size,
)
from tests.support.greedy import generated_ids, hf_greedy
from tests.support.tiny_models import random_prompts

VOCAB = 512


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    for max_num_seqs in (1, 3, 8, 100, 256, 300):
        sizes = capture_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
        for n in range(1, max_num_seqs + 1):
            size = padded_size(n, sizes)
            assert size is not None and n <= size
            # The smallest that fits: the next smaller captured size would not.
            assert all(s < n for s in sizes if s < size)
        assert padded_size(max_num_seqs + 1, sizes) is None


def test_padding_rows_write_nowhere_and_have_length_one() -> None:
    buffers = _StaticBuffers(max_size=8, max_blocks=4, device=torch.device("cpu"))
    buffers.slot_mapping.fill_(1234)  # stale values from an earlier, larger batch
    batch = DecodeBatch(token_ids=[5, 6, 7], positions=[10, 0, 33], slots=[42, 3, 97],
                        block_tables=[[2], [0], [1, 6, 3]])
    buffers.fill(batch, size=4)
    assert buffers.slot_mapping[:4].tolist() == [42, 3, 97, -1]
    assert buffers.seq_lens[:4].tolist() == [11, 1, 34, 1]
    assert buffers.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert buffers.block_tables[:4].tolist() == [[2, 0, 0, 0], [0, 0, 0, 0], [1, 6, 3, 0],
                                                 [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", num_threads=1, max_model_len=256,
               kv_cache_memory_bytes=4 * 1024 * 1024)


def test_static_buffer_decode_path_matches_plain_path_and_transformers(
        llm: LLM, tiny_llama_dir: Path) -> None:
    prompts = random_prompts(VOCAB, 5, 3, 40, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = generated_ids(llm, prompts, params)
    runner = llm.engine.runner
    seen_sizes: list[int] = []

    def forward(*args: object) -> torch.Tensor:
        seen_sizes.append(int(args[0].shape[0]))  # type: ignore[attr-defined]
        return runner.model(*args)

    # Sizes 2 and 8: five sequences pad to 8, and as they finish fewer still pad up.
    runner.graph_runner = DecodeGraphRunner(forward, [2, 8], 256, runner.block_size, None,
                                            runner.device, use_graphs=False)
    try:
        padded = generated_ids(llm, prompts, params)
    finally:
        runner.graph_runner = None
    assert seen_sizes and set(seen_sizes) <= {2, 8} and 8 in seen_sizes
    assert padded == plain
    assert padded == hf_greedy(tiny_llama_dir, prompts, 12)
