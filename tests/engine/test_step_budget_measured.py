"""The adaptive step budget's measured guards: the cap held to the decoders' measured
decode-only pace, short chunks in whole row tiles of the attention kernel, and chunks bounded by
the last measured step whatever the cost model predicts. Fake step costs, no model, no clock
(the fake hardware of test_step_budget.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.core.step_budget import MIN_CHUNK_TOKENS, AdaptiveStepBudget
from engine.core.step_cost import StepCostModel, batch_features, step_features
from engine.step_profile import chunk_granule, shape_batch
from kernels.cpu_attention import CpuAttentionBackend
from tests.engine.test_step_budget import fake_seconds, trained_model


def test_the_cap_follows_the_measured_decode_steps_not_the_models_guess() -> None:
    """The limit is a multiple of what decode-only steps with as many rows were measured to
    take (the pace the streams had). Once the recent window holds only mixed steps (a long
    prefill) the model's decode-only figure is an extrapolation: here the mixed steps ran
    slower than the hardware the model was fit on, which pulled its decode-only prediction up,
    and the cap must not follow it."""
    budget = AdaptiveStepBudget(8192, block_size=16, multiple=2.5, model=trained_model())
    decodes = shape_batch(((40,) * 4, 0, 0), 16)
    alone = fake_seconds(batch_features(decodes))
    four = step_features([(1, 40)] * 4)
    for _ in range(2):
        budget.observe(decodes, alone)
    assert budget.decode_step_seconds(four) == budget.model.predict(four)  # two: not yet
    budget.observe(decodes, alone * 1.1)
    mixed = shape_batch(((40,) * 4, 16, 1000), 16)
    for _ in range(64):
        budget.observe(mixed, 1.5 * fake_seconds(batch_features(mixed)))
    assert budget.model.predict(four) > 1.2 * alone  # the model's guess moved up
    assert budget.decode_step_seconds(four) == pytest.approx(alone)  # the median measured
    chunk = budget.chunk_tokens([40] * 4, 1000)
    with_chunk = step_features([(1, 40)] * 4 + [(chunk, 1000 + chunk)])
    assert budget.model.predict(with_chunk) <= 2.5 * alone * 1.001
    assert budget.model.predict(step_features([(1, 40)] * 4 + [(chunk + 16, 1016 + chunk)])) \
        > 2.5 * alone
    # decode-only steps with another number of rows do not count for these four
    other = AdaptiveStepBudget(8192, block_size=16, multiple=2.5, model=trained_model())
    for _ in range(5):
        other.observe(shape_batch(((40,) * 3, 0, 0), 16), alone / 2)
    assert other.decode_step_seconds(four) == other.model.predict(four)


def test_short_chunks_fill_whole_row_tiles_of_the_attention_kernel() -> None:
    """Below a block a chunk is a whole number of granules (the tokens whose query rows fill
    one tile of the attention kernel), or the least chunk."""
    for context in (0, 300, 600, 1000, 1500, 2500):
        plain = AdaptiveStepBudget(8192, block_size=16, multiple=2.5, model=trained_model())
        tiled = AdaptiveStepBudget(8192, block_size=16, multiple=2.5, model=trained_model(),
                                   granule=5)
        free, chunk = plain.chunk_tokens([40] * 4, context), tiled.chunk_tokens([40] * 4, context)
        if free >= 16:
            assert chunk == free
        else:
            assert chunk == (free if free < 5 else free - free % 5), (context, free, chunk)
    sizes = {AdaptiveStepBudget(8192, block_size=16, multiple=m, model=trained_model(),
                                granule=5).chunk_tokens([40] * 4, 1000)
             for m in (1.1, 1.3, 1.6, 2.0, 2.5, 3.0)}
    assert sizes - {4, 5, 10, 15} and all(s in (4, 5, 10, 15) or s % 16 == 0 for s in sizes)


def test_the_granule_is_the_tokens_of_one_row_tile_of_the_cpu_kernel() -> None:
    def runner(backend: object, heads: int, kv_heads: int) -> SimpleNamespace:
        config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
        return SimpleNamespace(backend=backend, config=config)

    cpu = CpuAttentionBackend(ops=None)
    assert chunk_granule(runner(cpu, 9, 3)) == 5  # SmolLM2: 3 query heads per KV head
    assert chunk_granule(runner(cpu, 32, 8)) == 4
    assert chunk_granule(runner(cpu, 12, 12)) == 16
    assert chunk_granule(runner(object(), 9, 3)) == 1  # a backend that does not say


def test_measured_steps_bound_the_chunk_when_the_model_goes_wrong() -> None:
    """A model refit on near-identical steps can call every chunk free; the measured steps
    still bound it: a chunk grows at most 2x (or to a block) over the last measured one, and
    after a step far past the limit the next chunk shrinks by the overrun."""
    free = StepCostModel()  # a broken fit: every step 20 ms, whatever it carries
    for rows in ([], [(64, 3064)], [(256, 256)], [(16, 6016)]):
        free.add_anchor(step_features([(1, 40)] * 4 + rows), 0.020)
    budget = AdaptiveStepBudget(8192, block_size=16, multiple=2.5, model=free, granule=5)
    decodes = shape_batch(((40,) * 4, 0, 0), 16)
    for _ in range(3):
        budget.observe(decodes, 0.020)
    assert budget.chunk_tokens([40] * 4, 3000) == 8176  # the model alone: all it may (blocks)
    budget.observe(shape_batch(((40,) * 4, 10, 3000), 16), 0.045)  # within 2.5 x 20 ms
    assert budget.chunk_tokens([40] * 4, 3010) == 16  # 2 x 10 tokens, rounded to a block
    budget.observe(shape_batch(((40,) * 4, 48, 3010), 16), 0.040)
    assert budget.chunk_tokens([40] * 4, 3058) == 96
    budget.observe(shape_batch(((40,) * 4, 96, 3058), 16), 0.200)  # 4x the 50 ms limit
    assert budget.chunk_tokens([40] * 4, 3154) == 16  # 96 x 50 / 200 = 24 -> one block
    budget.observe(shape_batch(((40,) * 4, 16, 3154), 16), 0.150)  # 3x: 16 x 1/3 -> 5
    assert budget.chunk_tokens([40] * 4, 3170) == 5
    budget.observe(shape_batch(((40,) * 4, 5, 3170), 16), 0.300)
    assert budget.chunk_tokens([40] * 4, 3175) == MIN_CHUNK_TOKENS  # never below the least
