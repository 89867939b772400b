"""Builds the model's flat inputs for one step from the scheduler's immutable batch: token ids,
positions, the attention metadata (block tables, slot mapping, query and sequence lengths) and
which rows sample; or, for a pure-decode step the CUDA graphs can take, their DecodeBatch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine.core.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from engine.worker.cuda_graphs import DecodeBatch, DecodeGraphRunner
from kernels.metadata import AttentionMetadata


@dataclass
class BatchInputs:
    """One step's tensors for an eager forward."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling_rows]
    sampling_rows: list[ScheduledRequest]


NO_TOKENS: Mapping[str, int] = {}
# Up to this many tokens a step's cache slots are computed in Python, above it by torch ops.
PYTHON_SLOTS_MAX = 256


def filled_token_ids(row: ScheduledRequest, previous: Mapping[str, int]) -> tuple[int, ...]:
    """The row's token ids with the placeholders of async scheduling (always at its end)
    replaced by the token the previous step sampled for it."""
    ids = row.token_ids
    if not ids or ids[-1] != PLACEHOLDER_TOKEN_ID:
        return ids
    # 0 only for a request whose previous step failed: it has ended, its output is dropped.
    token = previous.get(row.request_id, 0)
    return tuple(token if t == PLACEHOLDER_TOKEN_ID else t for t in ids)


def with_history(rows: list[ScheduledRequest], previous: Mapping[str, int]
                 ) -> list[ScheduledRequest]:
    """Rows whose penalties need the output history, with the tokens in flight added to it."""
    out = rows
    for i, row in enumerate(rows):
        if row.sampling_params.needs_penalties and row.token_ids and \
                row.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            filled = filled_token_ids(row, previous)
            missing = filled[len(filled) - row.token_ids.count(PLACEHOLDER_TOKEN_ID):]
            out = list(out) if out is rows else out
            out[i] = row._replace(output_token_ids=row.output_token_ids + missing)
    return out


# A decode batch's token ids, positions and cache slots, one of each a row (decode_rows).
DecodeRows = tuple[list[int], list[int], list[int]]


def decode_rows(batch: SchedulerOutput, block_size: int, previous: Mapping[str, int]
                ) -> DecodeRows | None:
    """Token ids (placeholders filled as filled_token_ids does), positions and cache slots of
    a batch in which every row decodes one token and samples; None for any other batch. One
    pass over the rows: it runs on the worker thread every decode step, holding the GIL the
    event loop needs meanwhile."""
    bs = block_size
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for row in batch.requests:
        ids = row.token_ids
        if len(ids) != 1 or not row.sample:
            return None
        token = ids[0]
        if token == PLACEHOLDER_TOKEN_ID:
            token = previous.get(row.request_id, 0)
        pos, blocks = row.start_pos, row.block_ids
        token_ids.append(token)
        positions.append(pos)
        slots.append(blocks[pos // bs] * bs + pos % bs)
    return token_ids, positions, slots


def decode_batch(batch: SchedulerOutput, block_size: int, graphs: DecodeGraphRunner | None,
                 previous: Mapping[str, int] = NO_TOKENS) -> DecodeBatch | None:
    """The batch as graph-runner input when it is all decodes and a graph fits; else None."""
    rows = None if graphs is None else decode_rows(batch, block_size, previous)
    if graphs is None or rows is None:
        return None
    token_ids, positions, slots = rows
    decode = DecodeBatch(token_ids=token_ids, positions=positions, slots=slots,
                         block_tables=[list(row.block_ids) for row in batch.requests])
    return decode if graphs.can_run(decode) else None


def prepare_inputs(batch: SchedulerOutput, block_size: int, sliding_window: int | None,
                   device: torch.device, previous: Mapping[str, int] = NO_TOKENS,
                   rows: DecodeRows | None = None) -> BatchInputs:
    """Flattens a mixed batch of prefill chunks and decodes into varlen tensors; `previous`
    holds the last step's sampled tokens, for placeholders; `rows`, decode_rows' answer for
    the batch where the caller has it already."""
    decode = decode_inputs(batch, block_size, sliding_window, device, previous, rows)
    if decode is not None:
        return decode
    token_ids: list[int] = []
    positions: list[int] = []
    query_lens, seq_lens, logits_idx = [], [], []
    for item in batch.requests:
        num = len(item.token_ids)
        token_ids.extend(filled_token_ids(item, previous))
        positions.extend(range(item.start_pos, item.start_pos + num))
        query_lens.append(num)
        seq_lens.append(item.start_pos + num)
        if item.sample:
            logits_idx.append(len(token_ids) - 1)
    meta = attention_metadata(batch, positions, query_lens, seq_lens, block_size, sliding_window,
                              device)
    return BatchInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=device),
        sampling_rows=[item for item in batch.requests if item.sample],
    )


