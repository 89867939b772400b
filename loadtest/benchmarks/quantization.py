"""Weight-only quantization (`--quantization int8|int4|gguf`) and the model dtype on CPU:
resident weight bytes, decode speed and quality, on the embedded SmolLM2-135M-Instruct GGUF.

The methods: `none` dequantizes the file to floats (the reference), `int8` and `int4` quantize
those floats again at load, and `gguf` keeps the file's own Q4_1 blocks in place (the default
for a GGUF file wherever they run fused). Each run loads its own
`LLM(quantization=..., dtype=...)` with the suite's thread count, then:
- resident weights: the engine's `runner.weight_bytes()` (quantized codes and scales, the
  oneDNN-packed copies of float layers, tied tensors once), as its startup line reports them;
- perplexity: a fixed English text shipped with the interpreter (the standard library's
  LICENSE.txt), tokenized by the model's own tokenizer, scored through the engine's own
  forward and paged KV cache in sliding windows (`quantization_quality`, whose docstring
  gives the method);
- decode tokens/s at batch 1 and at 64 sequences, as the offline benchmark measures them: the
  median wall time of N `engine.step()` calls taken once every sequence decodes (random-id
  prompts of 32 tokens, greedy, EOS ignored; the step includes scheduling and output
  handling), divided into the sequences per step;
- greedy agreement with the float32 unquantized model over chat prompts (fp8_quality's
  measures: prefix agreement, identical outputs, mean |logprob| difference of the chosen token
  over the common prefix).
The float32-model quantized runs are measured only where they are cheap, i.e. where the engine
runs them on the fused kernels with bfloat16 activations (a CPU with native bf16); elsewhere
they dequantize every weight per matmul, 3-5x slower than unquantized (README).

Alone: `python -m loadtest.benchmarks.quantization [--quick] [--threads N] [--json PATH]`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine import LLM
from engine.cpu_features import NATIVE_BF16_FLAGS, auto_cpu_dtype, read_cpu_flags
from engine.quantization import Int8Method, QuantizedLinear, apply_plan
from engine.worker.model_runner import ModelRunner
from loadtest.benchmarks.common import (
    SuiteContext,
    format_table,
    random_prompts,
    run_alone,
    target_line,
)
from loadtest.benchmarks.fp8_quality import PROMPTS, compare, greedy_chat
from loadtest.benchmarks.machine import QUIET_CORES, cpu_model, other_cpu_values, timed
from loadtest.benchmarks.offline_run import kvserve_decode
from loadtest.benchmarks.quantization_quality import load_text, perplexity

NAME = "Weight quantization: resident bytes, decode speed and quality"
COMMAND = "python -m loadtest.benchmarks.quantization [--quick] [--threads N] [--json PATH]"
# Issue 12 asks for the quality table and the resident bytes per method, with no figure to
# reach; the margins below are this benchmark's (quality: the SmolLM2 margins of
# tests/engine/test_quantization.py::test_smollm2_quality, plus a perplexity bound).
PPL_LIMIT = 1.05  # quantized perplexity / float32 unquantized
MIN_AGREEMENT = {"int8": 0.20, "int4": 0.30, "gguf": 0.30}
MAX_MAD = {"int8": 0.10, "int4": 0.08, "gguf": 0.08}
TARGET = ("issue 12: a quality table (perplexity on a fixed English text from an installed "
          "package, greedy agreement with the float model) and resident weight bytes per "
          "method (float / int8 / int4 / GGUF in place). Held here to: int8, int4 and GGUF-in-"
          "place weights below unquantized bfloat16 (int4 below int8), perplexity within "
          f"{PPL_LIMIT - 1:.0%} of float32 unquantized, and the test suite's SmolLM2 agreement "
          "margins (prefix agreement >= 20% int8 / 30% int4 and GGUF, logprob MAD <= 0.10 / "
          "0.08 nats)")

# (quantization, dtype); the first is the reference. OPTIONAL runs only where cheap (fused).
RUNS = (("none", "float32"), ("none", "bfloat16"), ("int8", "bfloat16"), ("int4", "bfloat16"),
        ("gguf", "bfloat16"))
OPTIONAL = (("int8", "float32"), ("int4", "float32"), ("gguf", "float32"))
KV_CACHE_MEMORY_BYTES = 256 * 2**20
MAX_MODEL_LEN = 1024
# The flags /proc/cpuinfo may show that decide bf16 and int8 speed on CPU.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
             "amx_int8")


@dataclass(frozen=True)
class Workload:
    """Sizes of every measurement; `quick()` cuts them to a smoke run."""

    window: int = 1024           # perplexity window (tokens of context at most)
    stride: int = 512            # window moves; every prediction sees >= window - stride
    max_text_tokens: int | None = None  # the whole text
    batch1_steps: int = 48
    batch_seqs: int = 64
    batch_steps: int = 16
    decode_input: int = 32
    num_prompts: int = 16
    max_tokens: int = 48

    @classmethod
    def quick(cls) -> Workload:
        """A few seconds per run."""
        return cls(window=128, stride=64, max_text_tokens=320, batch1_steps=8, batch_seqs=8,
                   batch_steps=4, num_prompts=3, max_tokens=8)


# ---- one run ------------------------------------------------------------------------------


def kernels(runner: ModelRunner) -> str:
    """How the linear layers compute: fused/dequantized quantized layers and their dtype."""
    layers = [m for m in runner.model.modules() if isinstance(m, QuantizedLinear)]
    if not layers:
        return f"float ({str(runner.dtype).removeprefix('torch.')}, oneDNN-packed)"
    fused = sum(m.fused for m in layers)
    dtype = str(layers[0].activation_dtype or runner.dtype).removeprefix("torch.")
    return f"{fused}/{len(layers)} fused, {dtype} activations"


def decode_rate(llm: LLM, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Median engine.step() over `steps` steps where every prompt decodes (offline's way)."""
    result = timed(lambda: kvserve_decode(llm, prompts, steps, False), 0.0)
    result.pop("profile", None)
    return result


