"""The adaptive step budget (no --max-num-batched-tokens): fake step costs, no model, no clock.

Costs are fed as if measured: a linear "hardware" whose true coefficients the tests know, so
the chunk the budget picks can be checked against the cost it must stay under.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from engine.capacity import resolve_max_num_batched_tokens
from engine.config import EngineArgs
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.step_budget import MIN_CHUNK_TOKENS, AdaptiveStepBudget
from engine.core.step_cost import StepCostModel, batch_features, step_features
from engine.sampling_params import SamplingParams
from engine.step_profile import profile_shapes, shape_batch

# The fake hardware: 20 ms a step, 1 ms a token, 2 ms a decode row, 1 µs per context token
# read by a decode, 5 µs per prefill context token, 0.1 µs per prefill query x context.
TRUE_COEF = (20e-3, 1e-3, 2e-3, 1e-6, 5e-6, 1e-7)


def fake_seconds(features: tuple[float, ...]) -> float:
    return sum(c * x for c, x in zip(TRUE_COEF, features, strict=True))


def trained_model() -> StepCostModel:
    """A cost model fed varied steps of the fake hardware, as the startup profile does."""
    model = StepCostModel()
    shapes = [[(1, 16)], [(1, 16)] * 8, [(1, 500)] * 4, [(1, 16), (32, 32)],
              [(1, 16), (128, 128)], [(1, 16), (32, 1056)], [(1, 16), (256, 2304)],
              [(64, 64)], [(1, 40)] * 3 + [(16, 4000)]]
    for rows in shapes:
        features = step_features(rows)
        model.add_anchor(features, fake_seconds(features))
    return model


def make_scheduler(budget: AdaptiveStepBudget | None, max_seqs: int = 8,
                   fixed: int = 4096) -> Scheduler:
    kv = KVCacheManager(num_blocks=4096, block_size=16, enable_caching=False)
    return Scheduler(kv, max_seqs, fixed, max_model_len=16384, step_budget=budget)


def add(s: Scheduler, rid: str, num_prompt: int, max_tokens: int = 1000) -> Request:
    req = Request(rid, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens),
                  max_tokens=max_tokens)
    s.add_request(req)
    return req


def run_step(s: Scheduler, budget: AdaptiveStepBudget | None = None) -> SchedulerOutput:
    """One step: schedule, "run" it on the fake hardware, feed its cost back, apply."""
    batch = s.schedule()
    if budget is not None:
        budget.observe(batch, fake_seconds(batch_features(batch)))
    s.update_from_output(batch, {r.request_id: 7 for r in batch.requests if r.sample}, {})
    return batch


def chunk_of(batch: SchedulerOutput, rid: str) -> int:
    return next((len(r.token_ids) for r in batch.requests if r.request_id == rid), 0)


def test_cost_model_recovers_the_fake_hardware() -> None:
    model = trained_model()
    for rows in ([(1, 64)] * 4, [(1, 64)] * 4 + [(96, 3000)], [(2048, 2048)]):
        features = step_features(rows)
        assert model.predict(features) == pytest.approx(fake_seconds(features), rel=0.02)


def test_a_step_with_decodes_is_capped_to_the_multiple_of_a_decode_step() -> None:
    budget = AdaptiveStepBudget(8192, block_size=16, multiple=2.5, model=trained_model())
    s = make_scheduler(budget)
    decoders = [add(s, f"d{i}", 32) for i in range(4)]
    run_step(s, budget)  # the four prompts prefill together (nothing decodes yet)
    long = add(s, "long", 8000)
    chunks = []
    while long.num_output_tokens == 0:
        batch = run_step(s, budget)
        assert all(chunk_of(batch, d.request_id) == 1 for d in decoders)  # never starved
        decode_only = fake_seconds(step_features(
            (1, d.num_computed_tokens) for d in decoders))
        # Within the multiple, or the least chunk whose tokens cost more than reading its
        # prefix (a smaller one would spend most of its step re-reading the prefix).
        seconds = fake_seconds(batch_features(batch))
        chunk, start = chunk_of(batch, "long"), long.num_computed_tokens - chunk_of(batch, "long")
        fixed = TRUE_COEF[4] * start
        smaller = chunk - 16
        assert seconds <= 2.5 * decode_only * 1.02 or chunk == MIN_CHUNK_TOKENS or fake_seconds(
            step_features([(smaller, start + smaller)])) - TRUE_COEF[0] - fixed < fixed
        chunks.append(chunk)
    assert max(chunks) < 100  # far from the 8192 a step could carry
    assert chunks[0] > min(chunks)  # deeper into the prompt the chunk attends more: smaller
    # whole blocks from one block up; below a block, tokens
    assert all(c % 16 == 0 or c < 16 for c in chunks[:-1])


def test_without_decodes_a_step_takes_the_whole_budget() -> None:
    budget = AdaptiveStepBudget(8192, block_size=16, model=trained_model())
    s = make_scheduler(budget)
    add(s, "long", 10000)
    batch = run_step(s, budget)
    assert chunk_of(batch, "long") == 8192 and budget.last_chunk is None
    batch = run_step(s, budget)
    assert chunk_of(batch, "long") == 10000 - 8192


def test_a_burst_of_arrivals_is_admitted_in_one_step() -> None:
    # One request started a moment before ten more arrived: the ten outnumber the one stream,
    # so they prefill together instead of a capped chunk per step.
    budget = AdaptiveStepBudget(8192, block_size=16, multiple=2.5, model=trained_model())
    s = make_scheduler(budget, max_seqs=16)
    add(s, "first", 100)
    run_step(s, budget)
    burst = [add(s, f"b{i}", 100) for i in range(10)]
    batch = run_step(s, budget)
    assert chunk_of(batch, "first") == 1 and budget.last_chunk is None
    assert all(chunk_of(batch, r.request_id) == 100 for r in burst)


def test_arrivals_fewer_than_the_streams_are_capped() -> None:
    budget = AdaptiveStepBudget(8192, block_size=16, multiple=2.5, model=trained_model())
    s = make_scheduler(budget, max_seqs=16)
    decoders = [add(s, f"d{i}", 32) for i in range(4)]
    run_step(s, budget)
    arrivals = [add(s, f"a{i}", 100) for i in range(3)]
    batch = run_step(s, budget)
    assert all(chunk_of(batch, d.request_id) == 1 for d in decoders)
    assert budget.last_chunk is not None
    assert sum(chunk_of(batch, r.request_id) for r in arrivals) < 100


def test_decodes_alone_are_not_capped() -> None:
    budget = AdaptiveStepBudget(2048, block_size=16, model=trained_model())
    s = make_scheduler(budget, max_seqs=8)
    for i in range(8):
        add(s, f"d{i}", 8)
    run_step(s, budget)
    batch = run_step(s, budget)
    assert len(batch.requests) == 8 and budget.last_chunk is None


def test_prefill_progresses_by_min_chunk_tokens_even_when_nothing_fits() -> None:
    model = StepCostModel()  # a hardware on which any chunk costs far more than a decode
    model.add_anchor(step_features([(1, 16)]), 0.010)
    model.add_anchor(step_features([(1, 16)] * 4), 0.011)
    model.add_anchor(step_features([(1, 16), (16, 16)]), 1.0)
    model.add_anchor(step_features([(1, 16), (16, 80)]), 1.0)
    model.add_anchor(step_features([(1, 16), (64, 64)]), 4.0)
    budget = AdaptiveStepBudget(8192, block_size=16, model=model)
    s = make_scheduler(budget)
    add(s, "d", 8)
    run_step(s)
    long = add(s, "long", 100)
    sizes = []
    while long.num_output_tokens == 0 and len(sizes) < 30:
        sizes.append(chunk_of(run_step(s), "long"))
    assert long.num_output_tokens == 1 and sum(sizes) == 100
    # a few tokens a step (the least that costs more than the step's fixed part), never none
    assert all(MIN_CHUNK_TOKENS <= n < 16 for n in sizes[:-1])


def test_a_chunk_is_never_smaller_than_what_amortizes_reading_its_prefix() -> None:
    """On a backend that copies a chunk's prefix out, deep into a long prompt even the least
    chunk takes the step past the limit: the chunk then grows until its tokens cost more than
    that read; while the least chunk keeps the pace, the largest that keeps it wins."""
    model = StepCostModel()  # decodes cost 10 ms; a chunk 1 ms a token plus 0.1 ms per
    for rows in ([(1, 16)], [(1, 16)] * 4, [(1, 16), (16, 16)], [(1, 16), (16, 1016)],
                 [(1, 16), (64, 1064)], [(1, 16), (64, 64)]):  # context token of its prefix
        features = step_features(rows)
        chunk = sum(q * 1e-3 + (c - q) * 1e-4 for q, c in rows if q > 1)
        model.add_anchor(features, 0.010 + chunk)
    budget = AdaptiveStepBudget(8192, block_size=16, model=model)
    assert 8 < budget.chunk_tokens([64], 0) < 16  # ~15 ms fits 2.5 x 10 ms: tokens, not a block
    deep = budget.chunk_tokens([64], 1600)  # prefix read 160 ms: ~160 tokens cost more
    assert 150 <= deep <= 176 and deep % 16 == 0
    # 2 ms fixed: the least chunk keeps the pace, so the largest that does (~13 tokens)
    assert 8 < budget.chunk_tokens([64], 20) < 16


def test_the_startup_profile_tells_a_chunks_context_read_from_its_attention() -> None:
    """The profile's shapes, timed on a hardware like a 2-core CPU serving SmolLM2 (a 35 ms
    decode step; a chunk deep in a prompt costs 2.5 µs per context token read plus 0.6 µs per
    query x context) with a few percent of noise per measurement: the fit must tell the two
    deep terms apart, so the chunk it picks deep into an 8k prompt keeps the step near its
    limit instead of far past it (one deep chunk size put the whole cost on the context read
    and picked 128-token chunks there)."""
    coef = (30e-3, 0.9e-3, 0.5e-3, 1.5e-6, 2.5e-6, 0.6e-6)

    def hardware(features: tuple[float, ...]) -> float:
        return sum(c * x for c, x in zip(coef, features, strict=True))

    rng = random.Random(0)
    for _ in range(20):
        model = StepCostModel()
        for shape in profile_shapes(8192, 64):
            features = batch_features(shape_batch(shape, 16))
            model.add_anchor(features, hardware(features) * rng.uniform(0.97, 1.03))
        budget = AdaptiveStepBudget(8192, block_size=16, multiple=2.5, model=model)
        for context in (2000, 4000, 7800):
            chunk = budget.chunk_tokens([40] * 4, context)
            alone = hardware(step_features([(1, 40)] * 4))
            step = hardware(step_features([(1, 40)] * 4 + [(chunk, context + chunk)]))
            assert step <= 2.5 * 1.15 * alone, (context, chunk, step / alone)
            assert step >= 2.5 * 0.7 * alone or chunk == MIN_CHUNK_TOKENS, (context, chunk)


def test_before_any_measurement_the_chunk_falls_back_to_a_fixed_size() -> None:
    budget = AdaptiveStepBudget(8192, block_size=16)
    s = make_scheduler(budget)
    add(s, "d", 8)
    run_step(s)
    add(s, "long", 1000)
    assert chunk_of(run_step(s), "long") == 256


def test_every_running_decode_fits_the_budget_at_max_num_seqs() -> None:
    """vLLM's rule: the budget is never below max_num_seqs, so a full batch of decodes fits
    in one step, with prefill still moving beside it."""
    args = EngineArgs(max_num_seqs=3000)
    assert resolve_max_num_batched_tokens(args, max_model_len=1024) == 3000
    assert resolve_max_num_batched_tokens(EngineArgs(), max_model_len=1024) == 2048
    assert resolve_max_num_batched_tokens(EngineArgs(), max_model_len=32768) == 8192
    model = StepCostModel()
    model.add_anchor(step_features([(1, 16)]), 0.010)
    model.add_anchor(step_features([(1, 16), (64, 64)]), 4.0)
    budget = AdaptiveStepBudget(64, block_size=16, model=model)
    s = make_scheduler(budget, max_seqs=64, fixed=64)
    for i in range(63):
        add(s, f"d{i}", 1)
    run_step(s)
    add(s, "long", 100)
    batch = run_step(s)
    assert sum(1 for r in batch.requests if len(r.token_ids) == 1) == 63
    assert chunk_of(batch, "long") == MIN_CHUNK_TOKENS  # beyond max_tokens by the least chunk


def test_an_explicit_budget_is_never_overridden() -> None:
    s = make_scheduler(None, fixed=48)
    add(s, "d", 8)
    run_step(s)
    add(s, "long", 200)
    assert [chunk_of(run_step(s), "long") for _ in range(3)] == [47, 47, 47]


def test_the_cost_model_follows_the_last_steps() -> None:
    """A machine that gets 3x slower (another process took the cores): after a window of
    steps the model predicts the new cost, so the chunks keep the ratio, not the old size."""
    model = trained_model()
    features = step_features([(1, 64)] * 4 + [(64, 1000)])
    for _ in range(64):
        model.observe(features, 3 * fake_seconds(features))
    assert model.predict(features) == pytest.approx(3 * fake_seconds(features), rel=0.05)


def test_an_outlier_step_barely_moves_the_fit() -> None:
    model = trained_model()
    features = step_features([(1, 64)] * 4)
    for _ in range(20):
        model.observe(features, fake_seconds(features))
    model.observe(features, 20 * fake_seconds(features))  # a step stalled by the OS
    assert model.predict(features) == pytest.approx(fake_seconds(features), rel=0.1)


def test_engine_without_the_flag_is_adaptive_and_says_so(
        tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from engine.llm_engine import LLMEngine

    caplog.set_level(logging.INFO, logger="kvserve")
    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), max_model_len=512))
    try:
        assert isinstance(engine.scheduler.step_budget, AdaptiveStepBudget)
        assert engine.step_budget is not None and engine.step_budget.model.ready
        assert engine.step_budget.max_tokens == engine.max_num_batched_tokens == 2048
    finally:
        engine.shutdown()
    assert "Token budget per step: adaptive" in caplog.text
    caplog.clear()
    engine = LLMEngine(EngineArgs(model=str(tiny_llama_dir), max_model_len=512,
                                  max_num_batched_tokens=64))
    try:
        assert engine.scheduler.step_budget is None
        assert engine.scheduler.max_num_batched_tokens == 64
    finally:
        engine.shutdown()
    assert "Token budget per step: 64 tokens (--max-num-batched-tokens: fixed" in caplog.text


def test_the_fit_is_the_exact_non_negative_least_squares_solution() -> None:
    """Against a brute force over every set of zero coefficients (numpy's least squares on the
    rest), on steps whose best unconstrained fit has negative terms."""
    np = pytest.importorskip("numpy")
    from engine.core.step_cost import FEATURE_SCALES, _weighted_nnls

    rng = random.Random(52)
    rows, targets = [], []
    for _ in range(40):
        shape = [(1, rng.randint(16, 3000))] * rng.randint(1, 8)
        if rng.random() < 0.6:
            q = rng.randint(2, 256)
            shape.append((q, q + rng.randint(0, 4000)))
        features = step_features(shape)
        rows.append([x / s for x, s in zip(features, FEATURE_SCALES, strict=True)])
        # mixed signs: some best unconstrained coefficients are negative, and a term the
        # active set takes in must be let go again (these seeds and terms make it so)
        targets.append(max(1e-3, 0.02 - 1e-3 * features[1] + 8.2e-4 * features[2]
                           + 4.3e-7 * features[3] - 2.6e-6 * features[4]
                           + 5.8e-7 * features[5] + rng.uniform(0, 0.004)))
    weights = [rng.uniform(0.2, 1.0) for _ in rows]
    a = np.array(rows) / np.array(targets)[:, None] * np.sqrt(weights)[:, None]
    b = np.sqrt(weights)

    def objective(c: np.ndarray) -> float:
        return float(((a @ c - b) ** 2).sum())

    best = None
    n = a.shape[1]
    for mask in range(1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        c = np.zeros(n)
        if cols:
            c[cols] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (c >= 0).all() and (best is None or objective(c) < objective(best)):
            best = c
    ours = np.array(_weighted_nnls(rows, targets, weights))
    assert (ours >= 0).all()
    assert objective(ours) <= objective(best) * (1 + 1e-6)
