"""Exports the embedded SmolLM2-135M-Instruct GGUF to a Hugging Face safetensors folder.

The serving benchmark gives kvserve and `transformers serve` the very same checkpoint, and
`transformers serve` only loads HF folders, so the GGUF (Q4_1) is dequantized once to
float32 and saved with its tokenizer and chat template. Run as
`python -m loadtest.benchmarks.hf_export [--out FOLDER] [--force]`; a complete folder is left alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_EXPORT_DIR = Path("~/.cache/kvserve/smollm2-135m-hf").expanduser()
# Written last (see export_smollm2), so its presence with the others means the export finished.
MARKER = "kvserve_export.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", MARKER)


def is_complete(folder: Path) -> bool:
    """True when `folder` holds a finished export: every required file and a chat template."""
    if not all((folder / name).is_file() for name in REQUIRED_FILES):
        return False
    return has_chat_template(folder)


def has_chat_template(folder: Path) -> bool:
    """transformers 5 saves the template as chat_template.jinja; older ones put it in
    tokenizer_config.json. Either counts."""
    if (folder / "chat_template.jinja").is_file():
        return True
    config = json.loads((folder / "tokenizer_config.json").read_text())
    return bool(config.get("chat_template"))


def export_smollm2(out: Path = DEFAULT_EXPORT_DIR, force: bool = False) -> Path:
    """Writes the float32 HF folder for the embedded model (skipped when already complete)
    and returns its path. Loads offline; nothing is downloaded."""
    if is_complete(out) and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model_loader.gguf.weights import default_model_path

    gguf = default_model_path()
    # Build in a sibling folder and rename at the end, so an interrupted export never
    # leaves a half-written folder that a server would try to load.
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model: Any = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                      dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf} carries no chat template; the chat benchmark needs one")
    # transformers dequantizes GGUF tensors on load, yet still tags the model as "gguf
    # quantized" and refuses to save it; the weights are plain float32, so drop the tag.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(staging), safe_serialization=True)
    tokenizer.save_pretrained(str(staging))
    (staging / MARKER).write_text(json.dumps({"source": str(gguf), "dtype": "float32"}))
    if not is_complete(staging):
        raise RuntimeError(f"export to {staging} is missing files: expected {REQUIRED_FILES}")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: export (if needed) and print the folder."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_EXPORT_DIR)
    parser.add_argument("--force", action="store_true", help="export even if complete")
    ns = parser.parse_args(argv)
    print(export_smollm2(ns.out.expanduser(), ns.force))


if __name__ == "__main__":
    main()
