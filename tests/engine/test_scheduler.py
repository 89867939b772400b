"""Scheduler on CPU with tiny blocks and no model: budget, chunking, ordering, preemption."""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.sampling_params import SamplingParams


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 16,
                   max_seqs: int = 8) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    return Scheduler(kv, max_seqs, budget, max_model_len=1024)


def add(s: Scheduler, rid: str, num_prompt: int, max_tokens: int = 8) -> Request:
    req = Request(rid, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens),
                  max_tokens=max_tokens)
    s.add_request(req)
    return req


def run_step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    batch = s.schedule()
    sampled = {r.request_id: token for r in batch.requests if r.sample}
    s.update_from_output(batch, sampled, {})
    return batch


def test_long_prompt_is_chunked_under_the_budget_and_decodes_keep_moving() -> None:
    s = make_scheduler(budget=16)
    short = add(s, "short", 3)
    run_step(s)  # short prefills and samples its first token
    long = add(s, "long", 40)
    sizes = []
    for _ in range(4):
        batch = run_step(s)
        assert batch.num_tokens <= 16
        by_id = {r.request_id: len(r.token_ids) for r in batch.requests}
        assert by_id["short"] == 1  # the decode is in every step
        sizes.append(by_id.get("long", 0))
    assert sizes == [15, 15, 10, 1]  # three chunks, then its first decode
    assert short.num_output_tokens == 5
    assert long.num_output_tokens >= 1


def test_a_chunk_that_does_not_reach_the_end_samples_nothing() -> None:
    s = make_scheduler(budget=8)
    req = add(s, "a", 20)
    batch = run_step(s)
    assert not batch.requests[0].sample and req.num_output_tokens == 0
    run_step(s)
    batch = run_step(s)
    assert batch.requests[0].sample and req.num_output_tokens == 1


def test_max_num_seqs_caps_running_requests() -> None:
    s = make_scheduler(budget=100, max_seqs=2)
    for i in range(4):
        add(s, str(i), 3)
    batch = run_step(s)
    assert len(batch.requests) == 2 and len(s.waiting) == 2


def test_out_of_blocks_preempts_the_most_recently_admitted_and_counts_it() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    first = add(s, "first", 8, max_tokens=12)  # 2 blocks now, up to 5
    second = add(s, "second", 8, max_tokens=12)
    run_step(s)
    assert s.running == [first, second]
    for _ in range(12):
        run_step(s)
        if s.stats.num_preemptions:
            break
    assert s.stats.num_preemptions >= 1
    assert second.num_preemptions >= 1 and first.num_preemptions == 0
    assert second.status in (RequestStatus.PREEMPTED, RequestStatus.RUNNING)
    for _ in range(40):
        if not s.has_unfinished():
            break
        run_step(s)
    assert first.num_output_tokens == 12 and second.num_output_tokens == 12
    assert s.kv.num_free_blocks == 6


def test_abort_frees_blocks_at_once() -> None:
    s = make_scheduler()
    req = add(s, "a", 10)
    run_step(s)
    assert s.kv.num_free_blocks < 64
    s.abort_requests(["a"])
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == 64 and not s.has_unfinished()
    assert "a" in s.schedule().finished_request_ids
