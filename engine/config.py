"""Engine configuration: the model's shape (`ModelConfig`) and the operator's knobs (`EngineArgs`).

`EngineArgs` is the one explicit struct built from the CLI or the Python API and passed down;
nothing reads environment variables to change behaviour.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine import cpu_features
from engine.generation_config import parse_override

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16",
                 "fp16": "float16"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# --quantization: weight-only methods applied at load (engine/quantization/); awq and gptq
# keep a checkpoint's own 4-bit codes, gguf a GGUF file's quantized blocks (Q4_0/1, Q5_0/1,
# Q8_0, Q4_K, Q5_K; Q6_K on 8 bits). auto (the default, vLLM's None): the checkpoint's own
# method, a GGUF file's blocks in place where the CPU runs int4 fused, else none.
QUANTIZATION_METHODS = ("auto", "none", "int8", "int4", "awq", "gptq", "gguf")
# Group sizes torch's int4 CPU kernel takes (--quantization-group-size).
INT4_GROUP_SIZES = (32, 64, 128, 256)
# The torch element type of each fp8 --kv-cache-dtype; `fp8` is vLLM's alias for e4m3 (the
# finer mantissa; e5m2 trades it for range, which scale-1.0 K/V values rarely need).
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                       "fp8_e5m2": torch.float8_e5m2}
# CPU KV budget when neither --kv-cache-memory-bytes nor a GPU is there: 4 GiB, small enough to
# leave room for weights, activations and the OS on a 16-24 GiB machine.
DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, read from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # config.json's quantization_config (an AWQ or GPTQ checkpoint): (quant_method, group_size)
    checkpoint_quantization: tuple[str, int] | None = None
    # A GGUF file's code width per fused linear (qkv, o, gate_up, down), bits a weight averaged
    # over the layers, as --quantization gguf keeps its blocks (gguf/codes.py); None elsewhere.
    gguf_code_bits: tuple[float, float, float, float] | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Builds a ModelConfig from a parsed config.json (transformers 4 or 5 spelling)."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; kvserve serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                              else None)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch ==
                                                      "MistralForCausalLM") else None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            checkpoint_quantization=_checkpoint_quantization(cfg.get("quantization_config")),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        """Reads `config.json` from an HF checkpoint folder."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{path} is not a model folder: it has no config.json")
        return cls.from_hf_config(json.loads(cfg_path.read_text()))

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """The seed's formula: 2 (K and V) x layers x kv_heads x head_dim x element bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_bytes

    def num_params(self) -> int:
        """Parameter count from the shapes alone (no weights loaded)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        layer = attn + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + h


def _checkpoint_quantization(qc: dict[str, Any] | None) -> tuple[str, int] | None:
    if not qc:
        return None
    return (str(qc.get("quant_method", "")).lower(),
            int(qc.get("group_size", qc.get("q_group_size", 128))))


def effective_quantization(requested: str, cfg: ModelConfig, source_kind: str = "hf",
                           gguf_in_place: bool = False) -> str:
    """The method a model loads with. An AWQ/GPTQ checkpoint's own, which an explicit different
    --quantization contradicts; for `auto` on a GGUF file `gguf` when `gguf_in_place` (the
    caller's judgement: int4 runs fused here), else `none`; otherwise `requested`."""
    found = cfg.checkpoint_quantization[0] if cfg.checkpoint_quantization else None
    if found is not None:
        if requested not in ("auto", "none", found):
            raise ValueError(f"this checkpoint is already {found}-quantized (config.json's "
                             f"quantization_config); --quantization {requested} cannot apply: "
                             f"omit it or pass {found}")
        return found
    if requested in ("awq", "gptq"):
        raise ValueError(f"--quantization {requested} needs a checkpoint quantized with "
                         f"{requested} (its config.json names quant_method {requested!r}); this "
                         "model has no quantization_config")
    if requested == "gguf" and source_kind != "gguf":
        raise ValueError("--quantization gguf keeps a GGUF file's quantized blocks; this model is "
                         "not a GGUF file")
    if requested == "auto":
        return "gguf" if source_kind == "gguf" and gguf_in_place else "none"
    return requested