def measure_run(method: str, dtype: str, ctx: SuiteContext, w: Workload, text: list[int],
                decode_prompts: list[list[int]], prompts: Sequence[str]) -> dict[str, Any]:
    """Loads one (quantization, dtype) engine and takes every measurement on it."""
    start = time.perf_counter()
    llm = LLM(quantization=method, dtype=dtype, num_threads=ctx.threads,
              max_model_len=MAX_MODEL_LEN, max_num_seqs=w.batch_seqs,
              kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES)
    load_s = time.perf_counter() - start
    runner = llm.engine.runner
    try:
        row: dict[str, Any] = {"quantization": method, "dtype": dtype,
                               "weight_bytes": runner.weight_bytes(), "load_s": load_s,
                               "kernels": kernels(runner)}
        # On the engine's worker thread, as its steps run: a forward from this thread would
        # start a second OpenMP team and slow both (engine/worker/worker.py).
        row["perplexity"] = timed(lambda: llm.engine.worker.call(
            perplexity, runner, text, w.window, w.stride), 0.0)
        row["batch1"] = decode_rate(llm, decode_prompts[:1], w.batch1_steps)
        row["batch"] = decode_rate(llm, decode_prompts, w.batch_steps)
        row["completions"] = greedy_chat(llm, prompts, w.max_tokens)
    finally:
        llm.engine.shutdown()
    row["seconds"] = time.perf_counter() - start
    print(f"   {method}/{dtype}: {row['weight_bytes'] / 2**20:.0f} MiB, ppl "
          f"{row['perplexity']['perplexity']:.3f}, {row['batch1']['tokens_per_s']:.1f} / "
          f"{row['batch']['tokens_per_s']:.0f} tok/s, {row['seconds']:.0f} s", flush=True)
    return row


# ---- the benchmark ------------------------------------------------------------------------


def cpu_info() -> dict[str, Any]:
    """The CPU flags that matter here, `--dtype auto`'s choice and how float32 quantizes."""
    flags = read_cpu_flags()
    auto, why = auto_cpu_dtype()
    plan = apply_plan("int8", torch.float32, torch.device("cpu"))
    return {"cpu": cpu_model(), "flags": {f: f in flags for f in CPU_FLAGS},
            "native_bf16": [f for f in NATIVE_BF16_FLAGS if f in flags],
            "onednn": torch.backends.mkldnn.is_available(),
            "auto_dtype": str(auto).removeprefix("torch."), "auto_why": why,
            "float32_quantized_plan": f"{plan.mode}, "
                                      f"{str(plan.compute_dtype).removeprefix('torch.')}"}


