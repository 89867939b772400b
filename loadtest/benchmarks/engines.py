"""What the in-process engine benchmarks (KV waste, step overhead) share: a tiny Llama and
engine args with a KV cache sized to the workload.

The tiny model is config.json plus a trained tokenizer, loaded with `load_format="dummy"`
(random weights, no checkpoint file). The tokenizer is a byte-level BPE trained in well under
a second on this repository's docs and engine source, so detokenizing is real work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import EngineArgs
from engine.model_loader.loader import resolve_model
from loadtest.benchmarks.common import ROOT

TINY_VOCAB = 4096
MAX_MODEL_LEN = 2048
EOS = "<|endoftext|>"


def train_tokenizer(vocab_size: int = TINY_VOCAB) -> Any:
    """A byte-level BPE (eos `<|endoftext|>`, id 0) as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "engine").rglob("*.py"))]
    corpus = [line for f in files if f.is_file() for line in f.read_text().splitlines()]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, bos_token=EOS,
                                   pad_token=EOS)


def build_tiny_model(folder: Path, layers: int = 1, hidden: int = 64,
                     vocab_size: int = TINY_VOCAB) -> Path:
    """Writes config.json (GQA 4/2 heads, tied embeddings) and the tokenizer into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": len(tokenizer),
              "hidden_size": hidden, "intermediate_size": 2 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0}
    tokenizer.save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps(config, indent=2))  # last: marks complete
    return folder


def tiny_model_dir(parent: Path) -> Path:
    """The one-layer, hidden-64 model under `parent`, built on first use."""
    folder = parent / "tiny_llama_1l_h64"
    if not (folder / "config.json").is_file():
        build_tiny_model(folder)
    return folder


def has_weights(model: str | None) -> bool:
    """Whether a model argument names weights (a GGUF, safetensors) rather than a config only."""
    if model is None:
        return True  # the embedded GGUF
    path = Path(model)
    return path.is_file() or any(path.glob("*.safetensors")) or any(path.glob("*.gguf"))


def engine_args(model: str | None, threads: int, max_seqs: int, kv_tokens: int,
                **overrides: Any) -> EngineArgs:
    """Args whose KV cache holds `kv_tokens` tokens (float32, +10%), not the 4 GiB CPU default;
    max_model_len and the step's token budget are 2048; dummy weights for a config-only
    folder."""
    per_token = resolve_model(model).config.kv_bytes_per_token(4)
    kv_tokens = max(kv_tokens, MAX_MODEL_LEN)  # one longest request must fit
    return EngineArgs(model=model, max_num_seqs=max_seqs, max_model_len=MAX_MODEL_LEN,
                      max_num_batched_tokens=2048, num_threads=threads,
                      kv_cache_memory_bytes=int(kv_tokens * 1.1 + 64) * per_token,
                      load_format="auto" if has_weights(model) else "dummy", **overrides)
