"""Finds a model (HF folder, GGUF file, or the embedded default) and reads its config,
tokenizer and weights. Nothing is ever downloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.model_loader.safetensors_weights import iter_safetensors


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: where it is, what kind, and its architecture config."""

    path: Path
    kind: str  # "hf" or "gguf"
    config: ModelConfig
    name: str


def resolve_model(model: str | None) -> ModelSource:
    """Turns a user's model argument into a source; None means the embedded default."""
    from engine.model_loader.gguf import weights as gguf_loader

    path = gguf_loader.default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist; pass a Hugging Face "
                         "checkpoint folder or a .gguf file (nothing is downloaded), or omit "
                         "the model to use the embedded SmolLM2-135M-Instruct")
    if path.is_file():
        if not gguf_loader.is_gguf_file(path):
            raise ValueError(f"{path} is not a model: expected a GGUF file or a folder "
                             "with config.json and safetensors weights")
        return ModelSource(path, "gguf", gguf_loader.read_gguf_config(path), path.stem)
    if (path / "config.json").is_file():
        return ModelSource(path, "hf", ModelConfig.from_folder(path), path.name)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return resolve_model(str(ggufs[0]))
    raise ValueError(f"{path} is not a model folder: it has no config.json (and not exactly "
                     "one .gguf file)")


def load_tokenizer(source: ModelSource, tokenizer: str | None = None) -> Any:
    """The source's tokenizer with its chat template, via transformers, offline."""
    if tokenizer is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    if source.kind == "gguf":
        from engine.model_loader.gguf.tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(source.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)


def iter_weights(source: ModelSource, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs from safetensors files or a GGUF file."""
    if source.kind == "gguf":
        from engine.model_loader.gguf.weights import iter_gguf_weights

        yield from iter_gguf_weights(source.path, dtype)
        return
    yield from iter_safetensors(source.path)


def checkpoint_generation_config(source: ModelSource) -> dict[str, Any]:
    """generation_config.json of an HF folder (eos ids may live there), else empty."""
    path = source.path / "generation_config.json"
    if source.kind == "hf" and path.is_file():
        return dict(json.loads(path.read_text()))
    return {}
