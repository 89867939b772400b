"""The offline benchmark's options, shared by its runs (kvserve and transformers) and report."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loadtest.benchmarks.machine import GIB


@dataclass
class BenchConfig:
    """Every knob of one run; `--quick` swaps in the small values of `quick()`."""

    threads: int = 2
    num_prompts: int = 64
    min_input: int = 32
    max_input: int = 512
    output_len: int = 128
    seed: int = 0
    dtype: str = "float32"
    skip_hf_sequential: bool = False
    hf_sequential_prompts: int = 8
    hf_page_size: int = 256
    hf_max_batch_tokens: int = 512
    batch1_tokens: int = 256
    batch1_repeats: int = 3  # batch-1 runs per engine; the median counts
    decode_seqs: int = 64
    decode_input: int = 32
    decode_steps: int = 32
    gemm_size: int = 2048
    bandwidth_bytes: int = GIB
    skip_bf16: bool = False
    wait_quiet: float = 0.0
    profile_decode: bool = False
    json_path: str | None = None
    markdown_path: str | None = None

    def quick(self) -> BenchConfig:
        """A smoke-run version: every workload cut to seconds."""
        return dataclasses.replace(
            self, num_prompts=8, min_input=16, max_input=64, output_len=16,
            hf_sequential_prompts=2, batch1_tokens=32, batch1_repeats=1, decode_seqs=8,
            decode_input=16, decode_steps=8, gemm_size=1024, bandwidth_bytes=256 * 1024**2)
