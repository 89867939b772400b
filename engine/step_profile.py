"""The step budget at startup: a fixed one from --max-num-batched-tokens, or the adaptive one
(engine/core/step_budget.py) seeded by timing a few synthetic steps on the model runner.

The profile runs after the KV cache is allocated and before any request exists, on the calling
thread (the worker thread has not run anything yet). Its rows write K/V into the first blocks
of the cache, which hold nothing yet and are overwritten before anyone reads them. It is
bounded by PROFILE_TIME_LIMIT_S (about 1-3 s for SmolLM2 on a 2-core CPU, milliseconds for
the tiny test models or on a GPU).
"""

from __future__ import annotations

import logging
import time

from engine.config import EngineArgs
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.core.step_budget import MIN_CHUNK_TOKENS, AdaptiveStepBudget
from engine.core.step_cost import batch_features
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger("kvserve")

PROFILE_TIME_LIMIT_S = 10.0
# How deep into a prompt the profile's deep steps are: the chunk costs that matter are those
# of long prompts, and a fit anchored at 1,024 extrapolated badly to 8,000.
DEEP_CONTEXT = 4096
# Each shape is timed this many times; the fastest counts (a step slowed by another process
# is not the hardware's cost).
PROFILE_REPEATS = 2
_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)
Shape = tuple[tuple[int, ...], int, int]  # decode contexts, chunk tokens, chunk start


def profile_shapes(room: int, max_num_seqs: int) -> list[Shape]:
    """Steps to time within `room` tokens of context: one and several decodes, two chunk
    sizes at context 0, two chunk sizes and decodes deep into a prompt. Each cost term needs
    shapes that move it apart from the others: a chunk's cost deep in a prompt is a part that
    grows with its context alone (reading it) and a part that grows with its tokens x context
    (their attention), and one deep chunk size cannot tell them apart. (With one, the fit once
    put the whole of it on the context: it then saw even a 4-token chunk at context 4,000 as
    past the step's limit and took 128-token chunks there, 480 ms steps beside 36 ms decodes.)"""
    if room < 32:
        return []
    short = 16
    chunks = (min(32, room // 4), min(128, room // 2))
    deep_chunks = (MIN_CHUNK_TOKENS * 2, 64)
    deep = min(DEEP_CONTEXT, room - deep_chunks[1]) // 16 * 16
    many = min(8, max_num_seqs)
    shapes: list[Shape] = [((short,), 0, 0), ((short,) * many, 0, 0),
                           ((short,), chunks[0], 0), ((short,), chunks[1], 0)]
    if deep >= 2 * chunks[0]:
        shapes += [((short,), deep_chunks[0], deep), ((short,), deep_chunks[1], deep),
                   ((deep,) * min(4, max_num_seqs), 0, 0)]
    return shapes


def shape_batch(shape: Shape, block_size: int) -> SchedulerOutput:
    """A synthetic batch of the shape; every row shares the blocks from 0 (contents unused)."""
    decode_contexts, chunk, start = shape
    rows = [(1, c - 1) for c in decode_contexts] + ([(chunk, start)] if chunk else [])
    requests = []
    for i, (num_query, first) in enumerate(rows):
        num_blocks = -(-(first + num_query) // block_size)
        requests.append(ScheduledRequest(f"kvserve-step-profile-{i}", (1,) * num_query, first,
                                         tuple(range(num_blocks)), True, _PARAMS))
    return SchedulerOutput(tuple(requests))


def profile_step_costs(runner: ModelRunner, budget: AdaptiveStepBudget, num_blocks: int,
                       max_model_len: int, max_num_seqs: int) -> None:
    """Times each profile shape PROFILE_REPEATS times (after one untimed warm-up step) into the
    budget's cost model as anchors, the fastest of each; stops early past
    PROFILE_TIME_LIMIT_S."""
    room = min(num_blocks * runner.block_size, max_model_len)
    shapes = profile_shapes(room, max_num_seqs)
    if not shapes:
        return
    deadline = time.perf_counter() + PROFILE_TIME_LIMIT_S
    warm_up = shape_batch(shapes[2], runner.block_size)
    runner.execute(warm_up)  # allocations, weight packing
    ids = {r.request_id for r in warm_up.requests}
    for shape in shapes:
        batch = shape_batch(shape, runner.block_size)
        times = []
        for _ in range(PROFILE_REPEATS):
            started = time.perf_counter()
            runner.execute(batch)
            times.append(time.perf_counter() - started)
        budget.model.add_anchor(batch_features(batch), min(times))
        ids.update(r.request_id for r in batch.requests)
        if time.perf_counter() > deadline:
            break
    runner.execute(SchedulerOutput((), frozenset(ids)))  # the runner forgets the synthetic rows


def chunk_granule(runner: ModelRunner) -> int:
    """Tokens whose query rows fill one row tile of the runner's attention kernel (1 where the
    backend does not say how many rows a tile holds)."""
    rows = getattr(runner.backend, "query_rows_per_tile", 0)
    cfg = runner.config
    group = cfg.num_attention_heads // max(1, cfg.num_key_value_heads or cfg.num_attention_heads)
    return max(1, rows // max(1, group))


def build_step_budget(args: EngineArgs, runner: ModelRunner, num_blocks: int,
                      max_model_len: int, max_tokens: int) -> AdaptiveStepBudget | None:
    """The adaptive budget, profiled, when --max-num-batched-tokens is not given (None: the
    fixed budget `max_tokens`); logs which one is in effect and its limits."""
    if args.max_num_batched_tokens is not None:
        logger.info("Token budget per step: %s tokens (--max-num-batched-tokens: fixed; long "
                    "prompts are prefilled in chunks under it)", f"{max_tokens:,}")
        return None
    budget = AdaptiveStepBudget(max_tokens, args.block_size, granule=chunk_granule(runner))
    started = time.perf_counter()
    profile_step_costs(runner, budget, num_blocks, max_model_len, args.max_num_seqs)
    for line in budget.describe():
        logger.info(line)
    contexts = [0, max_model_len // 2]
    chunks = budget.example_chunks(1, contexts)
    logger.info("Adaptive budget now, beside 1 decoding request: a prefill chunk of %s tokens "
                "at context %s, %s at %s (profiled in %.2f s)", f"{chunks[0]:,}",
                f"{contexts[0]:,}", f"{chunks[1]:,}", f"{contexts[1]:,}",
                time.perf_counter() - started)
    return budget
