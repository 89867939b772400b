"""`kvserve plan --pipeline-parallel-size N`: the planner's figures for one stage's GPU.

Each stage holds its layers' weights and the KV cache of its layers only, for every token, so
the bytes per token shrink with the stage's share of the layers and the same memory holds more
tokens. Every stage allocates the same number of blocks (block ids are global), so the largest
stage sizes the plan: its layers and one vocab matrix (the first stage's embedding or the last
stage's LM head; an upper bound for the middle stages, which hold neither).

With --tensor-parallel-size T as well, each stage's layers are split over T GPUs as
`kvserve plan -tp T` splits a whole model (their heads, KV heads, MLP and vocab slice), so the
figures are one GPU's of T x N. This is the planner's arithmetic only: `kvserve serve` does not
run tensor and pipeline parallelism together yet.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from engine.capacity import capacity_log_lines
from engine.config import EngineArgs, engine_args_from_flags
from engine.models.pipeline_layers import (
    check_pipeline_parallel_size,
    split_layers,
    stage_kv_config,
)
from engine.planner import (
    PLAN_DEVICE,
    PlanReport,
    _kv_lines,
    _memory_lines,
    _recommendation_lines,
    _resolve_memory,
    _table_lines,
    build_plan,
    load_model_config,
)


def build_pipeline_plan(args: EngineArgs, memory_bytes: int) -> PlanReport:
    """The plan of the largest stage's GPU (of one of its tensor-parallel ranks, with
    --tensor-parallel-size); `model_config` of the report is that stage's."""
    size = args.pipeline_parallel_size
    stage_args = dataclasses.replace(args, pipeline_parallel_size=1)
    stage_args.validate()  # TP x PP is checked as one stage's TP: the arithmetic holds
    cfg, label = load_model_config(args.model)
    check_pipeline_parallel_size(cfg, size)
    stage = dataclasses.replace(stage_kv_config(cfg, size), tie_word_embeddings=True)
    return build_plan(dataclasses.replace(stage_args, model=label), memory_bytes,
                      model_config=stage)


def format_pipeline_plan(report: PlanReport, size: int) -> str:
    """The planner's sections, headed by the whole model and its split into stages."""
    full, _ = load_model_config(report.model)
    bounds = split_layers(full.num_hidden_layers, size)
    stages = ", ".join(f"stage {i}{' holds' if i == 0 else ''} layers {a}-{b - 1}"
                       for i, (a, b) in enumerate(bounds))
    model_lines = [
        f"Model: {report.model} ({full.architecture})",
        f"  {full.num_hidden_layers} layers, {full.num_attention_heads} heads / "
        f"{full.num_key_value_heads} KV heads, head_dim {full.head_dim}, hidden "
        f"{full.hidden_size:,}, vocab {full.vocab_size:,}, max_position_embeddings "
        f"{full.max_position_embeddings:,}",
        f"  --pipeline-parallel-size {size}: {stages}, each with the KV cache of its layers; "
        f"figures below are per GPU, for the largest stage "
        f"({report.model_config.num_hidden_layers} layers and one vocab matrix)"]
    tp = report.tensor_parallel_size
    if tp > 1:
        model_lines.append(
            f"  --tensor-parallel-size {tp} within each stage ({tp * size} GPUs): each GPU "
            f"holds {report.kv_config.num_attention_heads} heads / "
            f"{report.kv_config.num_key_value_heads} KV heads of its stage's layers, 1/{tp} of "
            "their MLP and of the vocab matrix")
    memory = _memory_lines(report)
    memory[0] = memory[0].replace("Memory:", "Memory per GPU:", 1)
    recommendation = _recommendation_lines(report)
    if report.recommendation is not None:
        stage_line = capacity_log_lines(report.kv_plan, PLAN_DEVICE,
                                        report.recommendation.max_model_len, tp, size
                                        )[0].replace(" per rank (", " per GPU (")
        recommendation = [f"  {stage_line}" if line.startswith("  Available KV cache memory:")
                          else line for line in recommendation]
    sections = [model_lines, memory, _kv_lines(report), _table_lines(report), recommendation]
    return "\n\n".join("\n".join(lines) for lines in sections)


def plan_args(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from plan's flags, validated as one stage's (so -tp T -pp N is planned)."""
    size = ns.pipeline_parallel_size
    ns = argparse.Namespace(**{**vars(ns), "pipeline_parallel_size": 1})
    return dataclasses.replace(engine_args_from_flags(ns, "plan"), pipeline_parallel_size=size)


def run_pipeline_plan(ns: argparse.Namespace) -> int:
    """As engine.planner.run_plan, for --pipeline-parallel-size > 1."""
    try:
        args = plan_args(ns)
        size = args.pipeline_parallel_size
        report = build_pipeline_plan(args, _resolve_memory(ns.memory))
        text = format_pipeline_plan(report, size)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0 if report.recommendation is not None else 1
