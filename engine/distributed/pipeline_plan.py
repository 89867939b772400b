"""`kvserve plan --pipeline-parallel-size N`: the planner's figures for one stage's GPU.

Each stage holds its layers' weights and the KV cache of its layers only, for every token, so
the bytes per token shrink with the stage's share of the layers and the same memory holds more
tokens. Every stage allocates the same number of blocks (block ids are global), so the largest
stage sizes the plan: its layers and one vocab matrix (the first stage's embedding or the last
stage's LM head; an upper bound for the middle stages, which hold neither).
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
    """The plan of the largest stage's GPU; `model_config` of the report is that stage's."""
    args.validate()
    cfg, label = load_model_config(args.model)
    size = args.pipeline_parallel_size
    check_pipeline_parallel_size(cfg, size)
    stage = dataclasses.replace(stage_kv_config(cfg, size), tie_word_embeddings=True)
    stage_args = dataclasses.replace(args, pipeline_parallel_size=1, model=label)
    return build_plan(stage_args, memory_bytes, model_config=stage)


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
    memory = _memory_lines(report)
    memory[0] = memory[0].replace("Memory:", "Memory per GPU:", 1)
    recommendation = _recommendation_lines(report)
    if report.recommendation is not None:
        stage_line = capacity_log_lines(report.kv_plan, PLAN_DEVICE,
                                        report.recommendation.max_model_len, 1, size)[0]
        recommendation = [f"  {stage_line}" if line.startswith("  Available KV cache memory:")
                          else line for line in recommendation]
    sections = [model_lines, memory, _kv_lines(report), _table_lines(report), recommendation]
    return "\n\n".join("\n".join(lines) for lines in sections)


def run_pipeline_plan(ns: argparse.Namespace) -> int:
    """As engine.planner.run_plan, for --pipeline-parallel-size > 1."""
    try:
        args = engine_args_from_flags(ns, "plan")
        size = args.pipeline_parallel_size
        report = build_pipeline_plan(args, _resolve_memory(ns.memory))
        text = format_pipeline_plan(report, size)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0 if report.recommendation is not None else 1
