"""The GPU check's decode throughput (loadtest/benchmarks/gpu_check.py): a Llama-3-8B-shaped
model (random bfloat16 weights) with and without CUDA graphs, and with int4 and int8 weights
(CUDA graphs on), beside transformers' `generate`."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineArgs, ModelConfig
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.model_loader.loader import ModelSource
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner
from loadtest.benchmarks.gpu_check_report import Report, release, sync

QUANTIZED = ("int4", "int8")


def _write_config(folder: Path, shape: dict[str, Any]) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", **shape}
    (folder / "config.json").write_text(json.dumps(config))


def _engine_decode_tps(folder: Path, device: torch.device, dtype: torch.dtype, batch: int,
                       graphs: bool, prompt_len: int, steps: int,
                       quantization: str = "none") -> float:
    config = ModelConfig.from_folder(folder)
    source = ModelSource(folder, "hf", config, "llama3-8b-shape")
    args = EngineArgs(model=str(folder), load_format="dummy", enforce_eager=not graphs,
                      max_num_seqs=batch, attention_backend="auto", quantization=quantization)
    max_len = prompt_len + steps + 16
    runner = ModelRunner(source, args, device, dtype, max_len)
    blocks_per_seq = -(-max_len // args.block_size)
    runner.allocate_kv_cache(batch * blocks_per_seq)
    runner.init_cuda_graphs(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    tables = [tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    prefill = tuple(ScheduledRequest(str(i), tuple([7] * prompt_len), 0, tables[i], True, params)
                    for i in range(batch))
    last = runner.execute(SchedulerOutput(prefill)).sampled
    sync(device)
    started = time.perf_counter()
    for step in range(steps):
        batch_step = tuple(ScheduledRequest(str(i), (last[str(i)],), prompt_len + step,
                                            tables[i], True, params) for i in range(batch))
        last = runner.execute(SchedulerOutput(batch_step)).sampled
    sync(device)
    return batch * steps / (time.perf_counter() - started)


def _hf_generate_tps(folder: Path, device: torch.device, dtype: torch.dtype, batch: int,
                     prompt_len: int, steps: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.full((batch, prompt_len), 7, device=device)
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
    sync(device)
    started = time.perf_counter()
    model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kwargs)
    sync(device)
    return batch * steps / (time.perf_counter() - started)  # includes its prefill


def llama8b_throughput(report: Report, device: torch.device, smoke: bool,
                       shape: dict[str, Any]) -> None:
    """Decode tok/s at batch 1/32/128: kvserve with and without graphs, transformers."""
    if smoke:
        shape = {**shape, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
    dtype = torch.float32 if smoke else torch.bfloat16
    batches, steps, prompt_len = ([1, 4], 8, 16) if smoke else ([1, 32, 128], 128, 128)
    graph_modes = [False] if device.type != "cuda" else [True, False]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _write_config(folder, shape)
        for batch in batches:
            row: dict[str, Any] = {"batch": batch}
            for graphs in graph_modes:
                key = "kvserve_graphs" if graphs else "kvserve_eager"
                row[key] = _engine_decode_tps(folder, device, dtype, batch, graphs, prompt_len,
                                              steps)
                release(device)
            for method in QUANTIZED:  # weight-only, through the Triton kernel on CUDA
                row[f"kvserve_{method}"] = _engine_decode_tps(
                    folder, device, dtype, batch, device.type == "cuda", prompt_len, steps,
                    method)
                release(device)
            row["transformers"] = _hf_generate_tps(folder, device, dtype, batch, prompt_len,
                                                   steps)
            rows.append(row)
            release(device)
            report.add(f"8B-shape decode tok/s, batch {batch}",
                       ", ".join(f"{k} {v:.0f}" for k, v in row.items() if k != "batch"))
    report.sections["llama8b_decode"] = rows