def decode_inputs(batch: SchedulerOutput, block_size: int, sliding_window: int | None,
                  device: torch.device, previous: Mapping[str, int],
                  rows: DecodeRows | None = None) -> BatchInputs | None:
    """prepare_inputs for a batch of decodes that all sample (every step at batch 1), or None
    for any other batch: two tensors, an int64 one (ids, positions, slots, logits rows) and an
    int32 one (block tables, sequence lengths, query starts), that the inputs view. It runs on
    the worker thread before every decode step, after the event loop's own Python of the step
    before, on the path of every token (at batch 1 on SmolLM2 the general path's seven tensors
    from lists took 0.18 ms a step in place, on caches the forward had just swept; this 0.135)."""
    decode = rows if rows is not None else decode_rows(batch, block_size, previous)
    if decode is None:
        return None
    longs, positions, slots = list(decode[0]), decode[1], decode[2]
    requests, bs = batch.requests, block_size
    n = len(requests)
    seq_lens = [pos + 1 for pos in positions]
    width = max(len(row.block_ids) for row in requests)
    ints: list[int] = []
    for row in requests:
        ints.extend(row.block_ids)
        ints.extend([0] * (width - len(row.block_ids)))
    ints.extend(seq_lens)
    ints.extend(range(n + 1))
    longs.extend(positions)
    longs.extend(slots)
    longs.extend(range(n))
    flat64 = torch.tensor(longs, dtype=torch.long).to(device)
    flat32 = torch.tensor(ints, dtype=torch.int32).to(device)
    meta = AttentionMetadata(
        slot_mapping=flat64[2 * n:3 * n],
        query_start_loc=flat32[n * width + n:],
        seq_lens=flat32[n * width:n * width + n],
        block_tables=flat32[:n * width].view(n, width),
        query_lens_list=[1] * n,
        seq_lens_list=seq_lens,
        block_size=bs,
        sliding_window=sliding_window,
    )
    return BatchInputs(input_ids=flat64[:n], positions=flat64[n:2 * n], meta=meta,
                       logits_indices=flat64[3 * n:], sampling_rows=list(requests))


def attention_metadata(batch: SchedulerOutput, positions: list[int], query_lens: list[int],
                       seq_lens: list[int], block_size: int, sliding_window: int | None,
                       device: torch.device) -> AttentionMetadata:
    """Block tables padded with block 0, and each token's cache slot."""
    bs = block_size
    max_blocks = max(len(item.block_ids) for item in batch.requests)
    tables = [list(item.block_ids) + [0] * (max_blocks - len(item.block_ids))
              for item in batch.requests]
    block_tables = torch.tensor(tables, dtype=torch.int32)  # [num_seqs, max_blocks]
    if len(positions) <= PYTHON_SLOTS_MAX:
        # A decode step's few slots in Python: the torch formulation's six ops cost ~0.1 ms
        # on the worker thread, each one a point where it yields the GIL to the event loop
        # (batch 1 on SmolLM2: ~2% of a 4 ms token).
        token_slots = []
        for item, num in zip(batch.requests, query_lens, strict=True):
            blocks, start = item.block_ids, item.start_pos
            if num == 1:
                token_slots.append(blocks[start // bs] * bs + start % bs)
            else:
                token_slots.extend(blocks[p // bs] * bs + p % bs
                                   for p in range(start, start + num))
        slots = torch.tensor(token_slots, dtype=torch.long)
    else:
        pos = torch.tensor(positions, dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(query_lens)),
                                            torch.tensor(query_lens))
        slots = block_tables[seq_index, pos // bs].long() * bs + pos % bs  # [num_tokens]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
        block_size=bs,
        sliding_window=sliding_window,
    )