def _flag(default: Any, help: str, *, cli: bool = True, plan: bool = False,
          choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """One engine flag: its default and help, whether `serve`/`generate` (cli) and `plan` take
    it, and its choices. The field's name and type annotation give the flag's name and type."""
    return field(default=default, metadata={"help": help, "cli": cli, "plan": plan,
                                            "choices": choices, "aliases": aliases})


@dataclass
class EngineArgs:
    """Every engine knob, spelled as vLLM spells its flags: the one table that the Python API,
    `kvserve serve`, `generate` and `plan` read names, types, defaults and help from."""

    model: str | None = _flag(None, "HF checkpoint folder or .gguf file (default: the embedded "
                              "SmolLM2-135M-Instruct)", cli=False)
    tokenizer: str | None = _flag(None, "tokenizer folder (default: the model's)", cli=False)
    dtype: str = _flag("auto", "auto|float32|bfloat16|float16 (default: auto = bfloat16 on "
                       "CUDA and on CPUs with avx512_bf16 or amx_bf16, else float32)", plan=True)
    quantization: str = _flag(
        "auto", "weight-only quantization of the linear layers, done at load: none, int8 (per "
        "output channel) or int4 (per group of --quantization-group-size inputs); awq and gptq "
        "keep a checkpoint's own 4-bit codes, gguf a GGUF file's Q4_0/1, Q5_0/1, Q8_0, Q4_K, "
        "Q5_K and Q6_K blocks. auto: an AWQ/GPTQ checkpoint's method, a GGUF file's blocks in "
        "place (gguf) on CPUs that run int4 fused, else none",
        plan=True,
        choices=QUANTIZATION_METHODS)
    quantization_group_size: int | None = _flag(
        None, "int4 group size: 32, 64, 128 or 256 input columns per scale (default: 32, which "
        "fits every shape and matches GGUF's Q4 blocks)", plan=True)
    max_model_len: int | None = _flag(None, "prompt + output token limit (default: the model's)",
                                      plan=True)
    max_num_seqs: int = _flag(256, "most requests running at once", plan=True)
    max_num_batched_tokens: int | None = _flag(
        None, "fixed token budget per step (default: adaptive: up to 2048, or max-model-len up "
        "to 8192, at least max-num-seqs, while nothing decodes; beside decodes, a prefill chunk "
        "sized from measured step cost to keep the step within 2.5x a decode-only step)",
        plan=True)
    block_size: int = _flag(16, "tokens per KV block", plan=True)
    gpu_memory_utilization: float = _flag(0.9, "share of GPU memory kvserve may use", plan=True)
    kv_cache_memory_bytes: int | None = _flag(
        None, "KV cache size in bytes; overrides the memory-based sizing (default: unset)")
    enable_prefix_caching: bool = _flag(True, "reuse KV blocks of shared prefixes")
    kv_cache_dtype: str = _flag("auto", "KV cache element type: auto (the model dtype), "
                                "fp8_e4m3 (alias fp8) or fp8_e5m2; fp8 stores 1 byte per element",
                                plan=True, choices=KV_CACHE_DTYPES)
    seed: int = _flag(0, "random seed for unseeded sampling")
    device: str = _flag("auto", "auto|cpu|cuda", cli=False)
    tensor_parallel_size: int = _flag(
        1, "tensor-parallel ranks: the model's heads, MLP and vocab split over N processes "
        "(shared-memory collectives and gloo on CPU, NCCL on CUDA); N must divide the attention heads and KV heads",
        plan=True, aliases=("-tp",))
    pipeline_parallel_size: int = _flag(
        1, "pipeline stages: contiguous layers (and their KV cache) on N processes, hidden "
        "states passed between them (gloo on CPU, NCCL on CUDA); N <= the model's layers; with "
        "--tensor-parallel-size T, T x N processes", plan=True, aliases=("-pp",))
    cpu_offload_gb: float = _flag(
        0.0, "GiB of the decoder layers' weights (whole tensors, layers in order) kept in CPU "
        "memory, pinned on CUDA, and copied to the device per layer each forward, as vLLM: "
        "frees that much GPU memory for the KV cache at the cost of the copies; decode runs "
        "without CUDA graphs (default: 0, none)", plan=True)
    num_threads: int | None = _flag(None, "torch CPU threads (default: torch's choice, usually "
                                    "the cores)")
    attention_backend: str = _flag("auto", "attention kernels: auto = triton on CUDA, kvserve's "
                                   "C++ ops on CPU (torch where they cannot be built); cpu, "
                                   "triton or torch force one",
                                   choices=("auto", "cpu", "triton", "torch"))
    enforce_eager: bool = _flag(False, "CUDA: run decode steps eagerly instead of replaying "
                                "captured CUDA graphs")
    async_scheduling: bool = _flag(True, "schedule the next step while the model runs this "
                                   "one (steps of structured-output requests run one at a time)")
    # "dummy": random weights, for benchmarks of a model shape without its checkpoint
    load_format: str = _flag("auto", "auto|dummy", cli=False)
    generation_config: str = _flag(
        "auto", "request defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) from: auto = the model's generation_config.json, vllm = none, or a "
        "folder holding one")
    override_generation_config: dict[str, Any] | str | None = _flag(
        None, "JSON object of request defaults over the generation config's, e.g. "
        "'{\"max_new_tokens\": 512}'; requests that set a field keep their own")

    @classmethod
    def flags(cls, command: str) -> list[dataclasses.Field[Any]]:
        """The fields that are flags of `command` ("serve" and "generate", or "plan")."""
        key = "plan" if command == "plan" else "cli"
        return [f for f in dataclasses.fields(cls) if f.metadata.get(key)]

    @classmethod
    def from_kwargs(cls, model: str | None, **kwargs: Any) -> EngineArgs:
        """Builds EngineArgs, rejecting unknown keyword arguments by name."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(names)}")
        args = cls(model=model, **kwargs)
        args.validate()
        return args

    def validate(self) -> None:
        """Raises ValueError naming the bad field and what to change."""
        dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use auto, float32, bfloat16 or float16")
        self.dtype = dtype
        if self.quantization is None:  # vLLM's spelling of "as the checkpoint says"
            self.quantization = "auto"
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"unknown quantization {self.quantization!r}; use one of "
                             f"{', '.join(QUANTIZATION_METHODS)}")
        if (self.quantization_group_size is not None
                and self.quantization_group_size not in INT4_GROUP_SIZES):
            raise ValueError(f"quantization_group_size must be one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))}, got "
                             f"{self.quantization_group_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two from 1 to 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        self.override_generation_config = parse_override(self.override_generation_config)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if not math.isfinite(self.cpu_offload_gb) or self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb (--cpu-offload-gb) must be a number of GiB >= 0, "
                             f"got {self.cpu_offload_gb}")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, cpu, torch or triton, got "
                             f"{self.attention_backend!r}")

    def resolved_device(self) -> torch.device:
        """`auto` means CUDA when present, else CPU."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        """`auto` picks bfloat16 on CUDA; on CPU bfloat16 where oneDNN runs bf16 matmuls
        natively (avx512_bf16 or amx_bf16), else float32 (see README: dtype on CPU)."""
        if self.dtype == "auto":
            if device.type == "cuda":
                return torch.bfloat16
            return cpu_features.auto_cpu_dtype()[0]
        return DTYPES[self.dtype]


def add_engine_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Adds EngineArgs' flags for `command` ("serve", "generate" or "plan") to a parser: the
    positional MODEL, then `--kebab-name` per field, typed by its annotation."""
    model = dataclasses.fields(EngineArgs)[0]
    parser.add_argument("model", nargs="?", default=None, help=model.metadata["help"])
    hints = typing.get_type_hints(EngineArgs)
    for f in EngineArgs.flags(command):
        name = "--" + f.name.replace("_", "-")
        names = (name, *f.metadata.get("aliases", ()))
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
            continue
        base = next(a for a in typing.get_args(kind) if a is not type(None)) \
            if typing.get_args(kind) else kind
        if typing.get_origin(base) is dict:  # a JSON object, given as text on the command line
            base = str
        parser.add_argument(*names, type=base, default=f.default, help=f.metadata["help"],
                            choices=f.metadata["choices"])


def engine_args_from_flags(ns: argparse.Namespace, command: str) -> EngineArgs:
    """EngineArgs from parsed flags of `command` (validated)."""
    kwargs = {f.name: getattr(ns, f.name) for f in EngineArgs.flags(command)}
    return EngineArgs.from_kwargs(ns.model, **kwargs)
