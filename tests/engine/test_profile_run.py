"""The GPU memory profile's dummy step (ModelRunner.profile_batch), run here on the CPU: the
whole token budget, in prompts no longer than max_model_len, through a real forward."""

from __future__ import annotations

from pathlib import Path

from engine import LLM


def test_profile_step_fits_max_model_len_and_runs(tiny_llama_dir: Path) -> None:
    # A budget of 4.5 max_model_lens: one prompt of the whole budget would index the rotary
    # table past its end (on CUDA: a device-side assert that poisons the process).
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64,
              max_num_batched_tokens=288, kv_cache_memory_bytes=1 << 22)
    runner = llm.engine.runner
    batch, num_blocks = runner.profile_batch(288)
    lengths = [len(r.token_ids) for r in batch.requests]
    assert lengths == [64, 64, 64, 64, 32]
    tables = [b for r in batch.requests for b in r.block_ids]
    assert sorted(tables) == list(range(num_blocks))  # every block once: no two rows collide
    kept = runner.kv_caches
    try:
        runner.allocate_kv_cache(num_blocks)
        result = runner.execute(batch)
    finally:
        runner.kv_caches = kept
    assert sorted(result.sampled) == [f"profile-{i}" for i in range(5)]
    assert all(0 <= t < runner.config.vocab_size for t in result.sampled.values())
