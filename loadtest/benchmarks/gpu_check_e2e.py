"""The end-to-end parts of the GPU check (loadtest/benchmarks/gpu_check.py): greedy parity against transformers, and decode
throughput of a Llama-3-8B-shaped model (random bfloat16 weights) with and without CUDA graphs
beside transformers' `generate`."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineArgs, ModelConfig
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.model_loader.loader import ModelSource
from engine.sampling_params import SamplingParams
from engine.worker.model_runner import ModelRunner
from loadtest.benchmarks.common import ROOT

if TYPE_CHECKING:
    from loadtest.benchmarks.gpu_check_report import Report

TOP_K = 5


def _hf_topk(model: Any, prompt: list[int], max_new_tokens: int, device: torch.device
             ) -> tuple[list[int], list[set[int]]]:
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    tops = [set(s[0].topk(TOP_K).indices.tolist()) for s in out.scores]
    return tokens, tops


def _divergence_ok(ours: list[int], our_tops: list[set[int]], theirs: list[int],
                   their_tops: list[set[int]]) -> bool:
    """Equal until the first difference, where each side's token is in the other's top 5."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return a in their_tops[i] and b in our_tops[i]
    return True


def _parity_one(name: str, model_path: str, gguf_file: str | None, device: torch.device,
                dtype: torch.dtype, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from engine import LLM

    llm = LLM(model_path if gguf_file is None else str(Path(model_path) / gguf_file),
              dtype=str(dtype).removeprefix("torch."), device=device.type, max_model_len=1024,
              kv_cache_memory_bytes=256 * 2**20)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True,
                            logprobs=TOP_K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    hf = AutoModelForCausalLM.from_pretrained(model_path, device_map=device.type,
                                              **kwargs).eval()
    bad = identical = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.outputs[0].token_ids
        our_tops = [{t for t, lp in step.items() if lp.rank is not None and lp.rank <= TOP_K}
                    for step in out.outputs[0].logprobs or []]
        theirs, their_tops = _hf_topk(hf, prompt, max_new, device)
        identical += ours == theirs
        bad += not _divergence_ok(ours, our_tops, theirs, their_tops)
    return {"model": name, "prompts": len(prompts), "identical": identical,
            "disallowed_divergences": bad}


def greedy_parity(report: Report, device: torch.device, smoke: bool) -> None:
    """Tiny model and (on GPU) SmolLM2, bfloat16, against transformers under the top-5 rule."""
    if str(ROOT) not in sys.path:  # tests/ is a package of the repository, not installed
        sys.path.insert(0, str(ROOT))
    from tests.support.tiny_models import build_tiny_model, random_prompts

    dtype = torch.float32 if smoke else torch.bfloat16
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny", "llama", seed=0)
        prompts = random_prompts(512, 4 if smoke else 16, 4, 60, seed=3)
        results.append(_parity_one("tiny llama", str(tiny), None, device, dtype, prompts,
                                   8 if smoke else 32))
    if not smoke:
        from engine.model_loader.gguf.weights import default_model_path

        gguf = default_model_path()
        prompts = random_prompts(1000, 16, 8, 100, seed=4)
        results.append(_parity_one("SmolLM2-135M (GGUF)", str(gguf.parent), gguf.name, device,
                                   dtype, prompts, 32))
    report.sections["parity"] = results
    for r in results:
        report.add(f"greedy parity, {r['model']}",
                   f"{r['identical']}/{r['prompts']} identical, "
                   f"{r['disallowed_divergences']} outside top-5",
                   "PASS" if r["disallowed_divergences"] == 0 else "FAIL")


def _write_config(folder: Path, shape: dict[str, Any]) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", **shape}
    (folder / "config.json").write_text(json.dumps(config))


def _engine_decode_tps(folder: Path, device: torch.device, dtype: torch.dtype, batch: int,
                       graphs: bool, prompt_len: int, steps: int) -> float:
    config = ModelConfig.from_folder(folder)
    source = ModelSource(folder, "hf", config, "llama3-8b-shape")
    args = EngineArgs(model=str(folder), load_format="dummy", enforce_eager=not graphs,
                      max_num_seqs=batch, attention_backend="auto")
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
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for step in range(steps):
        batch_step = tuple(ScheduledRequest(str(i), (last[str(i)],), prompt_len + step,
                                            tables[i], True, params) for i in range(batch))
        last = runner.execute(SchedulerOutput(batch_step)).sampled
    if device.type == "cuda":
        torch.cuda.synchronize()
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
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
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
            row["transformers"] = _hf_generate_tps(folder, device, dtype, batch, prompt_len,
                                                   steps)
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            report.add(f"8B-shape decode tok/s, batch {batch}",
                       ", ".join(f"{k} {v:.0f}" for k, v in row.items() if k != "batch"))
    report.sections["llama8b_decode"] = rows
