"""Weights of a Hugging Face checkpoint folder: model.safetensors or a sharded index."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of an HF folder's safetensors files, shard by shard."""
    for file in _safetensors_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_tensor(name)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no safetensors weights (model.safetensors or a "
                         "sharded index); convert .bin checkpoints to safetensors first")
    return files
