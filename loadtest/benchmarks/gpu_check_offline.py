"""The GPU check's offline throughput (loadtest/benchmarks/gpu_check.py): kvserve's `LLM.generate`
against transformers' continuous batching (`generate_batch`) on the same device, same prompts,
same output lengths (EOS ignored), both with random weights of one Llama-3.2-1B-shaped config.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.sampling_params import SamplingParams
from loadtest.benchmarks.engines import build_tiny_model
from loadtest.benchmarks.gpu_check_report import Report, release, sync

LLAMA32_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True}
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def model_folder(parent: Path, shape: dict[str, Any]) -> Path:
    """The byte-level tokenizer of the engine benchmarks plus a config of `shape` (its vocab
    is the tokenizer's, 4096, so the LM head is small beside a real model's)."""
    folder = build_tiny_model(parent / "offline")
    config = json.loads((folder / "config.json").read_text())
    config.update(shape, model_type="llama", torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def kvserve_offline(folder: Path, device: torch.device, dtype: torch.dtype,
                    prompts: list[list[int]], out_len: int) -> dict[str, Any]:
    """Output tokens/s of one `LLM.generate` over every prompt (after a warm-up request)."""
    from engine import LLM

    llm = LLM(str(folder), load_format="dummy", device=device.type,
              dtype=str(dtype).removeprefix("torch."), max_model_len=1024,
              max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    # Warm-up over every prompt: Triton compiles each new launch shape once per process (a
    # one-prompt warm-up left compiles inside the timed run: 10.9k tok/s cold against 18.5k).
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    sync(device)
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm, outs
    release(device)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}


def hf_offline(folder: Path, device: torch.device, dtype: torch.dtype,
               prompts: list[list[int]], out_len: int) -> dict[str, Any]:
    """Output tokens/s of transformers' `generate_batch` (after a warm-up call)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    gen = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    page = 256
    kwargs = _batching_kwargs(gen, page, sum(-(-(len(p) + out_len) // page) for p in prompts),
                              len(prompts))
    model.generate_batch(inputs=prompts[:2], generation_config=gen, **kwargs)
    sync(device)
    started = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=gen, **kwargs)
    sync(device)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    del model
    release(device)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}


def _batching_kwargs(gen: Any, page: int, blocks: int, requests: int) -> dict[str, Any]:
    """generate_batch's cache settings: a ContinuousBatchingConfig on newer transformers (whose
    field names moved between releases: page_size was block_size), the GenerationConfig's own
    fields on older ones."""
    import inspect

    wanted: dict[str, Any] = {"page_size": page, "block_size": page, "num_blocks": blocks,
              "max_batch_tokens": 2048, "max_requests_per_batch": requests}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        for key, value in wanted.items():
            setattr(gen, key, value)
        return {}
    accepted = inspect.signature(ContinuousBatchingConfig).parameters
    return {"continuous_batching_config": ContinuousBatchingConfig(
        **{k: v for k, v in wanted.items() if k in accepted})}


def offline_throughput(report: Report, device: torch.device, smoke: bool) -> None:
    """kvserve vs generate_batch: 256 prompts of 64..192 tokens, 128 output tokens each."""
    shape = SMOKE_SHAPE if smoke else LLAMA32_1B
    dtype = torch.float32 if smoke else torch.bfloat16
    count, out_len = (8, 8) if smoke else (256, 128)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randrange(64, 193))]
               for _ in range(count)]
    result: dict[str, Any] = {"shape": "smoke" if smoke else "Llama-3.2-1B", "prompts": count,
                              "output_len": out_len}
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp), shape)
        result["kvserve"] = kvserve_offline(folder, device, dtype, prompts, out_len)
        try:
            result["generate_batch"] = hf_offline(folder, device, dtype, prompts, out_len)
        except Exception as exc:  # an older transformers without it: kvserve's figure stands
            result["generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            release(device)
    report.sections["offline"] = result
    ours, theirs = result["kvserve"]["tokens_per_s"], result["generate_batch"]
    if "error" in theirs:
        report.add("offline tok/s (1B shape)", f"kvserve {ours:.0f}; generate_batch failed: "
                   f"{theirs['error'][:100]}")
    else:
        report.add("offline tok/s (1B shape)",
                   f"kvserve {ours:.0f}, generate_batch {theirs['tokens_per_s']:.0f} "
                   f"({ours / theirs['tokens_per_s']:.1f}x)")

