"""Tiny, locally built Hugging Face checkpoints and the prompts tests send them (the HF oracles
that tests compare against are in greedy.py).

Nothing here touches the network: the tokenizer is a byte-level BPE trained in about a second on a
seeded English-like corpus, and the models are random-weight Llama / Qwen2 checkpoints written with
`save_pretrained`, so config.json carries transformers 5's spelling (`rope_parameters`).

The random weights are drawn with a larger spread than transformers' default init so that greedy
argmax has wide top-1/top-2 logit gaps: float32 reassociation in a different attention
implementation (paged, chunked, split-k) must never flip a greedy token.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
# The trainer puts special tokens first, so their ids are 0, 1, 2 in every tiny tokenizer.
SPECIAL_TOKEN_IDS = tuple(range(len(SPECIAL_TOKENS)))
EOS_TOKEN_ID = 0

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an one two three some every this that my your our their his her its "
    "cat dog bird fish horse tree river mountain city village house road garden window door "
    "book letter story song picture table chair kitchen market school teacher child friend "
    "king queen farmer sailor doctor painter writer engine server token cache block request "
    "model memory answer question morning evening night summer winter rain snow wind sun moon "
    "walks runs sees finds reads writes sings builds opens closes carries keeps gives takes "
    "likes wants needs knows makes tells asks waits sleeps watches follows remembers forgets "
    "quickly slowly quietly often never always today again almost together early late "
    "red green blue old young small large bright dark warm cold happy quiet busy strange "
    "in on under over near behind with without from into across through after before"
).split()
_PUNCTUATION = (".", ".", ".", "!", "?", ",")
# Language models usually saw ChatML text, digits and code; give the corpus a little of each so
# the merges are not all whole words.
_EXTRA_LINES = ("<|im_start|>user\nHello!<|im_end|>\n", "x = 1 + 2 * 3", "It was 1984, or 2024.")


def english_sentences(num_sentences: int, seed: int = 0) -> list[str]:
    """Returns deterministic English-like sentences built from a fixed word list."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        words[0] = words[0].capitalize()
        sentences.append(" ".join(words) + rng.choice(_PUNCTUATION))
    return sentences


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Trains the byte-level BPE once per vocab size; cached as an immutable JSON string."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    corpus = english_sentences(3000, seed=1234) + list(_EXTRA_LINES) * 20
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer.to_str()


def train_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Returns a deterministic byte-level BPE tokenizer with ChatML specials and chat template.

    `<|endoftext|>` (id 0) is bos, eos and pad; `<|im_start|>` is 1 and `<|im_end|>` is 2. No BOS
    is added when encoding, as with Qwen2.
    """
    backend = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=1024,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _llama_config(vocab_size: int, llama3_rope: bool) -> LlamaConfig:
    """Llama shape: GQA (4 query heads over 2 kv heads), tied embeddings."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if llama3_rope:
        # With head_dim 16 and theta 1e4 the rotary wavelengths span 6..2e4 tokens, so these
        # factors leave some frequencies alone, smooth one and divide the rest by `factor`.
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=True,
    )


def _qwen2_config(vocab_size: int) -> Qwen2Config:
    """Qwen2 shape: q/k/v bias, 4 query heads over 1 kv head, untied lm_head, theta 1e6."""
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, use_sliding_window=False,
    )


def _mistral_config(vocab_size: int) -> MistralConfig:
    """Mistral shape: GQA 4/2, untied, and a 48-token sliding window shorter than the prompts."""
    return MistralConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, sliding_window=48,
    )


def _tiny_config(arch: str, vocab_size: int, llama3_rope: bool) -> PretrainedConfig:
    """Returns the config for `arch` ("llama", "qwen2" or "mistral") with the special ids."""
    if arch == "llama":
        config: PretrainedConfig = _llama_config(vocab_size, llama3_rope)
    elif arch == "qwen2" and not llama3_rope:
        config = _qwen2_config(vocab_size)
    elif arch == "mistral" and not llama3_rope:
        config = _mistral_config(vocab_size)
    else:
        raise ValueError(f"unknown tiny arch {arch!r} (llama3_rope={llama3_rope})")
    config.bos_token_id = config.eos_token_id = config.pad_token_id = EOS_TOKEN_ID
    return config


@torch.no_grad()
def _randomize_weights(model: PreTrainedModel, seed: int, init_std: float) -> None:
    """Overwrites every parameter from one seeded generator, independent of transformers' init.

    Norm weights are drawn around 1 (not exactly 1) so a loader that skips them is caught.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if "norm" in name:
            param.copy_(1.0 + 0.1 * noise)
        else:
            param.copy_(init_std * noise)


def build_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    *,
    vocab_size: int = 512,
    llama3_rope: bool = False,
    init_std: float = 0.2,
) -> Path:
    """Writes a random-weight HF checkpoint folder for `arch` ("llama" or "qwen2") and returns it.

    The folder holds config.json, generation_config.json, model.safetensors (float32) and the
    tokenizer files; eos/bos/pad are all `<|endoftext|>` (id 0).
    """
    path = Path(path)
    config = _tiny_config(arch, vocab_size, llama3_rope)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_weights(model, seed, init_std)
    model.generation_config = GenerationConfig(
        bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID)
    model.save_pretrained(path, safe_serialization=True)
    train_tokenizer(vocab_size).save_pretrained(path)
    _check_written_eos(path)
    return path


def _check_written_eos(path: Path) -> None:
    """Fails loudly if save_pretrained dropped or renamed the eos id in either config file."""
    for name in ("config.json", "generation_config.json"):
        eos = json.loads((path / name).read_text()).get("eos_token_id")
        if eos != EOS_TOKEN_ID:
            raise RuntimeError(f"{name} has eos_token_id {eos!r}, expected {EOS_TOKEN_ID}")


def random_prompts(
    tokenizer_or_vocab_size: Any, n: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    """Returns `n` seeded prompts of non-special token ids, lengths spread evenly over the range.

    Given an int vocab size, ids 0..2 (the tiny tokenizer's specials) are avoided.
    """
    if isinstance(tokenizer_or_vocab_size, int):
        vocab_size, special_ids = tokenizer_or_vocab_size, set(SPECIAL_TOKEN_IDS)
    else:
        vocab_size = len(tokenizer_or_vocab_size)
        special_ids = set(tokenizer_or_vocab_size.all_special_ids)
    allowed_ids = [i for i in range(vocab_size) if i not in special_ids]
    rng = random.Random(seed)
    span = max_len - min_len
    lengths = [min_len + (i * span) // max(n - 1, 1) for i in range(n)]
    rng.shuffle(lengths)
    return [[rng.choice(allowed_ids) for _ in range(length)] for length in lengths]