def decode_workload(w: Workload, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Random-id prompts (special tokens excluded), as the offline benchmark draws them."""
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder",
                                                            {}))
    return random_prompts([w.decode_input] * w.batch_seqs, vocab_size, excluded, seed=1)


def summarize(rows: list[dict[str, Any]]) -> None:
    """Adds each row's comparison with the first (float32 unquantized) row, in place."""
    ref = rows[0]
    for row in rows:
        agreement = compare(ref["completions"], row["completions"])
        row["agreement"] = asdict(agreement)
        row["ppl_ratio"] = row["perplexity"]["perplexity"] / ref["perplexity"]["perplexity"]
        row["tokens_per_s_batch1"] = row["batch1"]["tokens_per_s"]
        row["tokens_per_s_batch"] = row["batch"]["tokens_per_s"]
    for row in rows:
        row.pop("completions")


def judge(rows: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """The verdict and the summary line (see TARGET)."""
    by = {(r["quantization"], r["dtype"]): r for r in rows}
    bf16, int8, int4, gguf = (by.get(("none", "bfloat16")), by.get(("int8", "bfloat16")),
                              by.get(("int4", "bfloat16")), by.get(("gguf", "bfloat16")))
    if bf16 is None or int8 is None or int4 is None or gguf is None:
        return None, "a run is missing"
    quantized = [r for r in rows if r["quantization"] != "none"]
    smaller = int8["weight_bytes"] < bf16["weight_bytes"] and \
        int4["weight_bytes"] < int8["weight_bytes"] and gguf["weight_bytes"] < bf16["weight_bytes"]
    quality = all(r["ppl_ratio"] <= PPL_LIMIT
                  and r["agreement"]["prefix_share"] >= MIN_AGREEMENT[r["quantization"]]
                  and r["agreement"]["logprob_mad"] <= MAX_MAD[r["quantization"]]
                  for r in quantized)
    mib = 2**20
    summary = (f"weights {rows[0]['weight_bytes'] / mib:.0f} / {bf16['weight_bytes'] / mib:.0f}"
               f" / {int8['weight_bytes'] / mib:.0f} / {int4['weight_bytes'] / mib:.0f} / "
               f"{gguf['weight_bytes'] / mib:.0f} MiB (float32 / bfloat16 / int8 / int4 / GGUF "
               f"in place); perplexity {int8['ppl_ratio'] - 1:+.1%} int8, "
               f"{int4['ppl_ratio'] - 1:+.1%} int4, {gguf['ppl_ratio'] - 1:+.1%} GGUF in place "
               f"vs float32; batch-1 {int8['tokens_per_s_batch1']:.1f} / "
               f"{int4['tokens_per_s_batch1']:.1f} / {gguf['tokens_per_s_batch1']:.1f} vs "
               f"{bf16['tokens_per_s_batch1']:.1f} tok/s bfloat16")
    return smaller and quality, summary


def run(ctx: SuiteContext) -> dict[str, Any]:
    """Every run of RUNS (and of OPTIONAL where cheap) on the embedded model."""
    logging.basicConfig(level=logging.WARNING)
    ctx.apply_threads()
    w = Workload.quick() if ctx.quick else Workload()
    from engine.model_loader.gguf.tokenizer import load_gguf_tokenizer
    from engine.model_loader.gguf.weights import default_model_path, read_gguf_config

    tokenizer = load_gguf_tokenizer(default_model_path())
    text, text_info = load_text(tokenizer, w.max_text_tokens)
    decode_prompts = decode_workload(w, tokenizer, read_gguf_config(default_model_path())
                                     .vocab_size)
    prompts = PROMPTS[:w.num_prompts]
    cpu = cpu_info()
    cheap = cpu["float32_quantized_plan"].startswith(("fused", "tiled"))
    runs = RUNS + (OPTIONAL if cheap else ())
    rows = [measure_run(m, d, ctx, w, text, decode_prompts, prompts) for m, d in runs]
    summarize(rows)
    met, summary = judge(rows)
    return {"target": TARGET, "met": met, "summary": summary, "threads": ctx.threads,
            "quick": ctx.quick, "workload": asdict(w), "text": text_info, "cpu_info": cpu,
            "optional_measured": cheap, "kv_cache_memory_bytes": KV_CACHE_MEMORY_BYTES,
            "rows": rows}


# ---- the section --------------------------------------------------------------------------


def _row(r: dict[str, Any]) -> list[Any]:
    a, mib = r["agreement"], 2**20
    ref = r["quantization"] == "none" and r["dtype"] == "float32"
    return [r["quantization"], r["dtype"], r["kernels"], f"{r['weight_bytes'] / mib:.1f}",
            f"{r['perplexity']['perplexity']:.3f}", "reference" if ref else
            f"{r['ppl_ratio'] - 1:+.2%}", "reference" if ref else f"{a['prefix_share']:.1%}",
            "-" if ref else f"{a['identical_outputs']}/{a['num_outputs']}",
            "-" if ref else f"{a['logprob_mad']:.4f}", f"{r['tokens_per_s_batch1']:.1f}",
            f"{r['tokens_per_s_batch']:.0f}", f"{r['load_s']:.1f}"]


def _reading(result: dict[str, Any]) -> list[str]:
    rows, cpu = result["rows"], result["cpu_info"]
    by = {(r["quantization"], r["dtype"]): r for r in rows}
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in cpu["flags"].items())
    lines = [
        f"- **CPU**: {cpu['cpu']}; flags: {flags}; oneDNN "
        f"{'available' if cpu['onednn'] else 'missing'}. `--dtype auto` picks "
        f"**{cpu['auto_dtype']}** here ({cpu['auto_why']}). A float32 model with "
        f"`--quantization` runs {cpu['float32_quantized_plan']} here."]
    if not result["optional_measured"]:
        lines.append("- The float32-model quantized runs were left out: without native bf16 "
                     "they dequantize each weight before each matmul (slow, README).")
    f32, bf16 = by.get(("none", "float32")), by.get(("none", "bfloat16"))
    int8, int4 = by.get(("int8", "bfloat16")), by.get(("int4", "bfloat16"))
    gguf = by.get(("gguf", "bfloat16"))
    if f32 and bf16 and int8 and int4:
        lines.append(
            f"- **Bytes**: int8 keeps {int8['weight_bytes'] / bf16['weight_bytes']:.0%} and "
            f"int4 {int4['weight_bytes'] / bf16['weight_bytes']:.0%} of unquantized bfloat16's "
            "resident weights (the LM head, and the tied embedding reading its codes, are int8 "
            "under both; norms stay in the model dtype). Unquantized float32 counts the "
            "oneDNN-packed LM head beside the embedding it is tied to, so it exceeds 4 bytes "
            "per parameter.")
        lines.append(
            "- **Quality**: the embedded GGUF is Q4_1 (linear layers: 4-bit codes with a scale "
            "and minimum per block of 32) with a Q8_0 embedding / LM head, dequantized to float "
            "at load. Its float weights thus already sit on a 4-bit grid of groups of 32: int4 "
            "with group 32 requantizes them almost exactly, while int8's one scale per output "
            "row cannot hold that grid. On a model from 16-bit weights int4 should lose more "
            "than int8; read int4's figures here as a best case. Greedy prefix agreement is "
            "strict (after one flipped near-tie the rest differs for a benign reason); "
            "perplexity is teacher-forced, so nothing compounds. The perplexity method was "
            "checked once by hand (not by this benchmark): transformers on the same GGUF in "
            "float32, same windows, gave 7.43829 against the engine's 7.43829.")
        lines.append(_speed(result, *rows))
    lines.append("- The issue's speed targets (batch 1: at least llama.cpp's tokens/s on the same "
                 "file and 85% of the bandwidth floor; 64 streams: 3x llama-server) are judged "
                 "in the offline, batch-1 and serving sections; the decode columns here compare "
                 "the methods with one another on one machine in one run.")
    if gguf and int4:
        lines.append(
            "- **GGUF in place** (`--quantization gguf`, the default for a GGUF file wherever its "
            "blocks run fused): the file's Q4_1 blocks are the int4 layers' codes as stored, "
            "their scales and mins exact in float16, never expanded to float; the Q8_0 "
            "embedding is no linear layer and loads as floats, its tied LM head going to int8 "
            "as under int4. The int4 row instead quantizes the dequantized floats again at "
            "group 32, which lands on nearly the same grid: "
            f"{gguf['weight_bytes'] / 2**20:.1f} against {int4['weight_bytes'] / 2**20:.1f} "
            f"MiB, perplexity {gguf['perplexity']['perplexity']:.3f} against "
            f"{int4['perplexity']['perplexity']:.3f}.")
    busiest = max(other_cpu_values({"rows": rows}), default=0.0)
    if busiest > QUIET_CORES:
        lines.append(f"- Other processes kept up to {busiest:.2f} cores busy during a "
                     "measurement.")
    return lines


def _speed(result: dict[str, Any], *rows: dict[str, Any]) -> str:
    """What the decode columns say, from the figures."""
    def name(r: dict[str, Any]) -> str:
        return f"{r['quantization']}/{r['dtype']}"

    seqs = result["workload"]["batch_seqs"]
    one = sorted(rows, key=lambda r: -r["tokens_per_s_batch1"])
    many = max(rows, key=lambda r: r["tokens_per_s_batch"])
    text = ("- **Speed**: at batch 1 a step reads every weight once: "
            + ", ".join(f"{name(r)} {r['tokens_per_s_batch1']:.1f}" for r in one)
            + f" tok/s. At {seqs} sequences the fastest is {name(many)} "
            f"({many['tokens_per_s_batch']:.0f} tok/s)")
    if many["quantization"] == "none":
        text += (": torch's fused CPU kernels cost each row a pass over the weight, and int8 "
                 f"layers switch to dequantize + matmul above {Int8Method.max_fused_rows} rows, "
                 "so batches favour unquantized weights")
    return text + "."


def render(result: dict[str, Any]) -> str:
    """The workload, one row per run, the target line and how to read it."""
    w, t = result["workload"], result["text"]
    rows = result["rows"]
    first = rows[0]
    headers = ["quantization", "dtype", "linear layers", "resident weights (MiB)",
               "perplexity", "vs float32", "prefix agreement", "identical outputs",
               "logprob MAD", "decode tok/s, batch 1", f"{w['batch_seqs']} seqs", "load s"]
    return "\n\n".join([
        f"SmolLM2-135M-Instruct (embedded GGUF), {result['threads']} threads, one engine per "
        f"row (`LLM(quantization=..., dtype=...)`). Perplexity: {t['name']} ({t['words']:,} "
        f"words, sha256 {t['sha256']}), {t['tokens_used']:,} tokens with the model's tokenizer, "
        f"through the engine's own forward and paged KV cache in windows of {w['window']} "
        f"tokens moved {w['stride']} at a time: {first['perplexity']['scored_tokens']:,} "
        f"tokens scored once each, every one with at least {w['window'] - w['stride']} tokens "
        "of context (all earlier ones in the first window); the engine has no prompt logprobs, "
        "so the windows run as prefill steps built by `prepare_inputs` without the scheduler, "
        "and `compute_logits` + log-softmax give each true next token's logprob. Decode: "
        f"median of {w['batch1_steps']} (batch 1) and {w['batch_steps']} ({w['batch_seqs']} "
        f"sequences) `engine.step()` calls once every sequence decodes, {w['decode_input']}-"
        "token random-id prompts, greedy (offline benchmark's method; scheduling included). "
        f"Agreement: {w['num_prompts']} chat prompts x {w['max_tokens']} greedy tokens against "
        "float32 unquantized (fp8_quality's measures; MAD in nats over the common prefix).",
        format_table(headers, [_row(r) for r in rows]),
        target_line(result["target"], result["met"], result["summary"]),
        "\n".join(_reading(result))])


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: --quick, --threads, --json; prints the rendered markdown."""
    run_alone(NAME, run, render, argv)


if __name__ == "__main__":
    main()
