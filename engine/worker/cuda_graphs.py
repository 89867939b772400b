"""CUDA graphs for decode steps: the model forward of a pure-decode batch is captured once per
batch size into static input buffers and replayed, so a step costs one launch instead of a few
hundred kernel launches.

A batch of n decodes runs in the graph of the smallest captured size >= n. The padding rows
have token 0, position 0, sequence length 1 and slot -1, so their K/V writes go nowhere and
their outputs are dropped. With `use_graphs=False` the same static-buffer path runs eagerly:
that is how the padding logic is tested on CPU, where CUDA graphs do not exist.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.metadata import AttentionMetadata

logger = logging.getLogger("kvserve")

# Batch sizes captured by default (vLLM's pattern: small sizes one by one, then steps of 8/16).
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)

# (input_ids [n], positions [n], kv_caches, meta) -> hidden states [n, hidden]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]],
                      AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int, sizes: Sequence[int] = DEFAULT_CAPTURE_SIZES
                  ) -> list[int]:
    """The captured sizes up to max_num_seqs, plus max_num_seqs itself when it falls between."""
    chosen = sorted(s for s in sizes if s <= max_num_seqs)
    if not chosen or chosen[-1] < max_num_seqs:
        chosen.append(max_num_seqs)
    return chosen


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds num_seqs, or None when none does."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


@dataclass
class DecodeBatch:
    """One pure-decode step's inputs, unpadded (host lists)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch."""
        return len(self.token_ids)


class _StaticBuffers:
    """Device tensors sized for the largest captured batch; graphs read them in place."""

    def __init__(self, max_size: int, max_blocks: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_size, max_blocks, dtype=torch.int32, device=device)
        self.max_blocks = max_blocks

    def fill(self, batch: DecodeBatch, size: int) -> None:
        """Copies a batch in, with padding rows up to `size` (slot -1, length 1)."""
        n, dev = batch.num_seqs, self.input_ids.device
        pad = size - n
        self.input_ids[:size].copy_(torch.tensor(batch.token_ids + [0] * pad, device=dev))
        self.positions[:size].copy_(torch.tensor(batch.positions + [0] * pad, device=dev))
        self.slot_mapping[:size].copy_(torch.tensor(batch.slots + [-1] * pad, device=dev))
        self.seq_lens[:size].copy_(
            torch.tensor([p + 1 for p in batch.positions] + [1] * pad, dtype=torch.int32,
                         device=dev))
        tables = [row + [0] * (self.max_blocks - len(row)) for row in batch.block_tables]
        tables += [[0] * self.max_blocks] * pad
        self.block_tables[:size].copy_(torch.tensor(tables, dtype=torch.int32, device=dev))

    def metadata(self, size: int, block_size: int, max_model_len: int,
                 sliding_window: int | None, seq_lens: list[int] | None) -> AttentionMetadata:
        """Metadata viewing the first `size` rows. Captured graphs get the static bound
        max_model_len as every sequence length on the host side; kernels read the real
        lengths from the seq_lens tensor."""
        lens = seq_lens if seq_lens is not None else [max_model_len] * size
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            query_lens_list=[1] * size, seq_lens_list=lens, block_size=block_size,
            sliding_window=sliding_window)


class DecodeGraphRunner:
    """Runs pure-decode batches through captured graphs (or eagerly through the same static
    buffers when use_graphs is False)."""

    def __init__(self, forward: ForwardFn, sizes: Sequence[int], max_model_len: int,
                 block_size: int, sliding_window: int | None, device: torch.device,
                 use_graphs: bool) -> None:
        self.forward = forward
        self.sizes = list(sizes)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sliding_window = sliding_window
        self.use_graphs = use_graphs
        max_blocks = -(-max_model_len // block_size)
        self.buffers = _StaticBuffers(self.sizes[-1], max_blocks, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_bytes = 0

    def can_run(self, batch: DecodeBatch) -> bool:
        """Whether this batch fits a captured size and the block-table width."""
        return (padded_size(batch.num_seqs, self.sizes) is not None
                and all(len(t) <= self.buffers.max_blocks for t in batch.block_tables))

    @torch.inference_mode()
    def capture(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Captures one graph per size, largest first so smaller ones reuse its memory pool."""
        if not self.use_graphs:
            return
        started = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = self.buffers.metadata(size, self.block_size, self.max_model_len,
                                         self.sliding_window, None)
            args = (self.buffers.input_ids[:size], self.buffers.positions[:size], kv_caches, meta)
            self.forward(*args)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(*args)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        self.graph_bytes = torch.cuda.memory_reserved() - before
        logger.info("Captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s, "
                    "using %.2f GiB", len(self.sizes), self.sizes[-1],
                    time.perf_counter() - started, self.graph_bytes / 2**30)

    @torch.inference_mode()
    def run(self, batch: DecodeBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
            ) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a pure-decode batch."""
        size = padded_size(batch.num_seqs, self.sizes)
        if size is None:
            raise ValueError(f"a decode batch of {batch.num_seqs} exceeds the largest captured "
                             f"size {self.sizes[-1]}")
        self.buffers.fill(batch, size)
        if self.use_graphs:
            graph, out = self.graphs[size]
            graph.replay()
            return out[:batch.num_seqs]
        lens = [p + 1 for p in batch.positions] + [1] * (size - batch.num_seqs)
        meta = self.buffers.metadata(size, self.block_size, self.max_model_len,
                                     self.sliding_window, lens)
        out = self.forward(self.buffers.input_ids[:size], self.buffers.positions[:size],
                           kv_caches, meta)
        return out[:batch.num_seqs]
