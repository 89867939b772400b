"""Tensor parallelism on this CPU: a decode step's time with --tensor-parallel-size 1 and 2,
and how much of a TP=2 step rank 0 spends inside its collectives.

SmolLM2-135M cannot be split in two (9 heads, 3 KV heads), so the model is SmolLM2-like with
heads that divide 2: 30 layers, hidden 512, 8 heads / 2 KV heads of 64, MLP 1536, SmolLM2's
49,152-token tokenizer and tied embeddings; config.json only, random weights
(`load_format="dummy"`). Each step is a synthetic all-decode batch (N sequences, one token
each, at a fixed context) handed straight to the engine's worker, as the overhead benchmark
does; the worker times forward + sampling on its thread.

The communication time comes from `CommTimer`, a hook this benchmark alone installs on rank 0's
`ParallelGroups` (engine/distributed/parallel_state.py): it wraps the instance's all_reduce,
all_gather and broadcast (the per-layer all-reduces of the row-parallel layers, the
vocab-parallel embedding's all-reduce, the LM head's all-gather, and the step's header and
inputs broadcast to rank 1) and adds up their wall time on the worker thread. That time
includes waiting for rank 1 to reach the same collective, so it is an upper bound on the
transfer itself. Nothing in the engine changes when the hook is not installed.

TP=2 runs twice: with the stage's shared-memory collectives (engine/distributed/
shm_collectives.py, the default on one host's CPU) and with gloo's (KVSERVE_SHM_COLLECTIVES=0).

Threads: each TP rank gets --num-threads / TP, rank 0's worker thread (where it computes)
included.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from loadtest.benchmarks.distributed_serving import CpuMeter
from loadtest.benchmarks.engines import engine_args
from loadtest.benchmarks.machine import wait_for_quiet
from loadtest.benchmarks.overhead import decode_batch, warm_up

SHM_ENV = "KVSERVE_SHM_COLLECTIVES"  # engine/distributed/shm_collectives.py
# SmolLM2-135M's shape with 8 heads / 2 KV heads (hidden 512 = 8 x 64) so TP=2 splits it.
TP_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
COLLECTIVES = ("all_reduce", "all_gather", "broadcast")


@dataclass(frozen=True)
class TPConfig:
    """Decode batch sizes, their context, timed steps and warm-up per configuration."""

    sizes: tuple[int, ...] = (1, 64)
    context: int = 256
    steps: int = 20
    warmup_s: float = 3.0
    # (tensor-parallel size, threads per rank, collectives: "shm", "gloo" or "-" for TP 1)
    setups: tuple[tuple[int, int, str], ...] = ((1, 1, "-"), (1, 2, "-"), (2, 1, "shm"),
                                                (2, 1, "gloo"))
    wait_quiet_s: float = 60.0  # before each setup, wait up to this long for an idle machine

    @classmethod
    def quick(cls) -> TPConfig:
        """Fewer steps and a short warm-up (same sizes), no wait for an idle machine."""
        return cls(context=64, steps=4, warmup_s=0.5, wait_quiet_s=0.0)


def build_tp_model(folder: Path) -> Path:
    """config.json (TP_MODEL_CONFIG) and SmolLM2's tokenizer in `folder`, once (again when
    the config differs)."""
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()) == TP_MODEL_CONFIG:
        return folder
    from engine.model_loader.loader import load_tokenizer, resolve_model

    folder.mkdir(parents=True, exist_ok=True)
    load_tokenizer(resolve_model(None)).save_pretrained(str(folder))
    config.write_text(json.dumps(TP_MODEL_CONFIG, indent=2))  # last: marks it complete
    return folder


class CommTimer:
    """Wall time, calls and bytes of the collectives rank 0 runs on one `ParallelGroups`,
    since the last `take()`. Installed by wrapping the instance's methods (benchmark only)."""

    def __init__(self, groups: Any) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0
        for name in COLLECTIVES:
            setattr(groups, name, self._wrap(getattr(groups, name)))

    def _wrap(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        def timed(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return collective(x, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1
                self.bytes += x.numel() * x.element_size()
        return timed

    def take(self) -> tuple[float, int, int]:
        """(seconds, calls, bytes) since the last take; resets them."""
        out = (self.seconds, self.calls, self.bytes)
        self.seconds, self.calls, self.bytes = 0.0, 0, 0
        return out


def time_steps(engine: LLMEngine, size: int, cfg: TPConfig, timer: CommTimer | None
               ) -> dict[str, Any]:
    """Median step and communication ms of `size`-sequence decode steps (after a warm-up)."""
    sampling = SamplingParams(temperature=0.0, max_tokens=1)
    batch = decode_batch(size, cfg.context, engine.args.block_size, sampling)
    warm_up(engine, batch, cfg.warmup_s)
    if timer is not None:
        timer.take()
    steps, comms, calls, moved = [], [], 0, 0
    for _ in range(cfg.steps):
        steps.append(engine.worker.submit(batch).result()[1])
        if timer is not None:
            seconds, calls, moved = timer.take()
            comms.append(seconds)
    step_ms = statistics.median(steps) * 1e3
    comm_ms = statistics.median(comms) * 1e3 if comms else 0.0
    share = statistics.median(c / s for c, s in zip(comms, steps, strict=True)) if comms else 0.0
    return {"sequences": size, "step_ms": step_ms, "comm_ms": comm_ms, "comm_share": share,
            "collectives_per_step": calls, "comm_kib_per_step": moved / 1024,
            "tok_s": size / (step_ms / 1e3)}


def measure_setup(model: Path, tp: int, threads_per_rank: int, cfg: TPConfig,
                  collectives: str = "shm") -> list[dict[str, Any]]:
    """One engine (TP ranks x threads each, their all-reduces and all-gathers through shared
    memory or gloo); one row per batch size."""
    max_seqs = max(cfg.sizes)
    args = engine_args(str(model), tp * threads_per_rank, max_seqs,
                       max_seqs * (cfg.context + 16), tensor_parallel_size=tp)
    if cfg.wait_quiet_s > 0:
        wait_for_quiet(cfg.wait_quiet_s)
    before = os.environ.get(SHM_ENV)
    os.environ[SHM_ENV] = "0" if collectives == "gloo" else "1"  # read at the groups' setup
    try:
        engine = LLMEngine(args)
    finally:
        if before is None:
            del os.environ[SHM_ENV]
        else:
            os.environ[SHM_ENV] = before
    try:
        timer = CommTimer(engine.tp.groups) if engine.tp is not None else None
        ranks = [p.pid for p in engine.tp.procs if p.pid is not None] if engine.tp else []
        rows = []
        for size in cfg.sizes:
            with CpuMeter(ranks) as cpu:
                row = time_steps(engine, size, cfg, timer)
            row.update(tp=tp, threads_per_rank=threads_per_rank, collectives=collectives,
                       other_cores=cpu.other_cores)
            rows.append(row)
            print(f"[tp] TP={tp} x {threads_per_rank} thread(s) ({collectives}), {size} seqs: "
                  f"{row['step_ms']:.1f} ms/step, comm {row['comm_ms']:.2f} ms "
                  f"({row['comm_share']:.1%})", flush=True)
        return rows
    finally:
        engine.shutdown()


def run_tp(folder: Path, cfg: TPConfig, model: Path | None = None) -> dict[str, Any]:
    """Every setup of `cfg` on the TP model (built under `folder`, or `model` when given)."""
    model = model or build_tp_model(folder / "tp_llama_30l_h512")
    rows = [row for tp, threads, coll in cfg.setups
            for row in measure_setup(model, tp, threads, cfg, coll)]
    config = json.loads((model / "config.json").read_text())
    return {"config": cfg.__dict__ | {"setups": [list(s) for s in cfg.setups]},
            "model": {k: config.get(k) for k in ("hidden_size", "intermediate_size",
                                                  "num_hidden_layers", "num_attention_heads",
                                                  "num_key_value_heads", "vocab_size")},
            "dtype": str(EngineArgs().resolved_dtype(torch.device("cpu"))).removeprefix("torch."),
            "rows": rows}


def tp_speedups(rows: Sequence[dict[str, Any]]) -> dict[int, dict[str, float | None]]:
    """Per batch size: TP=1 step over TP=2 step (1 thread per rank, shared-memory collectives),
    TP=2's comm share with them, and with gloo's."""
    def row(size: int, tp: int, collectives: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["sequences"] == size and r["tp"] == tp
                     and r["threads_per_rank"] == 1
                     and r.get("collectives", "gloo") in (collectives, "-")), None)

    out: dict[int, dict[str, float | None]] = {}
    for size in sorted({r["sequences"] for r in rows}):
        one, two, gloo = row(size, 1, "-"), row(size, 2, "shm"), row(size, 2, "gloo")
        out[size] = {"speedup": one["step_ms"] / two["step_ms"] if one and two else None,
                     "comm_share": two["comm_share"] if two else None,
                     "gloo_comm_share": gloo["comm_share"] if gloo else None,
                     "shm_vs_gloo": gloo["step_ms"] / two["step_ms"] if two and gloo else None}
    return out
