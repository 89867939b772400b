"""The GPU check's decode throughput (loadtest/benchmarks/gpu_check.py): a Llama-3-8B-shaped
model (random bfloat16 weights) with and without CUDA graphs, and with int4 and int8 weights
(CUDA graphs on), beside transformers' `generate`. Each variant's engine is built once and
decodes every batch (a quantized one takes ~40 s to build: its random float32 weights are made
in host memory and quantized on the GPU); its figures are printed as soon as it is done."""

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


class _Engine:
    """One model runner for every batch of a variant: built (and, with a method, quantized at
    load: ~40 s for the 8B shape's random float32 weights in host memory) once, with KV blocks
    and CUDA graphs for the largest batch."""

    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, max_batch: int,
                 graphs: bool, max_len: int, quantization: str = "none") -> None:
        config = ModelConfig.from_folder(folder)
        source = ModelSource(folder, "hf", config, "llama3-8b-shape")
        args = EngineArgs(model=str(folder), load_format="dummy", enforce_eager=not graphs,
                          max_num_seqs=max_batch, attention_backend="auto",
                          quantization=quantization)
        self.device = device
        self.runner = ModelRunner(source, args, device, dtype, max_len)
        self.blocks_per_seq = -(-max_len // args.block_size)
        self.runner.allocate_kv_cache(max_batch * self.blocks_per_seq)
        self.runner.init_cuda_graphs(max_batch)

    def decode_tps(self, batch: int, prompt_len: int, steps: int) -> float:
        """Output tok/s of `steps` greedy decode steps of `batch` fresh sequences."""
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        per = self.blocks_per_seq
        tables = [tuple(range(i * per, (i + 1) * per)) for i in range(batch)]
        ids = [f"b{batch}-{i}" for i in range(batch)]  # new requests for each batch
        prefill = tuple(ScheduledRequest(ids[i], tuple([7] * prompt_len), 0, tables[i], True,
                                         params) for i in range(batch))
        last = self.runner.execute(SchedulerOutput(prefill)).sampled
        sync(self.device)
        started = time.perf_counter()
        for step in range(steps):
            batch_step = tuple(ScheduledRequest(ids[i], (last[ids[i]],), prompt_len + step,
                                                tables[i], True, params) for i in range(batch))
            last = self.runner.execute(SchedulerOutput(batch_step)).sampled
        sync(self.device)
        return batch * steps / (time.perf_counter() - started)


def _hf_generate_tps(folder: Path, device: torch.device, dtype: torch.dtype,
                     batches: list[int], prompt_len: int, steps: int) -> list[float]:
    """transformers' `generate` at each batch (its prefill included), one model for all."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    rates = []
    for batch in batches:
        ids = torch.full((batch, prompt_len), 7, device=device)
        kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        sync(device)
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kwargs)
        sync(device)
        rates.append(batch * steps / (time.perf_counter() - started))
    return rates


def llama8b_throughput(report: Report, device: torch.device, smoke: bool,
                       shape: dict[str, Any]) -> None:
    """Decode tok/s at batch 1/32/128: kvserve with and without graphs, transformers."""
    if smoke:
        shape = {**shape, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
    dtype = torch.float32 if smoke else torch.bfloat16
    batches, steps, prompt_len = ([1, 4], 8, 16) if smoke else ([1, 32, 128], 128, 128)
    graph_modes = [False] if device.type != "cuda" else [True, False]
    on_gpu = device.type == "cuda"
    # (column, CUDA graphs, method): the quantized ones with graphs where the device has them
    variants = [("kvserve_graphs" if g else "kvserve_eager", g, "none") for g in graph_modes]
    variants += [(f"kvserve_{m}", on_gpu, m) for m in QUANTIZED]
    rows: list[dict[str, Any]] = [{"batch": batch} for batch in batches]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _write_config(folder, shape)
        for key, graphs, method in variants:
            engine = _Engine(folder, device, dtype, max(batches), graphs,
                             prompt_len + steps + 16, method)
            for row in rows:
                row[key] = engine.decode_tps(row["batch"], prompt_len, steps)
            print(f"[gpu_check] 8B-shape decode tok/s, {key}: " + ", ".join(
                f"batch {row['batch']} {row[key]:.0f}" for row in rows), flush=True)
            del engine
            release(device)
        rates = _hf_generate_tps(folder, device, dtype, batches, prompt_len, steps)
        release(device)
    for row, rate in zip(rows, rates, strict=True):
        row["transformers"] = rate
        report.add(f"8B-shape decode tok/s, batch {row['batch']}",
                   ", ".join(f"{k} {v:.0f}" for k, v in row.items() if k != "batch"))
    report.sections["llama8b_decode"] = rows
