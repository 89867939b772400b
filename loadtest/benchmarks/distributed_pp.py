"""Pipeline parallelism on this CPU: what the batch queue buys.

One PP=2 engine (1 thread per stage, so each stage has a core of its own) generates the same
offline workload twice per repeat: with the batch queue (rank 0 launches a batch to the first
stage and finishes the one before while that stage computes, each batch half the requests),
and with the batch queue switched off on the same engine (`engine.batch_queue = False`: the
same half-batches, each run through both stages before the next starts, so one stage is always
idle). One process with 2 threads on the same workload is the reference. The model is the TP
benchmark's SmolLM2-like Llama (30 layers, random weights, distributed_tp.TP_MODEL_CONFIG), 15
layers per stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from loadtest.benchmarks.distributed_serving import CpuMeter
from loadtest.benchmarks.distributed_tp import build_tp_model
from loadtest.benchmarks.machine import wait_for_quiet

SETUPS = ("PP=1, 2 threads", "PP=2 x 1 thread, batch queue", "PP=2 x 1 thread, one batch at a time")


@dataclass(frozen=True)
class PPConfig:
    """The offline workload: requests x (prompt, output) tokens, best of `repeats`."""

    requests: int = 32
    prompt_len: int = 32
    max_tokens: int = 64
    repeats: int = 3
    wait_quiet_s: float = 60.0

    @classmethod
    def quick(cls) -> PPConfig:
        """A smoke run."""
        return cls(requests=4, prompt_len=8, max_tokens=8, repeats=1, wait_quiet_s=0.0)


def _generate(llm: LLM, cfg: PPConfig) -> float:
    """Output tokens/s of one pass over the workload."""
    prompts = [{"prompt_token_ids": [1 + (i * 7 + j) % 1000 for j in range(cfg.prompt_len)]}
               for i in range(cfg.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return cfg.requests * cfg.max_tokens / (time.perf_counter() - started)


def _engine(model: Path, pp: int) -> LLM:
    return LLM(str(model), load_format="dummy", pipeline_parallel_size=pp, num_threads=2,
               max_model_len=1024, kv_cache_memory_bytes=1 << 28, max_num_seqs=64)


def run_pp(folder: Path, cfg: PPConfig, model: Path | None = None) -> dict[str, Any]:
    """Best output tokens/s of each setup, and the batch queue's gain."""
    model = model or build_tp_model(folder / "tp_llama_30l_h512")
    if cfg.wait_quiet_s > 0:
        wait_for_quiet(cfg.wait_quiet_s)
    best: dict[str, float] = dict.fromkeys(SETUPS, 0.0)
    other: dict[str, float] = dict.fromkeys(SETUPS, 0.0)
    one = _engine(model, 1)
    try:
        _generate(one, PPConfig.quick())
        for _ in range(cfg.repeats):
            with CpuMeter([]) as cpu:
                best[SETUPS[0]] = max(best[SETUPS[0]], _generate(one, cfg))
            other[SETUPS[0]] = max(other[SETUPS[0]], cpu.other_cores or 0.0)
    finally:
        one.engine.shutdown()
    two = _engine(model, 2)
    try:
        ranks = [p.pid for p in two.engine.ranks.procs if p.pid is not None] \
            if two.engine.ranks else []
        _generate(two, PPConfig.quick())
        for _ in range(cfg.repeats):
            for name, queue in ((SETUPS[1], True), (SETUPS[2], False)):
                two.engine.batch_queue = queue
                with CpuMeter(ranks) as cpu:
                    best[name] = max(best[name], _generate(two, cfg))
                other[name] = max(other[name], cpu.other_cores or 0.0)
        two.engine.batch_queue = True
    finally:
        two.engine.shutdown()
    rows = [{"setup": name, "tok_s": best[name], "other_cores": other[name]} for name in SETUPS]
    for row in rows:
        print(f"[pp] {row['setup']}: {row['tok_s']:.1f} output tok/s", flush=True)
    queued, serial = best[SETUPS[1]], best[SETUPS[2]]
    return {"config": cfg.__dict__, "rows": rows,
            "batch_queue_gain": queued / serial if serial else None,
            "vs_one_process": queued / best[SETUPS[0]] if best[SETUPS[0]] else None}
