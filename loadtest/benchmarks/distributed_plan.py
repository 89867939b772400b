"""The per-GPU KV arithmetic of a 70B-class model on 8x H200, from `kvserve plan`, with
--tensor-parallel-size 8 and with --tensor-parallel-size 4 --pipeline-parallel-size 2.

No weights: the model is a folder holding only Llama-3.1-70B's published config.json (80
layers, hidden 8192, 64 heads / 8 KV heads of 128, MLP 28672, vocab 128256, untied), which
`kvserve plan` reads. Memory: 140 GiB per GPU, what an H200 (NVIDIA's "141 GB") reports to
the driver; `kvserve plan` run on the GPU measures it itself. The plan is run in-process,
exactly as the command line runs it, and its text is kept for the page.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA_70B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009]}
FOLDER_NAME = "llama-3.1-70b-config"
MEMORY = "140GiB"
LAYOUTS = (("TP=8", ["--tensor-parallel-size", "8"]),
           ("TP=4 x PP=2", ["--tensor-parallel-size", "4", "--pipeline-parallel-size", "2"]))


def write_config(parent: Path) -> Path:
    """parent/llama-3.1-70b-config/config.json (nothing else)."""
    folder = parent / FOLDER_NAME
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_70B_CONFIG, indent=2))
    return folder


def plan_one(folder: Path, flags: list[str]) -> dict[str, Any]:
    """`kvserve plan FOLDER --memory 140GiB FLAGS`: its text and the figures of its report."""
    from engine.capacity import parse_bytes
    from engine.config import engine_args_from_flags
    from engine.distributed.pipeline_plan import (
        build_pipeline_plan,
        format_pipeline_plan,
        plan_args,
    )
    from engine.planner import build_plan, format_plan, rank_weight_config
    from server.cli import build_parser

    ns = build_parser().parse_args(["plan", str(folder), "--memory", MEMORY, *flags])
    memory = parse_bytes(MEMORY)
    pp = ns.pipeline_parallel_size
    if pp > 1:
        report = build_pipeline_plan(plan_args(ns), memory)
        text = format_pipeline_plan(report, pp)
    else:
        report = build_plan(engine_args_from_flags(ns, "plan"), memory)
        text = format_plan(report)
    text = text.replace(str(folder), FOLDER_NAME)
    tp = report.tensor_parallel_size
    len_32k = next((r for r in report.rows if r.max_model_len == 32768), None)
    return {"command": f"kvserve plan {FOLDER_NAME} --memory {MEMORY} {' '.join(flags)}",
            "text": text, "gpus": tp * pp, "tp": tp, "pp": pp,
            "layers_per_gpu": report.kv_config.num_hidden_layers,
            "kv_heads_per_gpu": report.kv_config.num_key_value_heads,
            "weight_params": rank_weight_config(report.model_config, tp).num_params(),
            "weight_gib": report.weight_bytes / 2**30,
            "activation_gib": report.activation.total_bytes / 2**30,
            "kv_gib": report.kv_plan.available_bytes / 2**30,
            "kv_bytes_per_token": report.kv_plan.bytes_per_token,
            "kv_tokens": report.kv_plan.num_tokens,
            "fp8_kv_tokens": report.alt_kv_plan.num_tokens,
            "max_concurrency_32k": len_32k.max_concurrency if len_32k else None}


def run_plans(parent: Path) -> dict[str, Any]:
    """Both layouts on the config-only 70B folder written under `parent`."""
    folder = write_config(parent)
    return {"memory": MEMORY, "config": LLAMA_70B_CONFIG,
            "layouts": [{"name": name, **plan_one(folder, flags)} for name, flags in LAYOUTS]}
