"""The worker's flat step inputs (engine/worker/input_batch.py): each token's KV cache slot is
its block's id x block size + its offset in the block, the same from the Python path of small
steps and the torch path of large ones."""

from __future__ import annotations

import pytest
import torch

import engine.worker.input_batch as input_batch
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams

BLOCK = 4


def mixed_batch() -> SchedulerOutput:
    """Decodes at block edges and a prefill chunk crossing three blocks, with scattered ids."""
    params = SamplingParams(temperature=0.0, max_tokens=4)
    rows = [
        ScheduledRequest("first", (7,), 0, (9,), True, params),
        ScheduledRequest("edge", (7,), 3, (5,), True, params),
        ScheduledRequest("next", (7,), 4, (5, 2), True, params),
        ScheduledRequest("chunk", tuple(range(10)), 6, (11, 3, 8, 1), False, params),
    ]
    return SchedulerOutput(tuple(rows))


def expected_slots(batch: SchedulerOutput) -> list[int]:
    return [row.block_ids[p // BLOCK] * BLOCK + p % BLOCK
            for row in batch.requests
            for p in range(row.start_pos, row.start_pos + len(row.token_ids))]


@pytest.mark.parametrize("python_max", [0, 256])
def test_slots_from_either_path(monkeypatch: pytest.MonkeyPatch, python_max: int) -> None:
    monkeypatch.setattr(input_batch, "PYTHON_SLOTS_MAX", python_max)
    batch = mixed_batch()
    inputs = input_batch.prepare_inputs(batch, BLOCK, None, torch.device("cpu"))
    meta = inputs.meta
    assert meta.slot_mapping.dtype == torch.long
    assert meta.slot_mapping.tolist() == expected_slots(batch)
    # spot checks by hand: the chunk's positions 6..15 in blocks 3, 8, 1
    assert meta.slot_mapping.tolist()[3:6] == [3 * 4 + 2, 3 * 4 + 3, 8 * 4]
    assert meta.slot_mapping.tolist()[-1] == 1 * 4 + 3
    assert meta.block_tables.tolist() == [[9, 0, 0, 0], [5, 0, 0, 0], [5, 2, 0, 0],
                                          [11, 3, 8, 1]]
    assert meta.seq_lens.tolist() == [1, 4, 5, 16]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 13]
    assert inputs.positions.tolist()[3:] == list(range(6, 16))
    assert inputs.logits_indices.tolist() == [0, 1, 2]


def test_decode_batch_fast_path_equals_the_general_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of decodes that all sample takes decode_inputs (two tensors, viewed): the same
    values, dtypes and shapes as the general path, placeholders filled from the last step."""
    from engine.core.scheduler_output import PLACEHOLDER_TOKEN_ID

    params = SamplingParams(temperature=0.0, max_tokens=4)
    rows = (ScheduledRequest("a", (7,), 0, (9,), True, params),
            ScheduledRequest("b", (PLACEHOLDER_TOKEN_ID,), 4, (5, 2), True, params),
            ScheduledRequest("c", (3,), 13, (11, 3, 8, 1), True, params))
    batch, previous = SchedulerOutput(rows), {"b": 42}
    fast = input_batch.prepare_inputs(batch, BLOCK, 6, torch.device("cpu"), previous)
    monkeypatch.setattr(input_batch, "decode_inputs", lambda *a: None)
    general = input_batch.prepare_inputs(batch, BLOCK, 6, torch.device("cpu"), previous)
    assert fast.input_ids.tolist() == [7, 42, 3]
    assert fast.meta.block_tables.tolist() == [[9, 0, 0, 0], [5, 2, 0, 0], [11, 3, 8, 1]]
    for name in ("input_ids", "positions", "logits_indices"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        a, b = getattr(fast.meta, name), getattr(general.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (fast.meta.query_lens_list, fast.meta.seq_lens_list, fast.meta.sliding_window) == \
        (general.meta.query_lens_list, general.meta.seq_lens_list, 6)
    assert fast.sampling_rows == general.sampling_rows == list(rows)
    # anything else (a prefill chunk, a row that does not sample) takes the general path
    assert input_batch.decode_inputs(mixed_batch(), BLOCK, None, torch.device("cpu"), {}) is None
